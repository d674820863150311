"""Clipping strategies, each owning its state: a fixed max norm, or an adaptive threshold.

A strategy turns this step's total norm into a threshold and says whether it applies; the
engine turns that into one clip coefficient and multiplies the grads in place. Everything stays
on the device; a non-finite norm never enters the adaptive statistics.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

from stabilitykit.config import ClipConfig

__all__ = ["AdaptiveClip", "ClipStrategy", "FixedClip", "make_clip_strategy"]


class ClipStrategy(Protocol):
    """Decides the clipping threshold of each step."""

    def threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """``(threshold, active)``: 0-d device tensors; grads are clipped to ``threshold`` when ``active``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (device tensors allowed)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


class FixedClip:
    """Clip to ``max_norm`` on every step."""

    def __init__(self, max_norm: float, device: torch.device) -> None:
        self._threshold = torch.full((), max_norm, dtype=torch.float32, device=device)
        self._active = torch.ones((), dtype=torch.bool, device=device)

    def threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """The fixed threshold, always active."""
        return self._threshold, self._active

    def state_dict(self) -> dict[str, Any]:
        """Nothing to keep: the threshold comes from the config."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


class AdaptiveClip:
    """ZClip-class threshold ``mean + z * std`` from EMAs of the total norm.

    The statistics take the clipped value, so a spike cannot poison them; NaN/Inf never enter.
    """

    def __init__(self, config: ClipConfig, device: torch.device) -> None:
        self.config = config
        self.mean = torch.zeros((), dtype=torch.float32, device=device)
        self.var = torch.zeros((), dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)

    def threshold(self, total: Tensor, finite: Tensor) -> tuple[Tensor, Tensor]:
        """This step's threshold from the statistics so far, then fold the (clipped) norm in."""
        cfg = self.config
        warmed = self.count >= cfg.warmup_steps
        threshold = self.mean + cfg.z_threshold * self.var.clamp(min=0).sqrt()
        fallback = cfg.warmup_max_norm if cfg.warmup_max_norm is not None else math.inf
        threshold = torch.where(warmed, threshold, fallback)
        active = warmed if cfg.warmup_max_norm is None else torch.ones_like(warmed)
        value = torch.where(finite, torch.where(warmed, torch.minimum(total, threshold), total), self.mean)
        a = cfg.ema_alpha
        first = self.count == 0
        delta = value - self.mean
        new_mean = torch.where(first, value, self.mean + (1 - a) * delta)
        new_var = torch.where(first, 0.0, a * (self.var + (1 - a) * delta * delta))
        self.mean = torch.where(finite, new_mean, self.mean)
        self.var = torch.where(finite, new_var, self.var)
        self.count = self.count + finite
        return threshold, active

    def state_dict(self) -> dict[str, Any]:
        """The EMAs and the count (device tensors, cloned)."""
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the EMAs and count onto this strategy's device."""
        self.mean = state["mean"].to(self.mean).clone()
        self.var = state["var"].to(self.var).clone()
        self.count = state["count"].to(self.count).clone()


def make_clip_strategy(config: ClipConfig, device: torch.device) -> ClipStrategy | None:
    """The strategy for ``config.mode`` (None when clipping is off)."""
    if config.mode == "fixed":
        return FixedClip(config.max_norm, device)
    if config.mode == "adaptive":
        return AdaptiveClip(config, device)
    return None
