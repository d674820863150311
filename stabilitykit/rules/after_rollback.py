"""Skip the batches a rollback skips ahead (``RecoveryConfig.skip_after``): decided on the host from
the configuration and the step number, so the same on every rank and free of any sync."""

from __future__ import annotations

from torch import Tensor

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues


class AfterRollback(SkipRule):
    """A batch after a rollback that is measured and logged but never trained on."""

    name = "after_rollback"
    event_kind = "skipped"
    counts_toward_divergence = False

    def flag(self, values: StepValues) -> Tensor:
        return values["after_rollback"]

    def message(self, ctx: SkipContext) -> str:
        return f"step {ctx.step} skipped ahead after a rollback"
