"""Module metric sources: what a model measures about itself, read with the logging step's journal copy.

A source is a module with ``stability_metrics()`` (``ZLoss``, ``QKNormAttention``), QK-clip over
the attention modules this optimizer updates (``config.qk_clip``), or the sampled monitors of
``config.monitors``. The engine tells every source which step comes next (``begin_step``), takes
their device tensors on logging steps (``collect``) and copies them to the host in the journal's
one read, so no source adds a host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from stabilitykit.events import Event
from stabilitykit.monitors import ModelMonitor
from stabilitykit.nn.qk_clip import QKClip

if TYPE_CHECKING:  # the config module imports the sections' owners, this package among them
    from stabilitykit.config import StabilityConfig


class MetricSources:
    """The engine's metric sources, QK-clip and the model monitor (each None when off)."""

    def __init__(self, config: StabilityConfig, model: nn.Module | None, params: Sequence[Tensor]) -> None:
        self.config = config
        self._model = model
        self.sources: list[Any] = []
        if model is not None and config.module_metrics:
            self.sources = [m for m in model.modules() if callable(getattr(m, "stability_metrics", None))]
        #: QK-clip (``config.qk_clip``) over the attention modules this optimizer updates, else None.
        self.qk_clip: QKClip | None = None
        self.follow_params(params)
        #: Sampled activation / attention-logit / log Z monitors (``config.monitors``), else None.
        self.monitor: ModelMonitor | None = None
        if model is not None and config.monitors is not None:
            self.monitor = ModelMonitor(model, config.monitors)
            self.sources.append(self.monitor)

    def follow_params(self, params: Sequence[Tensor]) -> None:
        """(Re)build QK-clip over the attention modules ``params`` holds (the optimizer's set changed)."""
        if self.qk_clip is not None:
            self.sources = [s for s in self.sources if s is not self.qk_clip]
        self.qk_clip = QKClip.from_config(self.config.qk_clip, self._model, list(params))
        if self.qk_clip is not None and self.config.module_metrics:
            self.sources.append(self.qk_clip)

    def begin_step(self, step: int, logging: bool) -> None:
        """Tell measuring sources about the coming step: ``begin_step(step, logging)`` where they have
        it (monitors sample on their own cadence), else ``measure_metrics = logging``."""
        for source in self.sources:
            begin_step = getattr(source, "begin_step", None)
            if callable(begin_step):
                begin_step(step, logging)
            elif hasattr(source, "measure_metrics"):
                source.measure_metrics = logging

    def collect(self) -> tuple[dict[str, Tensor], set[str]]:
        """Device tensors from every source (a key several share keeps the max), and the keys that are
        not precursors (a source's ``is_precursor(key)`` said no): logged, not scored."""
        merged: dict[str, list[Tensor]] = {}
        quiet: set[str] = set()
        for source in self.sources:
            is_precursor = getattr(source, "is_precursor", None)
            for key, value in source.stability_metrics().items():
                if value is not None:
                    merged.setdefault(key, []).append(value.detach().float().reshape(()))
                    if is_precursor is not None and not is_precursor(key):
                        quiet.add(key)
        return {k: v[0] if len(v) == 1 else torch.stack(v).amax() for k, v in merged.items()}, quiet

    def events(self, step: int, values: dict[str, float]) -> list[Event]:
        """Events the monitor raises from a logging step's host values (``"fp8_warning"``)."""
        return self.monitor.events(step, values) if self.monitor is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state (FP8 fallbacks), empty when there is none."""
        return self.monitor.state_dict() if self.monitor is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``."""
        if self.monitor is not None and state:
            self.monitor.load_state_dict(state)

    def step_values(self) -> dict[str, Tensor]:
        """Values the monitors measured for the step being decided (device tensors, NaN when unsampled),
        for the skip rules to read by name; they are not part of the step record."""
        return self.monitor.step_values() if self.monitor is not None else {}

    def discard(self) -> None:
        """Drop the monitor's values measured since the last read (a rollback undid their steps)."""
        if self.monitor is not None:
            self.monitor.discard()

    def close(self) -> None:
        """Remove the monitor's hooks from the model (training ended)."""
        if self.monitor is not None:
            self.monitor.close()
