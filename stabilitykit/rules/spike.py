"""Skip-on-spike: skip a finite step whose grad norm (or loss) is an outlier (``SkipConfig(spike=True)``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues
from stabilitykit.spike_skip import SpikeSkipRule


class Spike(SkipRule):
    """A log-space z-score above ``SkipConfig.spike_z`` on this rank (``spike_skip.SpikeSkipRule``,
    all on the device); a non-finite step is never a spike (and never feeds the statistics)."""

    name = "spike"
    event_kind = "spike_warning"

    def __init__(self, z: float, rate: float, warmup: int, device: torch.device, on_loss: bool) -> None:
        self.detector = SpikeSkipRule(z, rate, warmup, device, on_loss)

    def flag(self, values: StepValues) -> Tensor:
        finite = values["grads_finite"] & values["loss_finite"]
        loss = values["loss"] if values.has_loss else None
        return self.detector.decide(values["grad_norm"], loss, finite)

    def message(self, ctx: SkipContext) -> str:
        return f"step {ctx.step} skipped as a spike (skip-on-spike){ctx.where}"

    def state_dict(self) -> dict[str, Any]:
        return self.detector.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            self.detector.load_state_dict(dict(state))
