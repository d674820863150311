"""The snapshot ring: pending snapshots wait for their step's decision, healthy ones are kept, ``keep`` deep.

A snapshot taken after a step whose decision is still on the device (a fused optimizer between
logging steps) is *pending*: it is confirmed when the journal read shows that step was taken, and
dropped when it was skipped. Only confirmed snapshots are ever restored; the oldest confirmed one
goes when there are more than ``keep``.

Storage ``"memory"`` keeps the host copies; a directory writes each snapshot to
``<dir>/snapshot-<step>.pt`` once it is confirmed (the write waits for the copy: a host sync on
CUDA, on that step only) and frees its host buffers for the next one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from stabilitykit.recovery.host_copy import HostCopier
from stabilitykit.recovery.snapshot import Snapshot

__all__ = ["SnapshotStore"]


class SnapshotStore:
    """Pending and confirmed snapshots, oldest first."""

    def __init__(self, keep: int, storage: str, copier: HostCopier) -> None:
        self.keep = keep
        self.copier = copier
        self.directory = None if storage == "memory" else Path(storage)
        self.snapshots: list[Snapshot] = []

    @property
    def confirmed(self) -> list[Snapshot]:
        """Snapshots that may be restored, oldest first."""
        return [s for s in self.snapshots if s.confirmed]

    @property
    def nbytes(self) -> int:
        """Host bytes held by snapshots in memory."""
        return sum(s.nbytes for s in self.snapshots if s.tree is not None)

    def add(self, snapshot: Snapshot) -> None:
        """Hold ``snapshot`` (pending or confirmed)."""
        self.snapshots.append(snapshot)
        if snapshot.confirmed:
            self._settled(snapshot)

    def confirm(self, taken: Iterable[tuple[int, bool]]) -> None:
        """Decisions the host has just read, as ``(step, taken)``: pending snapshots after them are settled."""
        outcome = dict(taken)
        for snapshot in list(self.snapshots):
            if snapshot.confirmed or snapshot.step - 1 not in outcome:
                continue
            if outcome[snapshot.step - 1]:
                snapshot.confirmed = True
                self._settled(snapshot)
            else:
                self._drop(snapshot)  # a skipped step: this state is never restored

    def _settled(self, snapshot: Snapshot) -> None:
        if self.directory is not None and snapshot.tree is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"snapshot-{snapshot.step}.pt"
            snapshot.tree.wait()
            torch.save(snapshot.tree.tree, path)
            self.copier.release(snapshot.tree)
            snapshot.tree, snapshot.path = None, path
        confirmed = self.confirmed
        for old in confirmed[: max(0, len(confirmed) - self.keep)]:
            self._drop(old)

    def newest_at_or_before(self, step: int) -> Snapshot | None:
        """The newest confirmed snapshot of a step at or before ``step``."""
        found = [s for s in self.confirmed if s.step <= step]
        return found[-1] if found else None

    def load(self, snapshot: Snapshot) -> Any:
        """The host tree of ``snapshot`` (waits for its copies; reads its file on disk)."""
        if snapshot.tree is not None:
            snapshot.tree.wait()
            return snapshot.tree.tree
        assert snapshot.path is not None
        return torch.load(snapshot.path, weights_only=False)  # our own file: RNG states are not tensors

    def drop_after(self, step: int) -> None:
        """Forget the snapshots of steps after ``step`` (a rollback abandoned them)."""
        for snapshot in [s for s in self.snapshots if s.step > step]:
            self._drop(snapshot)

    def clear(self) -> None:
        """Forget every snapshot (the set of parameters changed)."""
        for snapshot in list(self.snapshots):
            self._drop(snapshot)

    def _drop(self, snapshot: Snapshot) -> None:
        self.snapshots.remove(snapshot)
        if snapshot.tree is not None:
            self.copier.release(snapshot.tree)
            snapshot.tree = None
        if snapshot.path is not None:
            snapshot.path.unlink(missing_ok=True)
            snapshot.path = None
