"""Rollback past a divergence in a plain PyTorch loop: the run goes on by itself.

    python examples/recovery.py [--steps 120] [--out runs/recovery]

A tiny GPT trains with fused AdamW and a warmup schedule. From step 50 a stretch of bad batches
makes every loss NaN; after ``max_consecutive`` skipped steps the guard restores the newest healthy
snapshot (taken every 20 steps), skips the batches since, and training continues. The rollback is
a ``rollback`` event (logged at WARNING, in the JSONL log) and a record in
``<out>/skipped_batches.json``. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt

BAD = range(50, 56)  # the steps whose batches are bad (their loss is NaN)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", type=Path, default=Path("runs/recovery"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    cfg = sk.StabilityConfig(
        log_every_n_steps=10,
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        skip=sk.SkipConfig(max_consecutive=4),
        recovery=sk.RecoveryConfig(
            enabled=True,
            snapshot_every=20,
            keep=2,
            lr_scale=0.5,  # a gentler learning rate for a while after the rollback
            cooldown_steps=10,
            record_dir=str(args.out),
        ),
    )
    model = tiny_gpt(n_layer=2, n_embd=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    guard = sk.StabilityGuard(
        model, optimizer, cfg, scheduler=scheduler, sinks=[sk.sinks.JsonlSink(args.out / "stability.jsonl")]
    )
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)

    data = char_batches()
    losses = []
    for step in range(args.steps):
        x, y = next(data)
        loss = model.loss(x, y)
        if step in BAD:
            loss = loss * float("nan")  # stands in for a corrupt batch or a numerical blow-up
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if step % 20 == 0 or step == args.steps - 1:
            losses.append(float(report.loss))
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    summary = guard.summary()
    guard.close()

    for event in rollbacks:
        print(f"rollback: {event.message}")
    skipped = json.loads((args.out / "skipped_batches.json").read_text())
    print(f"skipped_batches.json: {skipped['rollbacks']}")
    return {"rollbacks": rollbacks, "skipped": skipped, "losses": losses, "summary": summary}


if __name__ == "__main__":
    main()
