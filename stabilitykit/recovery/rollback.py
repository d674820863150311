"""What a trigger does: roll back to a restore point, or lower the LR where the run is, or stop rolling back.

A trigger rolls back to the newest confirmed snapshot taken at least ``min_lookback`` steps before its
onset and inside the bound (``max_lookback`` steps, ``max_lookback_share`` of the run: never the
initial weights). Parameters, buffers, optimizer, schedulers, GradScaler and, when asked, the random
generators are put back in place (``snapshot.py``), the driver's own state through the controller.
A ``rollback`` event names the skipped step range (``rollback_log.py``) and what was done to the learning
rate and why (``escalation.py``).

With no restore point inside the bound, an alert lowers the LR where the run is (a ``recovery``
event) and a divergence raises as without recovery. Past ``max_rollbacks`` within ``window`` steps,
when lowering the LR cannot help (the data) or did not (its lowest level holds), an alert stops the
rollbacks (skip and clip go on) and a divergence raises ``RollbackLimitError``, saying what was tried.
A lowered LR that ends with the trouble still there goes one backoff level further (``review``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stabilitykit.events import Event, RollbackLimitError, SnapshotUnavailableError
from stabilitykit.hooks import HookManager
from stabilitykit.recovery.config import RecoveryConfig
from stabilitykit.recovery.escalation import Cause, Escalation
from stabilitykit.recovery.files import SnapshotFileError, read_verified
from stabilitykit.recovery.rollback_log import RollbackLog, RollbackRecord
from stabilitykit.recovery.snapshot import Snapshot
from stabilitykit.recovery.store import SnapshotStore

if TYPE_CHECKING:
    from stabilitykit.engine.ledger import Divergence
    from stabilitykit.engine.step import StabilityEngine


class Rollback:
    """Acts on triggers for one guarded optimizer: restores, lowers the LR, stands down or raises."""

    def __init__(
        self,
        config: RecoveryConfig,
        engine: StabilityEngine,
        hooks: HookManager,
        store: SnapshotStore,
        log: RollbackLog,
        escalation: Escalation,
        restore: Callable[[Any], None],
        restored: Callable[[int], None],
        agree: bool,
    ) -> None:
        """``restore(tree)`` puts a snapshot's tree back in place (the driver's state included);
        ``restored(step)`` then forgets what belongs to the undone steps after ``step``; ``agree``: every
        rank must restore the same snapshot (no fallback to an older one)."""
        self.config = config
        self.engine = engine
        self.hooks = hooks
        self.store = store
        self.log = log
        self.escalation = escalation
        self._restore, self._restored = restore, restored
        self.agree = agree
        self.cooldown_until = 0  # steps before this one run with a lowered LR (the latest change's end)
        self.skip_until = 0  # steps before this one skip their batch (``skip_after``)
        #: The healthy snapshot kept when recovery gave up (``RollbackLimitError``), for ``restore_last_good``.
        self.last_good: Snapshot | None = None

    def roll_back(self, trigger: str, trigger_step: int, onset: int, divergence: Divergence | None) -> bool:
        """Act on ``trigger`` (fired at ``trigger_step``, trouble from ``onset``). True after a rollback."""
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
        found = self._load_newest(onset - cfg.min_lookback, at_step, trigger, self.oldest_restorable(at_step))
        if found is None:
            if divergence is not None:
                self.engine.readout.report_divergence(divergence)  # nothing to go back to: raise as before
            return self._lower_in_place(at_step, trigger, trigger_step, cause, onset)
        snapshot, tree = found
        self._restore(tree)
        self._restored(snapshot.step)
        skip = 0 if cause == "lr" and cfg.lr_backoff else cfg.skip_after  # the LR's fault: no data to skip
        self.skip_until = self.engine.step + skip
        change = esc.act(cause, at_step, self.skip_until, True, onset)
        esc.skipping(self.engine.step, self.skip_until, snapshot.step, onset, while_bad=cause == "data")
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

    def data_passed(self) -> None:
        """Batches skipped ahead for bad data measure fine again (``Escalation.passed``): training goes on from
        the next step, not after the rest of ``skip_after`` (a burst that recurs is known bad data, but not how
        long it lasts: a fixed count skips good batches with it, up to the end of a short run)."""
        passed = self.escalation.passed()
        if passed is not None and passed < self.skip_until:
            self.skip_until = max(passed, self.engine.step)

    def oldest_restorable(self, at_step: int) -> int:
        """The oldest snapshot step a rollback at ``at_step`` may restore (``max_lookback``, ``max_lookback_share``):
        never the initial weights, never further back than the bound."""
        cfg = self.config
        share = math.ceil(at_step - cfg.max_lookback_share * at_step)
        return max(at_step - cfg.max_lookback, share, 2)

    def _lower_in_place(self, at_step: int, trigger: str, trigger_step: int, cause: Cause, onset: int) -> bool:
        """An alert with no restore point inside the bound: no rollback; the LR is lowered where the run is
        (as a rollback for ``cause`` would), and skipping and clipping go on. Returns False."""
        change = self.escalation.act(cause, at_step, self.engine.step, False, onset)
        oldest = self.oldest_restorable(at_step)
        message = (
            f"{trigger} at step {trigger_step}: no healthy snapshot from step {oldest} on (RecoveryConfig."
            f"max_lookback={self.config.max_lookback}, max_lookback_share={self.config.max_lookback_share:g}), so "
            "nothing is rolled back; training goes on from here with skip and clip"
        )
        details: dict[str, Any] = {"action": "lr_backoff", "trigger": trigger, "trigger_step": trigger_step}
        details.update(cause=cause, oldest_restorable=oldest)
        if change is not None:
            self.cooldown_until = max(self.cooldown_until, change.until)
            message += f", the learning rate times {change.factor:g} until step {change.until - 1} ({why(cause)})"
            details.update(lr_factor=change.factor, lr_until=change.until)
        self.hooks.emit(Event("recovery", at_step, message, details))
        return False

    def review(self, at_step: int) -> None:
        """After step ``at_step``: when the last LR change has ended with the loss still far above the best the run
        held (``Escalation.unrecovered``), the trouble did not pass while the LR was lowered, and a
        clock that gives the full LR back would meet it again (the loss-level alert, once per excursion, does
        not page twice): the LR goes one ``lr_backoff`` level further where the run is (cause "lr"), said in
        a ``recovery`` event."""
        esc = self.escalation
        unrecovered = esc.unrecovered(at_step)
        if unrecovered is None or not self.config.lr_backoff:
            return
        ratio, against = unrecovered
        onset = esc.last_onset if esc.last_onset is not None else at_step
        change = esc.act("lr", at_step, self.engine.step, False, onset)
        if change is None:
            return
        self.cooldown_until = max(self.cooldown_until, change.until)
        message = (
            f"the loss is still {ratio:.1f}x {against} as the learning rate lowered after step {onset} ends: "
            f"the learning rate times {change.factor:g} until step {change.until - 1} "
            "(the trouble did not pass: the learning rate, lowered further)"
        )
        details: dict[str, Any] = {"action": "lr_backoff", "trigger": "unrecovered", "trigger_step": at_step}
        details.update(cause="lr", loss_ratio=ratio, loss_against=against)
        details.update(lr_factor=change.factor, lr_until=change.until)
        self.hooks.emit(Event("recovery", at_step, message, details))

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
            snapshot = self.store.newest_at_or_before(step, vetted_first=self.agree)
            if snapshot is None or snapshot.step < oldest:
                break
            try:
                return snapshot, self.store.load(snapshot)
            except SnapshotFileError as exc:
                problems.append(str(exc))
                if self.agree:  # another rank would restore another step: no fallback
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
        self._restore(tree)
        return snapshot.step

    def _event(self, record: RollbackRecord) -> Event:
        message = (
            f"rolled back after {record.trigger} at step {record.trigger_step}: restored the state before step "
            f"{record.restored_step}; steps {record.skipped_from}..{record.skipped_to} ({record.skipped_steps} "
            f"step(s)) and their batches are skipped, training goes on at step {record.at_step + 1}"
        )
        if record.skip_ahead_to is not None:
            message += f"; the batches of steps {record.at_step + 1}..{record.skip_ahead_to} are skipped too"
            if record.cause == "data":
                message += " while they measure bad (5 in a row that measure fine end the skip)"
        if record.lr_until is not None:
            message += f" with the learning rate times {record.lr_factor:g} until step {record.lr_until - 1}"
        message += f" ({why(record.cause)})"
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

    def state_dict(self) -> dict[str, Any]:
        """The rollbacks so far, the cooldown, the batches still to skip and the LR backoff."""
        return {
            "rollbacks": self.log.state_dict(),
            "cooldown_until": self.cooldown_until,
            "skip_until": self.skip_until,
            "escalation": self.escalation.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (a resume)."""
        self.log.load_state_dict(list(state.get("rollbacks", [])))
        self.cooldown_until = int(state.get("cooldown_until", 0))
        self.skip_until = int(state.get("skip_until", 0))
        self.escalation.load_state_dict(dict(state.get("escalation") or {}))


def why(cause: str) -> str:
    """Why a rollback did what it did, for its message."""
    return {
        "undetermined": (
            "nothing tells the LR from the data yet (the first trouble in a while, or back while a lowered LR "
            "held): both are handled"
        ),
        "data": "trouble again after batches that the restored model found bad: the data, skipped",
        "lr": (
            "trouble again that follows the learning rate (on data the restored model reads fine, or back once a "
            "lowered LR ended): the learning rate, lowered further"
        ),
    }[cause]
