"""Run by tests/test_rerun_distributed.py on 2 and 4 gloo processes: rerun verdicts and replica checks.

    python tests/distributed_rerun_script.py WORLD OUT PORT

Every fault is injected on rank 1 only (``stabilitykit.testing.inject_fault``). Cells, each on a fresh
model, on both world sizes:

* rerun, under DDP and FSDP2 (and FSDP1 on 2 processes), the plain loop with ``guard.step(replay=...)``: a clean run of
  ``CLEAN_REF_STEPS`` steps and one run of one step more with every fault of ``FAULTS`` in turn on rank 1
  (a one-time NaN and a one-time exponent bit flip in its logits, a one-time flip in its local
  gradient), then a batch of huge inputs on rank 1 (a reproducible fault) at its last step, skipped, so
  that its final weights are the clean run's; the final weights of each as a hash of their bytes; on 2
  processes a run started again with the rerun record;
* replica checks: a finite corruption of one parameter on rank 1 under DDP and (4 processes) HSDP
  on a 2 x 2 mesh, checked every ``CHECK_EVERY`` steps; and long clean runs with rerun and replica
  checks on, which must report nothing (``CLEAN_STEPS`` under DDP; HSDP and FSDP2 ``CLEAN_STEPS`` with
  ``STABILITYKIT_FULL_MATRIX=1``, else ``SHORT_CLEAN_STEPS``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stabilitykit as sk
from stabilitykit.testing import inject_fault
from tests.distributed_models import ResidualNet, wrap
from tests.distributed_script_runner import launch

WIDTH, HIDDEN, DEPTH, CLASSES, BATCH = 8, 16, 2, 4, 4
STEPS = 10  # the replica cells: a corruption before step 6, the check after step 9 its last
FAULT_STEP = 6
CHECK_EVERY = 5
CLEAN_STEPS = 500
SHORT_CLEAN_STEPS = 25
FULL = os.environ.get("STABILITYKIT_FULL_MATRIX") == "1"
#: The one-time faults on rank 1 of the faulted run, by the step they hit (each judged transient), and the step
#: of its batch of huge inputs (reproducible), its last.
FAULTS = {
    4: {"target": "activation", "name": "head", "kind": "nan"},
    5: {"target": "grad", "name": "head.weight"},  # a flip in rank 1's local gradient, before any reduction
    6: {"target": "activation", "name": "head"},  # an exponent bit flip (a large positive logit, flagged as a spike)
}
HUGE_STEP = 7
CLEAN_REF_STEPS = HUGE_STEP  # the clean run stops before the huge batch, which the faulted run skips


def batch(rank: int, step: int, huge: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    if huge:
        x = x * 3e38  # overflows to Inf in the first layer, however often it is computed
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def weights_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(
    rank: int,
    layout: str = "ddp",
    fault: dict[str, Any] | list[dict[str, Any]] | None = None,
    huge_at: int | None = None,
    steps: int = STEPS,
    record: str | None = None,
    replicas: bool = False,
    rerun: bool = True,
    spike: bool = False,
    fused: bool = False,
    check_every: int = CHECK_EVERY,
    max_transient: int | None = 3,
) -> dict[str, Any]:
    started = time.perf_counter()
    net = ResidualNet(WIDTH, HIDDEN, DEPTH, CLASSES)
    if layout == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        model: nn.Module = fully_shard(net, mesh=mesh)
    else:
        model = wrap(net, layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused or None)
    cfg = sk.StabilityConfig(
        log_every_n_steps=50 if fused else 4,
        rerun=sk.RerunConfig(record_path=record, max_transient=max_transient) if rerun else None,
        skip=sk.SkipConfig(spike=spike, spike_warmup_steps=3),
        replicas=sk.ReplicaCheckConfig(every_n_steps=check_every) if replicas else None,
    )
    events: list[dict[str, Any]] = []
    guard = sk.StabilityGuard(model, opt, cfg)
    guard.hooks.on("*", lambda e: events.append({"kind": e.kind, "step": e.step, **e.details}))
    faults = [] if fault is None else fault if isinstance(fault, list) else [fault]
    injected = [inject_fault(model, **f) for f in faults]
    skipped = []
    for step in range(steps):
        x, y = batch(rank, step, huge=rank == 1 and step == huge_at)

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y)

        guard.backward(loss_of())
        report = guard.step(replay=loss_of)
        if bool(report.skipped):
            skipped.append(step)
        guard.zero_grad()
    guard.close()
    keep = ("rerun", "replica_mismatch", "skipped")
    return {
        "hash": weights_hash(model),
        "events": [
            {k: v for k, v in e.items() if k in ("kind", "step", "verdict", "rank", "tensor", "reason")}
            for e in events
            if e["kind"] in keep
        ],
        "skipped": skipped,
        "fired": sum(f.fired for f in injected) if injected else None,
        "seconds": time.perf_counter() - started,
    }


def worker(rank: int, world: int) -> dict[str, Any]:
    out = Path(os.environ.get("SK_RERUN_OUT", "."))
    results: dict[str, Any] = {"world": world}
    faults = [{**fault, "step": step, "rank": 1} for step, fault in FAULTS.items()]
    for layout in ("ddp", "fsdp2", "fsdp1") if world == 2 else ("ddp", "fsdp2"):
        # skip-on-spike on (its warm-up over before the first fault), so that a finite exponent flip is flagged too;
        # three transient faults on rank 1 in one run: max_transient off
        common = {"layout": layout, "spike": True, "max_transient": None}
        results[f"{layout}-clean"] = train(rank, steps=CLEAN_REF_STEPS, **common)
        record = str(out / f"{layout}.jsonl")
        results[f"{layout}-faults"] = train(
            rank, fault=faults, steps=HUGE_STEP + 1, huge_at=HUGE_STEP, record=record, **common
        )
        dist.barrier()
        results[f"{layout}-record"] = Path(record).read_text().splitlines()
    # a run started again with the record: the huge batch skipped as known bad, without a rerun
    if world == 2:
        results["ddp-again"] = train(rank, steps=HUGE_STEP + 1, huge_at=HUGE_STEP, record=str(out / "ddp.jsonl"))
    param = {"target": "param", "name": "blocks.0.fc.weight", "kind": "bitflip", "bit": 12, "index": 3}
    param.update(step=FAULT_STEP, rank=1)
    results["ddp-param"] = train(rank, fault=param, replicas=True, rerun=False)
    long_clean = CLEAN_STEPS if FULL else SHORT_CLEAN_STEPS
    if world == 4:  # HSDP on a 2 x 2 mesh: compared across the replicate dimension, shard against shard
        results["hsdp-param"] = train(rank, "hsdp", fault=param, replicas=True, rerun=False)
        results["hsdp-clean"] = train(rank, "hsdp", steps=long_clean, replicas=True)
        return results
    if FULL:
        results["fsdp2-clean-long"] = train(rank, "fsdp2", steps=CLEAN_STEPS, replicas=True)
    # fused AdamW, a logging step every 50: the cheapest steps that still show any false flag (a rerun event, or a
    # skip event for a step flagged between logging steps) and any false replica mismatch (checked every 5 steps)
    results["ddp-clean-long"] = train(rank, steps=CLEAN_STEPS, replicas=True, fused=True)
    return results


if __name__ == "__main__":
    os.environ.setdefault("SK_RERUN_OUT", sys.argv[2])
    launch(worker, sys.argv[1:])
