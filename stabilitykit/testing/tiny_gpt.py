"""A tiny GPT (pre-norm transformer, causal SDPA attention) and a synthetic token stream.

Small enough to train for hundreds of steps on a CPU in seconds; shaped like the real thing
(``blocks`` ModuleList, embeddings, final norm, LM head) so layer grouping and tracing behave
as they do on large models.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class GPTConfig:
    """Sizes of the tiny GPT."""

    vocab_size: int = 64
    block_size: int = 32
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    qk_norm: bool = False  # attention from stabilitykit.nn.QKNormAttention
    z_loss: float = 0.0  # coefficient of a stabilitykit.nn.ZLoss added to the loss (0: off)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention over ``scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """Two-layer GELU feed-forward network."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn: nn.Module = CausalSelfAttention(cfg)
        if cfg.qk_norm:
            from stabilitykit.nn import QKNormAttention

            self.attn = QKNormAttention(cfg.n_embd, cfg.n_head, dropout=cfg.dropout)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class TinyGPT(nn.Module):
    """Token + position embeddings, ``blocks``, final LayerNorm, LM head."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.z_loss: nn.Module | None = None
        if cfg.z_loss:
            from stabilitykit.nn import ZLoss

            self.z_loss = ZLoss(cfg.z_loss)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (batch, time, vocab)."""
        t = idx.shape[1]
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # type: ignore[no-any-return]

    def loss(self, idx: Tensor, targets: Tensor, weights: Tensor | None = None) -> Tensor:
        """Cross-entropy of next-token prediction, optionally weighted per token."""
        logits = self(idx)
        per_token = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        extra = self.z_loss(logits) if self.z_loss is not None else 0.0
        if weights is None:
            return per_token.mean() + extra
        return (per_token * weights.flatten()).sum() / weights.sum() + extra


def tiny_gpt(seed: int = 0, **sizes: Any) -> TinyGPT:
    """A seeded TinyGPT; keyword arguments override ``GPTConfig`` fields."""
    torch.manual_seed(seed)
    return TinyGPT(GPTConfig(**sizes))  # type: ignore[arg-type]


def char_batches(
    batch_size: int = 8, block_size: int = 32, vocab_size: int = 64, seed: int = 0
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless (inputs, targets) batches from a repeating, learnable synthetic token pattern."""
    gen = torch.Generator().manual_seed(seed)
    period = 7
    while True:
        starts = torch.randint(0, vocab_size, (batch_size, 1), generator=gen)
        steps = torch.arange(block_size + 1).unsqueeze(0)
        seq = (starts + (steps % period) * 3 + steps // period) % vocab_size
        noise = torch.rand(seq.shape, generator=gen) < 0.05
        seq = torch.where(noise, torch.randint(0, vocab_size, seq.shape, generator=gen), seq)
        yield seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
