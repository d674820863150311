"""Run by tests/test_rerun_distributed.py on 2 and 4 gloo processes: rerun verdicts and replica checks.

    python tests/distributed_rerun_script.py WORLD OUT PORT

Every fault is injected on rank 1 only (``stabilitykit.testing.inject_fault``). Cells, each on a fresh
model:

* DDP, the plain loop with ``guard.step(replay=...)``: a clean run; a one-time NaN and a one-time
  exponent bit flip in rank 1's logits at step ``FAULT_STEP``; a one-time flip in rank 1's local
  gradient; a batch of huge inputs on rank 1 (a reproducible fault), then a run started again with
  the rerun record; the final weights of each as a hash of their bytes; FSDP2 (2 processes): a
  clean run and one with a one-time NaN in rank 1's logits and, two steps later, a one-time flip in
  rank 1's local gradient;
* replica checks: a finite corruption of one parameter on rank 1 under DDP and (4 processes) HSDP
  on a 2 x 2 mesh, checked every ``CHECK_EVERY`` steps; and a long clean run with rerun and replica
  checks on, which must report nothing.
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
STEPS = 12
FAULT_STEP = 6
CHECK_EVERY = 5
CLEAN_STEPS = 500


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
    huge_on: int | None = None,
    steps: int = STEPS,
    record: str | None = None,
    replicas: bool = False,
    rerun: bool = True,
    spike: bool = False,
    fused: bool = False,
    check_every: int = CHECK_EVERY,
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
        rerun=sk.RerunConfig(record_path=record) if rerun else None,
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
        x, y = batch(rank, step, huge=huge_on is not None and rank == huge_on and step == FAULT_STEP)

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
    at = {"step": FAULT_STEP, "rank": 1}
    param = {"target": "param", "name": "blocks.0.fc.weight", "kind": "bitflip", "bit": 12, "index": 3, **at}
    results["clean"] = train(rank)
    results["nan-activation"] = train(rank, fault={"target": "activation", "name": "head", "kind": "nan", **at})
    results["ddp-param"] = train(rank, fault=param, replicas=True, rerun=False)
    if world == 4:  # HSDP on a 2 x 2 mesh: compared across the replicate dimension, shard against shard
        results["hsdp-param"] = train(rank, "hsdp", fault=param, replicas=True, rerun=False)
        results["hsdp-clean"] = train(rank, "hsdp", steps=25, replicas=True)
        return results
    # FSDP2: 8 steps for both, the clean one the reference; in one run a one-time NaN in rank 1's logits at step
    # 4 and a one-time flip in rank 1's local (unsharded, before the reduce-scatter) gradient at step 6
    results["fsdp2-clean"] = train(rank, "fsdp2", steps=FAULT_STEP + 2)
    nan = {"target": "activation", "name": "head", "kind": "nan", "step": FAULT_STEP - 2, "rank": 1}
    flip = {"target": "grad", "name": "head.weight", **at}
    results["fsdp2-faults"] = train(rank, "fsdp2", fault=[nan, flip], steps=FAULT_STEP + 2)
    results["clean-spike"] = train(rank, spike=True)
    results["flip-activation"] = train(rank, fault={"target": "activation", "name": "head", **at}, spike=True)
    results["flip-grad"] = train(rank, fault={"target": "grad", "name": "head.weight", **at})
    record = str(out / "rerun.jsonl")
    results["huge-batch"] = train(rank, huge_on=1, record=record)
    dist.barrier()
    results["record"] = Path(record).read_text().splitlines()
    results["huge-batch-again"] = train(rank, huge_on=1, record=record)  # a run started again with the record
    # fused AdamW, a logging step every 50: the cheapest steps that still show any false flag (a rerun event, or a
    # skip event for a step flagged between logging steps) and any false replica mismatch (checked every 5 steps)
    results["ddp-clean-long"] = train(rank, steps=CLEAN_STEPS, replicas=True, fused=True)
    return results


if __name__ == "__main__":
    os.environ.setdefault("SK_RERUN_OUT", sys.argv[2])
    launch(worker, sys.argv[1:])
