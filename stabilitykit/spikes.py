"""Robust spike detectors that live on the device and never ingest a non-finite value.

Each detector keeps a one-step-ahead baseline of log(x) (an exponential moving average) and a
robust scale of its residuals (an EMA of absolute residuals, clamped so one spike cannot inflate
it). The score of a step is its residual divided by that scale: a robust z-score. Everything is
tensor arithmetic with ``torch.where``; nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["RobustDetector"]

#: |residual| EMA * 1.2533 estimates the standard deviation of a normal residual.
_ABS_TO_STD = 1.2533
#: Residuals are clamped to this many scales before they update the baseline (outlier rejection).
_CLAMP_SCALES = 3.0


class RobustDetector:
    """One-step-ahead robust z-score of log(x) for a positive series (loss, grad norm)."""

    def __init__(
        self, alpha: float = 0.1, warmup_steps: int = 20, device: torch.device | None = None, size: int | None = None
    ) -> None:
        self.alpha = alpha
        self.warmup_steps = warmup_steps
        self.device = device or torch.device("cpu")
        shape = () if size is None else (size,)  # one series, or several scored side by side
        self.mean = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.abs_dev = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.count = torch.zeros(shape, dtype=torch.int64, device=self.device)

    def update(self, value: Tensor) -> Tensor:
        """Score ``value`` against the baseline, then fold it in; returns the z-score (0 in warmup)."""
        x = value.detach().to(dtype=torch.float32, device=self.device)
        valid = torch.isfinite(x) & (x > 0)
        log_x = torch.log(torch.where(valid, x, torch.ones_like(x)))
        first = self.count == 0
        resid = torch.where(first, torch.zeros_like(log_x), log_x - self.mean)
        std = self.abs_dev * _ABS_TO_STD + 1e-3
        warmed = self.count >= self.warmup_steps
        z = torch.where(valid & warmed, resid / std, torch.zeros_like(resid))
        # Outlier rejection once warmed up: a spike moves the baseline by at most a few scales.
        bound = torch.where(warmed, _CLAMP_SCALES * std, torch.full_like(std, float("inf")))
        kept = torch.maximum(torch.minimum(resid, bound), -bound)
        new_mean = torch.where(first, log_x, self.mean + self.alpha * kept)
        new_abs = torch.where(first, self.abs_dev, (1 - self.alpha) * self.abs_dev + self.alpha * kept.abs())
        self.mean = torch.where(valid, new_mean, self.mean)
        self.abs_dev = torch.where(valid, new_abs, self.abs_dev)
        self.count = self.count + valid.to(torch.int64)
        return z

    def state_dict(self) -> dict[str, Any]:
        """Baseline, scale and count (tensors)."""
        return {"mean": self.mean.clone(), "abs_dev": self.abs_dev.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned, onto this detector's device."""
        self.mean = state["mean"].to(self.device, torch.float32)
        self.abs_dev = state["abs_dev"].to(self.device, torch.float32)
        self.count = state["count"].to(self.device, torch.int64)
