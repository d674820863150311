"""The user-written skip rule the extension-point tests give every driver."""

from __future__ import annotations

from torch import Tensor

import stabilitykit as sk


class QualityGate(sk.SkipRule):
    """Skip a step whose recorded ``quality`` is below one half (on any rank)."""

    name = "quality_gate"

    def flag(self, values: sk.StepValues) -> Tensor:
        return values["quality"] < 0.5
