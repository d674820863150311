"""A guarded plain PyTorch loop: fp16 autocast + GradScaler, accumulation, a scheduler, a resume.

    python examples/plain_loop.py [--steps 60] [--out runs/plain_loop]

Halfway through, the loop saves a checkpoint (model, optimizer, scaler, scheduler and the
guard's own state), rebuilds everything from it, and carries on as if nothing happened.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt


def build(cfg: sk.StabilityConfig, log: Path) -> tuple[Any, ...]:
    """Model, optimizer, scaler, scheduler and guard, freshly made."""
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    guard = sk.StabilityGuard(
        model, optimizer, cfg, scaler=scaler, scheduler=scheduler, sinks=[sk.sinks.JsonlSink(log)]
    )
    return model, optimizer, scaler, scheduler, guard


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--out", default="runs/plain_loop")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "stability.jsonl"
    log.unlink(missing_ok=True)

    cfg = sk.StabilityConfig(log_every_n_steps=10, clip=sk.ClipConfig(mode="adaptive", warmup_steps=10))
    model, optimizer, scaler, scheduler, guard = build(cfg, log)
    guard.hooks.on("*", lambda event: print(" ", event))
    data = char_batches(batch_size=8, seed=1)

    for step in range(args.steps):
        if step == args.steps // 2:
            checkpoint = out / "checkpoint.pt"
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "guard": guard.state_dict(),
                },
                checkpoint,
            )
            state = torch.load(checkpoint, weights_only=False)
            model, optimizer, scaler, scheduler, guard = build(cfg, log)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
            scheduler.load_state_dict(state["scheduler"])
            guard.load_state_dict(state["guard"])
            print(f"resumed from {checkpoint} at step {guard.step_count}")
        for _ in range(args.accumulate):
            x, y = next(data)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model.loss(x, y) / args.accumulate
            guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if step % 10 == 0:
            print(
                f"step {report.step:3d}  loss {float(report.loss):.3f}  "  # type: ignore[arg-type]
                f"grad norm {float(report.grad_norm):.3f}  scale {scaler.get_scale():.0f}"
            )
    guard.close()
    print("summary:", guard.summary())
    print("log:", log)


if __name__ == "__main__":
    main()
