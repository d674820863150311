"""Which states become restore points: snapshots on a cadence, kept only where the run was settled.

A snapshot is taken when the step count reaches a multiple of ``snapshot_every`` (and after the first
step, a resume, or a snapshot dropped), unless this step is known to be skipped (pending when its
decision is still on the device: the store settles it by the decisions read later) or the spike
monitor is not settled (then at the next settled step). A snapshot whose step the monitor scores
later is vetted then, and dropped if that step was not settled: a state inside a climb or an alert is
not a restore point (``_vet``).

Once recovery has acted on an alert (its lowered LR in force), the monitor stays unsettled for the
alert's cooldown although the run may be healthy again; without a restore point then, trouble that
comes next finds none inside the bound. So while recovery's lowered LR holds, the snapshot due on the
cadence is taken anyway, and kept when the loss at its step is back near its level from before the
trouble recovery acted on (``Escalation.recovered``: under 1.5 times its median then), dropped otherwise
(``_keeps``).

Under torch.distributed each rank's monitor scores its own loss, so a snapshot is taken on the
cadence whatever this rank's monitor says; the health each rank sees for it (healthy or climbing) rides
in a later step's all-reduce (``vetting.py``), and a snapshot any rank saw climbing is dropped on every
rank (``_judge``, ``_apply_health``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING

from stabilitykit.recovery.config import RecoveryConfig
from stabilitykit.recovery.escalation import Escalation
from stabilitykit.recovery.snapshot import TrainingObjects, take_snapshot
from stabilitykit.recovery.store import SnapshotStore
from stabilitykit.recovery.vetting import HealthQueue, decode_health

if TYPE_CHECKING:
    from stabilitykit.engine.decision import StepDecision
    from stabilitykit.engine.step import StabilityEngine
    from stabilitykit.spikes import SpikeMonitor


class RestorePoints:
    """The snapshot cadence and the health that keeps or drops each snapshot, over one ``SnapshotStore``."""

    def __init__(
        self, config: RecoveryConfig, engine: StabilityEngine, store: SnapshotStore, agree: bool, escalation: Escalation
    ) -> None:
        """``agree``: several ranks agree on each snapshot's health (else this rank's monitor decides);
        ``escalation``: whether recovery's lowered LR holds, and whether the loss is back (``_keeps``)."""
        self.config = config
        self.engine = engine
        self.store = store
        self.agree = agree
        self.escalation = escalation
        #: With several ranks: the health this rank sees for snapshots, sent to be agreed (``vetting.py``).
        self.health = HealthQueue()
        #: Snapshot at the end of the next healthy, settled step: the first step of a run (a blow-up before the
        #: first ``snapshot_every`` multiple has a state to go back to), a resume, a snapshot put off while the
        #: detectors were not settled.
        self.due_next = True
        self._scheduler_checked = False  # the unpassed-scheduler check runs once, at the first snapshot

    def after_step(self, decision: StepDecision, objects: TrainingObjects) -> None:
        """The step is over and nothing rolled back: take a snapshot of ``objects`` if one is due."""
        step = self.engine.step  # steps done: a snapshot now holds the state before this step
        cadence = step % self.config.snapshot_every == 0
        if not (cadence or self.due_next) or decision.skipped_now:
            return
        monitor = self._monitor()
        scored = monitor is not None and monitor.last_step is not None and monitor.last_step >= step - 1
        if not self.agree and monitor is not None and not monitor.settled():
            # recovery acted and its lowered LR holds: taken on the cadence, kept by the loss (``_keeps``)
            acted = cadence and self.escalation.lowered(step - 1)
            if not acted or (scored and not self._keeps(monitor, step - 1)):
                self.due_next = True  # inside a climb or an alert: not a restore point; the next settled step
                return
        if not self._scheduler_checked:
            self._scheduler_checked = True
            _warn_unpassed_scheduler(objects)
        snapshot = take_snapshot(objects, self.store.copier, step, confirmed=not decision.pending)
        if not self.agree:
            snapshot.vetted = monitor is None or scored
        else:
            snapshot.vetted = monitor is None  # vetted by the health every rank agreed (``_apply_health``)
        self.store.add(snapshot)
        self.due_next = False
        if self.agree:
            self._judge()  # its step may be scored already (a logging step's read)

    def settle(self, health: Iterable[tuple[int, int]]) -> None:
        """The host read rows: keep or drop snapshots by the health agreed in them, as (step, encoded
        health) pairs (``RecoveryAnswer.health``)."""
        if not self.agree:
            self._vet()
        else:
            self._apply_health(health)
            self._judge()

    def send(self, step: int) -> int:
        """What step ``step`` sends as a snapshot's health: with several ranks, the oldest this rank queued,
        encoded (``vetting.py``); 0 otherwise or when none is queued."""
        return self.health.send(step) if self.agree else 0

    def forget_after(self, step: int) -> None:
        """A rollback to the snapshot of ``step``: later snapshots, and their health, belong to undone steps."""
        self.store.drop_after(step)
        self.health.forget_after(step)

    def clear(self) -> None:
        """Drop every snapshot and its queued health (they cannot be restored any more)."""
        self.store.clear()
        self.health.clear()

    def _monitor(self) -> SpikeMonitor | None:
        """The spike monitor that tells a snapshot's health: the engine's (None when spike detection is off).
        In one process it decides at once (``_vet``); under torch.distributed each rank's monitor scores
        its own loss, so what it sees is only this rank's vote (``_judge``), and the health agreed across
        ranks decides (``_apply_health``)."""
        return self.engine.ledger.spikes

    def _judge(self) -> None:
        """With several ranks: queue the health this rank sees for each unvetted snapshot whose step its monitor has
        scored (every rank has scored the same steps: rows are read at the same steps everywhere)."""
        monitor = self._monitor()
        if monitor is None or monitor.last_step is None:
            return
        for snapshot in self.store.snapshots:
            if not snapshot.vetted and snapshot.step - 1 <= monitor.last_step:
                self.health.judge(snapshot.step, not self._keeps(monitor, snapshot.step - 1))

    def _apply_health(self, health: Iterable[tuple[int, int]]) -> None:
        """With several ranks: keep or drop snapshots by the agreed (step, encoded health) pairs (the same on
        every rank): dropped on every rank when any rank's monitor was not settled at the snapshot's step."""
        changed = False
        for step, value in health:
            if value <= 0:
                continue
            snapshot_step, unsettled = decode_health(value, step)
            for snapshot in [s for s in self.store.snapshots if s.step == snapshot_step and not s.vetted]:
                if unsettled:
                    self.store.discard(snapshot)
                    self.due_next = True  # replaced by the next settled step's (the same on every rank)
                else:
                    snapshot.vetted = changed = True
        if changed:
            self.store.trim()

    def _vet(self) -> None:
        """Snapshots of steps the spike monitor has now scored: kept when it was settled after that step,
        dropped when not (a state inside a climb or an alert is not a restore point)."""
        monitor = self._monitor()
        if monitor is None or monitor.last_step is None:
            return
        changed = False
        for snapshot in list(self.store.snapshots):
            if snapshot.vetted or snapshot.step - 1 > monitor.last_step:
                continue
            if self._keeps(monitor, snapshot.step - 1):
                snapshot.vetted = changed = True
            else:
                self.store.discard(snapshot)
                self.due_next = True  # inside a climb: the next settled step gives the restore point
        if changed:
            self.store.trim()

    def _keeps(self, monitor: SpikeMonitor, step: int) -> bool:
        """The state after taken step ``step`` is a restore point: the monitor was settled there, or recovery's
        lowered LR held there and the loss was back near its level from before the trouble."""
        if monitor.was_settled(step):
            return True
        return self.escalation.lowered(step) and self.escalation.recovered(step)


def _warn_unpassed_scheduler(objects: TrainingObjects) -> None:
    """A torch LR scheduler was built on this optimizer (it leaves ``initial_lr`` in every param group)
    but none was handed to recovery: a rollback would put the model back and leave the LR where it is."""
    groups = objects.optimizer.param_groups
    if objects.schedulers or not any("initial_lr" in group for group in groups):
        return
    warnings.warn(
        f"stabilitykit: an LR scheduler drives {type(objects.optimizer).__name__} (its param groups hold "
        "'initial_lr'), but recovery was not given it: a rollback restores the model and optimizer, not the "
        "scheduler, so the learning rate would not go back with them. Pass it to the guard: "
        "StabilityGuard(..., scheduler=scheduler)",
        UserWarning,
        stacklevel=7,
    )
