"""Lightning's DeepSpeed strategy (ZeRO-2) with ``DeepSpeedStabilityCallback``: a NaN step skipped.

    python examples/deepspeed_lightning.py [--steps 12] [--devices 1] [--stage 2] [--out runs/deepspeed_lightning]

Needs CUDA GPUs: Lightning runs its DeepSpeed strategy on CUDA only (``DeepSpeedStrategy`` refuses any
other accelerator with "The DeepSpeed strategy is only supported on CUDA GPUs"). Without one this
prints a line saying so and exits 0, having run nothing; ``examples/deepspeed_loop.py`` and
``examples/deepspeed_hf_trainer.py`` run DeepSpeed on the CPU.

On a GPU machine a tiny GPT trains under ``strategy="deepspeed_stage_2"`` with the callback as the one
line. At optimizer step 5 the loss is NaN (on rank 1 only when ``--devices`` is 2 or more): the guard
skips that step on every rank, nothing of it is applied (parameters, fp32 partitions, Adam moments,
DeepSpeed's step counters), and the run goes on. It prints the skipped steps, DeepSpeed's step count
(the skipped step not counted), whether the parameters are finite, and the guard's summary. Needs
``pip install 'stabilitykit[deepspeed]'``. A few seconds after start-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

NEEDS_CUDA = (
    "Lightning's DeepSpeed strategy needs CUDA GPUs (DeepSpeedStrategy refuses any other accelerator) "
    "and none is here: nothing was run. On the CPU see examples/deepspeed_loop.py and "
    "examples/deepspeed_hf_trainer.py."
)
BAD_STEP = 5


def main(argv: list[str] | None = None) -> dict[str, object] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stage", type=int, default=2, choices=[2, 3])
    parser.add_argument("--out", type=Path, default=Path("runs/deepspeed_lightning"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(NEEDS_CUDA)
        return None

    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy

    import stabilitykit as sk
    from stabilitykit.drivers.deepspeed_lightning import DeepSpeedStabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    cfg = sk.StabilityConfig(log_every_n_steps=4, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    callback = DeepSpeedStabilityCallback(cfg)  # the one line
    skipped: list[int] = []
    callback.hooks.on("skipped", lambda e: skipped.append(e.step))
    trainer = pl.Trainer(
        strategy=f"deepspeed_stage_{args.stage}",
        accelerator="gpu",
        devices=args.devices,
        max_steps=args.steps,
        gradient_clip_val=0.0,  # stabilitykit clips: one clipper (Lightning would pass it to DeepSpeed)
        callbacks=[callback],
        default_root_dir=args.out,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    bad_rank = 1 if args.devices > 1 else 0  # one rank only, where there is more than one

    class NaNAtOneStep(GPTModule):
        """The loss of batch ``BAD_STEP`` (one epoch: the optimizer step of that index) is NaN on ``bad_rank``."""

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            return loss * float("nan") if batch_idx == BAD_STEP and self.global_rank == bad_rank else loss

    module = NaNAtOneStep(fused=False)
    trainer.fit(module, gpt_dataloader(args.steps * args.devices))  # one epoch: each rank gets `steps` batches
    assert isinstance(trainer.strategy, DeepSpeedStrategy)
    engine = trainer.strategy.deepspeed_engine
    finite = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters())
    assert callback.guard is not None
    summary = callback.guard.summary()
    if trainer.global_rank == 0:
        print(f"ZeRO-{args.stage} on {args.devices} GPU(s): skipped steps {skipped}")
        print(f"DeepSpeed's engine steps (the skipped step not counted): {engine.global_steps}")
        print(f"parameters finite: {finite}")
        print(f"guard: {summary.line()}")
    return {"skipped": skipped, "global_steps": engine.global_steps, "finite": finite}


if __name__ == "__main__":
    main(sys.argv[1:])
