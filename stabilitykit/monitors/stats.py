"""Device-side statistics of one forward output: no host sync, float32, nothing kept but 0-d tensors.

Each function takes the tensors a hook sees and returns 0-d float32 tensors on the same device,
detached from autograd, so a measurement never changes the graph the loss backpropagates through.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["activation_stats", "first_tensor", "logit_stats", "max_attention_logit"]


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


def activation_stats(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """RMS over all elements, max |x|, and the mean L2 norm per position (the last dimension: features).

    Two reductions over ``x``, neither allocating a tensor of its size: the per-position norms
    (``vector_norm``, accumulated in float32) give the RMS and the mean norm; ``aminmax`` the max.
    """
    x = x.detach()
    norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)
    rms = norms.square().mean().div(max(1, x.shape[-1])).sqrt()
    return rms, _max_abs(x), norms.mean()


def logit_stats(logits: Tensor, positions: int | None = None) -> tuple[Tensor, Tensor]:
    """max |logit| over all output logits (..., vocab), and the mean log Z (log-sum-exp over the
    vocabulary) over at most ``positions`` evenly spaced token positions (None: all of them).

    The max is one cheap min/max pass; a log-sum-exp costs an exp per logit, about as much as the
    LM head's matmul, so the mean log Z is estimated from a strided subset of positions.
    """
    logits = logits.detach()
    rows = logits.reshape(-1, logits.shape[-1])
    if positions is not None and rows.shape[0] > positions:
        rows = rows[:: rows.shape[0] // positions][:positions]
    return _max_abs(logits), torch.logsumexp(rows.float(), dim=-1).mean()


def max_attention_logit(q: Tensor, k: Tensor, scaling: float, causal: bool) -> Tensor:
    """max |q·kᵀ| * ``scaling`` over heads and (causally allowed) positions.

    ``q``: (batch, heads, T_q, head_dim); ``k``: (batch, kv_heads, T_k, head_dim) with ``heads`` a
    multiple of ``kv_heads`` (grouped-query attention: each key head serves ``heads // kv_heads``
    query heads, as ``repeat_kv`` does, without copying the keys). Computed in the input's dtype,
    as the model computes its own logits; positions a causal mask hides count as 0 (the scores
    are masked in place, then one min/max pass: no other tensor of their size).
    """
    q, k = q.detach(), k.detach()
    b, h, t_q, d = q.shape
    kv = k.shape[1]
    scores = q.reshape(b, kv, h // kv, t_q, d) @ k.unsqueeze(2).transpose(-2, -1)
    if causal:
        scores.tril_(diagonal=k.shape[2] - t_q)
    return _max_abs(scores) * abs(scaling)
