"""A user-written attention module implementing ``QKClipTarget``, and a small model around it.

Written the way users write attention (explicit scores, optional grouped-query attention, a fused
``qkv`` or separate ``q_proj``/``k_proj``/``v_proj``), so QK-clip is tested on code shaped like
theirs; shared by tests/test_qk_clip.py and the distributed script.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import stabilitykit as sk


class UserAttention(nn.Module):
    """Causal attention with explicit scores; ``num_heads`` query heads, ``num_kv_heads`` key/value heads.

    Under tensor parallelism set ``num_heads``/``num_kv_heads`` to the local counts (the forward
    reads the local head count from the projection output).
    """

    qk_clip_tracking = False

    def __init__(self, width: int, num_heads: int, num_kv_heads: int | None = None, fused: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = width // num_heads
        self.fused = fused
        q_rows, kv_rows = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if fused:
            self.qkv = nn.Linear(width, q_rows + 2 * kv_rows)
        else:
            self.q_proj = nn.Linear(width, q_rows)
            self.k_proj = nn.Linear(width, kv_rows)
            self.v_proj = nn.Linear(width, kv_rows)
        self.o_proj = nn.Linear(q_rows, width)
        self.head_max: Tensor | None = None
        #: Compute the separate projections in this many row blocks, as that many tensor-parallel ranks
        #: do: a single-process reference with bitwise the same per-head logits.
        self.proj_chunks = 1

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        if self.fused:
            q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
            q, k, v = self.qkv(x).split([q_rows, kv_rows, kv_rows], dim=-1)
        else:
            q, k, v = (self._project(p, x) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k, v = (z.reshape(b, t, -1, d).transpose(1, 2) for z in (q, k, v))
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), -math.inf)
        if self.qk_clip_tracking:
            self.head_max = scores.detach().amax(dim=(0, 2, 3))
        y = scores.softmax(-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]

    def _project(self, linear: nn.Linear, x: Tensor) -> Tensor:
        if self.proj_chunks == 1:
            return linear(x)  # type: ignore[no-any-return]
        blocks = zip(linear.weight.chunk(self.proj_chunks), linear.bias.chunk(self.proj_chunks), strict=True)
        return torch.cat([F.linear(x, w, b) for w, b in blocks], dim=-1)

    def qk_clip_layout(self) -> sk.nn.QKLayout:
        if self.fused:
            return sk.nn.QKLayout.fused(self.qkv, self.num_heads, self.head_dim, self.num_kv_heads)
        return sk.nn.QKLayout.separate(self.q_proj, self.k_proj, self.num_heads, self.head_dim, self.num_kv_heads)

    def qk_clip_max_logits(self) -> Tensor | None:
        return self.head_max


class AttnNet(nn.Module):
    """Two residual attention layers and a linear head: (B, T, width) -> (B, T, 3).

    ``parallel=True``: both layers read the input (``x + l0(x) + l1(x)``), so each layer's logits
    come from the input alone (a tensor-parallel reference then matches bitwise).
    """

    def __init__(
        self, width: int = 16, heads: int = 4, kv_heads: int | None = None, fused: bool = False, parallel: bool = False
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([UserAttention(width, heads, kv_heads, fused) for _ in range(2)])
        self.head = nn.Linear(width, 3)
        self.parallel = parallel

    def forward(self, x: Tensor) -> Tensor:
        if self.parallel:
            x = x + sum(layer(x) for layer in self.layers)
        else:
            for layer in self.layers:
                x = x + layer(x)
        return self.head(x)  # type: ignore[no-any-return]


def per_head_logit_max(layer: UserAttention, x: Tensor) -> Tensor:
    """The per-head max causal logit of ``layer`` on ``x``, recomputed here from its weights."""
    lay = layer.qk_clip_layout()
    d, hq, hkv = lay.head_dim, lay.num_heads, lay.kv_heads
    qb = lay.q_bias if lay.q_bias is not None else torch.zeros(lay.q_weight.shape[0])
    kb = lay.k_bias if lay.k_bias is not None else torch.zeros(lay.k_weight.shape[0])
    q_rows = slice(lay.q_row, lay.q_row + hq * d)
    k_rows = slice(lay.k_start, lay.k_start + hkv * d)
    q = x @ lay.q_weight[q_rows].T + qb[q_rows]
    k = x @ lay.k_weight[k_rows].T + kb[k_rows]
    t = x.shape[1]
    out = []
    for h in range(hq):
        g = h // (hq // hkv)
        s = torch.einsum("btd,bsd->bts", q[..., h * d : (h + 1) * d], k[..., g * d : (g + 1) * d]) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
        out.append(s.amax())
    return torch.stack(out)
