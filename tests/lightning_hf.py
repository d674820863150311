"""A LightningModule holding a tiny Hugging Face model as ``self.model``, with step-interval schedulers."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from hf_models import tiny_gpt2, tiny_llama, token_batches
from torch.utils.data import DataLoader

SCHEDULERS = ("lambda", "onecycle", "cosine")


class HFModule(pl.LightningModule):
    """Causal-LM training of a tiny random-init HF model; ``poison`` maps global steps to a loss factor."""

    def __init__(
        self,
        kind: str = "llama",
        scheduler: str | None = "lambda",
        fused: bool = False,
        poison: dict[int, float] | None = None,
        lr: float = 3e-3,
        total_steps: int = 64,
        fail_at: int | None = None,
    ) -> None:
        super().__init__()
        self.model = tiny_llama() if kind == "llama" else tiny_gpt2()
        self.scheduler_kind = scheduler
        self.fused = fused
        self.poison = poison or {}
        self.lr = lr
        self.total_steps = total_steps
        self.fail_at = fail_at

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.fail_at is not None and self.global_step == self.fail_at:
            raise RuntimeError("injected failure")
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        return loss * self.poison.get(self.global_step, 1.0)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=self.fused, foreach=not self.fused)
        if self.scheduler_kind is None:
            return opt
        if self.scheduler_kind == "lambda":
            sched: Any = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
        elif self.scheduler_kind == "onecycle":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=self.total_steps)
        else:
            from transformers import get_cosine_schedule_with_warmup

            sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=3, num_training_steps=self.total_steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def hf_dataloader(n_batches: int = 4, seed: int = 0, repeat: bool = False) -> DataLoader:
    """``n_batches`` fixed batches per epoch, in order; ``repeat``: one batch ``n_batches`` times, so a
    resume sees the same data wherever Lightning restarts the epoch of a non-stateful loader."""
    batches = token_batches(1, seed=seed) * n_batches if repeat else token_batches(n_batches, seed=seed)
    return DataLoader(batches, batch_size=None, shuffle=False)
