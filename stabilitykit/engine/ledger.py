"""The ledger: journal rows in, counters, events and the divergence (if any) out. Pure Python.

Every row is folded exactly once, whether the host learned of it at its own step (a non-fused
optimizer's skip, a logging step) or at a later logging step (a fused optimizer skipped on the
device). That single path is what keeps counters, events and ``TrainingDivergedError`` consistent:
a run of skips is reported once, and a healthy step after a caught divergence starts afresh.

A skip the host learned of late was not seen by the LR scheduler, which stepped past it; the
ledger counts that as scheduler debt, paid by holding the scheduler on the coming steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from stabilitykit.engine.fp16 import Fp16Monitor
from stabilitykit.engine.journal import Row
from stabilitykit.events import Event, TrainingDivergedError
from stabilitykit.fields import NonNegativeInt
from stabilitykit.rules import RuleSet, SkipContext, Verdict
from stabilitykit.spikes import SpikeMonitor

if TYPE_CHECKING:  # the config module imports the sections' owners, this package among them
    from stabilitykit.config import StabilityConfig


@dataclass
class Counters:
    """Totals over the run, and over the current logging interval (``*_recent``).

    ``skipped_total``: steps skipped because they were bad (a rule's verdict: non-finite, a bad batch,
    a spike, an fp16 overflow). ``skipped_ahead_total``: batches a rollback skipped after it
    (``RecoveryConfig.skip_after``), counted apart; the run's summary and the logged metrics
    (``skipped/total``, ``skipped/ahead``) use these two, under the same names.
    """

    skipped_total: NonNegativeInt = 0
    skipped_ahead_total: NonNegativeInt = 0
    clipped_total: NonNegativeInt = 0
    nonfinite_total: NonNegativeInt = 0
    overflow_total: NonNegativeInt = 0
    consecutive: NonNegativeInt = 0
    max_norm: float = 0.0
    last_bad_step: int = -1
    last_bad_reason: str | None = None
    last_bad_layer: str | None = None
    skipped_recent: NonNegativeInt = 0
    clipped_recent: NonNegativeInt = 0
    max_norm_recent: float = 0.0
    #: The largest finite loss of the interval, skipped steps included (a blow-up between logging steps
    #: shows in ``loss/max``); -inf while the interval has none.
    max_loss_recent: float = -math.inf

    def reset_recent(self) -> None:
        """Start a new logging interval."""
        self.skipped_recent = self.clipped_recent = 0
        self.max_norm_recent = 0.0
        self.max_loss_recent = -math.inf

    def state(self) -> dict[str, Any]:
        """Every field, as plain values."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class Divergence:
    """Where a run of skips reached ``max_consecutive``."""

    step: int
    consecutive: int
    layer: str | None
    reason: str | None

    def error(self) -> TrainingDivergedError:
        """The exception the driver raises."""
        return TrainingDivergedError(self.step, self.consecutive, self.layer, self.reason)


class Ledger:
    """Folds host rows into counters, spike and fp16 monitors, and events."""

    def __init__(
        self, config: StabilityConfig, layer_names: list[str], fused: bool, rank: int | None, rules: RuleSet
    ) -> None:
        self.config = config
        self.rules = rules
        self.layer_names = layer_names
        self.fused = fused
        self.rank = rank
        self.counters = Counters()
        self.scheduler_debt = 0
        #: A driver tells the ledger whether an LR scheduler is held on skips (its event text says so).
        self.has_scheduler = False
        self.spikes = SpikeMonitor(config.spikes, layer_names) if config.spikes.enabled else None
        self.fp16 = Fp16Monitor(config.fp16)

    def carry_over(self, previous: Ledger, spikes: bool) -> None:
        """Take ``previous``'s counters, scheduler debt and fp16 monitor (and its spike monitor when
        ``spikes``): the same run, measured over a new set of parameters."""
        self.counters = previous.counters
        self.scheduler_debt = previous.scheduler_debt
        self.fp16 = previous.fp16
        if spikes:
            self.spikes = previous.spikes

    def fold(
        self, row: Row, source: Any | None = None, signals: dict[str, float] | None = None
    ) -> tuple[list[Event], Divergence | None]:
        """Take one row into the counters and monitors: its events, and a divergence if this row completes one.

        ``source``: where a tracer saw the first non-finite value of this step (named in its events).
        ``signals``: precursors measured at this step (module metrics), for the spike monitor.
        """
        c = self.counters
        events: list[Event] = []
        divergence = None
        loss_bad = row.loss is not None and not math.isfinite(row.loss)
        if not math.isfinite(row.total) or loss_bad:
            c.nonfinite_total += 1
        verdict = self.rules.decode(row.code)
        if verdict.reason == "after_rollback":
            # a batch a rollback skips ahead: counted apart from the bad steps, announced by the rollback
            # event; no streak, and never scored by the detectors (the bad data it skips must not
            # trigger the next rollback)
            c.skipped_ahead_total += 1
            row.folded = True
            return events, divergence
        if row.skipped:
            layer = self.bad_layer(row.layers)
            c.skipped_total += 1
            c.skipped_recent += 1
            counts = verdict.rule is None or verdict.rule.counts_toward_divergence
            if verdict.rule is not None and verdict.rule.name == "fp16_overflow":
                c.overflow_total += 1
                self.fp16.overflow(row.step)
            if counts:
                c.consecutive += 1
            c.last_bad_step, c.last_bad_reason, c.last_bad_layer = row.step, verdict.reason, layer
            if not row.on_time and self.fused:
                self.scheduler_debt += 1  # the scheduler already stepped past this skip
            late = not row.on_time and self.fused
            events.extend(self._skip_events(row.step, verdict, layer, source, late, row.total, row))
            limit = self.config.skip.max_consecutive
            if limit is not None and counts and c.consecutive >= limit:
                divergence = Divergence(row.step, c.consecutive, layer, verdict.reason)
        else:
            c.consecutive = 0
            if row.coef < 1.0:
                c.clipped_total += 1
                c.clipped_recent += 1
        if math.isfinite(row.total):
            c.max_norm = max(c.max_norm, row.total)
            c.max_norm_recent = max(c.max_norm_recent, row.total)
        if row.loss is not None and math.isfinite(row.loss):
            c.max_loss_recent = max(c.max_loss_recent, row.loss)
        if self.spikes is not None:
            layers = row.layers if self.layer_names and len(row.layers) == len(self.layer_names) else None
            events.extend(self.spikes.update(row.step, row.total, row.loss, layers, signals=signals))
        row.folded = True
        return events, divergence

    def consume_scheduler_hold(self, skipped_now: bool) -> bool:
        """Whether the LR scheduler must not advance this step: skipped now, or a step of scheduler debt
        (a skip learned late), which this call pays off. Call it once per step."""
        if skipped_now:
            return True
        if self.scheduler_debt > 0:
            self.scheduler_debt -= 1
            return True
        return False

    def bad_layer(self, layers: list[float]) -> str | None:
        """The non-finite layer reached first in backward (the last one in model order)."""
        for i in range(len(layers) - 1, -1, -1):
            if not math.isfinite(layers[i]):
                return self.layer_names[i] if i < len(self.layer_names) else None
        return None

    def _skip_events(
        self,
        step: int,
        verdict: Verdict,
        layer: str | None,
        source: Any | None,
        late: bool = False,
        total: float = math.nan,
        row: Row | None = None,
    ) -> list[Event]:
        """The rule's own event (its ``message``) and the ``skipped`` event of a skipped step."""
        reason = verdict.reason or "skipped"
        where = f" (first non-finite layer in backward order: {layer})" if layer else ""
        details: dict[str, Any] = {"reason": reason, "layer": layer}
        if self.rank is not None:
            details["rank"] = self.rank
            where += f" on rank {self.rank}"
        if source is not None:
            where = f" (first non-finite value: {source})"
            details.update(module=source.module, phase=source.phase, dtype=source.dtype, **source.stats)
        rule = verdict.rule
        events: list[Event] = []
        if rule is not None and not verdict.here and rule.remote_reason is not None:
            events.append(Event("nonfinite", step, "another rank saw a non-finite value; every rank skips", details))
        elif rule is not None and rule.event_kind != "rule_skip":
            ctx = SkipContext(step, where, total, details)
            events.append(Event(rule.event_kind, step, rule.message(ctx), details))
        elif rule is not None:
            details["rule"] = type(rule).__name__
            if row is not None:
                details["inputs"] = self._rule_inputs(rule.name, row)
            where = f" ({rule.message(SkipContext(step, where, total, details))})"
        skipped = f"step {step} skipped: {reason}"
        if rule is not None and rule.event_kind == "rule_skip":
            skipped += where
            if details.get("inputs"):
                skipped += " with " + ", ".join(f"{k}={v:.4g}" for k, v in details["inputs"].items())
        if late:
            details["learned_late"] = True
            skipped += " (skipped on the device by the fused optimizer, learned at this logging step"
            skipped += (
                "; its LR scheduler stepped once and is held one step to catch up)" if self.has_scheduler else ")"
            )
        events.append(Event("skipped", step, skipped, details))
        return events

    def _rule_inputs(self, name: str, row: Row) -> dict[str, float]:
        """The values of the step ``row`` that rule ``name`` read (its recorded metrics, the grad norm, the
        loss), as the journal holds them: what tripped it, in its skip event's details."""
        found: dict[str, float] = {}
        for key in self.rules.inputs.get(name, ()):
            if key in row.metrics:
                found[key] = row.metrics[key]
            elif key == "grad_norm":
                found[key] = row.total
            elif key == "loss" and row.loss is not None:
                found[key] = row.loss
        return found

    def fp16_events(self, step: int, scale: float, source: Any | None = None) -> list[Event]:
        """The fp16 monitor's events at a logging step (names where the first overflow came from)."""
        layer = self.counters.last_bad_layer
        where = ""
        if source is not None:
            where = f"; first overflow in {source}"
        elif layer:
            where = f"; the first layer to overflow in backward order: {layer}"
        events = self.fp16.check(step, scale, where)
        for event in events:
            event.details["layer"] = layer
        return events

    def state_dict(self) -> dict[str, Any]:
        """Counters, scheduler debt and monitor state (plain values)."""
        return {
            "counters": self.counters.state(),
            "scheduler_debt": self.scheduler_debt,
            "spikes": self.spikes.state_dict() if self.spikes is not None else None,
            "fp16": self.fp16.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.counters = Counters(**state["counters"])
        self.scheduler_debt = int(state["scheduler_debt"])
        if self.spikes is not None and state["spikes"] is not None:
            self.spikes.load_state_dict(state["spikes"])
        self.fp16.load_state_dict(state["fp16"])
