"""Run by test_extension_points.py: a user's skip rule and recorded metrics under DDP on 2 gloo processes.

A tiny HF Llama in DDP behind a plain ``StabilityGuard`` with the ``QualityGate`` rule. Rank 1 alone
records a bad ``quality`` at step 3, so only rank 1's flag is raised: both ranks must skip that step
(parameters and optimizer state bitwise unchanged, replicas identical). Each rank also records
``rank_id`` (rank + 1) with reduce "mean", "sum" and "max": the logged values must be the agreed
ones (1.5, 3, 2) on both ranks. ``SK_REDUCE_MAX_ONLY=1``: only "max" metrics, so the agreement rides
the MAX all-reduce instead of the all-gather. ``SK_DRIVER=accelerate``:
the same through Accelerate (``AccelerateGuard``; Accelerate wraps the model in DDP over the group).
Each rank writes ``rank<r>.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))

from distributed_script_runner import launch
from hf_models import tiny_llama, token_batches

import stabilitykit as sk
from stabilitykit.integrations import AccelerateGuard
from tests.custom_rules import QualityGate

BAD_STEP = 3
STEPS = 6


class Rows:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}
        self.events: list[tuple[int, str, str]] = []

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows[step] = {k: float(v) for k, v in metrics.items() if "/metrics/" in k}

    def log_event(self, event: sk.Event) -> None:
        self.events.append((event.step, event.kind, str(event.details.get("reason"))))


def _accelerate(rank: int, world: int, model: Any, opt: Any, cfg: sk.StabilityConfig, rows: Rows) -> tuple:
    """Accelerate over the process group already made (MULTI_CPU): it wraps the model in DDP itself."""
    from accelerate import Accelerator

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    accelerator = Accelerator(cpu=True)
    assert accelerator.num_processes == world, accelerator.state
    wrapped, opt = accelerator.prepare(model, opt)
    guard = AccelerateGuard(accelerator, wrapped, opt, cfg, sinks=[rows], rules=[QualityGate()])
    return wrapped, opt, guard


def worker(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    max_only = os.environ.get("SK_REDUCE_MAX_ONLY") == "1"
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    rows = Rows()
    cfg = sk.StabilityConfig(log_every_n_steps=1)
    guard: sk.StabilityGuard | AccelerateGuard
    if os.environ.get("SK_DRIVER") == "accelerate":
        ddp, opt, guard = _accelerate(rank, world, model, opt, cfg, rows)
    else:
        ddp = DistributedDataParallel(model)
        guard = sk.StabilityGuard(model, opt, cfg, sinks=[rows], rules=[QualityGate()])
    unchanged = None
    for step, batch in enumerate(token_batches(STEPS, seed=rank)):
        bad = rank == 1 and step == BAD_STEP
        guard.record("quality", torch.tensor(0.0 if bad else 1.0), reduce="max" if max_only else "mean")
        for how in ("max",) if max_only else ("mean", "sum", "max"):
            guard.record(f"rank_id_{how}", torch.tensor(float(rank + 1)), reduce=how)
        before = [t.clone() for t in model.parameters()] if step == BAD_STEP else None
        guard.backward(ddp(**batch).loss)
        guard.step()
        guard.zero_grad()
        if before is not None:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    guard.close()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return {
        "skipped": [e for e in rows.events if e[1] == "skipped"],
        "metrics": rows.rows[STEPS - 2],
        "unchanged": unchanged,
        "checksum": checksum,
    }


if __name__ == "__main__":
    launch(worker, sys.argv[1:])
