"""z-loss: a penalty on log Z = logsumexp(logits) that keeps output logits from drifting.

``z_loss = coefficient * mean(logsumexp(logits, -1) ** 2)`` over the kept tokens. Usual
coefficients: 1e-4 (PaLM), 1e-5 (OLMo 2), and 1e-3 for a mixture-of-experts router z-loss.
A growing log Z (mean or max) is an early sign of output-logit divergence; ``ZLoss`` exposes it
to the engine, which logs it on logging steps.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def log_z(logits: Tensor) -> Tensor:
    """``logsumexp(logits, -1)`` computed in fp32 (bf16/fp16 logits lose too much here)."""
    return torch.logsumexp(logits.float(), dim=-1)


def _masked_mean(values: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return values.mean()
    keep = mask.to(values.dtype)
    return (values * keep).sum() / keep.sum().clamp(min=1.0)


def z_loss(logits: Tensor, coefficient: float = 1e-4, mask: Tensor | None = None) -> Tensor:
    """``coefficient * mean(logsumexp(logits, -1) ** 2)`` over tokens where ``mask`` is true (all if None)."""
    if coefficient < 0:
        raise ValueError(f"coefficient must be >= 0, got {coefficient!r}")
    if mask is not None and mask.shape != logits.shape[:-1]:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal the logits' leading shape {tuple(logits.shape[:-1])}"
        )
    return coefficient * _masked_mean(log_z(logits).square(), mask)


class ZLossOutput(NamedTuple):
    """The total loss and its parts; ``log_z_mean``/``log_z_max`` are detached, for monitoring."""

    loss: Tensor
    cross_entropy: Tensor
    z_loss: Tensor
    log_z_mean: Tensor
    log_z_max: Tensor


def cross_entropy_with_z_loss(
    logits: Tensor, target: Tensor, coefficient: float = 1e-4, ignore_index: int = -100
) -> ZLossOutput:
    """Token cross-entropy plus z-loss over the same kept tokens (``target != ignore_index``).

    ``logits``: (..., vocab); ``target``: (...) integer classes. Returns a ``ZLossOutput``.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal the logits' leading shape {tuple(logits.shape[:-1])}"
        )
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_target = target.reshape(-1)
    ce = F.cross_entropy(flat_logits.float(), flat_target, ignore_index=ignore_index)
    keep = flat_target != ignore_index
    lz = log_z(flat_logits)
    z = coefficient * _masked_mean(lz.square(), keep)
    detached = lz.detach()
    kept = torch.where(keep, detached, torch.full_like(detached, -torch.inf))
    return ZLossOutput(ce + z, ce, z, _masked_mean(detached, keep), kept.max())


class ZLoss(nn.Module):
    """Module form of :func:`z_loss` that also keeps the last log Z mean/max for the engine's logs."""

    def __init__(self, coefficient: float = 1e-4) -> None:
        super().__init__()
        if coefficient < 0:
            raise ValueError(f"coefficient must be >= 0, got {coefficient!r}")
        self.coefficient = coefficient
        self._last: dict[str, Tensor] = {}

    def forward(self, logits: Tensor, mask: Tensor | None = None) -> Tensor:
        lz = log_z(logits)
        detached = lz.detach()
        if mask is not None:
            kept = torch.where(mask, detached, torch.full_like(detached, -torch.inf))
            self._last = {"logits/log_z_mean": _masked_mean(detached, mask), "logits/log_z_max": kept.max()}
        else:
            self._last = {"logits/log_z_mean": detached.mean(), "logits/log_z_max": detached.max()}
        return self.coefficient * _masked_mean(lz.square(), mask)

    def stability_metrics(self) -> dict[str, Tensor]:
        """Device tensors the engine reads on logging steps (no sync here)."""
        return dict(self._last)

    def extra_repr(self) -> str:
        return f"coefficient={self.coefficient}"
