"""Device-side statistics of one forward output: no host sync, float32, nothing kept but 0-d tensors.

Each function takes the tensors a hook sees and returns 0-d float32 tensors on the same device,
detached from autograd, so a measurement never changes the graph the loss backpropagates through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def first_tensor(value: Any) -> Tensor | None:
    """The tensor a module returned, or the first tensor of a tuple / list / ModelOutput."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, Tensor)), None)
    to_tuple = getattr(value, "to_tuple", None)
    return first_tensor(to_tuple()) if callable(to_tuple) else None


def _max_abs(x: Tensor) -> Tensor:
    """max |x| from one min/max pass (no |x| tensor is allocated)."""
    low, high = torch.aminmax(x)
    return torch.maximum(-low, high).float()


def feature_dim(x: Tensor) -> int:
    """The dimension that holds a position's features: channels (1) of an image batch (N, C, H, W),
    else the last one (tokens: (..., T, features))."""
    return 1 if x.dim() == 4 else -1


def activation_stats(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """RMS over all elements, max |x|, and the mean L2 norm per position (over the features:
    ``feature_dim``, the channels of each pixel of an image batch, else the last dimension).

    Two reductions over ``x``, neither allocating a tensor of its size: the per-position norms
    (``vector_norm``, accumulated in float32) give the RMS and the mean norm; ``aminmax`` the max.
    """
    x = x.detach()
    dim = feature_dim(x)
    norms = torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)
    rms = norms.square().mean().div(max(1, x.shape[dim])).sqrt()
    return rms, _max_abs(x), norms.mean()


def spread_rows(total: int, count: int | None, device: torch.device | str = "cpu") -> Tensor | None:
    """``count`` row indices spread evenly over ``range(total)`` (first and last included; built on
    ``device``, no copy from the host), None for all rows."""
    if count is None or total <= count:
        return None
    step = max(1, count - 1)
    return torch.arange(count, device=device).mul_(total - 1).div_(step, rounding_mode="floor")


def logit_stats(logits: Tensor, positions: int | None = None, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """max |logit| over the output logits (..., vocab) of the positions ``mask`` keeps, and the mean
    log Z (log-sum-exp over the vocabulary) over at most ``positions`` positions spread evenly over
    the whole batch (None: all of them), padding left out.

    ``mask``: the model's ``attention_mask`` (batch, tokens), 1 for a real token, or None. The max
    is one min/max pass per position; a log-sum-exp costs an exp per logit, about as much as the
    LM head's matmul, so the mean log Z is estimated from a subset of positions. No host sync: the
    padding enters as weights, never as a data-dependent selection.
    """
    logits = logits.detach()
    rows = logits.reshape(-1, logits.shape[-1])
    weights = None
    if mask is not None and mask.numel() == rows.shape[0]:
        weights = mask.detach().reshape(-1).to(device=rows.device, dtype=torch.float32).clamp(0, 1)
    low, high = torch.aminmax(rows, dim=-1)
    top = torch.maximum(-low, high).float()
    if weights is not None:
        top = top * weights  # |logit| >= 0: a padded position counts as 0
    index = spread_rows(rows.shape[0], positions, rows.device)
    if index is not None:
        rows = rows.index_select(0, index)
        weights = weights.index_select(0, index) if weights is not None else None
    log_z = torch.logsumexp(rows.float(), dim=-1)
    if weights is None:
        return top.amax(), log_z.mean()
    return top.amax(), (log_z * weights).sum() / weights.sum().clamp_min(1.0)
