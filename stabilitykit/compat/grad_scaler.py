"""One adapter over ``torch.amp.GradScaler``: every private attribute we read is read here.

GradScaler keeps per-optimizer stages (ready, unscaled, stepped); a second ``unscale_`` before
``update`` raises, and fused optimizers unscale inside their own step. ``grads_scale`` makes the
grads readable whatever stage the user's code (the PyTorch AMP recipe, Lightning's precision
plugin, Accelerate, Fabric) left them in, unscaling exactly once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def scaler_enabled(scaler: Any) -> bool:
    """True for a GradScaler that actually scales (``enabled=True``)."""
    return scaler is not None and bool(scaler.is_enabled())


class ScalerAdapter:
    """Stage-aware access to a GradScaler (or to none: every method then does nothing)."""

    def __init__(self, scaler: Any | None) -> None:
        self.scaler = scaler
        #: A GradScaler is present and scaling (fixed at construction, as GradScaler's own flag is).
        self.enabled = scaler_enabled(scaler)

    def stage(self, optimizer: Any) -> str:
        """ "ready" (grads scaled), "unscaled" (``unscale_`` ran) or "stepped" for ``optimizer`` this iteration."""
        from torch.amp.grad_scaler import OptState

        states = getattr(self.scaler, "_per_optimizer_states", {})
        state = states.get(id(optimizer)) if isinstance(states, dict) else None
        stage = state["stage"] if state else OptState.READY
        return {OptState.READY: "ready", OptState.UNSCALED: "unscaled", OptState.STEPPED: "stepped"}[stage]

    def grads_scale(self, optimizer: Any, fused: bool) -> Tensor | None:
        """Make the grads readable; returns the scale still applied to them (None: they are unscaled).

        A non-fused optimizer is unscaled now unless that happened already (never twice). A fused
        one keeps its grads scaled (its step unscales them for free); the norms divide by the scale.
        """
        if not self.enabled or self.stage(optimizer) != "ready":
            return None
        if fused:
            return self.scaler._get_scale_async()  # type: ignore[union-attr,no-any-return]
        self.scaler.unscale_(optimizer)  # type: ignore[union-attr]
        return None

    def loss_scale(self) -> Tensor | None:
        """The current loss scale on the device (for logging), or None."""
        if not self.enabled:
            return None
        scale = getattr(self.scaler, "_scale", None)
        return scale.detach() if isinstance(scale, torch.Tensor) else None

    def scale(self, loss: Tensor) -> Tensor:
        """``scaler.scale(loss)``, or ``loss`` without a scaler."""
        return self.scaler.scale(loss) if self.enabled else loss  # type: ignore[union-attr,no-any-return]

    def state_tensors(self) -> dict[str, Tensor] | None:
        """The scale and growth tracker as device tensors (no host sync, unlike ``GradScaler.state_dict()``),
        or None without an enabled scaler or before its first ``scale``."""
        if not self.enabled:
            return None
        scale = getattr(self.scaler, "_scale", None)
        tracker = getattr(self.scaler, "_growth_tracker", None)
        if not isinstance(scale, torch.Tensor) or not isinstance(tracker, torch.Tensor):
            return None
        return {"scale": scale, "growth_tracker": tracker}

    def load_state_tensors(self, state: dict[str, Tensor]) -> None:
        """Copy what ``state_tensors`` returned back into the scaler's own tensors."""
        current = self.state_tensors()
        if current is None:
            return
        with torch.no_grad():
            for key, value in state.items():
                current[key].copy_(value)
