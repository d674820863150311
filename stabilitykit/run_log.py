"""Skips are never silent: notable events on Python's ``logging``, and a one-line summary at the end.

Every ``HookManager`` hands each event to an ``EventLog``: skips, data-guard refusals, divergence,
rollbacks and spike alerts are written at WARNING to the logger ``"stabilitykit"``, on rank zero
only and rate-limited (the first ``first`` of a run, then at most one per ``every`` steps with the
count of those left out; a divergence or a rollback is always written). Drivers write
``RunSummary.line()`` at INFO when a run ends (``guard.close()``, the Lightning callback's fit end,
the HF callback's train end).

The logger gets a stderr handler of its own unless something already configured one (as Lightning
and transformers do for theirs); silence it with ``logging.getLogger("stabilitykit").setLevel(...)``.
While a tqdm progress bar is on the screen (the HF Trainer's, Lightning's), that handler writes
through ``tqdm.write``, so a warning gets a line of its own instead of being glued onto the bar.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from stabilitykit.compat.private import live_tqdm_bars
from stabilitykit.events import Event


class TqdmSafeHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr handler that writes through ``tqdm.write`` while a tqdm bar is active.

    ``tqdm.write`` clears the bars, writes the line and draws them again, so a log line never
    lands on the end of a bar. With no bar (or no tqdm imported) it is a plain ``StreamHandler``.
    """

    def emit(self, record: logging.LogRecord) -> None:
        bars = live_tqdm_bars()
        if not bars:
            super().emit(record)
            return
        try:
            sys.modules["tqdm"].tqdm.write(self.format(record), file=self.stream)
        except Exception:  # a handler never raises into the training loop
            self.handleError(record)


LOGGER = logging.getLogger("stabilitykit")
if not LOGGER.handlers:
    _handler = TqdmSafeHandler()
    _handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    LOGGER.addHandler(_handler)
    LOGGER.setLevel(logging.INFO)

#: Event kinds written to the log (a skip's ``nonfinite`` twin is folded into its ``skipped`` line).
LOGGED_KINDS = frozenset({"skipped", "bad_batch", "diverged", "rollback", "recovery", "spike_alert"})
#: Event kinds never left out by the rate limit (rare, and each one changes the run).
ALWAYS_LOGGED = frozenset({"diverged", "rollback", "recovery"})


def _rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class EventLog:
    """Writes notable events to the ``stabilitykit`` logger, rank zero only, rate-limited."""

    def __init__(self, first: int = 20, every: int = 100) -> None:
        self.first, self.every = first, every
        self.written = 0
        self.suppressed = 0
        self._last_step: int | None = None

    def __call__(self, event: Event) -> None:
        if event.kind not in LOGGED_KINDS or not _rank_zero():
            return
        due = self.written < self.first or self._last_step is None or event.step - self._last_step >= self.every
        if event.kind in ALWAYS_LOGGED:
            due = True  # always said
        if not due:
            self.suppressed += 1
            return
        message = f"{event.message}{self._where(event)}"
        if self.suppressed:
            message += f" ({self.suppressed} similar message(s) left out since step {self._last_step})"
            self.suppressed = 0
        LOGGER.warning(message)
        self.written += 1
        self._last_step = event.step

    @staticmethod
    def _where(event: Event) -> str:
        details = event.details or {}
        module, phase, layer = details.get("module"), details.get("phase"), details.get("layer")
        if event.kind != "skipped":
            return ""
        if module:
            return f" (first non-finite value: {phase} of {module})"
        if layer:
            return f" (first non-finite layer in backward order: {layer})"
        return ""


@dataclass(frozen=True)
class RunSummary:
    """A run's totals (``guard.summary()``); readable by key too (``summary["skipped"]``).

    ``skipped``: steps skipped because they were bad (non-finite, a bad batch, a spike, an fp16
    overflow), the logged ``skipped/total``. A rollback's work is counted apart: ``rollbacks``,
    ``undone_steps`` (optimizer steps whose effect a rollback took back) and ``skipped_ahead``
    (batches a rollback skipped after it, ``RecoveryConfig.skip_after``, never trained on), the
    logged ``skipped/ahead``. ``clipped`` includes the clips of a
    framework's own clipping that the driver applies (the HF Trainer's ``max_grad_norm``).
    """

    steps: int
    skipped: int
    clipped: int
    max_grad_norm: float
    nonfinite_steps: int
    nonfinite_source: str | None = None
    optimizers: tuple[RunSummary, ...] = ()
    #: Modules the monitors could not measure, as "name: reason" (``MonitorConfig``).
    unmeasured: tuple[str, ...] = ()
    rollbacks: int = 0
    undone_steps: int = 0
    skipped_ahead: int = 0
    #: The lowest factor a rollback put on the learning rate (1.0: never lowered), and the rollbacks' causes
    #: as "cause: count" ("undetermined", "data": bad batches skipped, "lr": the learning rate lowered further).
    lowest_lr_factor: float = 1.0
    rollback_causes: tuple[str, ...] = ()

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready)."""
        return asdict(self)

    def line(self) -> str:
        """One line for the end of a run."""
        norm = f"{self.max_grad_norm:.4g}" if math.isfinite(self.max_grad_norm) else str(self.max_grad_norm)
        text = (
            f"{self.steps} steps, {self.skipped} skipped, {self.clipped} clipped, max grad norm {norm}, "
            f"{self.nonfinite_steps} non-finite"
        )
        if self.rollbacks or self.skipped_ahead:
            text += (
                f"; {self.rollbacks} rollback(s): {self.undone_steps} step(s) undone, "
                f"{self.skipped_ahead} skipped ahead (batches after a rollback, not trained on)"
            )
            if self.rollback_causes:
                text += f" (causes: {', '.join(self.rollback_causes)})"
            if self.lowest_lr_factor < 1.0:
                text += f", learning rate lowered to {self.lowest_lr_factor:g}x the schedule's at most"
        if self.nonfinite_source:
            text += f"; first non-finite: {self.nonfinite_source}"
        if self.unmeasured:
            text += f"; not measured by the monitors: {', '.join(self.unmeasured)}"
        return text

    def with_rollbacks(self, records: Sequence[Any]) -> RunSummary:
        """This summary with the rollbacks ``records`` (``RollbackRecord``) counted: how many, and
        their undone steps (the batches they skipped ahead are the ledger's own count)."""
        if not records:
            return self
        undone = sum(int(r.skipped_steps) for r in records)
        causes: dict[str, int] = {}
        for r in records:
            cause = str(getattr(r, "cause", "undetermined"))
            causes[cause] = causes.get(cause, 0) + 1
        return dataclasses.replace(
            self,
            rollbacks=len(records),
            undone_steps=undone,
            lowest_lr_factor=min((float(getattr(r, "lr_factor", 1.0)) for r in records), default=1.0),
            rollback_causes=tuple(f"{cause}: {n}" for cause, n in causes.items()),
        )

    def log(self) -> None:
        """Write ``line()`` to the ``stabilitykit`` logger (INFO, rank zero only)."""
        if _rank_zero():
            LOGGER.info("run summary: %s", self.line())


def engine_summary(engine: Any) -> RunSummary:
    """One optimizer's totals from its engine (reads the steps since the last logging step first: one sync)."""
    engine.flush()
    c = engine.counters
    found = engine.tracing.last_nonfinite if engine.tracing is not None else None
    monitor = engine.monitor
    unmeasured = tuple(f"{n}: {r}" for n, r in monitor.unmeasured.items()) if monitor is not None else ()
    summary = RunSummary(
        engine.step,
        c.skipped_total,
        c.clipped_total,
        c.max_norm,
        c.nonfinite_total,
        nonfinite_source=str(found) if found is not None else None,
        unmeasured=unmeasured,
        skipped_ahead=c.skipped_ahead_total,
    )
    return summary.with_rollbacks(engine.recovery.log.records if engine.recovery is not None else [])
