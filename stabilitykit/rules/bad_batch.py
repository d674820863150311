"""Skip a step whose batch the data guard flagged (``DataGuardConfig(mode="skip")``)."""

from __future__ import annotations

from torch import Tensor

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues


class BadBatch(SkipRule):
    """Some micro-batch of the step held non-finite inputs or labels out of range (on any rank)."""

    name = "bad_batch"
    event_kind = "bad_batch"

    def flag(self, values: StepValues) -> Tensor:
        return values["bad_batch"]

    def message(self, ctx: SkipContext) -> str:
        return "the data guard found non-finite values or bad labels in the batch"
