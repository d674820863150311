"""Recovery: snapshots on a cadence, triggers, the rollback itself, and the learning rate after it.

The driver core calls ``after_step`` at the end of every optimizer step (after the engine has
folded what the host read) and runs the optimizer step inside ``scaled_lr()``. In order:

1. pending snapshots are settled by the decisions just read (``store.py``), and snapshots whose
   steps the spike monitor has scored are kept or dropped (``restore_points.py``);
2. a trigger (``RecoveryConfig.trigger``): the engine's divergence (a run of ``max_consecutive``
   skips, left unraised for us), or a ``spike_alert`` seen since the last step (``triggers.py``);
3. a trigger rolls back to the newest healthy snapshot inside the bound, or lowers the learning rate
   where the run is, or stops rolling back (``rollback.py``); the driver's own state is put back
   through ``restore_guard`` (the core rewinds its engine: ``StabilityEngine.rewind``); the learning
   rate after it, and whether trouble was the LR's or the data's, is ``escalation.py``'s;
4. otherwise a lowered LR that ends with the trouble still there goes one level further
   (``Rollback.review``, one process only), and a snapshot is taken if one is due (``restore_points.py``).

With several ranks a trigger is not acted on where it is found: it is queued, agreed in the next
step's all-reduce and acted on at the next logging step, by every rank at once (``agreement.py``).
Snapshots are kept or dropped the same way: the health each rank sees for a snapshot (healthy or
climbing) rides in a later step's all-reduce, and a snapshot any rank saw climbing is dropped on every
rank (``vetting.py``).

The step count goes on after a rollback (loggers need steps that only grow; Lightning and the HF
Trainer own their global step); the LR schedulers are the snapshot's, so the schedule runs behind
the step count by the steps undone. Batches keep coming from the driver's loop: those trained on
in the undone steps are skipped, not replayed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.distributed import is_distributed
from stabilitykit.engine.decision import RecoveryAnswer, StepDecision
from stabilitykit.engine.journal import Row
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.recovery.agreement import Agreement
from stabilitykit.recovery.config import RecoveryConfig as RecoveryConfig  # its old path
from stabilitykit.recovery.config import refuse_several_optimizers as refuse_several_optimizers
from stabilitykit.recovery.escalation import Escalation
from stabilitykit.recovery.host_copy import HostCopier
from stabilitykit.recovery.restore_points import RestorePoints
from stabilitykit.recovery.rollback import Rollback
from stabilitykit.recovery.rollback_log import RollbackLog
from stabilitykit.recovery.snapshot import TrainingObjects, restore_snapshot
from stabilitykit.recovery.store import SnapshotStore
from stabilitykit.recovery.triggers import Triggers


class Recovery:
    """Rollback for one guarded optimizer (see the module docstring): wires the collaborators together
    and is what the driver core calls."""

    def __init__(
        self,
        config: RecoveryConfig,
        engine: StabilityEngine,
        model: nn.Module | None,
        optimizer: Any,
        scaler: ScalerAdapter,
        hooks: HookManager,
        guard_state: Callable[[], dict[str, Any]],
        restore_guard: Callable[[dict[str, Any]], None],
        agree: bool | None = None,
    ) -> None:
        """``guard_state``: the driver's own state a snapshot keeps (the engine's included);
        ``restore_guard``: puts such a state back after a rollback (``drivers/build.py`` rewinds the engine);
        ``agree``: agree every rollback across ranks (``agreement.py``; default: under torch.distributed)."""
        self.config = config
        self.engine = engine
        self.hooks = hooks
        self._model = model
        self._guard_state, self._restore_guard = guard_state, restore_guard
        #: Builds what snapshots cover from (scaler, guard state) when a driver says so (``cover``).
        self._cover: Callable[[ScalerAdapter, Callable[[], dict[str, Any]]], TrainingObjects] | None = None
        self.objects = self._objects(optimizer, scaler)
        self.store = SnapshotStore(config.keep, config.storage, HostCopier())
        record_dir = config.record_dir
        if record_dir is None and config.storage != "memory":
            record_dir = config.storage
        self.log = RollbackLog(Path(record_dir) if record_dir is not None else None)
        if agree is None:
            agree = is_distributed()
        #: With several ranks: this rank's queued trigger and the agreed request (None: act at once).
        self.agreement: Agreement | None = Agreement() if agree else None
        #: The LR after rollbacks, and whether trouble was the LR's or the data's (``escalation.py``).
        self.escalation = Escalation(
            config.lr_scale,
            config.cooldown_steps,
            config.lr_backoff,
            config.backoff_steps,
            config.window,
            judge_data=not agree,
        )
        #: The snapshot cadence and the health that keeps or drops snapshots.
        self.points = RestorePoints(config, engine, self.store, agree, self.escalation)
        #: What a trigger does (restore, lower the LR in place, stand down, raise).
        self.rollback = Rollback(
            config, engine, hooks, self.store, self.log, self.escalation, self._restore, self._restored, agree
        )
        self._no_lr_warned = False  # the one warning for param groups without an "lr"
        every = engine.config.log_every_n_steps or 1
        alerts = any(t in config.trigger for t in ("spike_alert", "loss_drift"))
        if agree and alerts and config.snapshot_every * (config.keep - 1) < every + config.min_lookback:
            warnings.warn(
                f"stabilitykit: under torch.distributed a rollback comes at the next logging step, up to "
                f"{every} step(s) after its trigger, and snapshots taken meanwhile push older ones out of the "
                f"ring: RecoveryConfig(keep={config.keep}, snapshot_every={config.snapshot_every}) may have "
                f"nothing left from before the onset. Keep (keep - 1) * snapshot_every >= log_every_n_steps + "
                f"min_lookback ({every + config.min_lookback})",
                UserWarning,
                stacklevel=4,
            )
        if agree and not engine.config.skip.sync_ranks:
            raise ValueError(
                "RecoveryConfig(enabled=True) under torch.distributed needs SkipConfig(sync_ranks=True): ranks agree "
                "on a rollback in the step's all-reduce, which sync_ranks=False turns off"
            )
        #: The triggers found since the last step (listens on the engine's readout: built last).
        self.triggers = Triggers(config, engine)

    # ------------------------------------------------------------------ what the driver core calls
    def track_scheduler(self, scheduler: Any) -> None:
        """Save and restore ``scheduler`` with every snapshot (snapshots taken before it are dropped)."""
        if not any(s is scheduler for s in self.objects.schedulers):
            self.objects.schedulers.append(scheduler)
            self.points.clear()

    def cover(self, build: Callable[[ScalerAdapter, Callable[[], dict[str, Any]]], TrainingObjects]) -> None:
        """Snapshots cover ``build(scaler, guard_state)`` from now on instead of the model and optimizer the
        core was given: for a driver whose framework keeps the training state elsewhere (DeepSpeed's
        partitions and inner optimizer). Schedulers tracked so far stay; snapshots held are dropped."""
        self._cover = build
        self.forget()

    def forget(self) -> None:
        """The optimizer's parameters changed: snapshots of the old set cannot be restored."""
        old = self.objects
        self.objects = self._objects(old.optimizer, old.scaler)
        self.objects.schedulers = old.schedulers
        self.points.clear()

    def _objects(self, optimizer: Any, scaler: ScalerAdapter) -> TrainingObjects:
        if self._cover is not None:
            return self._cover(scaler, self._guard_state)
        return TrainingObjects.build(self._model, optimizer, self.engine.params, scaler, self._guard_state)

    def close(self) -> None:
        """Stop listening for alerts and drop every snapshot (the driver is done)."""
        self.triggers.close()
        self.store.close()

    @contextmanager
    def scaled_lr(self) -> Iterator[None]:
        """Around the optimizer step: learning rates times the factor in force (the cooldown after a
        rollback, a backoff level: ``escalation.py``).

        The param groups hold the scheduler's values again right after the step, so no scheduler
        ever sees (or compounds) the scaled value.
        """
        scale = self.escalation.factor(self.engine.step)
        if scale == 1.0:
            yield
            return
        groups = self.objects.optimizer.param_groups
        if not all("lr" in group for group in groups):
            if not self._no_lr_warned:
                self._no_lr_warned = True
                warnings.warn(
                    f"stabilitykit: {type(self.objects.optimizer).__name__} has param groups without an 'lr': "
                    f"recovery cannot lower its learning rate (times {scale:g} after a rollback); the rollbacks "
                    "go on without it",
                    RuntimeWarning,
                    stacklevel=5,
                )
            yield
            return
        saved = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * scale
        try:
            yield
        finally:
            for group, lr in zip(groups, saved, strict=True):
                group["lr"] = lr

    def skips_batch(self, step: int) -> bool:
        """``step`` is one of the batches a rollback skips ahead (``skip_after``): not trained on."""
        return step < self.rollback.skip_until

    def request(self, step: int) -> int:
        """What step ``step`` sends in its all-reduce: this rank's queued trigger, encoded (0: none)."""
        return self.agreement.request(step) if self.agreement is not None else 0

    def health(self, step: int) -> int:
        """What step ``step`` sends as a snapshot's health: with several ranks, the oldest this rank queued,
        encoded (``vetting.py``); 0 otherwise or when none is queued."""
        return self.points.send(step)

    def confirm(self, rows: Iterable[Row], answer: RecoveryAnswer) -> None:
        """Journal rows the host has read, and the ranks' ``answer`` the engine handed back with them: settle
        pending snapshots, keep or drop snapshots by their health (agreed across ranks under
        torch.distributed), note agreed rollback requests."""
        rows = list(rows)
        self.store.confirm((row.step, not row.skipped) for row in rows)
        self.escalation.observe(rows)
        self.rollback.data_passed()
        self.points.settle(answer.health)
        if self.agreement is not None:
            self.agreement.read(answer.requests)

    def flush(self, rows: Iterable[Row], answer: RecoveryAnswer) -> None:
        """The engine folded ``rows`` outside a step (a flush): settle them, and wait for snapshot files."""
        self.confirm(rows, answer)
        self.store.wait_for_writes()

    def after_step(self, decision: StepDecision) -> bool:
        """The step is over and folded: settle, trigger and roll back, or snapshot. True after a rollback."""
        self.confirm(decision.rows, decision.answer)
        trigger = self.triggers.found(decision)
        if self.agreement is None:
            if trigger is not None:
                return self.rollback.roll_back(*trigger, decision.divergence)
            self.rollback.review(self.engine.step - 1)  # a lowered LR that ends with the trouble still there
        else:
            if trigger is not None:
                self.agreement.queue(trigger[0], trigger[2])
                self.triggers.queued(decision.divergence)
            agreed = self.agreement.take() if decision.logging else None  # every rank has read the row
            if agreed is not None:
                return self.rollback.roll_back(*self.triggers.agreed(*agreed))
        self.points.after_step(decision, self.objects)
        return False

    def _restore(self, tree: Any) -> None:
        """Put a snapshot's ``tree`` back in place: the training objects, then the driver's own state."""
        self._restore_guard(restore_snapshot(self.objects, tree, rng=self.config.restore_rng))

    def _restored(self, step: int) -> None:
        """After a rollback to the snapshot of ``step``: what was found, queued or snapshotted since belongs
        to the undone steps."""
        self.triggers.clear()  # alerts raised while rewinding belong to the undone steps
        if self.agreement is not None:
            self.agreement.clear()
        self.points.forget_after(step)

    def restore_last_good(self) -> int:
        """Put back the last healthy snapshot in place; returns its step (``Rollback.restore_last_good``)."""
        return self.rollback.restore_last_good()

    # ------------------------------------------------------------------ state
    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by snapshots now."""
        return self.store.nbytes

    def state_dict(self) -> dict[str, Any]:
        """The rollbacks so far, the cooldown and the LR backoff (the snapshots themselves are not saved)."""
        return self.rollback.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (a resume). Snapshots held from before belong to another
        point of the run and are dropped; the first step after the resume takes a snapshot, so the
        resumed run can roll back before its first ``snapshot_every`` multiple."""
        self.points.clear()
        self.points.due_next = True
        self.rollback.load_state_dict(state)
