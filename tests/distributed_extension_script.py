"""Run by test_extension_points.py: a user's skip rule and recorded metrics under DDP on 2 gloo processes.

A tiny HF Llama in DDP behind a plain ``StabilityGuard`` with the ``QualityGate`` rule. Rank 1 alone
records a bad ``quality`` at step 3, so only rank 1's flag is raised: both ranks must skip that step
(parameters and optimizer state bitwise unchanged, replicas identical). Each rank also records
``rank_id`` (rank + 1) with reduce "mean", "sum" and "max": the logged values must be the agreed
ones (1.5, 3, 2) on both ranks. ``SK_REDUCE_MAX_ONLY=1``: only "max" metrics, so the agreement rides
the MAX all-reduce instead of the all-gather. ``SK_DRIVER=accelerate``:
the same through Accelerate (``AccelerateGuard``; Accelerate wraps the model in DDP over the group).
The guard's cell then trains a tiny Mixtral in DDP for one sampled step per ``RouterConfig.across_ranks``
setting, each rank on its own small batch, and returns the router values it logged with the router
logits its model returned (``moe_routers``). Each rank writes ``rank<r>.json``.
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


class MonitorRows:
    """The monitor values of the last logged step."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.logged = {k: float(v) for k, v in metrics.items() if "/monitors/" in k}


def moe_routers(rank: int) -> dict[str, Any]:
    """Router monitors in DDP: per ``across_ranks`` setting, the router values this rank logged at its one
    (sampled) step, and the router logits and attention mask of its own batch (different on each rank)."""
    from moe_models import padded_batch, tiny_mixtral

    out: dict[str, Any] = {}
    for across in (True, False):
        model = tiny_mixtral()  # the same weights on every rank
        ddp = DistributedDataParallel(model)
        sink = MonitorRows()

        routers = sk.RouterConfig(across_ranks=across)
        off = {"activations": False, "attention": False, "logits": False, "residual": False}
        cfg = sk.StabilityConfig(log_every_n_steps=1, monitors=sk.MonitorConfig(routers=routers, **off))
        guard = sk.StabilityGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg, sinks=[sink])
        batch = padded_batch(batch_size=2, seq=4, seed=rank)  # 6 tokens: some experts idle on each rank
        result = ddp(**batch, output_router_logits=True)
        guard.backward(result.loss)
        guard.step()
        guard.close()
        out[str(across)] = {
            "logged": sink.logged,
            "router_logits": [t.detach().tolist() for t in result.router_logits],
            "mask": batch["attention_mask"].tolist(),
        }
    return out


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
    routers = moe_routers(rank) if os.environ.get("SK_DRIVER") != "accelerate" and not max_only else None
    return {
        "routers": routers,
        "skipped": [e for e in rows.events if e[1] == "skipped"],
        "metrics": rows.rows[STEPS - 2],
        "unchanged": unchanged,
        "checksum": checksum,
    }


if __name__ == "__main__":
    launch(worker, sys.argv[1:])
