"""WandbSink: stabilitykit's metrics, event markers and alerts in a W&B run.

Names live under ``stability/...`` and are plotted against ``trainer/global_step`` (the step
metric Lightning's WandbLogger defines), so they line up with a Lightning run's own charts.

The run is looked up at every call (``wandb.run`` unless one was passed), so a sink built before
``wandb.init()`` (the usual order) logs to the run once it starts: what arrives before is held
(up to ``buffer_size`` records) and sent then. A missing or failing W&B never stops training and
never drops data silently: the sink warns once and says what it dropped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from stabilitykit.events import Event

#: Event kinds that raise a W&B alert by default.
ALERT_KINDS = ("spike_alert", "nonfinite", "diverged", "fp16_warning", "rollback", "recovery")
_LEVELS = {
    "diverged": "ERROR",
    "nonfinite": "WARN",
    "spike_alert": "WARN",
    "fp16_warning": "WARN",
    "rollback": "WARN",
    "recovery": "WARN",
}
_PER_LAYER_FAMILIES = ("grad_norm/", "update_ratio/", "weight_norm/")


def _per_layer(key: str) -> bool:
    """A per-layer key (``stability/grad_norm/blocks.0``), the first kind dropped above ``max_keys``."""
    if key.count("/") > 2:
        return True
    return any(f in key for f in _PER_LAYER_FAMILIES) and not key.endswith(("grad_norm/total", "grad_norm/max"))


class WandbSink:
    """Logs to ``run`` (default: whichever ``wandb.run`` is active when each record arrives).

    ``alert_on``: event kinds that call ``run.alert`` (title under 64 characters, a level, and
    ``alert_wait_seconds`` between alerts of one kind). Every event is also logged as a marker
    metric ``stability/events/<kind>`` at the step it happened, for spike markers on charts.
    ``max_keys`` bounds the keys of one log call (per-layer norms beyond it are dropped, once
    with a warning; weight norms first, then update ratios, then grad norms). ``buffer_size``
    records are held while no run is active.
    """

    def __init__(
        self,
        run: Any | None = None,
        step_metric: str = "trainer/global_step",
        alert_on: Iterable[str] = ALERT_KINDS,
        alert_wait_seconds: float = 300.0,
        max_keys: int = 512,
        prefix: str = "stability",
        buffer_size: int = 1000,
    ) -> None:
        self.run = run
        self.step_metric = step_metric
        self.alert_on = set(alert_on)
        self.alert_wait_seconds = alert_wait_seconds
        self.max_keys = max_keys
        self.prefix = prefix
        self.buffer_size = buffer_size
        self.dropped = 0
        self._reported = 0
        self._dropped_steps: list[int] = []
        self._pending: deque[tuple[str, Any, int]] = deque()
        self._wandb: Any | None = None
        self._no_wandb = False
        self._defined_for: Any | None = None
        self._warned: set[str] = set()
        self._trimmed_warned = False

    # ------------------------------------------------------------------ plumbing
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"stabilitykit WandbSink: {message}", RuntimeWarning, stacklevel=4)

    def _count_dropped(self, step: int) -> None:
        self.dropped += 1
        self._dropped_steps = [self._dropped_steps[0] if self._dropped_steps else step, step]

    def _dropped_text(self) -> str:
        first, last = [*self._dropped_steps, 0, 0][:2]
        return f"{self.dropped} record(s) dropped (steps {first}..{last})"

    def _current_run(self) -> Any | None:
        """The run to log to now: the one passed in, else the active ``wandb.run`` (None if neither)."""
        if self.run is not None:
            return self.run
        if self._no_wandb:
            return None
        if self._wandb is None:
            try:
                import wandb
            except ImportError:
                self._no_wandb = True
                self._warn_once(
                    "import", "wandb is not installed (pip install 'stabilitykit[wandb]'); every record is dropped"
                )
                return None
            self._wandb = wandb
        return self._wandb.run

    def _define_metrics(self, run: Any) -> None:
        run.define_metric(self.step_metric)
        run.define_metric(f"{self.prefix}/*", step_metric=self.step_metric)
        run.define_metric(f"{self.prefix}/grad_norm/total", step_metric=self.step_metric, summary="max")
        run.define_metric(f"{self.prefix}/loss", step_metric=self.step_metric, summary="min")
        self._defined_for = run

    def _submit(self, kind: str, payload: Any, step: int) -> None:
        """Send one record to the run now, or hold it until there is one."""
        run = self._current_run()
        if run is None:
            if self._no_wandb:
                self._count_dropped(step)
                return
            self._warn_once(
                "no-run",
                "no active W&B run (call wandb.init() before training, or pass run=); holding up to "
                f"{self.buffer_size} records until one starts, training goes on",
            )
            if len(self._pending) >= self.buffer_size:
                _kind, _payload, old_step = self._pending.popleft()
                self._count_dropped(old_step)
                self._warn_once(
                    "overflow",
                    f"more than {self.buffer_size} records arrived before a W&B run started; dropping the "
                    "oldest (raise buffer_size, or call wandb.init() earlier)",
                )
            self._pending.append((kind, payload, step))
            return
        try:
            if self._defined_for is not run:
                self._define_metrics(run)
            while self._pending:
                self._send(run, *self._pending[0])
                self._pending.popleft()
            self._send(run, kind, payload, step)
        except Exception as exc:  # W&B failing must never stop training
            self._count_dropped(step)
            self._warn_once(
                "log-failed",
                f"logging to W&B failed ({exc!r}); records are dropped while it fails (counted, "
                "reported at close), training goes on",
            )

    def _send(self, run: Any, kind: str, payload: Any, step: int) -> None:
        if kind == "metrics":
            run.log({**payload, self.step_metric: step})
            return
        event: Event = payload
        value = float(event.details.get("z", 1.0)) if event.kind == "spike_warning" else 1.0
        run.log({f"{self.prefix}/events/{event.kind}": value, self.step_metric: step})
        if event.kind in self.alert_on:
            send_alert(event, run, wait_seconds=self.alert_wait_seconds)

    # ------------------------------------------------------------------ the sink protocol
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """One logging step's metrics, with ``trainer/global_step = step``."""
        row = dict(metrics)
        if len(row) > self.max_keys:
            keep = sorted(row, key=lambda k: (_per_layer(k), k))  # per-layer last; grad norms kept longest
            row = {k: row[k] for k in keep[: self.max_keys]}
            if not self._trimmed_warned:
                warnings.warn(
                    f"stabilitykit WandbSink: {len(metrics)} keys in one step, keeping {self.max_keys} "
                    "(raise max_keys, or coarsen GradNormConfig.grouping)",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self._trimmed_warned = True
        self._submit("metrics", row, step)

    def log_event(self, event: Event) -> None:
        """A marker metric at the event's step; an alert for the kinds in ``alert_on``."""
        self._submit("event", event, event.step)

    def close(self) -> None:
        """Send what is held if a run is active now; warn with the count of anything dropped.

        The run itself belongs to its owner (``wandb.finish()``).
        """
        run = self._current_run() if self._pending else None
        if run is not None:
            with contextlib.suppress(Exception):  # what is left is counted below
                if self._defined_for is not run:
                    self._define_metrics(run)
                while self._pending:
                    self._send(run, *self._pending[0])
                    self._pending.popleft()
        for _kind, _payload, step in self._pending:
            self._count_dropped(step)
        self._pending.clear()
        if self.dropped > self._reported:
            self._reported = self.dropped
            warnings.warn(
                f"stabilitykit WandbSink: {self._dropped_text()}: no W&B run took them (wandb.init() never "
                "came, the run failed, or it had finished)",
                RuntimeWarning,
                stacklevel=2,
            )


def send_alert(event: Event, run: Any | None = None, wait_seconds: float = 300.0) -> bool:
    """Page W&B about ``event`` on ``run`` (default: the active ``wandb.run``).

    The one place alerts are made: title under 64 characters, level ERROR for ``diverged`` and
    WARN otherwise, ``wait_seconds`` between alerts of one title. Returns False when there is no
    run; raises what ``run.alert`` raises (callers decide: ``WandbSink`` counts, others warn).
    """
    import wandb  # an alert is only asked for where wandb is installed

    run = run if run is not None else wandb.run
    if run is None:
        return False
    title = f"stabilitykit: {event.kind} at step {event.step}"[:63]
    level = getattr(wandb.AlertLevel, _LEVELS.get(event.kind, "WARN"))  # type: ignore[attr-defined]
    run.alert(title=title, text=event.message, level=level, wait_duration=wait_seconds)
    return True
