"""A learning rate that stays past the edge: recovery blames the LR and lowers it, one level at a time.

    python examples/recovery_lr_edge.py [--peak 1.2] [--steps 170]

SGD on a noisy linear regression diverges once its learning rate passes about 0.7. The schedule warms
up over 30 steps to ``--peak`` and stays there, as a too-hot schedule would. Trained twice: the guard
alone (a streak of non-finite steps, ``TrainingDivergedError``), then with ``RecoveryConfig()``: the
first rollback cannot tell the data from the LR (it skips 50 batches and halves the LR for 50 steps);
when the trouble comes back on data the restored model reads fine, the LR is blamed and lowered to
0.5x, then 0.25x of the schedule's, each held 500 steps, and the run converges. Prints each rollback's
cause and LR factor, the LR the steps really used (``stability/lr/0``) and the summary line. About a
second on a CPU.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

import stabilitykit as sk


class LrLog:
    """A sink keeping the logged ``stability/lr/0`` per step."""

    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def log_metrics(self, metrics: Any, step: int) -> None:
        if "stability/lr/0" in metrics:
            self.lr[step] = metrics["stability/lr/0"]


def train(peak: float, steps: int, recovery: sk.RecoveryConfig | None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    w = torch.randn(16, 1, generator=gen)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=peak)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30))
    config = sk.StabilityConfig(log_every_n_steps=5, **({"recovery": recovery} if recovery else {}))
    lr_log = LrLog()
    guard = sk.StabilityGuard(model, optimizer, config, scheduler=scheduler, sinks=[lr_log])
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    error = None
    last = torch.tensor(float("nan"))
    try:
        for _ in range(steps):
            x = torch.randn(32, 16, generator=gen)
            y = x @ w + 0.3 * torch.randn(32, 1, generator=gen)
            last = nn.functional.mse_loss(model(x), y)
            guard.backward(last)
            guard.step()
            guard.zero_grad()
    except sk.TrainingDivergedError as exc:
        error = exc
    line = guard.summary().line()
    guard.close()
    return {"error": error, "rollbacks": rollbacks, "lr": lr_log.lr, "summary": line, "loss": float(last.detach())}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak", type=float, default=1.2)
    parser.add_argument("--steps", type=int, default=170)
    args = parser.parse_args(argv)
    alone = train(args.peak, args.steps, None)
    print(f"guard alone: {type(alone['error']).__name__ if alone['error'] else 'finished'}")
    healed = train(args.peak, args.steps, sk.RecoveryConfig(snapshot_every=10))
    for event in healed["rollbacks"]:
        d = event.details
        print(f"rollback at step {event.step}: cause {d['cause']}, LR x{d['lr_factor']:g} to step {d['lr_until'] - 1}")
    print(f"LR used at the last logging step: {list(healed['lr'].values())[-1]:g} (the schedule's: {args.peak:g})")
    print(f"final loss {healed['loss']:.3f}; {healed['summary']}")
    return {"alone": alone, "recovery": healed}


if __name__ == "__main__":
    main()
