"""A tiny GPT trained by a Lightning Trainer with StabilityCallback, a NaN step and a gradient spike.

    python examples/lightning_gpt.py [--steps 60] [--out runs/lightning_gpt]

Metrics reach the Trainer's CSVLogger (``stability/...`` columns in metrics.csv); the NaN step
is skipped without ``training_step`` returning None; the spike is clipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader


def main(argv: list[str] | None = None) -> StabilityCallback:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/lightning_gpt")
    args = parser.parse_args(argv)

    config = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))  # cadence: trainer's
    callback = StabilityCallback(config)
    callback.hooks.on("*", lambda event: print(" ", event))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        log_every_n_steps=10,
        logger=CSVLogger(args.out, name="csv"),
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    module = GPTModule(poison={20: float("nan"), 40: 1000.0}, scheduler=True)
    trainer.fit(module, gpt_dataloader(args.steps))
    summary = callback.summary()  # the run's totals, as every driver gives them
    print("skipped:", summary.skipped, "clipped:", summary.clipped)
    print("metrics:", Path(trainer.logger.log_dir) / "metrics.csv")  # type: ignore[union-attr]
    return callback


if __name__ == "__main__":
    main()
