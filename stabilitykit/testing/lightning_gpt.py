"""A tiny GPT LightningModule for tests, examples and benchmarks (needs the ``lightning`` extra)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from stabilitykit.testing.tiny_gpt import char_batches, tiny_gpt


class GPTModule(pl.LightningModule):
    """TinyGPT trained with AdamW; ``poison`` maps global steps to a loss factor (``nan``, ``1000``)."""

    def __init__(
        self,
        lr: float = 3e-3,
        fused: bool = True,
        poison: dict[int, float] | None = None,
        poison_rank: int | None = None,
        scheduler: bool = False,
        log_grad_norm: bool = False,
        seed: int = 0,
        sizes: dict[str, int] | None = None,
    ) -> None:
        super().__init__()
        self.model = tiny_gpt(seed=seed, **(sizes or {}))
        self.lr = lr
        self.fused = fused
        self.poison = poison or {}
        self.poison_rank = poison_rank
        self.use_scheduler = scheduler
        self.log_grad_norm = log_grad_norm

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.model.loss(x, y)
        factor = self.poison.get(self.global_step)
        if factor is not None and (self.poison_rank is None or self.global_rank == self.poison_rank):
            loss = loss * factor
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.log_grad_norm:  # Lightning's own recommendation, for the benchmark
            from lightning.pytorch.utilities import grad_norm

            self.log_dict(grad_norm(self, norm_type=2))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1, fused=self.fused)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class ManualGPTModule(GPTModule):
    """The same module under manual optimization: ``training_step`` backpropagates and steps the
    optimizer itself, so a callback must act through Lightning's wrapped optimizer step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()  # type: ignore[union-attr]
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()  # type: ignore[union-attr]
        return loss


def gpt_dataloader(
    n_batches: int = 40,
    batch_size: int = 8,
    seed: int = 0,
    repeat: bool = False,
    block_size: int = 32,
    vocab_size: int = 64,
) -> DataLoader:
    """A fixed, unshuffled stream of ``n_batches`` batches of the synthetic token pattern.

    ``repeat=True`` repeats one batch, so results do not depend on where a resumed epoch restarts.
    """
    data = char_batches(batch_size=batch_size, block_size=block_size, vocab_size=vocab_size, seed=seed)
    batches = [next(data) for _ in range(1 if repeat else n_batches)] * (n_batches if repeat else 1)
    xs, ys = zip(*batches, strict=True)
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=batch_size, shuffle=False)
