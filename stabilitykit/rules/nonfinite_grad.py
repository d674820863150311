"""Skip a step whose grads hold a NaN or Inf (no GradScaler: not an overflow, a real fault)."""

from __future__ import annotations

import math

from torch import Tensor

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues


class NonFiniteGrad(SkipRule):
    """A non-finite grad norm without a GradScaler."""

    name = "nonfinite_grad"
    remote_reason = "nonfinite_on_other_rank"
    event_kind = "nonfinite"

    def flag(self, values: StepValues) -> Tensor:
        return values["never"] if values.scaler_active else ~values["grads_finite"]

    def message(self, ctx: SkipContext) -> str:
        if ctx.total == math.inf and "module" not in ctx.details:
            # +inf, not NaN: the fp32 norm overflowed (finite grads above ~1.8e19 in norm, or an Inf grad)
            ctx.details["overflowed_fp32"] = True
            where = ctx.where.replace("first non-finite layer", "first layer to overflow")
            return (
                f"grad norm overflowed fp32{where}: the grads are too large for an fp32 norm (above about 1.8e19) "
                "or hold an Inf"
            )
        return f"non-finite grad{ctx.where}"
