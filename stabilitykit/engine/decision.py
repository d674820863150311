"""One step's decision: one code, made on the device, agreed across ranks, decoded by the rule set.

What happened to an optimizer step is a single integer, the *decision code*: 0 when the step was
taken, else bit 0 plus one bit per skip rule that fired (``rules/registry.py`` lays the bits out and
is the only decoder). The engine computes it on the device from the rules' flags agreed across
ranks (``engine/step_record.py``), so it costs no host sync; the journal stores it in its ``code`` column.

Whether the host knows a step's code yet is explicit: ``Known(code, reason)`` once the host has
read it (a logging step, a non-fused optimizer that must skip on the host, a driver that asked), or
``PENDING`` while it lives on the device only (a fused optimizer skips through ``found_inf``; the
next journal read tells the host).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from stabilitykit.rules.registry import SKIP


@dataclass(frozen=True)
class RecoveryAsk:
    """What recovery asks of one step, read from it once before the step (``drivers/base.py``).

    ``skip_ahead``: a batch a rollback skips (``RecoveryConfig.skip_after``): measured and logged, never
    trained on; known on the host (the same on every rank), so it costs no sync. ``request``: a rollback
    request of this rank (``recovery/agreement.py``) and ``health``: the health this rank sees for a
    snapshot, healthy or climbing, encoded (``recovery/vetting.py``), both non-negative integers agreed
    in the step's collective (the largest any rank sent) and written to its journal row.
    """

    skip_ahead: bool = False
    request: int = 0
    health: int = 0


#: A step recovery asks nothing of (recovery off, or nothing to ask).
NO_ASK = RecoveryAsk()


@dataclass(frozen=True)
class RecoveryAnswer:
    """What the ranks agreed on recovery's asks (``RecoveryAsk``), for the steps the host has read.

    ``requests`` and ``health``: (step, agreed value) pairs, zeros left out, in step order. Each value is
    agreed in its step's collective and reaches the host with that step's journal row, so the answer costs
    no sync of its own: the engine hands it back with the step (``StepDecision.answer``, set by
    ``StabilityEngine.book_step``) or the flush that read it; the journal keeps the values for logs.
    """

    requests: tuple[tuple[int, int], ...] = ()
    health: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, rows: Iterable[Any]) -> RecoveryAnswer:
        """The answer carried by journal ``rows`` the host has read (``engine/journal.py``'s ``Row``)."""
        rows = list(rows)
        if not rows:
            return NO_ANSWER
        requests = tuple((row.step, row.request) for row in rows if row.request > 0)
        return cls(requests, tuple((row.step, row.health) for row in rows if row.health > 0))


#: No answer (no row read, or nothing agreed).
NO_ANSWER = RecoveryAnswer()


@dataclass(frozen=True)
class Known:
    """The host has read this step's decision code: the skip is applied and reported at once."""

    code: int
    reason: str | None = None  # decoded by the rule set (None: taken)

    @property
    def skipped(self) -> bool:
        """The step is skipped."""
        return bool(self.code & SKIP)


@dataclass(frozen=True)
class Pending:
    """The decision is on the device only: a fused optimizer skips through ``found_inf``."""


#: The one ``Pending`` value.
PENDING = Pending()
#: A step that can never be skipped (skipping off, no data guard, no skip-on-spike): known, taken.
TAKEN = Known(0)

Outcome = Known | Pending


@dataclass
class StepDecision:
    """What ``StabilityEngine.evaluate`` decided for one optimizer step, and what the host knows of it."""

    report: Any  # the step's StepReport
    skip: Tensor  # 0-d bool on the device, identical on every rank
    code: Tensor  # the decision code, 0-d int32 on the device (``rules/registry.py``)
    outcome: Outcome = PENDING
    logging: bool = False
    rows: list[Any] = field(default_factory=list)  # journal rows the host read during this step
    loss_scale: float | None = None
    module_metrics: dict[str, float] = field(default_factory=dict)
    signals: dict[str, float] = field(default_factory=dict)  # the module metrics the spike detector watches
    update_metrics: dict[str, float] = field(default_factory=dict)  # update ratio and weight norms (logging steps)
    lr_metrics: dict[str, float] = field(default_factory=dict)  # the LR each param group used (logging steps)
    divergence: Any = None  # a run of skips that reached max_consecutive, when ``book_step`` did not raise it
    log_step: int | None = None  # the step number sinks see (a framework's global step); None: the engine's
    answer: RecoveryAnswer = NO_ANSWER  # recovery's agreed answer in the rows read, set by ``book_step``

    @property
    def skipped_now(self) -> bool:
        """The host knows this step is skipped: the optimizer step is not called, the scheduler held."""
        outcome = self.outcome
        return isinstance(outcome, Known) and bool(outcome.code & SKIP)  # ``Known.skipped``, without the call

    @property
    def pending(self) -> bool:
        """The decision is on the device only (a fused optimizer skips through ``found_inf``)."""
        return isinstance(self.outcome, Pending)

    def keep_reads(self, first: StepDecision, row: Any) -> None:
        """This step was measured again (a rerun): keep what the host read for its ``first`` decision (earlier
        rows, a logging step's metrics), with ``row``, the new measurement's own, in place of the first's."""
        self.rows = [*(r for r in first.rows if r.step != self.report.step), row]
        self.loss_scale, self.module_metrics, self.signals = first.loss_scale, first.module_metrics, first.signals
        self.update_metrics, self.lr_metrics = first.update_metrics, first.lr_metrics

    def settle(self, code: int, reason: str | None) -> None:
        """The host has read this step's code (``reason``: what the rule set decodes it to)."""
        self.outcome = Known(code, reason)
        self.report.settle(code, reason)
