"""A guarded Accelerate loop: bf16, gradient accumulation, a NaN micro-batch skipped, a resume.

    python examples/accelerate_loop.py [--steps 12] [--out runs/accelerate_loop]

``guard.step()`` runs on every micro-batch inside ``accelerator.accumulate`` and acts only when
the grads are synced: it counts optimizer steps, measures the fully accumulated grads (the loss
divided by the accumulation steps, as ``accelerator.backward`` does) and skips the step whose
second micro-batch is NaN. The guard is registered for checkpointing, so ``save_state`` /
``load_state`` carry its counters.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

import stabilitykit as sk
from stabilitykit.drivers.accelerate import AccelerateGuard
from stabilitykit.testing import char_batches, tiny_gpt

POISON_STEP = 4


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--out", default="runs/accelerate_loop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)

    accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=args.accumulate)
    model = tiny_gpt(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    config = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=4)
    guard = AccelerateGuard(accelerator, model, optimizer, config, scheduler=scheduler)  # the one line
    guard.hooks.on("*", lambda event: print(" ", event))
    accelerator.register_for_checkpointing(guard)

    data = char_batches(batch_size=8, seed=1)
    micro_batches = [next(data) for _ in range(args.steps * args.accumulate)]
    reports = []
    for i, (x, y) in enumerate(micro_batches):
        if i == (args.steps // 2) * args.accumulate:
            accelerator.save_state(str(out / "checkpoint"))
        with accelerator.accumulate(model):
            loss = model.loss(x, y)
            if i == POISON_STEP * args.accumulate + 1:
                loss = loss * float("nan")  # the second micro-batch of optimizer step 4
            guard.backward(loss)
            report = guard.step()  # None on the first micro-batch of each step
            guard.zero_grad()
        if report is not None:
            reports.append(report)
    summary = guard.summary()
    print(f"{len(micro_batches)} micro-batches, {summary['steps']} optimizer steps, {summary['skipped']} skipped")

    accelerator.load_state(str(out / "checkpoint"))
    print(f"load_state: the guard is back at step {guard.step_count} with {guard.summary().skipped} skipped")
    guard.close()
    return {"summary": summary, "reports": reports, "restored_step": guard.step_count}


if __name__ == "__main__":
    main()
