"""Where ``StabilityConfig.rerun`` cannot re-run a step: refused when the guard is built, naming the field and why.

* A torch ``GradScaler`` (fp16 autocast): a recomputed step would unscale the grads a second time before
  the scaler's ``update``, which GradScaler forbids; and the steps a scaler makes non-finite are fp16
  overflows, which are never re-run anyway.
* DeepSpeed's fp16 (its own dynamic loss scaler): a non-finite step there is DeepSpeed's overflow, which
  its own step skips (and lowers the scale) and which is never re-run; a recomputed backward would run
  DeepSpeed's overflow check a second time in one step, which nothing here has been shown to handle.
* A framework's DeepSpeed integration (the Hugging Face Trainer with ``deepspeed=``, Lightning's
  ``DeepSpeedStrategy``): the framework's step runs DeepSpeed's backward, which reduces the grads into
  DeepSpeed's partitioned buffers as it runs; a rerun would have to drop them before computing the batch
  again, as ``DeepSpeedGuard.step(replay=...)`` does in a loop of your own (``rerun/deepspeed.py``), and
  the framework's step offers no point to do it.

Each says what to do instead. bf16 needs no scaler and reruns everywhere.
"""

from __future__ import annotations

from stabilitykit.config import StabilityConfig

_WHY = {
    "grad_scaler": (
        "a torch GradScaler: a recomputed step would unscale the grads a second time before the scaler's update, "
        "which GradScaler forbids (and its overflow steps are never re-run); use bf16 autocast"
    ),
    "deepspeed_fp16": (
        "DeepSpeed's fp16 (its own loss scaler): a non-finite step is DeepSpeed's overflow, skipped by its own "
        "step and never re-run, and a recomputed backward would run its overflow check twice in one step; use "
        'DeepSpeed\'s bf16 ("bf16": {"enabled": true})'
    ),
    "framework_deepspeed": (
        "a framework's DeepSpeed integration (the HF Trainer with deepspeed=, Lightning's DeepSpeedStrategy): its "
        "step reduces the grads into DeepSpeed's partitions as the backward runs and offers no point to drop them "
        "before a recomputation; rerun with DeepSpeedGuard and guard.step(replay=...) in a loop of your own"
    ),
}


def refuse_rerun(
    config: StabilityConfig,
    *,
    grad_scaler: bool = False,
    deepspeed_fp16: bool = False,
    framework_deepspeed: bool = False,
) -> None:
    """Raise ``ValueError`` when ``config.rerun`` is given with what it cannot re-run (see the module docstring)."""
    if config.rerun is None:
        return
    for name, present in (
        ("grad_scaler", grad_scaler),
        ("deepspeed_fp16", deepspeed_fp16),
        ("framework_deepspeed", framework_deepspeed),
    ):
        if present:
            raise ValueError(
                f"stabilitykit: StabilityConfig.rerun (RerunConfig) cannot be used with {_WHY[name]}, "
                "or leave rerun=None"
            )
