"""Skip a step whose loss is NaN or Inf: a bad batch, whatever else happened (a GradScaler too)."""

from __future__ import annotations

from torch import Tensor

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues


class NonFiniteLoss(SkipRule):
    """The recorded loss is not finite. Under a GradScaler this is a data problem, not an fp16
    overflow (the loss is computed before any scaling), so it counts toward divergence."""

    name = "nonfinite_loss"
    remote_reason = "nonfinite_on_other_rank"
    event_kind = "nonfinite"

    def flag(self, values: StepValues) -> Tensor:
        return ~values["loss_finite"]

    def message(self, ctx: SkipContext) -> str:
        return f"non-finite loss{ctx.where}"
