"""What the one-process recovery tests share: a small MLP with BatchNorm (state in buffers too), its
batches, and a recovery config that rolls back on a divergence only and trains on at once (the
defaults' alert trigger, skip-ahead and LR cooldown off), so a test sees one mechanism at a time."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import stabilitykit as sk


def mlp() -> nn.Sequential:
    """Linear, BatchNorm, ReLU, Linear: parameters, optimizer state and running statistics to restore."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


def mlp_batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` inputs for ``mlp()``, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 8, generator=gen) for _ in range(n)]


def diverged_only_config(**recovery: Any) -> sk.StabilityConfig:
    """Snapshots every 4 steps (2 kept), a rollback after 3 skips in a row; ``recovery`` overrides."""
    settings: dict[str, Any] = {
        "enabled": True,
        "snapshot_every": 4,
        "keep": 2,
        "trigger": ["diverged"],
        "skip_after": 0,
        "cooldown_steps": 0,
        "max_lookback_share": 1.0,  # these runs are a few dozen steps: any snapshot but the first step's
        **recovery,
    }
    return sk.StabilityConfig(
        log_every_n_steps=5,
        skip=sk.SkipConfig(max_consecutive=3),
        recovery=sk.RecoveryConfig(**settings),
    )


def regression(steps: int = 120, seed: int = 0) -> tuple[nn.Linear, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A noisy linear regression the model learns in a few dozen steps, and its batches (SGD on it diverges
    once its LR passes about 0.7)."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    w = torch.randn(16, 1, generator=gen)
    batches = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=gen)
        batches.append((x, x @ w + 0.3 * torch.randn(32, 1, generator=gen)))
    return nn.Linear(16, 1), batches
