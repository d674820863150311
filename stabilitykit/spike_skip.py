"""Skip-on-spike: decide on the device, with no host sync, whether a finite step is an outlier.

The rule keeps, as 0-d device tensors, an exponential moving average of log(grad norm) (and of
log(loss) when a loss is given), an EMA of the absolute residual (a robust scale), and a count.
A step is an outlier when, after ``warmup_steps`` finite steps, its log value lies more than
``z_threshold`` scales above the average. Non-finite values never enter the statistics (NaN-safe:
``torch.where`` picks the old state), so one NaN cannot blind the rule, unlike a plain EMA.

A skipped outlier enters the statistics clamped to the threshold: the scale then widens within
a few steps, so a genuine level shift (a new LR regime) is adopted instead of skipped forever.
This is the family OLMo-core (SkipStepAdamW), MaxText (``skip_step_on_spikes``), Levanter and
Megatron (``grad_norm_skip_threshold``) ship; theirs take NaN into the rolling window.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

#: |residual| EMA * 1.2533 estimates the standard deviation of a normal residual.
_ABS_TO_STD = 1.2533
#: Floor of the scale in log space, so a perfectly flat series cannot skip on a 1% move.
_MIN_STD = 0.02


class SpikeSkipRule:
    """Device-side outlier test on the total grad norm (and optionally the loss), in log space.

    ``decide(total, loss, finite)`` returns a 0-d bool tensor: True when this finite step is a
    spike that should be skipped. A non-finite step returns False (the non-finite rule skips it)
    and leaves the statistics untouched. A handful of tensor ops, no ``.item()``.
    """

    def __init__(
        self,
        z_threshold: float = 6.0,
        rate: float = 0.05,
        warmup_steps: int = 50,
        device: torch.device | str | None = None,
        use_loss: bool = True,
    ) -> None:
        if not z_threshold > 0:
            raise ValueError(f"z_threshold must be > 0, got {z_threshold!r}")
        if not 0 < rate < 1:
            raise ValueError(f"rate must be in (0, 1), got {rate!r}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps!r}")
        self.z_threshold = float(z_threshold)
        self.rate = float(rate)
        self.warmup_steps = int(warmup_steps)
        self.use_loss = use_loss
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        #: [grad norm, loss] statistics in log space.
        self.mean = torch.zeros(2, dtype=torch.float32, device=self.device)
        self.abs_dev = torch.zeros(2, dtype=torch.float32, device=self.device)
        self.count = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._active = {
            has: torch.tensor([True, has], device=self.device) for has in (False, True)
        }  # which of [grad norm, loss] a call scores; built once so decide() copies nothing

    def decide(self, total: Tensor, loss: Tensor | None = None, finite: Tensor | None = None) -> Tensor:
        """Whether to skip this step as a spike (0-d bool on the device); updates the statistics."""
        total = total.detach().float().reshape(())
        if finite is None:
            finite = torch.isfinite(total)
        has_loss = self.use_loss and loss is not None
        lossv = loss.detach().float().reshape(()) if has_loss and loss is not None else total
        values = torch.stack([total, lossv])
        finite = finite.reshape(()) & torch.isfinite(values).all()
        logs = torch.log(torch.where(finite & (values > 0), values, 1.0).clamp_min(1e-30))
        resid = logs - self.mean
        std = self.abs_dev * _ABS_TO_STD + _MIN_STD
        bound = self.z_threshold * std
        warm = self.count >= self.warmup_steps
        active = self._active[has_loss]
        outlier = warm & active & (resid > bound)
        spike = finite & outlier.any()
        # the statistics: the first value sets the mean; warm residuals are clamped to the bound
        clamped = torch.where(warm, torch.minimum(resid.clamp_min(-bound), bound), resid)
        first = self.count == 0
        a = self.rate
        new_mean = torch.where(first, logs, self.mean + a * clamped)
        new_dev = torch.where(first, self.abs_dev, (1 - a) * self.abs_dev + a * clamped.abs())
        take = finite & active
        self.mean = torch.where(take, new_mean, self.mean)
        self.abs_dev = torch.where(take, new_dev, self.abs_dev)
        self.count = self.count + take.long()
        return spike

    def state_dict(self) -> dict[str, Any]:
        """The statistics as tensors (cloned), for checkpoints."""
        return {"mean": self.mean.clone(), "abs_dev": self.abs_dev.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, onto this rule's device."""
        for key in ("mean", "abs_dev", "count"):
            if key not in state:
                raise KeyError(f"SpikeSkipRule state is missing {key!r}")
        self.mean = torch.as_tensor(state["mean"], dtype=torch.float32).to(self.device).clone().reshape(2)
        self.abs_dev = torch.as_tensor(state["abs_dev"], dtype=torch.float32).to(self.device).clone().reshape(2)
        self.count = torch.as_tensor(state["count"], dtype=torch.int64).to(self.device).clone().reshape(2)

    def threshold(self) -> Tensor:
        """The grad norm above which the next step would be skipped (inf during warmup; a device tensor)."""
        std = self.abs_dev[0] * _ABS_TO_STD + _MIN_STD
        value = torch.exp(self.mean[0] + self.z_threshold * std)
        return torch.where(self.count[0] >= self.warmup_steps, value, math.inf)
