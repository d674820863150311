"""The record of rollbacks: which steps each one skipped, how many happened recently, ``skipped_batches.json``.

A rollback at step ``t`` to the snapshot of step ``s`` (the state before step ``s``) undoes steps
``s`` to ``t``: the batches those steps trained on are skipped. Each rollback is one record;
records are plain values, saved with the guard's state, and, when a directory is set, written
as a whole to ``<dir>/skipped_batches.json`` after every rollback. A write that cannot happen (a full
disk, a folder turned read-only) is a warning: the records stay in memory and the next rollback
writes them all again.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stabilitykit.fields import NonNegativeInt

#: The file name of the skipped ranges in ``RecoveryConfig.record_dir``.
SKIPPED_FILE = "skipped_batches.json"


@dataclass(frozen=True)
class RollbackRecord:
    """One rollback: what fired, where it began, and the step range whose batches were skipped."""

    at_step: NonNegativeInt  # the step whose end rolled back
    trigger: str  # "diverged", "spike_alert" or "loss_drift"
    trigger_step: NonNegativeInt  # the step the trigger was raised for
    onset: int  # the first step of the bad stretch (the first skipped step of a divergence, an alert's step)
    restored_step: NonNegativeInt  # the snapshot's step: training went on from the state before it
    skipped_from: NonNegativeInt  # first step undone (== restored_step)
    skipped_to: NonNegativeInt  # last step undone (== at_step)
    skip_ahead_to: NonNegativeInt | None = None  # last step of the batches skipped after the rollback (``skip_after``)
    cause: str = "undetermined"  # "undetermined", "data" or "lr" (``escalation.py``)
    lr_factor: float = 1.0  # the learning rate's factor after the rollback (1.0: unchanged)
    lr_until: NonNegativeInt | None = None  # the first step back at the schedule's learning rate

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps (and their batches) were undone."""
        return self.skipped_to - self.skipped_from + 1

    @property
    def last_skipped_batch(self) -> int:
        """The last step whose batch is not trained on because of this rollback."""
        return self.skip_ahead_to if self.skip_ahead_to is not None else self.skipped_to

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready), with ``skipped_steps``."""
        return {**asdict(self), "skipped_steps": self.skipped_steps}


class RollbackLog:
    """Every rollback of the run, oldest first; ``directory``: where ``skipped_batches.json`` goes (None: nowhere)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.records: list[RollbackRecord] = []

    def add(self, record: RollbackRecord) -> None:
        """Record one rollback and rewrite the file."""
        self.records.append(record)
        self.write()

    def since(self, step: int) -> int:
        """Rollbacks at steps after ``step``."""
        return sum(1 for r in self.records if r.at_step > step)

    @property
    def path(self) -> Path | None:
        """``skipped_batches.json``'s path, or None when no directory is set."""
        return self.directory / SKIPPED_FILE if self.directory is not None else None

    def write(self) -> bool:
        """Write every record to ``skipped_batches.json`` (nothing without a directory); a failed write
        warns and returns False (the records stay in memory)."""
        path = self.path
        if path is None:
            return True
        body = {"rollbacks": [r.to_dict() for r in self.records]}
        tmp = path.with_suffix(".json.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
            tmp.replace(path)
        except OSError as exc:
            warnings.warn(
                f"stabilitykit: could not write the rollback records to {path}: {exc!r}; they stay in memory "
                "(and in the guard's state_dict) and are written again with the next rollback",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        return True

    def state_dict(self) -> list[dict[str, Any]]:
        """The records as plain values."""
        return [asdict(r) for r in self.records]

    def load_state_dict(self, records: list[dict[str, Any]]) -> None:
        """Restore what ``state_dict`` returned."""
        self.records = [RollbackRecord(**r) for r in records]
