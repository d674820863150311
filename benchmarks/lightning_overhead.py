"""Trainer step time with StabilityCallback vs a bare Trainer vs Lightning's own recommendation.

    python benchmarks/lightning_overhead.py [--steps 120] [--repeats 3] [--layers 6 --width 256]
    python benchmarks/lightning_overhead.py --tiny      # the 4x32 test model: a ~8 ms step

Arms (same GPT, same data, fused AdamW, logging every 10 steps to a CSVLogger): bare;
``Trainer(gradient_clip_val=1.0)`` (Lightning's own clipping); ``self.log_dict(grad_norm(self, 2))``
in ``on_before_optimizer_step`` (Lightning's recommendation for watching norms);
StabilityCallback (norms, per-layer norms, clipping, skip, spike scores), and the callback with
clipping off (monitoring and skip only). Each repeat runs every
arm once, in rotating order; the median time per step is reported.

The default model is the small GPT of ``benchmarks/overhead.py`` (6 layers x 256, 4.9M params).
With ``--tiny`` the step is so short that the fixed cost of Lightning's hook dispatch and of a
norm + clip pass (about 0.3 ms on 2 CPU threads) is a visible share; the script prints both.
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
    """Wall time of each training batch (forward, backward, optimizer step, every callback hook)."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.start = 0.0
        self.samples: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.skip:
            self.samples.append(time.perf_counter() - self.start)

    def robust_mean(self) -> float:
        """Mean step time after dropping steps the OS interrupted (over 2x the median).

        Logging steps stay in: they are part of what the callback costs.
        """
        median = statistics.median(self.samples)
        kept = [t for t in self.samples if t <= 2 * median]
        return statistics.fmean(kept)


def run(arm: str, steps: int, sizes: dict[str, int]) -> float:
    timer = _Timer(skip=10)
    callbacks: list[pl.Callback] = [timer]
    if arm == "stabilitykit":
        callbacks.append(StabilityCallback(sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))))
    if arm == "stabilitykit no clip":
        callbacks.append(StabilityCallback(sk.StabilityConfig(clip=sk.ClipConfig(mode="off"))))
    trainer = pl.Trainer(
        accelerator="cpu",
        gradient_clip_val=1.0 if arm == "gradient_clip_val" else None,
        max_steps=steps,
        log_every_n_steps=10,
        logger=CSVLogger(tempfile.mkdtemp()),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    block = sizes.get("block_size", 32)
    data = gpt_dataloader(steps, block_size=block, vocab_size=sizes.get("vocab_size", 64))
    trainer.fit(GPTModule(log_grad_norm=arm == "lightning grad_norm", sizes=sizes), data)
    return timer.robust_mean() * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Trainer overhead of StabilityCallback")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="the 4x32 test model instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    sizes = {} if args.tiny else {"n_layer": args.layers, "n_embd": args.width, "vocab_size": 256, "block_size": 64}
    steps = args.steps * (3 if args.tiny else 1)
    arms = ["bare", "gradient_clip_val", "lightning grad_norm", "stabilitykit", "stabilitykit no clip"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    for r in range(args.repeats):
        for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
            times[arm].append(run(arm, steps, sizes))
    med = {a: statistics.median(t) for a, t in times.items()}
    model = "tiny GPT 4x32" if args.tiny else f"GPT {args.layers}x{args.width}"
    print(f"\n{model}, {torch.get_num_threads()} threads, {steps} steps x {args.repeats} repeats")
    print(f"{'arm':<22}{'ms/step':>10}{'x bare':>10}")
    for arm in arms:
        print(f"{arm:<22}{med[arm]:>10.3f}{med[arm] / med['bare']:>10.3f}")
    print(f"\nStabilityCallback overhead vs bare Trainer: {(med['stabilitykit'] / med['bare'] - 1) * 100:+.1f}%")
    print(
        "StabilityCallback without clipping (monitoring + skip) vs bare: "
        f"{(med['stabilitykit no clip'] / med['bare'] - 1) * 100:+.1f}%"
    )
    print(
        "StabilityCallback vs Trainer(gradient_clip_val=1.0): "
        f"{(med['stabilitykit'] / med['gradient_clip_val'] - 1) * 100:+.1f}%"
    )
    print(f"Lightning grad_norm recommendation vs bare: {(med['lightning grad_norm'] / med['bare'] - 1) * 100:+.1f}%")


if __name__ == "__main__":
    main()
