"""What sets a rollback off: the engine's divergence, or a ``spike_alert`` seen since the last step.

``RecoveryConfig.trigger`` picks among ``"diverged"`` (a run of ``SkipConfig.max_consecutive`` skips,
left unraised for recovery), ``"spike_alert"`` (a jump of the loss or grad norm, or a loss far above
its best level) and ``"loss_drift"`` (the loss-drift rule's alert). Alerts are heard on the engine's
readout (the ledger's events in step order, not the user's hook bus); the earliest since the last
step wins. Under torch.distributed a trigger is queued and agreed first (``agreement.py``); the
divergence behind a queued ``"diverged"`` is kept here until the agreed request comes back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stabilitykit.engine.ledger import Divergence
from stabilitykit.events import Event
from stabilitykit.recovery.config import RecoveryConfig
from stabilitykit.spikes import DRIFT_RULE

if TYPE_CHECKING:
    from stabilitykit.engine.decision import StepDecision
    from stabilitykit.engine.step import StabilityEngine

#: ``(trigger, its step, onset)``: what fired, the step it fired at, and the step trouble began.
Found = tuple[str, int, int]


class Triggers:
    """The triggers found since the last step, for one guarded optimizer."""

    def __init__(self, config: RecoveryConfig, engine: StabilityEngine) -> None:
        self.config = config
        self.engine = engine
        self._alert: tuple[str, int] | None = None  # (trigger, step) of the earliest alert since the last step
        self._divergence: Divergence | None = None  # the divergence behind a queued "diverged" trigger
        self._listening = any(t in config.trigger for t in ("spike_alert", "loss_drift"))
        if self._listening:
            engine.readout.observers.append(self._on_alert)

    def _on_alert(self, event: Event) -> None:
        if event.kind != "spike_alert":
            return
        trigger = "loss_drift" if event.details.get("rule") == DRIFT_RULE else "spike_alert"
        if trigger in self.config.trigger and (self._alert is None or event.step < self._alert[1]):
            self._alert = (trigger, event.step)

    def found(self, decision: StepDecision) -> Found | None:
        """The earliest trigger this step, or None. A divergence when ``"diverged"`` is not a trigger raises,
        as without recovery."""
        found: list[Found] = []
        divergence = decision.divergence
        if divergence is not None:
            if "diverged" not in self.config.trigger:
                self.engine.readout.report_divergence(divergence)  # raises, as without recovery
            found.append(("diverged", divergence.step, divergence.step - divergence.consecutive + 1))
        if self._alert is not None:
            trigger, step = self._alert
            found.append((trigger, step, step))
            self._alert = None
        return min(found, key=lambda t: t[2]) if found else None

    def queued(self, divergence: Divergence | None) -> None:
        """A trigger was queued to be agreed across ranks; keep the divergence behind it (if this rank saw one)."""
        self._divergence = divergence or self._divergence

    def agreed(self, trigger: str, onset: int) -> tuple[str, int, int, Divergence | None]:
        """(trigger, its step, onset, divergence) of a request every rank agreed on."""
        if trigger != "diverged":
            return trigger, onset, onset, None
        divergence, self._divergence = self._divergence, None
        if divergence is None:  # another rank saw it first: the streak that reached the limit
            consecutive = self.engine.config.skip.max_consecutive or 1
            divergence = Divergence(onset + consecutive - 1, consecutive, None, None)
        return trigger, divergence.step, onset, divergence

    def clear(self) -> None:
        """Forget what was found: after a rollback, alerts and divergences belong to the undone steps."""
        self._alert = None
        self._divergence = None

    def close(self) -> None:
        """Stop listening for alerts."""
        if self._listening:
            self.engine.readout.observers.remove(self._on_alert)
            self._listening = False
