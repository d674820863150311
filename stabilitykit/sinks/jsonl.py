"""JsonlSink: one JSON object per logging step, appended and flushed so a crash loses nothing."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from stabilitykit.events import Event

__all__ = ["JsonlSink", "read_jsonl"]


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class JsonlSink:
    """Appends ``{"step": s, "metric": v, ...}`` per logging step and ``{"event": kind, ...}`` per event.

    Each line is flushed (and fsynced when ``fsync=True``) as it is written.
    """

    def __init__(self, path: str | os.PathLike[str], fsync: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self._file: IO[str] | None = None

    def _write(self, record: Mapping[str, Any]) -> None:
        if self._file is None or self._file.closed:
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Write one line holding the step and every metric."""
        self._write({"step": step, **metrics})

    def log_event(self, event: Event) -> None:
        """Write one line for an event: ``{"event": kind, "step": s, "message": ..., details}``."""
        self._write({"event": event.kind, "step": event.step, "message": event.message, **event.details})

    def close(self) -> None:
        """Close the file (a later write reopens it in append mode)."""
        if self._file is not None:
            self._file.close()


def read_jsonl(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read a JsonlSink file back: ``(metric rows, event rows)``, NaN/Inf strings turned back to floats."""
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    specials = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        record = {k: specials.get(v, v) if isinstance(v, str) and k != "event" else v for k, v in record.items()}
        (events if "event" in record else rows).append(record)
    return rows, events
