"""Trainer step time with StabilityCallback vs a bare Trainer vs Lightning's own tools. Prints ratios.

    python benchmarks/lightning_overhead.py [--steps 2000] [--layers 4 --width 64]

Separate Trainer runs per arm differ by more than the effect measured here on a shared 2-core
machine, so the arms rotate step by step inside ONE Trainer run: step ``s`` belongs to slot
``s % 6`` (the five arms, then an untimed bare step that absorbs Lightning's processing of the
grad_norm arm's logged dict), and each arm's time is the mean of its steps (after dropping steps
the OS interrupted, over 2x the median). Arms:

* ``bare``: no grad processing;
* ``gradient_clip_val``: Lightning's own clipping (``trainer.gradient_clip_val = 1.0`` on its steps);
* ``lightning grad_norm``: ``self.log_dict(grad_norm(self, 2))`` in ``on_before_optimizer_step``
  (Lightning's recommendation for watching norms);
* ``stabilitykit``: StabilityCallback (norms, per-layer norms, fixed clipping, skip, spike scores),
  active on its own steps only, logging (journal read + CSV logger) on every 7th of them: more
  often than the every-10th the target names, so the number is an upper bound;
* ``stabilitykit no clip``: the same with clipping off (norms, per-layer norms, skip, spike
  scores, logging): what watching costs, next to what clipping costs.

The default model is the tiny GPT of the tests (4x64, a few-ms step), where any fixed cost shows
most; ``--layers 6 --width 256`` is the small GPT of ``benchmarks/overhead.py``.
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

ARMS = ("bare", "stabilitykit", "stabilitykit no clip", "gradient_clip_val", "lightning grad_norm")
#: The step after the grad_norm arm is not timed: Lightning processes that arm's logged dict then.
SLOTS = (*ARMS, "spacer")


class Rotation(pl.Callback):
    """Assigns each step to an arm, switches Lightning's settings for it, and times the step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.current = ARMS[0]
        self.start = 0.0
        self.samples: dict[str, list[float]] = {arm: [] for arm in ARMS}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.current = SLOTS[trainer.global_step % len(SLOTS)]
        trainer.gradient_clip_val = 1.0 if self.current == "gradient_clip_val" else None
        pl_module.log_grad_norm = self.current == "lightning grad_norm"  # type: ignore[assignment]
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        elapsed = time.perf_counter() - self.start
        if trainer.global_step > self.warmup and self.current in self.samples:
            self.samples[self.current].append(elapsed)

    def robust_means(self) -> dict[str, float]:
        """Mean ms per step of each arm, without steps over 2x the arm's median (OS interruptions)."""
        out = {}
        for arm, samples in self.samples.items():
            median = statistics.median(samples)
            out[arm] = statistics.fmean([t for t in samples if t <= 2 * median]) * 1e3
        return out


class GatedCallback(StabilityCallback):
    """StabilityCallback that acts only on the steps of the ``stabilitykit`` arm."""

    def __init__(self, rotation: Rotation, config: sk.StabilityConfig, arm: str) -> None:
        super().__init__(config, name=arm)
        self.rotation = rotation
        self.arm = arm

    def _active(self) -> bool:
        return self.rotation.current == self.arm

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        if self._active():
            super().on_train_batch_start(*args, **kwargs)

    def on_before_backward(self, *args: Any, **kwargs: Any) -> None:
        if self._active():
            super().on_before_backward(*args, **kwargs)

    def on_before_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        if self._active():
            super().on_before_optimizer_step(*args, **kwargs)

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        if self._active():
            super().on_train_batch_end(*args, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Trainer overhead of StabilityCallback")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--block", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rotation = Rotation(warmup=20)
    clip = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=7)
    watch = sk.StabilityConfig(clip=sk.ClipConfig(mode="off"), log_every_n_steps=7)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        log_every_n_steps=10,
        logger=CSVLogger(tempfile.mkdtemp()),
        callbacks=[
            rotation,
            GatedCallback(rotation, clip, "stabilitykit"),
            GatedCallback(rotation, watch, "stabilitykit no clip"),
        ],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    sizes = {"n_layer": args.layers, "n_embd": args.width, "block_size": args.block, "vocab_size": 64}
    data = gpt_dataloader(args.steps, block_size=args.block)
    trainer.fit(GPTModule(sizes=sizes), data)
    med = rotation.robust_means()
    n = len(rotation.samples["bare"])
    print(
        f"\nGPT {args.layers}x{args.width}, {torch.get_num_threads()} threads, "
        f"{n} steps per arm, arms rotating per step"
    )
    print(f"{'arm':<22}{'ms/step':>10}{'x bare':>10}")
    for arm in ARMS:
        print(f"{arm:<22}{med[arm]:>10.3f}{med[arm] / med['bare']:>10.3f}")
    print(f"\nStabilityCallback overhead vs bare Trainer: {(med['stabilitykit'] / med['bare'] - 1) * 100:+.1f}%")
    print(
        "StabilityCallback without clipping vs bare Trainer: "
        f"{(med['stabilitykit no clip'] / med['bare'] - 1) * 100:+.1f}%"
    )
    print(
        "StabilityCallback vs Trainer(gradient_clip_val=1.0): "
        f"{(med['stabilitykit'] / med['gradient_clip_val'] - 1) * 100:+.1f}%"
    )
    print(f"Lightning grad_norm recommendation vs bare: {(med['lightning grad_norm'] / med['bare'] - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
