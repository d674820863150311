"""Logit soft-capping (Gemma 2): ``cap * tanh(x / cap)``.

A smooth bound on logits: close to the identity well below ``cap`` (slope 1 at 0), never beyond
``±cap``, with a gradient that fades as a logit saturates. Gemma 2 caps attention logits at 50 and
the final (vocabulary) logits at 30. ``QKNormAttention(softcap=...)`` caps attention logits;
``SoftCap`` caps a model's output logits.
"""

from __future__ import annotations

import math

from torch import Tensor, nn


def validate_cap(cap: float) -> float:
    """``cap`` as a float, or a ValueError: a soft-cap must be a finite number > 0."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(
            f"softcap: cap must be a finite number > 0 (Gemma 2: 50 for attention, 30 for logits), got {cap!r}"
        )
    return float(cap)


def softcap(x: Tensor, cap: float) -> Tensor:
    """``cap * tanh(x / cap)``, in ``x``'s dtype: values bounded by ``±cap``, gradient ``1 - tanh(x / cap) ** 2``."""
    cap = validate_cap(cap)
    return (x / cap).tanh() * cap


class SoftCap(nn.Module):
    """Module form of :func:`softcap`, for a model's final logits (Gemma 2 uses ``SoftCap(30.0)``).

    On steps the engine marks as logging steps (``measure_metrics``) it keeps the largest
    pre-cap logit, logged as ``logits/max_precap``: a value far above ``cap`` means the cap is
    saturating. Other steps pay nothing for it.
    """

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = validate_cap(cap)
        #: Set by the engine: keep the largest pre-cap logit on the next forward.
        self.measure_metrics = False
        self._max_precap: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.measure_metrics:
            self._max_precap = x.detach().amax()
        return softcap(x, self.cap)

    def stability_metrics(self) -> dict[str, Tensor]:
        """The last measured largest pre-cap logit (a device tensor; the engine reads it when logging)."""
        return {"logits/max_precap": self._max_precap} if self._max_precap is not None else {}

    def extra_repr(self) -> str:
        return f"cap={self.cap}"
