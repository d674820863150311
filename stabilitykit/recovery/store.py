"""The snapshot ring: pending snapshots wait for their step's decision, healthy ones are kept, ``keep`` deep.

A snapshot taken after a step whose decision is still on the device (a fused optimizer between
logging steps) is *pending*: it is confirmed when the journal read shows that step was taken, and
dropped when it was skipped. Only confirmed snapshots are ever restored; the oldest confirmed one
goes when there are more than ``keep``.

Storage ``"memory"`` keeps the host copies; a directory writes each snapshot to
``<dir>/snapshot-<step>.<host>-<pid>.pt`` once it is confirmed, on a background thread: the step
goes on while the file is written (the thread waits for the device copy, so the step thread never
syncs), and the host buffers go back to the pool when the write is done. A snapshot being written is
restored from its host copy.

Storage never takes training down (``files.py``): a write that fails is a warning, and that snapshot
is dropped (training goes on, with one snapshot fewer); a file that cannot be removed is a warning;
every file's checksum is taken as it is written and checked when it is read back, so a missing or
damaged file is a ``SnapshotFileError`` the rollback handles (it falls back to an older snapshot).
A store that opens a directory first removes the snapshot files of processes that no longer run.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from stabilitykit.recovery.files import (
    clean_orphans,
    last_good_path,
    read_verified,
    snapshot_path,
    write_checksummed,
)
from stabilitykit.recovery.host_copy import HostCopier, HostTree
from stabilitykit.recovery.snapshot import Snapshot


class SnapshotStore:
    """Pending and confirmed snapshots, oldest first."""

    def __init__(self, keep: int, storage: str, copier: HostCopier) -> None:
        self.keep = keep
        self.copier = copier
        self.directory = None if storage == "memory" else Path(storage)
        self.snapshots: list[Snapshot] = []
        self._writer: ThreadPoolExecutor | None = None  # started with the first write
        self._writes: dict[int, Future[str]] = {}  # id(snapshot) -> its file being written (its checksum)
        if self.directory is not None:
            clean_orphans(self.directory)  # the files of a killed run: nothing will ever restore them

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
            path = snapshot_path(self.directory, snapshot.step)
            if self._writer is None:
                self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stabilitykit-snapshot")
            self._writes[id(snapshot)] = self._writer.submit(_write, snapshot.tree, path)
            snapshot.path = path
        self.trim()

    def trim(self) -> None:
        """Drop the oldest confirmed, vetted snapshots beyond ``keep`` (one not yet vetted pushes none out)."""
        kept = [s for s in self.confirmed if s.vetted]
        for old in kept[: max(0, len(kept) - self.keep)]:
            self._drop(old)

    def newest_at_or_before(self, step: int, vetted_first: bool = False) -> Snapshot | None:
        """The newest confirmed snapshot of a step at or before ``step``; with ``vetted_first``, the newest
        vetted one when there is one (a snapshot whose health is still being agreed across ranks may turn
        out to be inside a climb)."""
        found = [s for s in self.confirmed if s.step <= step]
        if vetted_first and any(s.vetted for s in found):
            found = [s for s in found if s.vetted]
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
            else:
                snapshot.checksum = write.result()
                if snapshot.tree is not None:
                    self.copier.release(snapshot.tree)
                    snapshot.tree = None

    def load(self, snapshot: Snapshot) -> Any:
        """The host tree of ``snapshot`` (waits for its copies; reads and verifies its file on disk).

        A file that is missing or damaged raises ``SnapshotFileError`` naming it.
        """
        if snapshot.tree is not None:
            snapshot.tree.wait()
            return snapshot.tree.tree
        assert snapshot.path is not None
        return read_verified(snapshot.path, snapshot.checksum)

    def preserve(self, snapshot: Snapshot, directory: Path | None) -> Path | None:
        """Take ``snapshot`` out of the ring and keep it past ``close()`` (recovery gave up).

        On disk as ``<dir>/last-good-<step>.pt``, its SHA-256 next to it (``.sha256``): the storage
        directory's file is renamed, or (memory storage) the host copy is written into ``directory``.
        The host copy, if any, stays in memory too. Returns the file, or None when there is nowhere to
        put it or it cannot be written (a warning).
        """
        self.wait_for_writes()
        if not any(s is snapshot for s in self.snapshots):
            return None
        # out of the ring: no longer dropped, pushed out or removed by close()
        self.snapshots = [s for s in self.snapshots if s is not snapshot]
        target_dir = self.directory or directory
        if target_dir is None:
            return None
        target = last_good_path(target_dir, snapshot.step)
        try:
            if snapshot.path is not None:
                snapshot.path.replace(target)
            else:
                assert snapshot.tree is not None
                snapshot.tree.wait()
                snapshot.checksum = write_checksummed(snapshot.tree.tree, target)
            snapshot.path = target
            if snapshot.checksum is not None:
                target.with_name(target.name + ".sha256").write_text(snapshot.checksum + "\n", encoding="utf-8")
        except OSError as exc:
            warnings.warn(
                f"stabilitykit: could not keep the last healthy snapshot (step {snapshot.step}) at {target}: {exc!r}",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        return target

    def discard(self, snapshot: Snapshot) -> None:
        """Forget ``snapshot`` (its file could not be read back) and remove what is left of its file."""
        if any(s is snapshot for s in self.snapshots):
            self._drop(snapshot)

    def drop_after(self, step: int) -> None:
        """Forget the snapshots of steps after ``step`` (a rollback abandoned them)."""
        for snapshot in [s for s in self.snapshots if s.step > step]:
            self._drop(snapshot)

    def clear(self) -> None:
        """Forget every snapshot (the set of parameters changed)."""
        for snapshot in list(self.snapshots):
            self._drop(snapshot)

    def close(self) -> None:
        """Forget every snapshot and stop the writer thread (the driver is done; never raises for storage)."""
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
            path, snapshot.path = snapshot.path, None
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # a folder turned read-only, a file where the folder was
                warnings.warn(
                    f"stabilitykit: could not remove the recovery snapshot {path}: {exc!r}; training goes on",
                    RuntimeWarning,
                    stacklevel=3,
                )


def _write(tree: HostTree, path: Path) -> str:
    """On the writer thread: wait for the device copy, then write ``tree`` to ``path`` (whole or not at all);
    returns the file's SHA-256."""
    tree.wait()
    return write_checksummed(tree.tree, path)
