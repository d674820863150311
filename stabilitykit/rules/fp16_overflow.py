"""Skip a step whose grads overflowed fp16 under a GradScaler (the scaler lowers its scale and goes on)."""

from __future__ import annotations

from torch import Tensor

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues


class Fp16Overflow(SkipRule):
    """A non-finite grad while a GradScaler scales the loss: an overflow, expected now and then, so it
    never counts toward divergence (the fp16 monitor watches the overflow rate instead)."""

    name = "fp16_overflow"
    remote_reason = "nonfinite_on_other_rank"
    event_kind = "fp16_overflow"
    counts_toward_divergence = False

    def flag(self, values: StepValues) -> Tensor:
        return ~values["grads_finite"] if values.scaler_active else values["never"]

    def message(self, ctx: SkipContext) -> str:
        return f"fp16 overflow, GradScaler skipped the step{ctx.where}"
