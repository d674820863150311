"""Run by tests/test_recovery_distributed.py on 2 gloo processes: one rollback, agreed by every rank.

    python tests/distributed_recovery_script.py 2 OUT_DIR PORT

A tiny random-init Hugging Face ``LlamaForCausalLM`` under DDP, FSDP2 (``fully_shard`` per
decoder layer and at the root), FSDP1 (per decoder layer, ``use_orig_params=True``) or tensor
parallel (attention and MLP projections split over both ranks, the same batches on both) trains
48 steps with ``RecoveryConfig`` on (a snapshot every 4 steps, 3 kept; logging every 2 steps).
The fault is on **rank 1 only**:

* ``alert``: at step 30 rank 1's recorded loss jumps 1000x (a constant added to the loss: the
  grads are unchanged), so only rank 1's detector raises a ``spike_alert``; trigger ``spike_alert``;
  plain AdamW.
* ``alert`` again under FSDP2 with ``storage=`` a directory: each rank writes its shard's snapshots
  to disk and reads them back.
* ``nan``: rank 1's loss is NaN at steps 30-34; every rank skips them (the skip is agreed) and the
  run of 3 skips is a divergence; trigger ``diverged``; fused AdamW (its skips stay on the device
  until a logging step).
* ``climb`` (DDP): rank 1's recorded loss is 50x at steps 30-37 (finite; the grads are unchanged), so
  only rank 1's detectors are unsettled there, then NaN at steps 38-40 (a divergence, onset 38);
  trigger ``diverged``. The snapshots due inside the climb (steps 32 and 36) must be dropped on both
  ranks, so the rollback restores step 28's on both, not step 36's.

Each rank records, after every step, a copy of its local parameters (its shard under FSDP2) and
optimizer state, and reports: its own alerts, every rollback event, whether the state right after
the rollback equals its copy from before the restored step bitwise, a hash of its final local
parameters, and whether they are finite.
"""

from __future__ import annotations

import hashlib
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tests.distributed_script_runner import launch

STEPS = 48
FAULT = 30
NAN_STEPS = range(FAULT, FAULT + 5)
CLIMB_STEPS = range(FAULT, FAULT + 8)  # the climb of ``climb``, then its NaN steps
CLIMB_NAN_STEPS = range(FAULT + 8, FAULT + 11)


#: Tensor parallel over both ranks: attention and MLP projections split Megatron-style.
TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def make_model(kind: str) -> nn.Module:
    from tests.hf_models import tiny_llama

    model = tiny_llama(seed=0)  # the same init on every rank
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = ModuleWrapPolicy({LlamaDecoderLayer})
        return FullyShardedDataParallel(
            model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu")
        )
    if kind == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (2,))
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        for layer in model.model.layers:
            parallelize_module(layer, mesh, {name: styles[style]() for name, style in TP_PLAN.items()})
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def local(t: Tensor) -> Tensor:
    from stabilitykit.distributed import to_local

    return to_local(t).detach().clone()


def state_copy(model: nn.Module, opt: torch.optim.Optimizer) -> list[Tensor]:
    """This rank's parameters and optimizer state tensors, in a fixed order."""
    out = [local(p) for p in model.parameters()]
    for p in model.parameters():
        for key in sorted(opt.state.get(p, {})):
            value = opt.state[p][key]
            if isinstance(value, Tensor):
                out.append(local(value))
    return out


def equal(a: list[Tensor], b: list[Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local(p).float().numpy().tobytes())
    return h.hexdigest()


def run(kind: str, fault: str, rank: int, storage: str = "memory") -> dict[str, Any]:
    import stabilitykit as sk

    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fault == "nan")
    trigger = ["spike_alert"] if fault == "alert" else ["diverged"]
    held: dict[int, list[int]] = {}  # the snapshot steps held after each step
    cfg = sk.StabilityConfig(
        log_every_n_steps=2,
        skip=sk.SkipConfig(max_consecutive=3),
        nan_trace=sk.NaNTraceConfig(mode="off"),
        recovery=sk.RecoveryConfig(
            enabled=True, snapshot_every=4, keep=3, trigger=trigger, storage=storage, skip_after=0, cooldown_steps=0
        ),
    )
    guard = sk.StabilityGuard(model, opt, cfg)
    alerts: list[int] = []
    rollbacks: list[dict[str, Any]] = []
    guard.hooks.on("spike_alert", lambda e: alerts.append(e.step))
    guard.hooks.on("rollback", lambda e: rollbacks.append(dict(e.details)))
    copies: dict[int, list[Tensor]] = {0: state_copy(model, opt)}  # state before step s
    restored_equal: list[bool] = []
    gen = torch.Generator().manual_seed(100 + (0 if kind == "tp" else rank))  # data parallel: each rank its own
    for step in range(STEPS):
        if step == FAULT and storage != "memory":
            guard.summary()  # waits for the snapshot files: their host copies are freed, the rollback reads a file
        ids = torch.randint(0, 96, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        if rank == 1 and fault == "alert" and step == FAULT:
            loss = loss + 1000.0 * loss.detach()  # the loss the detector sees jumps; the grads do not change
        if rank == 1 and fault == "nan" and step in NAN_STEPS:
            loss = loss * float("nan")
        if rank == 1 and fault == "climb" and step in CLIMB_STEPS:
            loss = loss + 49.0 * loss.detach()  # 50x, finite: only rank 1's detectors see it
        if rank == 1 and fault == "climb" and step in CLIMB_NAN_STEPS:
            loss = loss * float("nan")
        before = len(rollbacks)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
        if len(rollbacks) > before:
            restored = int(rollbacks[-1]["restored_step"])
            restored_equal.append(equal(state_copy(model, opt), copies[restored]))
        copies[step + 1] = state_copy(model, opt)
        recovery = guard.engine.recovery
        assert recovery is not None
        held[step] = [s.step for s in recovery.store.snapshots]
    if storage != "memory":
        guard.summary()  # the files being written are on disk
    files = sorted(p.name for p in Path(storage).iterdir()) if storage != "memory" else []
    guard.close()
    params = [local(p) for p in model.parameters()]
    return {
        "alerts": alerts,
        "rollbacks": [
            {k: r[k] for k in ("at_step", "trigger", "onset", "restored_step", "skipped_from", "skipped_to")}
            for r in rollbacks
        ],
        "restored_equal": restored_equal,
        "digest": digest(model),
        "files": files,  # the storage directory before close (which removes the snapshots)
        "held": {FAULT + 9: held[FAULT + 9]},  # the snapshots held at step 39 (before the climb's rollback)
        "finite": all(bool(torch.isfinite(p).all()) for p in params),
        "norm": math.sqrt(sum(float(p.double().square().sum()) for p in params)),
    }


def worker(rank: int, world: int) -> dict[str, Any]:
    results = {f"{kind}-{fault}": run(kind, fault, rank) for kind in ("ddp", "fsdp2") for fault in ("alert", "nan")}
    results["fsdp1-alert"] = run("fsdp1", "alert", rank)
    results["ddp-climb"] = run("ddp", "climb", rank)
    results["tp-alert"] = run("tp", "alert", rank)
    with tempfile.TemporaryDirectory() as directory:  # each rank writes its own shard's snapshots
        results["fsdp2-alert-disk"] = run("fsdp2", "alert", rank, storage=directory)
    return results


if __name__ == "__main__":
    launch(worker, sys.argv[1:])
