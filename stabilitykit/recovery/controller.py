"""Recovery: snapshots on a cadence, triggers, the rollback itself, and the learning rate after it.

The driver core calls ``after_step`` at the end of every optimizer step (after the engine has
folded what the host read) and runs the optimizer step inside ``scaled_lr()``. In order:

1. pending snapshots are settled by the decisions just read (``store.py``);
2. a trigger (``RecoveryConfig.trigger``): the engine's divergence (a run of ``max_consecutive``
   skips, left unraised for us), or a ``spike_alert`` seen on the hook manager since the last step;
3. a trigger rolls back to the newest confirmed snapshot taken at least ``min_lookback`` steps
   before its onset: parameters, buffers, optimizer, schedulers, GradScaler and, when asked, the
   random generators in place (``snapshot.py``), the driver's own state through ``restore_guard``
   (the core rewinds its engine: ``StabilityEngine.rewind``);
   a ``rollback`` event names the skipped step range (``record.py``); more than ``max_rollbacks``
   within ``window`` steps raises ``RollbackLimitError`` (a ``TrainingDivergedError``);
4. otherwise a snapshot is taken when the step count reaches a multiple of ``snapshot_every`` (and after
   the first step), unless this step is known to be skipped (pending when its decision is still on the
   device) or the spike monitor is not settled (then at the next settled step); a snapshot whose step the
   monitor scores later is vetted then, and dropped if that step was not settled (``_vet``). Under
   torch.distributed the snapshot is taken on the cadence whatever this rank's monitor says, and the
   agreed verdict of every rank keeps or drops it (``_judge``, ``_apply_verdicts``: below).

With several ranks a trigger is not acted on where it is found: it is queued, agreed in the next
step's all-reduce and acted on at the next logging step, by every rank at once (``agreement.py``).
Snapshots are kept or dropped the same way: taken on the cadence on every rank, each rank's verdict
on a snapshot's step (was its monitor settled?) rides in a later step's all-reduce, and a snapshot
any rank judged unsettled is dropped on every rank (``vetting.py``).

The step count goes on after a rollback (loggers need steps that only grow; Lightning and the HF
Trainer own their global step); the LR schedulers are the snapshot's, so the schedule runs behind
the step count by the steps undone. Batches keep coming from the driver's loop: those trained on
in the undone steps are skipped, not replayed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field
from torch import nn

from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.distributed import is_distributed
from stabilitykit.engine import StabilityEngine
from stabilitykit.engine.decision import StepDecision
from stabilitykit.engine.journal import Row
from stabilitykit.engine.ledger import Divergence
from stabilitykit.events import Event, RollbackLimitError, SnapshotUnavailableError
from stabilitykit.hooks import HookManager
from stabilitykit.recovery.agreement import Agreement
from stabilitykit.recovery.escalation import Cause, Escalation
from stabilitykit.recovery.files import SnapshotFileError, read_verified
from stabilitykit.recovery.host_copy import HostCopier
from stabilitykit.recovery.record import RollbackLog, RollbackRecord
from stabilitykit.recovery.snapshot import Snapshot, TrainingObjects, restore_snapshot, take_snapshot
from stabilitykit.recovery.store import SnapshotStore
from stabilitykit.recovery.vetting import Verdicts, decode_verdict
from stabilitykit.section import Section
from stabilitykit.spikes import DRIFT_RULE, SpikeMonitor


class RecoveryConfig(Section):
    """Rollback past a divergence: a ring of healthy snapshots, restored when a trigger fires, then training goes on.

    On by being given: ``StabilityConfig(recovery=RecoveryConfig(...))`` turns it on without ``enabled=True``
    (as a ``MonitorConfig`` given is on); ``enabled=False`` turns a given one off, and a
    ``StabilityConfig`` given none has it off. See the recovery guide for what is restored, what is
    skipped and what it costs.
    """

    enabled: bool = Field(
        False,
        description=(
            "Take snapshots and roll back on a trigger. Set to True when this config is given to "
            "StabilityConfig(recovery=...) without enabled; enabled=False keeps a given config off."
        ),
    )
    snapshot_every: int = Field(
        100, ge=1, description="Optimizer steps between snapshots (a snapshot is kept only if its step was taken)."
    )
    keep: int = Field(2, ge=1, description="Healthy snapshots kept (the ring's depth).")
    trigger: list[Literal["diverged", "spike_alert", "loss_drift"]] = Field(
        default_factory=lambda: ["diverged", "spike_alert"],  # type: ignore[arg-type]
        min_length=1,
        description=(
            "What rolls back. 'diverged': a run of SkipConfig.max_consecutive skipped steps (instead of raising "
            "TrainingDivergedError); 'spike_alert': a spike_alert for a jump of the loss or grad norm, or for a "
            "loss far above its best level (SpikeConfig.loss_level_alert); "
            "'loss_drift': a spike_alert of the loss-drift rule (SpikeConfig.loss_drift_alert). The default "
            "(both of the first two) rolls back a finite blow-up and a burst of bad data as well as a divergence "
            "(the recovery benchmarks)."
        ),
    )
    min_lookback: int = Field(
        0,
        ge=0,
        description=(
            "Restore the newest snapshot taken at least this many steps before the onset (the first skipped "
            "step of a divergence, the step of an alert)."
        ),
    )
    lr_scale: float = Field(
        0.5,
        gt=0,
        allow_inf_nan=False,
        description=(
            "After a rollback, the optimizer steps with its learning rates times this for cooldown_steps "
            "(1.0: unchanged)."
        ),
    )
    cooldown_steps: int = Field(
        50, ge=0, description="Steps after a rollback (and after its skip_after) that use lr_scale (0: none)."
    )
    skip_after: int = Field(
        50,
        ge=0,
        description=(
            "After a rollback, also skip this many of the following batches (measured and logged, never "
            "trained on; the LR schedule waits): the large-run recipe of restarting before a spike and "
            "skipping the next batches, for bad data that goes on past the trigger. 0: none."
        ),
    )
    max_lookback: int = Field(
        500,
        ge=1,
        description=(
            "Restore no snapshot taken more than this many steps before the step that rolls back. With none "
            "inside the bound an alert lowers the learning rate where the run is, instead of going further back."
        ),
    )
    max_lookback_share: float = Field(
        0.5,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description=(
            "Nor more than this share of the steps done so far: a rollback never puts back the initial weights "
            "(at step 60 the snapshot of step 1 is 59 steps back, over half the run)."
        ),
    )
    lr_backoff: list[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]] = Field(
        default_factory=lambda: [0.5, 0.25],
        description=(
            "When trouble comes back after a rollback on data the restored model reads fine, the learning "
            "rate is to blame: each such rollback lowers it one level further (times 0.5, then 0.25), held for "
            "backoff_steps. [] turns escalation off (every rollback is a first one)."
        ),
    )
    backoff_steps: int = Field(
        500, ge=1, description="Steps a backoff level of lr_backoff holds after its rollback (then the schedule's LR)."
    )
    max_rollbacks: int = Field(
        3,
        ge=1,
        description=(
            "Rollbacks within `window` steps before recovery stops rolling back. One more trigger then lowers "
            "the LR to the next lr_backoff level if any is left; once the lowest holds, a divergence raises "
            "RollbackLimitError (saying what was tried) and an alert leaves the run to skip and clip."
        ),
    )
    window: int = Field(1000, ge=1, description="Steps over which max_rollbacks is counted.")
    storage: str = Field(
        "memory",
        min_length=1,
        description="'memory': snapshots in host memory; any other value: a directory that holds them as files.",
    )
    record_dir: str | None = Field(
        None,
        description=(
            "Directory of skipped_batches.json (the step ranges each rollback skipped). None: the storage "
            "directory with disk storage, no file with memory storage."
        ),
    )
    restore_rng: bool = Field(
        False,
        description=(
            "Also put back the random generators (torch, CUDA, random, numpy) saved with the snapshot. Off by "
            "default: a loop that draws its batches from them would then replay the batches it skipped."
        ),
    )

    @classmethod
    def preset(cls, name: Literal["bad_data", "blow_up"], **overrides: Any) -> RecoveryConfig:
        """A named recipe from the recovery guide (its benchmark rows say what each did), on, with ``overrides``.

        Each is the defaults with one change. ``"bad_data"``: skip the next 100 batches after a rollback
        (the default skips 50): a long burst of bad data that goes on past the trigger.
        ``"blow_up"``: skip none and train on every batch after the rollback: a finite blow-up with good
        data (a learning-rate or optimizer accident). Both roll back on a divergence or a ``spike_alert``.
        """
        recipes: dict[str, dict[str, Any]] = {
            "bad_data": {"trigger": ["diverged", "spike_alert"], "skip_after": 100},
            "blow_up": {"trigger": ["diverged", "spike_alert"], "skip_after": 0},
        }
        if name not in recipes:
            raise ValueError(f"unknown recovery preset {name!r}; the presets are {sorted(recipes)}")
        return cls(**{"enabled": True, **recipes[name], **overrides})


def refuse_several_optimizers(config: RecoveryConfig, count: int) -> None:
    """Recovery restores one optimizer with the model: refuse it, by name, with several optimizers."""
    if config.enabled and count > 1:
        raise ValueError(
            f"RecoveryConfig(enabled=True) supports one optimizer; this run has {count}. A rollback restores "
            "the model's parameters, which several optimizers would have to agree on; turn recovery off here"
        )


class Recovery:
    """Rollback for one guarded optimizer (see the module docstring)."""

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
        ``restore_guard``: puts such a state back after a rollback (``DriverCore`` rewinds its engine);
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
        self.cooldown_until = 0  # steps before this one run with a lowered LR (the latest change's end)
        self.skip_until = 0  # steps before this one skip their batch (``skip_after``)
        #: Snapshot at the end of the next healthy, settled step: the first step of a run (a blow-up before the
        #: first ``snapshot_every`` multiple has a state to go back to), a resume, a snapshot put off while the
        #: detectors were not settled.
        self._snapshot_next = True
        #: The healthy snapshot kept when recovery gave up (``RollbackLimitError``), for ``restore_last_good``.
        self.last_good: Snapshot | None = None
        self._scheduler_checked = False  # the unpassed-scheduler check runs once, at the first snapshot
        self._alert: tuple[str, int] | None = None  # (trigger, step) of the earliest alert since the last step
        if agree is None:
            agree = is_distributed()
        #: With several ranks: this rank's queued trigger and the agreed request (None: act at once).
        self.agreement: Agreement | None = Agreement() if agree else None
        #: With several ranks: this rank's verdicts on snapshots, sent to be agreed (``vetting.py``).
        self.verdicts = Verdicts()
        #: The LR after rollbacks, and whether trouble was the LR's or the data's (``escalation.py``).
        self.escalation = Escalation(
            config.lr_scale,
            config.cooldown_steps,
            config.lr_backoff,
            config.backoff_steps,
            config.window,
            judge_data=not agree,
        )
        self._no_lr_warned = False  # the one warning for param groups without an "lr"
        self._divergence: Divergence | None = None  # the divergence behind a queued "diverged" trigger
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
        self._listening = any(t in config.trigger for t in ("spike_alert", "loss_drift"))
        if self._listening:
            engine.readout.observers.append(self._on_alert)  # the ledger's events in step order, not the user's bus

    # ------------------------------------------------------------------ what the driver core calls
    def track_scheduler(self, scheduler: Any) -> None:
        """Save and restore ``scheduler`` with every snapshot (snapshots taken before it are dropped)."""
        if not any(s is scheduler for s in self.objects.schedulers):
            self.objects.schedulers.append(scheduler)
            self._clear_snapshots()

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
        self._clear_snapshots()

    def _clear_snapshots(self) -> None:
        self.store.clear()
        self.verdicts.clear()

    def _objects(self, optimizer: Any, scaler: ScalerAdapter) -> TrainingObjects:
        if self._cover is not None:
            return self._cover(scaler, self._guard_state)
        return TrainingObjects.build(self._model, optimizer, self.engine.params, scaler, self._guard_state)

    def close(self) -> None:
        """Stop listening for alerts and drop every snapshot (the driver is done)."""
        if self._listening:
            self.engine.readout.observers.remove(self._on_alert)
            self._listening = False
        self.store.close()

    @contextmanager
    def scaled_lr(self) -> Iterator[None]:
        """Around the optimizer step: learning rates times ``lr_scale`` during the cooldown after a rollback.

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
        return step < self.skip_until

    def request(self, step: int) -> int:
        """What step ``step`` sends in its all-reduce: this rank's queued trigger, encoded (0: none)."""
        return self.agreement.request(step) if self.agreement is not None else 0

    def verdict(self, step: int) -> int:
        """What step ``step`` sends as its snapshot verdict: with several ranks, this rank's oldest queued
        verdict, encoded (``vetting.py``); 0 otherwise or when none is queued."""
        return self.verdicts.send(step) if self.agreement is not None else 0

    def confirm(self, rows: Iterable[Row]) -> None:
        """Journal rows the host has read (outside a step, e.g. a flush): settle pending snapshots, keep or
        drop snapshots by the detectors' verdict (agreed across ranks under torch.distributed), note agreed
        rollback requests."""
        rows = list(rows)
        self.store.confirm((row.step, not row.skipped) for row in rows)
        self.escalation.observe(rows)
        if self.agreement is None:
            self._vet()
        else:
            self._apply_verdicts(rows)
            self._judge()
            self.agreement.read(rows)

    def flush(self, rows: Iterable[Row]) -> None:
        """The driver folded ``rows`` outside a step (a flush): settle them, and wait for snapshot files."""
        self.confirm(rows)
        self.store.wait_for_writes()

    def after_step(self, decision: StepDecision) -> bool:
        """The step is over and folded: settle, trigger and roll back, or snapshot. True after a rollback."""
        self.confirm(decision.rows)
        trigger = self._trigger(decision)
        if self.agreement is None:
            if trigger is not None:
                return self._roll_back(*trigger, decision.divergence)
        else:
            if trigger is not None:
                self.agreement.queue(trigger[0], trigger[2])
                self._divergence = decision.divergence or self._divergence
            agreed = self.agreement.take() if decision.logging else None  # every rank has read the row
            if agreed is not None:
                return self._roll_back(*self._agreed_trigger(*agreed))
        step = self.engine.step  # steps done: a snapshot now holds the state before this step
        due = step % self.config.snapshot_every == 0 or self._snapshot_next
        if due and not decision.skipped_now:
            monitor = self._monitor()
            if self.agreement is None and monitor is not None and not monitor.settled():
                self._snapshot_next = True  # inside a climb or an alert: not a restore point; the next settled step
                return False
            if not self._scheduler_checked:
                self._scheduler_checked = True
                self._warn_unpassed_scheduler()
            snapshot = take_snapshot(self.objects, self.store.copier, step, confirmed=not decision.pending)
            if self.agreement is None:
                scored = monitor is not None and monitor.last_step is not None and monitor.last_step >= step - 1
                snapshot.vetted = monitor is None or scored
            else:
                snapshot.vetted = monitor is None  # vetted by the agreed verdict of every rank (``_apply_verdicts``)
            self.store.add(snapshot)
            self._snapshot_next = False
            if self.agreement is not None:
                self._judge()  # its step may be scored already (a logging step's read)
        return False

    def _monitor(self) -> SpikeMonitor | None:
        """The spike monitor whose verdict keeps or drops snapshots: the engine's (None when spike detection
        is off). In one process its verdict decides at once (``_vet``); under torch.distributed each rank's
        monitor scores its own loss, so its verdict is only this rank's vote (``_judge``), and the verdict
        agreed across ranks decides (``_apply_verdicts``)."""
        return self.engine.ledger.spikes

    def _judge(self) -> None:
        """With several ranks: queue this rank's verdict on each unvetted snapshot whose step its monitor has
        scored (every rank has scored the same steps: rows are read at the same steps everywhere)."""
        monitor = self._monitor()
        if monitor is None or monitor.last_step is None:
            return
        for snapshot in self.store.snapshots:
            if not snapshot.vetted and snapshot.step - 1 <= monitor.last_step:
                self.verdicts.judge(snapshot.step, not monitor.was_settled(snapshot.step - 1))

    def _apply_verdicts(self, rows: list[Row]) -> None:
        """With several ranks: keep or drop snapshots by the verdicts agreed in ``rows`` (the same on every
        rank): dropped on every rank when any rank's monitor was not settled at the snapshot's step."""
        changed = False
        for row in rows:
            if row.verdict <= 0:
                continue
            snapshot_step, unsettled = decode_verdict(row.verdict, row.step)
            for snapshot in [s for s in self.store.snapshots if s.step == snapshot_step and not s.vetted]:
                if unsettled:
                    self.store.discard(snapshot)
                    self._snapshot_next = True  # replaced by the next settled step's (the same on every rank)
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
            if monitor.was_settled(snapshot.step - 1):
                snapshot.vetted = changed = True
            else:
                self.store.discard(snapshot)
                self._snapshot_next = True  # inside a climb: the next settled step gives the restore point
        if changed:
            self.store.trim()

    def _warn_unpassed_scheduler(self) -> None:
        """A torch LR scheduler was built on this optimizer (it leaves ``initial_lr`` in every param group)
        but none was handed to recovery: a rollback would put the model back and leave the LR where it is."""
        groups = self.objects.optimizer.param_groups
        if self.objects.schedulers or not any("initial_lr" in group for group in groups):
            return
        warnings.warn(
            f"stabilitykit: an LR scheduler drives {type(self.objects.optimizer).__name__} (its param groups hold "
            "'initial_lr'), but recovery was not given it: a rollback restores the model and optimizer, not the "
            "scheduler, so the learning rate would not go back with them. Pass it to the guard: "
            "StabilityGuard(..., scheduler=scheduler)",
            UserWarning,
            stacklevel=6,
        )

    # ------------------------------------------------------------------ triggers
    def _on_alert(self, event: Event) -> None:
        if event.kind != "spike_alert":
            return
        trigger = "loss_drift" if event.details.get("rule") == DRIFT_RULE else "spike_alert"
        if trigger in self.config.trigger and (self._alert is None or event.step < self._alert[1]):
            self._alert = (trigger, event.step)

    def _trigger(self, decision: StepDecision) -> tuple[str, int, int] | None:
        """(trigger, its step, onset) of the earliest trigger this step, or None."""
        found: list[tuple[str, int, int]] = []
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

    def _agreed_trigger(self, trigger: str, onset: int) -> tuple[str, int, int, Divergence | None]:
        """(trigger, its step, onset, divergence) of a request every rank agreed on."""
        if trigger != "diverged":
            return trigger, onset, onset, None
        divergence, self._divergence = self._divergence, None
        if divergence is None:  # another rank saw it first: the streak that reached the limit
            consecutive = self.engine.config.skip.max_consecutive or 1
            divergence = Divergence(onset + consecutive - 1, consecutive, None, None)
        return trigger, divergence.step, onset, divergence

    # ------------------------------------------------------------------ the rollback
    def _roll_back(self, trigger: str, trigger_step: int, onset: int, divergence: Divergence | None) -> bool:
        cfg = self.config
        esc = self.escalation
        at_step = self.engine.step - 1  # the step just finished
        cause = esc.cause(onset)
        recent = self.log.since(at_step - cfg.window)
        if recent >= cfg.max_rollbacks:
            if cause == "data" or esc.deepest_in_force(at_step):  # lowering the LR cannot help, or did not
                if trigger == "diverged":
                    self._raise_limit(at_step, recent, trigger, cause)
                return self._stand_down(at_step, recent, trigger, trigger_step, cause)
            cause = "lr"  # a limit reached with nothing pointing at the data: the LR, one level further
        found = self._load_newest(onset - cfg.min_lookback, at_step, trigger, self._oldest_restorable(at_step))
        if found is None:
            if divergence is not None:
                self.engine.readout.report_divergence(divergence)  # nothing to go back to: raise as before
            return self._lower_in_place(at_step, trigger, trigger_step, cause)
        snapshot, tree = found
        self._restore_guard(restore_snapshot(self.objects, tree, rng=cfg.restore_rng))
        self._alert = None  # alerts raised while rewinding belong to the undone steps
        if self.agreement is not None:
            self.agreement.clear()
        self._divergence = None
        self.store.drop_after(snapshot.step)
        self.verdicts.forget_after(snapshot.step)
        skip = 0 if cause == "lr" and cfg.lr_backoff else cfg.skip_after  # the LR's fault: no data to skip
        self.skip_until = self.engine.step + skip
        change = esc.act(cause, at_step, self.skip_until, True)
        esc.skipping(self.engine.step, self.skip_until, snapshot.step, onset)
        if change is not None:
            self.cooldown_until = max(self.cooldown_until, change.until)
        record = RollbackRecord(
            at_step=at_step,
            trigger=trigger,
            trigger_step=trigger_step,
            onset=onset,
            restored_step=snapshot.step,
            skipped_from=snapshot.step,
            skipped_to=at_step,
            skip_ahead_to=at_step + skip if skip else None,
            cause=cause,
            lr_factor=change.factor if change is not None else 1.0,
            lr_until=change.until if change is not None else None,
        )
        self.log.add(record)
        self.hooks.emit(self._event(record))
        return True

    def _oldest_restorable(self, at_step: int) -> int:
        """The oldest snapshot step a rollback at ``at_step`` may restore (``max_lookback``, ``max_lookback_share``):
        never the initial weights, never further back than the bound."""
        cfg = self.config
        share = math.ceil(at_step - cfg.max_lookback_share * at_step)
        return max(at_step - cfg.max_lookback, share, 2)

    def _lower_in_place(self, at_step: int, trigger: str, trigger_step: int, cause: Cause) -> bool:
        """An alert with no restore point inside the bound: no rollback; the LR is lowered where the run is
        (as a rollback for ``cause`` would), and skipping and clipping go on. Returns False."""
        change = self.escalation.act(cause, at_step, self.engine.step, False)
        oldest = self._oldest_restorable(at_step)
        message = (
            f"{trigger} at step {trigger_step}: no healthy snapshot from step {oldest} on (RecoveryConfig."
            f"max_lookback={self.config.max_lookback}, max_lookback_share={self.config.max_lookback_share:g}), so "
            "nothing is rolled back; training goes on from here with skip and clip"
        )
        details: dict[str, Any] = {"action": "lr_backoff", "trigger": trigger, "trigger_step": trigger_step}
        details.update(cause=cause, oldest_restorable=oldest)
        if change is not None:
            self.cooldown_until = max(self.cooldown_until, change.until)
            message += f", the learning rate times {change.factor:g} until step {change.until - 1} ({_why(cause)})"
            details.update(lr_factor=change.factor, lr_until=change.until)
        self.hooks.emit(Event("recovery", at_step, message, details))
        return False

    def _stand_down(self, at_step: int, rollbacks: int, trigger: str, trigger_step: int, cause: Cause) -> bool:
        """An alert past ``max_rollbacks`` that lowering the LR cannot or did not fix: no rollback (the run goes
        on with skip and clip, as the guard alone would), said in a ``recovery`` event. Returns False."""
        tried = self.escalation.tried() or "no change of the learning rate"
        message = (
            f"{trigger} at step {trigger_step} after {rollbacks} rollback(s) within {self.config.window} steps "
            f"(RecoveryConfig.max_rollbacks): recovery stops rolling back and the run goes on with skip and clip. "
            f"Tried: {tried}. " + ("The skipped batches were bad: inspect the data" if cause == "data" else "")
        )
        details = {"action": "stand_down", "trigger": trigger, "trigger_step": trigger_step, "cause": cause}
        self.hooks.emit(Event("recovery", at_step, message.strip(), {**details, "rollbacks": rollbacks}))
        return False

    def _raise_limit(self, at_step: int, rollbacks: int, trigger: str, cause: Cause) -> None:
        """A divergence past ``max_rollbacks`` that lowering the LR cannot or did not fix: ``RollbackLimitError``."""
        error = self._give_up(at_step, rollbacks, trigger)
        details = {"reason": "rollback_limit", "rollbacks": rollbacks, "window": self.config.window, "trigger": trigger}
        details.update(cause=cause, tried=self.escalation.tried())
        if error.last_good_step is not None:
            details.update(last_good_step=error.last_good_step, last_good_path=error.last_good_path)
        self.hooks.emit(Event("diverged", at_step, str(error), details))
        raise error

    def _load_newest(self, step: int, at_step: int, trigger: str, oldest: int = 0) -> tuple[Snapshot, Any] | None:
        """The newest snapshot at or before ``step`` (and not before ``oldest``) that can be read, with its tree;
        None when there is none.

        A missing or damaged snapshot file is a warning; that snapshot is dropped and the next older one
        is tried (with several ranks there is no fallback: every rank must restore the same step). When
        snapshots were there but none could be read, ``SnapshotUnavailableError`` names each file
        (nothing has been restored).
        """
        problems: list[str] = []
        while True:
            snapshot = self.store.newest_at_or_before(step, vetted_first=self.agreement is not None)
            if snapshot is None or snapshot.step < oldest:
                break
            try:
                return snapshot, self.store.load(snapshot)
            except SnapshotFileError as exc:
                problems.append(str(exc))
                if self.agreement is not None:  # another rank would restore another step: no fallback
                    problems.append("under torch.distributed every rank must restore the same snapshot")
                    break
                warnings.warn(
                    f"stabilitykit: {exc}; the rollback falls back to an older snapshot",
                    RuntimeWarning,
                    stacklevel=5,
                )
                self.store.discard(snapshot)
        if problems:
            error = SnapshotUnavailableError(at_step, trigger, problems)
            self.hooks.emit(Event("diverged", at_step, str(error), {"reason": error.reason, "files": problems}))
            raise error
        return None

    def _give_up(self, at_step: int, rollbacks: int, trigger: str) -> RollbackLimitError:
        """The error for the rollback limit; the newest healthy snapshot is kept (``restore_last_good``, on disk)."""
        confirmed = self.store.confirmed
        path: Path | None = None
        if confirmed:
            self.last_good = confirmed[-1]
            record_dir = self.log.directory
            path = self.store.preserve(self.last_good, record_dir)
        clipping = self.engine.config.clip.mode != "off"
        return RollbackLimitError(
            at_step,
            rollbacks,
            self.config.window,
            trigger,
            clipping=clipping,
            tried=self.escalation.tried() or None,
            last_good_step=self.last_good.step if self.last_good is not None else None,
            last_good_path=str(path) if path is not None else None,
        )

    def restore_last_good(self) -> int:
        """Put back the last healthy snapshot in place; returns its step.

        After ``RollbackLimitError``: the snapshot it kept (also after ``close()``); otherwise the newest
        confirmed one of the ring. The step count and the rollback records are left as they are. Raises
        ``RuntimeError`` when there is none.
        """
        snapshot = self.last_good
        if snapshot is None:
            confirmed = self.store.confirmed
            if not confirmed:
                raise RuntimeError("stabilitykit: recovery holds no healthy snapshot to restore")
            snapshot = confirmed[-1]
        if snapshot.tree is not None:
            snapshot.tree.wait()
            tree = snapshot.tree.tree
        elif snapshot.path is not None:
            tree = read_verified(snapshot.path, snapshot.checksum)
        else:
            raise RuntimeError(f"stabilitykit: the last healthy snapshot (step {snapshot.step}) is no longer held")
        self._restore_guard(restore_snapshot(self.objects, tree, rng=self.config.restore_rng))
        return snapshot.step

    def _event(self, record: RollbackRecord) -> Event:
        message = (
            f"rolled back after {record.trigger} at step {record.trigger_step}: restored the state before step "
            f"{record.restored_step}; steps {record.skipped_from}..{record.skipped_to} ({record.skipped_steps} "
            f"step(s)) and their batches are skipped, training goes on at step {record.at_step + 1}"
        )
        if record.skip_ahead_to is not None:
            message += f"; the batches of steps {record.at_step + 1}..{record.skip_ahead_to} are skipped too"
        if record.lr_until is not None:
            message += f" with the learning rate times {record.lr_factor:g} until step {record.lr_until - 1}"
        message += f" ({_why(record.cause)})"
        details: dict[str, Any] = {
            **record.to_dict(),
            "rollbacks": len(self.log.records),
            "lr_scale": record.lr_factor,
            "cooldown_until": self.cooldown_until,
            "backoff_level": self.escalation.level,
        }
        if self.log.path is not None:
            details["skipped_file"] = str(self.log.path)
        return Event("rollback", record.at_step, message, details)

    # ------------------------------------------------------------------ state
    @property
    def snapshot_bytes(self) -> int:
        """Host memory held by snapshots now."""
        return self.store.nbytes

    def state_dict(self) -> dict[str, Any]:
        """The rollbacks so far, the cooldown and the LR backoff (the snapshots themselves are not saved)."""
        return {
            "rollbacks": self.log.state_dict(),
            "cooldown_until": self.cooldown_until,
            "skip_until": self.skip_until,
            "escalation": self.escalation.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (a resume). Snapshots held from before belong to another
        point of the run and are dropped; the first step after the resume takes a snapshot, so the
        resumed run can roll back before its first ``snapshot_every`` multiple."""
        self._clear_snapshots()
        self._snapshot_next = True
        self.log.load_state_dict(list(state.get("rollbacks", [])))
        self.cooldown_until = int(state.get("cooldown_until", 0))
        self.skip_until = int(state.get("skip_until", 0))
        self.escalation.load_state_dict(dict(state.get("escalation") or {}))


def _why(cause: str) -> str:
    """Why a rollback did what it did, for its message."""
    return {
        "undetermined": "the first trouble in a while: the LR's or the data's, so both are handled",
        "data": "trouble again after batches that the restored model found bad: the data, skipped",
        "lr": "trouble again on data the restored model reads fine: the learning rate, lowered further",
    }[cause]
