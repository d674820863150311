"""Buffers a skipped step must leave as they were: BatchNorm-style running statistics.

A forward pass in training mode updates running statistics before the skip is decided, so a NaN
batch poisons them even though the optimizer step is skipped. ``BufferGuard`` keeps a device copy
of those buffers from the end of the last applied step and puts it back on a skip: with a plain
copy when the host knows the decision, with ``torch.where`` on the device when it does not (no
host sync either way). Only buffers of modules that track running statistics are kept
(``track_running_stats``), so large constant buffers (masks, rotary tables) cost nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def running_stat_buffers(model: nn.Module | None, mode: str = "auto") -> list[Tensor]:
    """The buffers a skip restores: "auto" (modules with ``track_running_stats``), "all" or "none"."""
    if model is None or mode == "none":
        return []
    if mode == "all":
        return [b for b in model.buffers() if b is not None]
    found: list[Tensor] = []
    for module in model.modules():
        if getattr(module, "track_running_stats", False):
            found.extend(b for b in module.buffers(recurse=False) if b is not None)
    return found


class BufferGuard:
    """Snapshot after every applied step; restore on a skip."""

    def __init__(self, buffers: list[Tensor]) -> None:
        self.buffers = buffers
        self.snapshot = [b.detach().clone() for b in buffers]

    def __bool__(self) -> bool:
        return bool(self.buffers)

    def restore(self, skip: Tensor | bool) -> None:
        """Put the snapshot back where ``skip`` (a host bool, or a 0-d device bool) says so."""
        if not self.buffers:
            return
        if isinstance(skip, bool):
            if skip:
                torch._foreach_copy_(self.buffers, self.snapshot)
            return
        with torch.no_grad():
            for buffer, saved in zip(self.buffers, self.snapshot, strict=True):
                buffer.copy_(torch.where(skip.to(buffer.device), saved, buffer))

    def save(self) -> None:
        """The buffers as they are now become what a later skip restores."""
        if self.buffers:
            torch._foreach_copy_(self.snapshot, self.buffers)
