"""WandbSink: stabilitykit's metrics, event markers and alerts in a W&B run.

Names live under ``stability/...`` and are plotted against ``trainer/global_step`` (the step
metric Lightning's WandbLogger defines), so they line up with a Lightning run's own charts.
A missing or failing W&B never stops training: the sink warns once and goes quiet.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from stabilitykit.events import Event

__all__ = ["ALERT_KINDS", "WandbSink"]

#: Event kinds that raise a W&B alert by default.
ALERT_KINDS = ("spike_warning", "nonfinite", "diverged", "fp16_warning")
_LEVELS = {"diverged": "ERROR", "nonfinite": "WARN", "spike_warning": "WARN", "fp16_warning": "WARN"}


class WandbSink:
    """Logs to ``run`` (default: the active ``wandb.run`` when the first metrics arrive).

    ``alert_on``: event kinds that call ``run.alert`` (title under 64 characters, a level, and
    ``alert_wait_seconds`` between alerts of one kind). Every event is also logged as a marker
    metric ``stability/events/<kind>`` at the step it happened, for spike markers on charts.
    ``max_keys`` bounds the keys of one log call (per-layer norms beyond it are dropped, once
    with a warning).
    """

    def __init__(
        self,
        run: Any | None = None,
        step_metric: str = "trainer/global_step",
        alert_on: Iterable[str] = ALERT_KINDS,
        alert_wait_seconds: float = 300.0,
        max_keys: int = 512,
        prefix: str = "stability",
    ) -> None:
        self.run = run
        self.step_metric = step_metric
        self.alert_on = set(alert_on)
        self.alert_wait_seconds = alert_wait_seconds
        self.max_keys = max_keys
        self.prefix = prefix
        self._wandb: Any | None = None
        self._defined = False
        self._quiet = False
        self._trimmed_warned = False

    # ------------------------------------------------------------------ plumbing
    def _warn(self, message: str) -> None:
        if not self._quiet:
            warnings.warn(
                f"stabilitykit WandbSink: {message}; W&B logging is off, training goes on", RuntimeWarning, stacklevel=3
            )
        self._quiet = True

    def _active_run(self) -> Any | None:
        if self._quiet:
            return None
        if self._wandb is None:
            try:
                import wandb
            except ImportError:
                self._warn("wandb is not installed (pip install 'stabilitykit[wandb]')")
                return None
            self._wandb = wandb
        if self.run is None:
            self.run = self._wandb.run
            if self.run is None:
                self._warn("no active W&B run (call wandb.init() first, or pass run=)")
                return None
        if not self._defined:
            self._define_metrics()
        return self.run

    def _define_metrics(self) -> None:
        run: Any = self.run
        run.define_metric(self.step_metric)
        run.define_metric(f"{self.prefix}/*", step_metric=self.step_metric)
        run.define_metric(f"{self.prefix}/grad_norm/total", step_metric=self.step_metric, summary="max")
        run.define_metric(f"{self.prefix}/loss", step_metric=self.step_metric, summary="min")
        self._defined = True

    # ------------------------------------------------------------------ the sink protocol
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One logging step's metrics, with ``trainer/global_step = step``."""
        run = self._active_run()
        if run is None:
            return
        row = dict(metrics)
        if len(row) > self.max_keys:
            keep = sorted(
                row, key=lambda k: (k.count("/") > 2 or ("grad_norm/" in k and not k.endswith(("total", "max"))), k)
            )
            row = {k: row[k] for k in keep[: self.max_keys]}
            if not self._trimmed_warned:
                warnings.warn(
                    f"stabilitykit WandbSink: {len(metrics)} keys in one step, keeping {self.max_keys} "
                    "(raise max_keys, or coarsen GradNormConfig.grouping)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._trimmed_warned = True
        row[self.step_metric] = step
        run.log(row)

    def log_event(self, event: Event) -> None:
        """A marker metric at the event's step; an alert for the kinds in ``alert_on``."""
        run = self._active_run()
        if run is None:
            return
        value = float(event.details.get("z", 1.0)) if event.kind == "spike_warning" else 1.0
        run.log({f"{self.prefix}/events/{event.kind}": value, self.step_metric: event.step})
        if event.kind in self.alert_on:
            title = f"stabilitykit: {event.kind} at step {event.step}"[:63]
            level = getattr(self._wandb.AlertLevel, _LEVELS.get(event.kind, "WARN"))  # type: ignore[union-attr]
            run.alert(title=title, text=event.message, level=level, wait_duration=self.alert_wait_seconds)

    def close(self) -> None:
        """Nothing to close: the run belongs to its owner (``wandb.finish()``)."""
