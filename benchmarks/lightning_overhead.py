"""Trainer step time with StabilityCallback vs a bare Trainer vs Lightning's own recommendation.

    python benchmarks/lightning_overhead.py [--steps 150] [--repeats 3]

Arms (same tiny GPT, same data, fused AdamW, logging every 10 steps to a CSVLogger):
bare; ``self.log_dict(grad_norm(self, 2))`` in ``on_before_optimizer_step`` (Lightning's
recommendation); StabilityCallback (norms, per-layer norms, clipping, skip, spike scores).
Each repeat runs every arm once, in rotating order; the median time per step is reported.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader


class _Timer(pl.Callback):
    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.start = 0.0
        self.steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.skip:
            self.start = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps = trainer.global_step - self.skip
        self.elapsed = time.perf_counter() - self.start


def run(arm: str, steps: int) -> float:
    timer = _Timer(skip=10)
    callbacks: list[pl.Callback] = [timer]
    if arm == "stabilitykit":
        callbacks.append(StabilityCallback(sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        log_every_n_steps=10,
        logger=CSVLogger(tempfile.mkdtemp()),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(GPTModule(log_grad_norm=arm == "lightning grad_norm"), gpt_dataloader(steps))
    return timer.elapsed / timer.steps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Trainer overhead of StabilityCallback")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    arms = ["bare", "lightning grad_norm", "stabilitykit"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.repeats):
        for arm in arms[r % 3 :] + arms[: r % 3]:
            times[arm].append(run(arm, args.steps))
    med = {a: statistics.median(t) for a, t in times.items()}
    print(f"\n{'arm':<22}{'ms/step':>10}{'x bare':>10}")
    for arm in arms:
        print(f"{arm:<22}{med[arm]:>10.3f}{med[arm] / med['bare']:>10.3f}")
    print(f"\nStabilityCallback overhead vs bare Trainer: {(med['stabilitykit'] / med['bare'] - 1) * 100:+.1f}%")
    print(f"Lightning grad_norm recommendation vs bare: {(med['lightning grad_norm'] / med['bare'] - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
