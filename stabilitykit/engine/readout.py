"""The host side of a step: journal rows read, folded into the ledger in step order, logged.

The engine (``engine/step.py``) decides steps on the device; this module is where the host learns
of them. ``read`` is a logging step's one device-to-host copy: the journal rows since the last read,
the metric sources' values, the loss scale and the update ratio, in one transfer. ``fold`` hands
each row to the ledger exactly once (counters, events, divergence) and the events to the library's
observers (recovery's triggers) and then the user's hooks and sinks, in step order. ``log`` builds
the logging step's metrics (``metrics.py``) and sends them to the sinks. ``flush`` does the read
and the fold outside a step (a summary, the end of a run).

The parts it reads (ledger, journal, rule set, metric names) are the engine's; the engine binds
them here whenever it builds new ones (construction, a state load, a rollback, a change of
parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from torch import Tensor

from stabilitykit.engine.decision import StepDecision
from stabilitykit.engine.journal import Journal, Row
from stabilitykit.engine.ledger import Divergence, Ledger
from stabilitykit.engine.metrics import MetricNames
from stabilitykit.engine.sources import MetricSources
from stabilitykit.engine.updates import UpdateMonitor
from stabilitykit.events import Event
from stabilitykit.hooks import HookManager
from stabilitykit.rules import RuleSet


class Readout:
    """One optimizer's host side: what the host read of its steps, and what it did with it."""

    def __init__(self, hooks: HookManager) -> None:
        self.hooks = hooks
        #: The library's own observers of folded events (recovery's triggers): fed from the ledger in step
        #: order, before the events go out to the user's hooks and sinks, never through them.
        self.observers: list[Callable[[Event], None]] = []
        #: Where a driver's tracer saw the first non-finite value; named by this step's skip events.
        self.source_hint: Any | None = None
        #: The newest metrics sent to the sinks (a final row updates the last logging step's values).
        self.last_host_metrics: dict[str, float] = {}
        self._unlogged: Row | None = None  # the newest row a flush read without logging it (see ``flush``)
        self._logged_step: int | None = None  # the newest row logged so far
        # bound by the engine (``bind``) before the first step
        self.ledger: Ledger
        self.journal: Journal
        self.rules: RuleSet
        self.names: MetricNames
        self.updates: UpdateMonitor | None = None
        self.clipping = False

    def bind(
        self,
        ledger: Ledger,
        journal: Journal,
        rules: RuleSet,
        names: MetricNames,
        updates: UpdateMonitor | None,
        clipping: bool,
    ) -> None:
        """Read and fold into these parts from now on (the engine built new ones)."""
        self.ledger, self.journal, self.rules = ledger, journal, rules
        self.names, self.updates, self.clipping = names, updates, clipping

    def read(self, decision: StepDecision, sources: MetricSources, loss_scale: Tensor | None = None) -> None:
        """Copy the journal rows since the last read to the host: the logging step's one sync.

        On a logging step the metric ``sources``' values and ``loss_scale`` ride in the same copy."""
        names: list[str] = []
        extras: list[Tensor] = []
        quiet: set[str] = set()  # module metrics logged only, not watched by the spike detector
        if decision.logging:
            metrics, quiet = sources.collect()
            for key, value in metrics.items():
                names.append(key)
                extras.append(value)
        if loss_scale is not None:
            names.append("scaler/scale")
            extras.append(loss_scale)
        updates = self.updates if decision.logging else None
        update = updates.values(decision.report.step) if updates is not None else None
        if update is not None:
            extras = [*extras, update]  # a vector: the update ratio and weight norms, read in the same copy
        rows, tail = self.journal.read(extras, current_step=decision.report.step)
        if updates is not None and update is not None:
            decision.update_metrics = updates.named(
                tail[len(names) :], self.names.layer_names, self.names.logged_layers
            )
        values = dict(zip(names, tail[: len(names)], strict=True))
        decision.loss_scale = values.pop("scaler/scale", None)
        decision.module_metrics = values
        decision.signals = {k: v for k, v in values.items() if k not in quiet}
        decision.rows.extend(rows)
        if rows and rows[-1].step == decision.report.step and decision.pending:
            decision.settle(rows[-1].code, self.rules.decode(rows[-1].code).reason)

    def fold(self, rows: list[Row], step: int, signals: dict[str, float] | None = None) -> Divergence | None:
        """Fold rows the ledger has not taken yet; emit their events; the first divergence among them.

        ``signals``: module metrics measured at ``step`` (max attention logit, log Z), scored with its row.
        """
        first: Divergence | None = None
        for row in rows:
            if row.folded:
                continue
            source, row_signals = None, None
            if row.step == step:
                source, self.source_hint = self.source_hint, None
                row_signals = signals
            if row.metrics:  # recorded metrics are precursors too, at every step they were recorded
                recorded = {self.names.key(f"metrics/{k}"): v for k, v in row.metrics.items() if math.isfinite(v)}
                row_signals = {**(row_signals or {}), **recorded}
            events, divergence = self.ledger.fold(row, source, row_signals)
            for event in events:
                for observe in self.observers:
                    observe(event)  # the library's own observers (recovery's triggers), in step order
                self.hooks.emit(event)
            first = first or divergence
        return first

    def report_divergence(self, divergence: Divergence, raise_error: bool = True) -> None:
        """Emit the "diverged" event; raise ``TrainingDivergedError`` when ``raise_error``."""
        err = divergence.error()
        details = {"consecutive": divergence.consecutive, "layer": divergence.layer, "reason": divergence.reason}
        self.hooks.emit(Event("diverged", divergence.step, str(err), details))
        if raise_error:
            raise err

    def flush(self, step: int, final_row: bool = False) -> list[Row]:
        """Read and fold the journal now (one sync): counters, detectors and events catch up.

        ``step``: the engine's next step. Drivers call it at the end of training and ``summary()``
        relies on it. A run of skips that reached ``max_consecutive`` is reported as a "diverged"
        event, not raised. ``final_row``: the run is closing, so the steps since the last logging
        step also get a metrics row (at the newest step's number) in every sink. Returns the rows read.
        """
        rows: list[Row] = []
        divergence = None
        if len(self.journal):
            rows, _ = self.journal.read()
            divergence = self.fold(rows, step)
            if rows and rows[-1].step != self._logged_step:
                self._unlogged = rows[-1]  # read without a metrics row (a summary): still owed one at the end
        if final_row and self._unlogged is not None:
            self.log(self._unlogged, self._unlogged.step, None, [])
        if divergence is not None:
            self.report_divergence(divergence, raise_error=False)
        return rows

    def log(self, last: Row, step: int, loss_scale: float | None, extra: list[dict[str, float]]) -> None:
        """Metrics for the rows read up to ``last`` (the newest), logged at ``step`` to every sink (names:
        ``metrics.py``); ``extra``: a logging step's module metrics and update ratios."""
        self._unlogged, self._logged_step = None, last.step
        extra_given = any(extra)
        c = self.ledger.counters
        scaler = None
        if loss_scale is not None:
            scaler = {"scaler/scale": loss_scale, "scaler/overflow_rate": self.ledger.fp16.rate(last.step)}
            for event in self.ledger.fp16_events(last.step, loss_scale, self.source_hint):
                self.hooks.emit(event)
        extra = list(extra)
        if self.ledger.spikes is not None:
            extra.append(self.ledger.spikes.metrics())
        if last.metrics:
            extra.append({f"metrics/{k}": v for k, v in last.metrics.items()})
        named = self.names.build(last, c, self.clipping, scaler, extra)
        if c.clipped_recent:
            count = c.clipped_recent
            self.hooks.emit(
                Event("clipped", step, f"{count} step(s) clipped since the last logging step", {"count": count})
            )
        c.reset_recent()
        # a final row (no module metrics of its own) updates the last logging step's values, keeping the rest
        self.last_host_metrics = {**self.last_host_metrics, **named} if not extra_given else dict(named)
        self.hooks.log_metrics(named, step)
