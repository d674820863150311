"""Run by test_lightning.py: Lightning DDP on 2 CPU processes with a NaN on rank 1 only."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader


def main() -> None:
    out = Path(os.environ["SK_OUT"])
    torch.set_num_threads(1)
    callback = StabilityCallback(sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0)))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=4,
        callbacks=[callback],
    )
    module = GPTModule(fused=False, poison={5: float("nan")}, poison_rank=1)
    trainer.fit(module, gpt_dataloader(30))
    checksum = sum(float(p.detach().double().sum()) for p in module.parameters())
    assert callback.engine is not None
    result = {
        "checksum": checksum,
        "skipped": int(callback.engine.counters.skipped_total),
        "steps": trainer.global_step,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
