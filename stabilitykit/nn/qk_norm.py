"""qk-norm: normalize queries and keys before the attention dot product.

Bounded q and k keep attention logits from growing without limit, a common cause of loss
spikes in long transformer runs. Two placements are in use: per head over ``head_dim``
(Megatron, Qwen3) and over the full width ``num_heads * head_dim`` (OLMo 2).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stabilitykit.nn.qk_clip import QKLayout
from stabilitykit.nn.softcap import softcap, validate_cap


def _norm(kind: str, width: int, eps: float) -> nn.Module:
    if kind == "rms":
        return nn.RMSNorm(width, eps=eps)
    if kind == "layer":
        return nn.LayerNorm(width, eps=eps)
    raise ValueError(f"QKNorm kind must be 'rms' or 'layer', got {kind!r}")


class QKNorm(nn.Module):
    """Normalizes q and k: ``forward(q, k) -> (q, k)``, same shapes and dtypes.

    Layouts: (B, H, T, D) with H = ``num_heads`` and D = ``head_dim``, or (B, T, H*D).
    ``per_head=True`` normalizes each head over D (one weight of size D, shared by the heads);
    ``per_head=False`` normalizes over the full width H*D.
    """

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        per_head: bool = True,
        kind: Literal["rms", "layer"] = "rms",
        eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if head_dim < 1 or num_heads < 1:
            raise ValueError(f"head_dim and num_heads must be >= 1, got {head_dim} and {num_heads}")
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.per_head = per_head
        self.kind = kind
        width = head_dim if per_head else head_dim * num_heads
        self.q_norm = _norm(kind, width, eps)
        self.k_norm = _norm(kind, width, eps)

    def _normalize(self, norm: nn.Module, x: Tensor, which: str) -> Tensor:
        h, d = self.num_heads, self.head_dim
        if x.dim() == 4 and x.shape[1] == h and x.shape[-1] == d:  # (B, H, T, D)
            if self.per_head:
                return norm(x)
            b, _, t, _ = x.shape
            flat = x.transpose(1, 2).reshape(b, t, h * d)
            return norm(flat).reshape(b, t, h, d).transpose(1, 2)
        if x.shape[-1] == h * d:  # (B, T, H*D)
            if not self.per_head:
                return norm(x)
            heads = x.reshape(*x.shape[:-1], h, d)
            return norm(heads).reshape(x.shape)
        raise ValueError(
            f"QKNorm: {which} of shape {tuple(x.shape)} is neither (B, {h}, T, {d}) nor (B, T, {h * d}) "
            f"for num_heads={h}, head_dim={d}"
        )

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self._normalize(self.q_norm, q, "q"), self._normalize(self.k_norm, k, "k")

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, num_heads={self.num_heads}, per_head={self.per_head}, kind={self.kind!r}"


class QKNormAttention(nn.Module):
    """Causal self-attention with qk-norm on ``scaled_dot_product_attention``: a drop-in block.

    Input and output are (B, T, embed_dim). On steps the engine marks as logging steps
    (``measure_metrics``), it also computes the largest attention logit, an early sign of
    attention-logit growth; other steps pay nothing for it.

    ``softcap``: cap the attention logits at ``softcap * tanh(logits / softcap)`` (Gemma 2: 50).
    SDPA has no score modifier, so the attention is then computed explicitly (same causal mask,
    dropout on the attention weights). The max-logit metric is the pre-cap value.

    It is a ``QKClipTarget`` (``stabilitykit.nn.QKClip``): while QK-clip tracks it, every training
    forward also computes the per-head max logit (one extra ``q @ k^T`` on the SDPA path, none with
    ``softcap``). QK-clip needs ``qk_norm=False``: it rescales the projection rows, which qk-norm
    would normalize away. That is MuonClip's setting: QK-clip in place of qk-norm.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        qk_norm: bool = True,
        per_head: bool = True,
        kind: Literal["rms", "layer"] = "rms",
        causal: bool = True,
        dropout: float = 0.0,
        bias: bool = False,
        eps: float = 1e-6,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.causal = causal
        self.dropout = dropout
        self.softcap = validate_cap(softcap) if softcap is not None else None
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bias)
        self.proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.qk_norm = QKNorm(self.head_dim, num_heads, per_head, kind, eps) if qk_norm else None
        #: Set by the engine: compute the max attention logit on the next forward.
        self.measure_metrics = False
        #: Set by QKClip: compute the per-head max logits on every training forward.
        self.qk_clip_tracking = False
        self._max_logit: Tensor | None = None
        self._head_max: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        track = self.qk_clip_tracking and self.training
        measure = self.measure_metrics or track
        dropout = self.dropout if self.training else 0.0
        if self.softcap is None:
            if measure:
                scores = (q.detach().float() @ k.detach().float().transpose(-2, -1)) / math.sqrt(self.head_dim)
                self._record(self._masked(scores), track)
            else:
                self._head_max = None
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, dropout_p=dropout)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            if measure:
                self._record(self._masked(scores.detach().float()), track)  # the pre-cap logits
            else:
                self._head_max = None
            weights = self._masked(softcap(scores, self.softcap)).float().softmax(dim=-1).to(v.dtype)
            y = F.dropout(weights, p=dropout) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]

    def _masked(self, scores: Tensor) -> Tensor:
        """``scores`` with the positions the causal mask hides set to -inf (as SDPA's ``is_causal``)."""
        if not self.causal:
            return scores
        t_q, t_k = scores.shape[-2:]
        allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).tril()
        return scores.masked_fill(~allowed, -torch.inf)

    def _record(self, scores: Tensor, track: bool) -> None:
        head_max = scores.amax(dim=(0, 2, 3))
        if self.measure_metrics:
            self._max_logit = head_max.amax()
        self._head_max = head_max if track else None

    def stability_metrics(self) -> dict[str, Tensor]:
        """The last measured max attention logit (a device tensor; the engine reads it when logging)."""
        return {"attention/max_logit": self._max_logit} if self._max_logit is not None else {}

    # ------------------------------------------------------------------ QKClipTarget

    def qk_clip_layout(self) -> QKLayout:
        """The fused ``qkv`` rows: query heads, then key heads (refused with qk-norm on: see the class)."""
        if self.qk_norm is not None:
            raise ValueError(
                "QK-clip rescales the query and key projection rows, which qk-norm normalizes away: build "
                "QKNormAttention(..., qk_norm=False) to use QK-clip (MuonClip uses QK-clip instead of qk-norm)"
            )
        return QKLayout.fused(self.qkv, self.num_heads, self.head_dim)

    def qk_clip_max_logits(self) -> Tensor | None:
        """Per-head max pre-softmax (pre-cap) logits of the last training forward while tracked."""
        return self._head_max
