"""A trainer written the way nanoGPT's ``model.py`` and ``train.py`` are, adopted as the plain-loop guide says.

Not this project's code style on purpose: the model is nanoGPT's (pre-norm blocks with bias-free
``LayerNorm``, fused ``c_attn``, ``F.scaled_dot_product_attention``, GELU MLP, tied embedding and head,
``std=0.02`` init with ``c_proj`` scaled by ``1/sqrt(2 * n_layer)``), its ``configure_optimizers``
(weight decay on 2-D tensors only, AdamW betas 0.9/0.95) and its loop (``get_lr(it)``: linear
warm-up then cosine to ``min_lr = lr / 10``, written into every ``param_group["lr"]`` each iteration;
``grad_clip = 1.0``). The adoption follows ``docs/guides/plain-loop.md``: ``guard.backward(loss)`` and
``guard.step()`` replace ``loss.backward()`` and ``optimizer.step()``, nanoGPT's
``clip_grad_norm_(..., grad_clip)`` becomes ``ClipConfig(mode="fixed", max_norm=grad_clip)``, and
``get_lr`` is fed ``guard.schedule_step`` instead of ``iter_num`` (a skipped step, or a rollback,
holds the schedule).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head
        self.n_embd = config.n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(
        self, weight_decay: float, learning_rate: float, betas: tuple[float, float]
    ) -> torch.optim.Optimizer:
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's schedule: linear warm-up, cosine decay to ``min_lr``, then ``min_lr``."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def train(
    get_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    max_iters: int,
    learning_rate: float,
    warmup_iters: int,
    recovery: Any | None,
    seed: int,
    lr_boost: Callable[[int], float] = lambda iter_num: 1.0,
    events: list[Any] | None = None,
) -> tuple[GPT, Any, list[float], bool]:
    """nanoGPT's loop over ``get_batch(iter_num)`` under ``sk.StabilityGuard``: (model, guard, losses every 10
    iterations, gave up). ``recovery``: a ``RecoveryConfig`` or None (the guard alone). ``lr_boost``: a fault,
    the factor on the learning rate at an iteration (1.0: none); ``events``: gets the ``rollback`` and
    ``recovery`` events."""
    import stabilitykit as sk

    torch.manual_seed(seed)
    grad_clip, weight_decay, beta1, beta2 = 1.0, 0.1, 0.9, 0.95
    min_lr, lr_decay_iters = learning_rate / 10, max_iters
    model = GPT(GPTConfig())
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
    clip = sk.ClipConfig(mode="fixed", max_norm=grad_clip)
    config = sk.StabilityConfig(clip=clip) if recovery is None else sk.StabilityConfig(clip=clip, recovery=recovery)
    guard = sk.StabilityGuard(model, optimizer, config)
    if events is not None:
        guard.hooks.on("rollback", events.append)
        guard.hooks.on("recovery", events.append)
    losses: list[float] = []
    gave_up = False
    for iter_num in range(max_iters):
        lr = get_lr(guard.schedule_step, learning_rate, warmup_iters, lr_decay_iters, min_lr) * lr_boost(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        model.train()
        X, Y = get_batch(iter_num)
        _, loss = model(X, Y)
        guard.backward(loss)
        try:
            guard.step()
        except sk.TrainingDivergedError:
            gave_up = True
            break
        guard.zero_grad()
        if iter_num % 10 == 9:
            losses.append(float(loss.detach()))
    return model, guard, losses, gave_up
