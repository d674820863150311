"""A Lightning callback shared by the Lightning tests: state around one global step's optimizer step."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch


class StateAt(pl.Callback):
    """Parameters, optimizer state and LR before and after the optimizer step of one global step."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def _take(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        opt = trainer.optimizers[0]
        return {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "opt": copy.deepcopy(opt.state_dict()["state"]),
            "lr": opt.param_groups[0]["lr"],
        }

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not self.before:
            self.before = self._take(trainer, module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step + 1 and not self.after:
            self.after = self._take(trainer, module)

    def assert_unchanged(self) -> None:
        """Parameters and optimizer state are bitwise what they were before the step."""
        assert self.before and self.after
        for name, value in self.before["params"].items():
            assert torch.equal(value, self.after["params"][name]), f"parameter {name} changed on a skipped step"
        for key, state in self.before["opt"].items():
            for field, value in state.items():
                assert torch.equal(value, self.after["opt"][key][field]), f"optimizer state {key}.{field} changed"
