"""Snapshot files: their names, a checksummed write, a verified read, and the files a killed run left behind.

A snapshot file is ``<dir>/snapshot-<step>.<host>-<pid>.pt``: the owner's host and process id are in
the name, so a run that starts in a directory can tell the files of a process that no longer runs
(killed before it could remove them) from those of a run still going, and remove only the former.

Every file is written whole or not at all (a temporary file renamed into place) and its SHA-256 is
taken while it is written (no second read); a read checks the file against it before anything
is unpickled, so a missing, truncated, emptied, overwritten or bit-flipped file is a
``SnapshotFileError`` naming the file and what is wrong, never a restore of damaged values.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import warnings
from pathlib import Path
from typing import Any

import torch

_CHUNK = 1 << 20
_OWNED = re.compile(r"^snapshot-\d+\.(?P<host>.+)-(?P<pid>\d+)\.pt(?:\.tmp)?$")


class SnapshotFileError(OSError):
    """A snapshot file that cannot be restored: missing, unreadable, or not what was written."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"recovery snapshot {path}: {problem}")


def owner_tag() -> str:
    """This process, as it appears in its snapshot file names: ``<host>-<pid>``."""
    host = re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"
    return f"{host}-{os.getpid()}"


def snapshot_path(directory: Path, step: int) -> Path:
    """Where this process writes the snapshot of ``step``."""
    return directory / f"snapshot-{step}.{owner_tag()}.pt"


def last_good_path(directory: Path, step: int) -> Path:
    """Where the last healthy snapshot is kept when recovery gives up (never cleaned as an orphan)."""
    return directory / f"last-good-{step}.pt"


class _HashingWriter:
    """A file object for ``torch.save`` that hashes every byte on its way to the file."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        written: int = self.file.write(data)
        return written

    def flush(self) -> None:
        self.file.flush()


def write_checksummed(tree: Any, path: Path) -> str:
    """``torch.save`` ``tree`` to ``path`` (whole or not at all); returns the file's SHA-256 (hex)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as file:
            writer = _HashingWriter(file)
            torch.save(tree, writer)  # type: ignore[arg-type]  # any object with write() is a file here
            file.flush()
            os.fsync(file.fileno())
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write already failed; that is what is reported
            tmp.unlink(missing_ok=True)
        raise
    return writer.digest.hexdigest()


def read_verified(path: Path, checksum: str | None) -> Any:
    """The tree in ``path``, after its SHA-256 matched ``checksum`` (None: not checked).

    Raises ``SnapshotFileError`` naming the file for anything that keeps it from being restored.
    """
    try:
        size = path.stat().st_size
        if size == 0:
            raise SnapshotFileError(path, "the file is empty")
        if checksum is not None:
            digest = hashlib.sha256()
            with open(path, "rb") as file:
                while chunk := file.read(_CHUNK):
                    digest.update(chunk)
            found = digest.hexdigest()
            if found != checksum:
                raise SnapshotFileError(
                    path, f"its checksum does not match what was written ({found[:12]}, not {checksum[:12]})"
                )
    except FileNotFoundError:
        raise SnapshotFileError(path, "the file is gone") from None
    except SnapshotFileError:
        raise
    except OSError as exc:
        raise SnapshotFileError(path, f"cannot be read ({exc})") from exc
    try:
        return torch.load(path, weights_only=False)  # our own file: RNG states are not tensors
    except Exception as exc:
        raise SnapshotFileError(path, f"cannot be loaded ({type(exc).__name__}: {exc})") from exc


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def clean_orphans(directory: Path) -> list[Path]:
    """Remove the snapshot files in ``directory`` left by processes of this host that no longer run.

    Files of a live process (another run sharing the directory, this process) and of other hosts
    are left alone; a file that cannot be removed is a warning. Returns the files removed.
    """
    removed: list[Path] = []
    try:
        entries = list(directory.iterdir()) if directory.is_dir() else []
    except OSError:
        return removed
    me = owner_tag().rsplit("-", 1)[0]
    for entry in entries:
        match = _OWNED.match(entry.name)
        if match is None or match["host"] != me or _running(int(match["pid"])):
            continue
        try:
            entry.unlink(missing_ok=True)
            removed.append(entry)
        except OSError as exc:
            warnings.warn(
                f"stabilitykit: could not remove the recovery snapshot {entry} left by a process that no longer "
                f"runs: {exc!r}",
                RuntimeWarning,
                stacklevel=3,
            )
    return removed
