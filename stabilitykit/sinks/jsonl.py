"""JsonlSink: one JSON object per logging step, appended and flushed so a crash loses nothing.

The sink survives what happens to log files on real machines: a file moved or deleted mid-run
(logrotate) is reopened at the next write, as ``logging.handlers.WatchedFileHandler`` does; a
partial last line left by a process killed mid-write is cut off before appending, so the file
stays valid JSONL; a failing write (disk full) warns once, says what it dropped, and retries.

Two runs never share one file silently. With the default ``mode="new"`` a run that starts over
(its first record is not past the first step already in the file) gets a fresh file at
``path``, and the earlier run's file is kept beside it as ``run.1.jsonl`` (then ``run.2.jsonl``,
...), with a warning saying so; a resumed run (its first record is past the file's first step)
continues the file, as it should. ``mode="append"`` always continues the file, ``mode="overwrite"``
always replaces it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Literal

from stabilitykit.events import Event

#: What a JsonlSink does with a file that already holds records: see the module docstring.
JsonlMode = Literal["new", "append", "overwrite"]
_MODES = ("new", "append", "overwrite")

_SPECIALS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class JsonlError(ValueError):
    """A JSONL log that cannot be read; the message names the file and the line."""


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _clean_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with every non-finite float written as text (one pass, for a row of many metrics)."""
    out = dict(record)
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = _clean(value)  # called only for the rare non-finite value
    return out


def _default(value: Any) -> Any:
    """Values json cannot write (tensors, numpy scalars, paths): numbers when they are numbers, else text."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        out = tolist()
        return _clean(out) if isinstance(out, float) else out
    return str(value)


def _cut_partial_line(path: Path) -> int:
    """Truncate ``path`` after its last newline; returns the bytes cut (0 when it ends cleanly)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size == 0:
        return 0
    with path.open("rb+") as handle:
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return 0
        end = size
        while end > 0:
            start = max(0, end - 65536)
            handle.seek(start)
            newline = handle.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        handle.truncate(keep)
    return size - keep


def _first_step(path: Path) -> int | None:
    """The step of the first record in ``path`` (None: empty, missing, or no readable first record)."""
    try:
        with path.open("rb") as handle:
            for raw in handle:
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    return None
                step = record.get("step") if isinstance(record, dict) else None
                return step if isinstance(step, int) else None
    except FileNotFoundError:
        return None
    return None


def _numbered(path: Path) -> Path:
    """The first free ``run.N.jsonl`` beside ``path`` (N = 1, 2, ...): older runs get lower numbers."""
    number = 1
    while True:
        candidate = path.with_name(f"{path.stem}.{number}{path.suffix}")
        if not candidate.exists():
            return candidate
        number += 1


class JsonlSink:
    """Appends ``{"step": s, "metric": v, ...}`` per logging step and ``{"event": kind, ...}`` per event.

    Each line is flushed (and fsynced when ``fsync=True``) as it is written. The file is checked
    (one ``stat``) before each write and reopened when it was moved or deleted.

    ``mode`` says what happens to a file that already holds records when this sink first writes:
    ``"new"`` (default) keeps a new run apart from an old one (the old file is moved to
    ``run.1.jsonl``, ``run.2.jsonl``, ... and ``previous`` names it) while a resumed run, whose
    first record is past the file's first step, continues the file; ``"append"`` always
    continues it; ``"overwrite"`` replaces it. The choice is made at this sink's first record (the
    drivers write nothing before their first step, so a resume's first record carries its step).
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False, mode: JsonlMode = "new") -> None:
        if mode not in _MODES:
            raise ValueError(f"JsonlSink(mode={mode!r}): expected one of {', '.join(map(repr, _MODES))}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.mode: JsonlMode = mode
        #: Where an earlier run's file was moved to (``mode="new"``), else None.
        self.previous: Path | None = None
        self._chosen = mode == "append"  # whether the file for this run is settled
        self._file: IO[str] | None = None
        self._identity: tuple[int, int] | None = None
        self.written = 0
        self.dropped = 0
        self._dropped_steps: list[int] = []
        self._failing = False

    # ------------------------------------------------------------------ file handling
    def _open(self) -> IO[str]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        cut = _cut_partial_line(self.path)
        if cut:
            warnings.warn(
                f"stabilitykit JsonlSink: {self.path} ended in a partial line ({cut} bytes, left by a process "
                "killed mid-write); cut it off so the log stays valid JSONL",
                RuntimeWarning,
                stacklevel=4,
            )
        handle = self.path.open("a", encoding="utf-8")
        stat = os.fstat(handle.fileno())
        self._identity = (stat.st_dev, stat.st_ino)
        return handle

    def _moved(self) -> bool:
        """True when ``path`` no longer names the open file (rotated, moved or deleted)."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (stat.st_dev, stat.st_ino) != self._identity

    def _handle(self) -> IO[str]:
        if self._file is not None and not self._file.closed and self._moved():
            self._file.close()
        if self._file is None or self._file.closed:
            self._file = self._open()
        return self._file

    def _write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(_clean_record(record), default=_default) + "\n"
        try:
            handle = self._handle()
            handle.write(line)
            handle.flush()
            if self.fsync:
                os.fsync(handle.fileno())
        except OSError as exc:
            self._drop(record, exc)
            return
        self.written += 1
        if self._failing:
            self._failing = False
            warnings.warn(
                f"stabilitykit JsonlSink: writing {self.path} again; {self._dropped_summary()} while it failed",
                RuntimeWarning,
                stacklevel=3,
            )

    def _drop(self, record: Mapping[str, Any], exc: OSError) -> None:
        """Count a record that could not be written; warn when the failing starts (not once per row)."""
        self.dropped += 1
        step = record.get("step")
        if isinstance(step, int):
            self._dropped_steps = [self._dropped_steps[0] if self._dropped_steps else step, step]
        if self._file is not None:
            with contextlib.suppress(OSError):  # every line was flushed: nothing is lost here
                self._file.close()
            self._file = None
        if not self._failing:
            self._failing = True
            warnings.warn(
                f"stabilitykit JsonlSink: cannot write {self.path} ({exc}); dropping records until it can, "
                "training goes on",
                RuntimeWarning,
                stacklevel=4,
            )

    def _dropped_summary(self) -> str:
        steps = self._dropped_steps
        where = f" (steps {steps[0]}..{steps[-1]})" if steps else ""
        return f"dropped {self.dropped} record(s) so far{where}"

    def _choose_file(self, step: int | None) -> None:
        """Once, before this run's first line: continue, replace or set aside what ``path`` holds."""
        self._chosen = True
        try:
            if self.path.stat().st_size == 0:
                return
        except FileNotFoundError:
            return
        if self.mode == "overwrite":
            self.path.unlink()
            return
        first = _first_step(self.path)
        if step is not None and first is not None and step > first:
            return  # a resume: this run continues the file
        self.previous = _numbered(self.path)
        self.path.rename(self.previous)
        warnings.warn(
            f"stabilitykit JsonlSink: {self.path} held an earlier run (from step {first}); it is kept as "
            f"{self.previous} and this run starts a fresh {self.path.name} "
            "(JsonlSink(path, mode='append') continues a file, mode='overwrite' replaces it)",
            UserWarning,
            stacklevel=4,
        )

    # ------------------------------------------------------------------ the sink protocol
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Write one line holding the step and every metric."""
        if not self._chosen:
            self._choose_file(step)
        self._write({"step": step, **metrics})

    def log_event(self, event: Event) -> None:
        """Write one line for an event: ``{"event": kind, "step": s, "message": ..., details}``."""
        if not self._chosen:
            self._choose_file(event.step)
        self._write({"event": event.kind, "step": event.step, "message": event.message, **event.details})

    def close(self) -> None:
        """Close the file (a later write reopens it in append mode); warn if records were dropped."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # every line was flushed: nothing is lost here
                self._file.close()
            self._file = None
        if self.dropped and self._failing:
            warnings.warn(
                f"stabilitykit JsonlSink: {self.path}: {self._dropped_summary()}; they are lost",
                RuntimeWarning,
                stacklevel=2,
            )


def iter_jsonl_numbered(path: str | os.PathLike[str], specials: bool = True) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of a JSONL log one at a time (bounded memory), NaN/Inf strings turned back to floats.

    ``specials=False`` leaves "nan"/"inf" strings as they are (faster, for readers that skip them).
    A truncated last line (no newline, not JSON: a process killed mid-write) is skipped with a
    warning. Any other unreadable line raises ``JsonlError`` naming the file and line number.
    """
    path = Path(path)
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                if not raw.endswith(b"\n") and raw.lstrip().startswith(b"{") and isinstance(exc, json.JSONDecodeError):
                    # only the last line can lack its newline; a record cut short still starts like one
                    warnings.warn(
                        f"stabilitykit: {path}:{number}: skipped a truncated last line ({len(raw)} bytes; "
                        "the process was killed mid-write)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    return
                if isinstance(exc, UnicodeDecodeError):
                    raise JsonlError(f"{path}:{number}: not UTF-8 text; is this a JSONL log?") from None
                excerpt = raw.decode("utf-8").strip()[:60]
                raise JsonlError(f"{path}:{number}: not a JSON line ({exc.msg}): {excerpt!r}") from None
            if not isinstance(record, dict):
                raise JsonlError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
            if specials:
                record = {
                    k: _SPECIALS.get(v, v) if isinstance(v, str) and k != "event" else v for k, v in record.items()
                }
            yield number, record


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a JSONL log one at a time; see ``iter_jsonl_numbered``."""
    for _number, record in iter_jsonl_numbered(path):
        yield record


def read_jsonl(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read a JsonlSink file back: ``(metric rows, event rows)``, NaN/Inf strings turned back to floats."""
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for record in iter_jsonl(path):
        (events if "event" in record else rows).append(record)
    return rows, events
