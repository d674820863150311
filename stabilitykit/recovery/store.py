"""The snapshot ring: pending snapshots wait for their step's decision, healthy ones are kept, ``keep`` deep.

A snapshot taken after a step whose decision is still on the device (a fused optimizer between
logging steps) is *pending*: it is confirmed when the journal read shows that step was taken, and
dropped when it was skipped. Only confirmed snapshots are ever restored; the oldest confirmed one
goes when there are more than ``keep``.

Storage ``"memory"`` keeps the host copies; a directory writes each snapshot to
``<dir>/snapshot-<step>.pt`` once it is confirmed, on a background thread: the step goes on while
the file is written (the thread waits for the device copy, so the step thread never syncs), and
the host buffers go back to the pool when the write is done. A snapshot being written is restored
from its host copy; a write that fails is a warning, and that snapshot is dropped (training goes
on, with one snapshot fewer).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from stabilitykit.recovery.host_copy import HostCopier, HostTree
from stabilitykit.recovery.snapshot import Snapshot

__all__ = ["SnapshotStore"]


class SnapshotStore:
    """Pending and confirmed snapshots, oldest first."""

    def __init__(self, keep: int, storage: str, copier: HostCopier) -> None:
        self.keep = keep
        self.copier = copier
        self.directory = None if storage == "memory" else Path(storage)
        self.snapshots: list[Snapshot] = []
        self._writer: ThreadPoolExecutor | None = None  # started with the first write
        self._writes: dict[int, Future[None]] = {}  # id(snapshot) -> its file being written

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
        self._collect_writes()
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
            path = self.directory / f"snapshot-{snapshot.step}.pt"
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stabilitykit-snapshot")
            self._writes[id(snapshot)] = self._writer.submit(_write, snapshot.tree, path)
            snapshot.path = path
        confirmed = self.confirmed
        for old in confirmed[: max(0, len(confirmed) - self.keep)]:
            self._drop(old)

    def newest_at_or_before(self, step: int) -> Snapshot | None:
        """The newest confirmed snapshot of a step at or before ``step``."""
        found = [s for s in self.confirmed if s.step <= step]
        return found[-1] if found else None

    def wait_for_writes(self) -> None:
        """Block until every snapshot file being written is on disk (a failed write warns)."""
        for snapshot in list(self.snapshots):
            write = self._writes.get(id(snapshot))
            if write is not None:
                write.exception()  # waits; the outcome is handled below
        self._collect_writes()

    def _collect_writes(self) -> None:
        """Free the host copies of snapshots whose file is written; drop those whose write failed."""
        for snapshot in list(self.snapshots):
            write = self._writes.get(id(snapshot))
            if write is None or not write.done():
                continue
            del self._writes[id(snapshot)]
            error = write.exception()
            if error is not None:
                warnings.warn(
                    f"stabilitykit: could not write the recovery snapshot of step {snapshot.step} to "
                    f"{snapshot.path}: {error!r}; training goes on without it",
                    RuntimeWarning,
                    stacklevel=2,
                )
                snapshot.path = None  # nothing to remove
                self._drop(snapshot)
            elif snapshot.tree is not None:
                self.copier.release(snapshot.tree)
                snapshot.tree = None

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

    def close(self) -> None:
        """Forget every snapshot and stop the writer thread (the driver is done)."""
        self.clear()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    def _drop(self, snapshot: Snapshot) -> None:
        self.snapshots.remove(snapshot)
        write = self._writes.pop(id(snapshot), None)
        if write is not None:
            write.exception()  # wait for the file before it is removed (a failure no longer matters)
        if snapshot.tree is not None:
            self.copier.release(snapshot.tree)
            snapshot.tree = None
        if snapshot.path is not None:
            snapshot.path.unlink(missing_ok=True)
            snapshot.path = None


def _write(tree: HostTree, path: Path) -> None:
    """On the writer thread: wait for the device copy, then write ``tree`` to ``path`` (whole or not at all)."""
    tree.wait()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(tree.tree, tmp)
    tmp.replace(path)
