"""Run by test_integrations_fabric.py: FabricGuard on 2 gloo processes, a NaN on rank 1 only.

Each rank writes ``rank<r>.json``: a parameter checksum, the skip count, the skipped step, and
whether parameters and optimizer state were bitwise unchanged across it; then the run is saved
with ``fabric.save`` at step 6, trained on, reloaded with ``fabric.load`` and retrained, and the
two endings compared bit for bit. Then a second run with recovery on: rank 1's loss (only the value
the detector sees) jumps 1000x at step 8, rank 1 alone raises a ``spike_alert``, and both ranks
must roll back once, together, keeping the replicas identical.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric

import stabilitykit as sk
from stabilitykit.integrations import FabricGuard
from stabilitykit.testing import char_batches, tiny_gpt
from tests.custom_rules import QualityGate

POISON_STEP = 4
STEPS = 10


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"]
    tensors = [p.detach().clone() for p in model.parameters()]
    for value in state.values():
        tensors.extend(v.clone() for v in value.values() if torch.is_tensor(v))
    return tensors


def recovery_run(fabric: Fabric, rank: int) -> dict:
    """Recovery under Fabric DDP with an alert on rank 1 only: the rollbacks each rank saw, a checksum."""
    model = tiny_gpt(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    model.mark_forward_method("loss")
    config = sk.StabilityConfig(
        log_every_n_steps=2,
        recovery=sk.RecoveryConfig(
            enabled=True, snapshot_every=2, keep=3, trigger=["spike_alert"], skip_after=0, cooldown_steps=0
        ),
        spikes=sk.SpikeConfig(warmup_steps=5),
    )
    guard = FabricGuard(fabric, model, optimizer, config)
    rollbacks: list[dict] = []
    alerts: list[int] = []
    guard.hooks.on("rollback", lambda e: rollbacks.append({k: e.details[k] for k in ("at_step", "restored_step")}))
    guard.hooks.on("spike_alert", lambda e: alerts.append(e.step))
    data = char_batches(seed=10 + rank)
    for step in range(14):
        x, y = next(data)
        loss = model.loss(x, y)
        if step == 8 and rank == 1:
            loss = loss + 1000.0 * loss.detach()  # the value the detector sees; the grads are unchanged
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return {"rollbacks": rollbacks, "alerts": alerts, "checksum": checksum}


def rule_run(fabric: Fabric, rank: int) -> dict:
    """A user's skip rule raised on rank 1 only at step 3 (from a recorded metric), and a metric summed
    across ranks: both ranks skip step 3, bitwise, and log the same agreed sum."""
    model = tiny_gpt(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    model.mark_forward_method("loss")
    logged: dict[int, float] = {}
    skipped: list[list] = []

    class Rows:
        def log_metrics(self, metrics: dict, step: int) -> None:
            logged[step] = float(metrics["stability/metrics/rank_id"])

        def log_event(self, event: sk.Event) -> None:
            if event.kind == "skipped":
                skipped.append([event.step, event.details["reason"]])

    guard = FabricGuard(
        fabric, model, optimizer, sk.StabilityConfig(log_every_n_steps=2), sinks=[Rows()], rules=[QualityGate()]
    )
    data = char_batches(seed=20 + rank)
    unchanged = None
    for step in range(6):
        x, y = next(data)
        guard.record("quality", torch.tensor(0.0 if (rank == 1 and step == 3) else 1.0))
        guard.record("rank_id", torch.tensor(float(rank + 1)), reduce="sum")
        before = snapshot(model, optimizer) if step == 3 else None
        guard.backward(model.loss(x, y))
        guard.step()
        guard.zero_grad()
        if before is not None:
            unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer), strict=True))
    guard.close()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return {"skipped": skipped, "sums": sorted(set(logged.values())), "unchanged": unchanged, "checksum": checksum}


def main() -> None:
    out = Path(os.environ["SK_OUT"])
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    model = tiny_gpt(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    model.mark_forward_method("loss")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    config = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=3)
    guard = FabricGuard(fabric, model, optimizer, config, scheduler=scheduler)
    data = char_batches(seed=rank)
    batches = [next(data) for _ in range(STEPS)]
    result: dict = {"layer_names": list(guard.engine.layer_names)}

    def train(start: int, stop: int) -> None:
        for step in range(start, stop):
            x, y = batches[step]
            before = snapshot(model, optimizer) if step == POISON_STEP else None
            loss = model.loss(x, y)
            if step == POISON_STEP and rank == 1:
                loss = loss * float("nan")
            guard.backward(loss)
            report = guard.step()
            guard.zero_grad()
            if before is not None:
                after = snapshot(model, optimizer)
                result["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
                result["skipped_step"] = report.step if bool(report.skipped) else None

    train(0, 6)
    path = out / "ckpt.pt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "guard": guard})
    train(6, STEPS)
    guard.engine.flush()
    first = [p.detach().clone() for p in model.parameters()]
    result["checksum"] = sum(float(p.double().sum()) for p in first)
    result["skipped"] = guard.skipped_total
    result["lr_steps"] = scheduler.last_epoch

    fabric.load(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "guard": guard})
    result["restored_step"] = guard.step_count
    train(6, STEPS)
    guard.engine.flush()
    result["resume_exact"] = all(torch.equal(a, b.detach()) for a, b in zip(first, model.parameters(), strict=True))
    result["skipped_after_resume"] = guard.skipped_total
    guard.close()
    result["recovery"] = recovery_run(fabric, rank)
    result["rule"] = rule_run(fabric, rank)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # An orderly teardown: a gloo process group left to the interpreter's exit can abort it
    # ("terminate called without an active exception") while its threads are still running.
    fabric.barrier()
    torch.distributed.destroy_process_group()
    # no interpreter teardown racing gloo's threads (it has aborted a finished rank with SIGABRT)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
