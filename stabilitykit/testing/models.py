"""Model factories for ``stabilitykit precision --model``, shipped with the package so they work
from any folder: each returns ``(model, batch, loss_fn)``.

    stabilitykit precision --model stabilitykit.testing.models:tiny_gpt --variants bf16,fp16 --out report/
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stabilitykit.testing.tiny_gpt import char_batches
from stabilitykit.testing.tiny_gpt import tiny_gpt as _tiny_gpt


def _gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return model.loss(x, y)  # type: ignore[operator,no-any-return]


def tiny_gpt() -> tuple[nn.Module, Any, Any]:
    """The 4-layer test GPT on one batch of the synthetic token stream."""
    return _tiny_gpt(seed=0), next(char_batches(batch_size=8, seed=0)), _gpt_loss


def tiny_gpt_qk_norm() -> tuple[nn.Module, Any, Any]:
    """The same GPT with qk-norm attention and z-loss, to compare against ``tiny_gpt``."""
    return _tiny_gpt(seed=0, qk_norm=True, z_loss=1e-4), next(char_batches(batch_size=8, seed=0)), _gpt_loss
