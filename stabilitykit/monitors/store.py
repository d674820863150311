"""The monitors' store: one device value per metric, kept between sampled steps and the logging read.

Every hook keeps its values in a slot declared when it was installed (the set of slots never changes
afterwards, so nothing grows per step). A max signal keeps its running maximum over the sampled
forward passes since the last read, any other the latest value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stabilitykit.monitors.fp8 import FP8_SIGNALS

#: Every signal a monitor records, and whether values measured on several sampled steps between
#: two reads keep their running maximum (True) or the latest value (False).
SIGNALS = {
    "act_rms": False,
    "act_max": True,
    "resid_norm": False,
    "attn_logit_max": True,
    "logits_max": True,
    "log_z": False,
    **FP8_SIGNALS,
    "expert_load_max": True,
    "experts_dead": True,
    "router_entropy": False,
    "router_z": True,
    "router_collapsed": True,
}


class Slot:
    """One metric's value since the last read. Its value is always a tensor on a sampled step (primed
    before the step, outside any compiled code), so a hook's running max reads no Python state that
    changes between forward passes: a compiled model keeps one graph for sampled forward passes,
    whether values from earlier micro-batches or steps are waiting or not."""

    __slots__ = ("filled", "value")

    def __init__(self) -> None:
        self.value: Tensor | None = None
        self.filled = False


class MetricStore:
    """The slots of one monitor, by metric name ``monitors/<signal>/<module>``, on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: dict[str, Slot] = {}

    def declare(self, signal: str, module: str) -> None:
        """Declare a metric when its hook is installed (the set of slots never changes afterwards)."""
        self._slots.setdefault(f"monitors/{signal}/{module}", Slot())

    def keep(self, signal: str, module: str, value: Tensor) -> None:
        """Keep one measured value on the device (a running max for max signals) until the next read."""
        slot = self._slots.get(f"monitors/{signal}/{module}")
        if slot is None:
            return
        if SIGNALS[signal] and slot.value is not None:
            slot.value = torch.maximum(slot.value, value.float())
        else:
            slot.value = value.float()
        slot.filled = True

    def filled(self, signal: str, module: str) -> bool:
        """Whether ``module``'s ``signal`` was measured since the last read."""
        slot = self._slots.get(f"monitors/{signal}/{module}")
        return slot is not None and slot.filled

    def prime(self) -> None:
        """Before a sampled step: every unfilled slot holds its own -inf (one tensor per slot: a compiled
        graph must not see two slots as one input; sampled steps only)."""
        for slot in self._slots.values():
            if slot.value is None:
                slot.value = torch.full((), -torch.inf, device=self.device)

    def take(self) -> dict[str, Tensor]:
        """The values measured since the last read, by metric name; the store is emptied."""
        out = {key: slot.value for key, slot in self._slots.items() if slot.filled and slot.value is not None}
        self.clear()
        return out

    def clear(self) -> None:
        """Forget every value."""
        for slot in self._slots.values():
            slot.value, slot.filled = None, False
