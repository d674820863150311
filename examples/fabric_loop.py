"""A guarded Lightning Fabric loop with two optimizers (a body and a head), a NaN step, a resume.

    python examples/fabric_loop.py [--steps 12] [--out runs/fabric_loop]

Each optimizer gets its own skip decision and step count, and its metrics under
``stability/opt<i>/``. The head's step 5 is poisoned: only that step is skipped. The guard is
saved with ``fabric.save`` and restored with ``fabric.load``. On several devices, run with
``Fabric(devices=2, strategy="ddp")`` unchanged: every rank takes the same, all-reduced decision.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

import stabilitykit as sk
from stabilitykit.drivers.fabric import FabricGuard
from stabilitykit.testing import char_batches, tiny_gpt

POISON_STEP = 5


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default="runs/fabric_loop")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    fabric = Fabric(accelerator="cpu", devices=1)
    model = tiny_gpt(seed=0)
    body = torch.optim.AdamW([p for n, p in model.named_parameters() if not n.startswith("lm_head")], lr=3e-3)
    head = torch.optim.SGD(model.lm_head.parameters(), lr=0.05)
    model, body, head = fabric.setup(model, body, head)
    model.mark_forward_method("loss")
    sink = sk.sinks.JsonlSink(out / "stability.jsonl")
    guard = FabricGuard(fabric, model, [body, head], sk.StabilityConfig(log_every_n_steps=4), sinks=[sink])
    guard.hooks.on("*", lambda event: print(" ", event))

    data = char_batches(batch_size=8, seed=1)
    for step in range(args.steps):
        if step == args.steps // 2:
            fabric.save(out / "checkpoint.pt", {"model": model, "body": body, "head": head, "guard": guard})
        x, y = next(data)
        guard.backward(model.loss(x, y), optimizer=body)
        guard.step(optimizer=body)
        guard.zero_grad()
        x, y = next(data)
        loss = model.loss(x, y)
        if step == POISON_STEP:
            loss = loss * float("nan")
        guard.backward(loss, optimizer=head)
        guard.step(optimizer=head)
        guard.zero_grad()
    summary = guard.summary()
    for i, row in enumerate(summary["optimizers"]):
        print(f"optimizer {i}: {row['steps']} steps, {row['skipped']} skipped")
    fabric.load(out / "checkpoint.pt", {"model": model, "body": body, "head": head, "guard": guard})
    print(f"fabric.load: the guard is back at step {guard.step_count}")
    guard.close()
    return {"summary": summary, "restored_step": guard.step_count}


if __name__ == "__main__":
    main()
