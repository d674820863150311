"""Reading a W&B run's transaction log (``run-*.wandb``) back, for tests and offline checks.

wandb >= 0.30 removed its Python reader of this file. The format is LevelDB's log format with
a 7-byte file header (``:W&B``, magic 0xBEE1, version 0): 32 KiB blocks of chunks, each with a
7-byte header (crc32, length, type: full/first/middle/last); each record is a protobuf
``wandb.proto.wandb_internal_pb2.Record``.

``run.finish()`` returns before the wandb-core process has written the file (right after it, the
file often holds only its 7-byte header); a complete file ends with the run's ``exit`` record.
``WandbRunFile.read`` waits for that record (``timeout`` seconds) rather than reading half a run.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> Iterator[tuple[int, bytes]]:
    offset = _HEADER  # the file header sits at the start of the first block
    while offset + _HEADER <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _HEADER:  # block trailer padding
            offset += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + _HEADER])
        if kind == 0 and length == 0:  # zero padding at the end of a block or file
            offset += left_in_block
            continue
        start = offset + _HEADER
        if start + length > len(data):  # the writer has not finished this chunk yet
            return
        yield kind, data[start : start + length]
        offset = start + length


def read_wandb_records(path: str | Path) -> Iterator[Any]:
    """Every ``Record`` protobuf in a ``run-*.wandb`` file, in write order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _HEADER:
        return
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER])
    if ident != b":W&B" or magic != 0xBEE1:
        raise ValueError(f"{path} is not a W&B transaction log (header {ident!r}, magic {magic:#x})")
    pending = b""
    for kind, chunk in _chunks(data):
        if kind == _FULL:
            payload = chunk
        elif kind == _FIRST:
            pending = chunk
            continue
        elif kind == _MIDDLE:
            pending += chunk
            continue
        elif kind == _LAST:
            payload, pending = pending + chunk, b""
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} (version {version})")
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        record.ParseFromString(payload)
        yield record


@dataclass
class WandbRunFile:
    """History rows, metric definitions, alerts, summary and config of one offline run."""

    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    #: The file ends with the run's exit record (wandb finished writing it).
    complete: bool = False

    @classmethod
    def read(cls, path: str | Path, timeout: float = 60.0) -> WandbRunFile:
        """Parse ``path``: a ``run-*.wandb`` file, or a run folder holding one.

        Waits up to ``timeout`` seconds for the file to be complete (its exit record written) and
        raises ``TimeoutError`` naming the file if it is not; ``timeout=0`` reads what is there now.
        """
        deadline = time.monotonic() + timeout
        delay = 0.02
        while True:
            found = _run_file(Path(path))
            out = cls._parse(found) if found is not None else None
            if out is not None and (out.complete or timeout <= 0):
                return out
            if time.monotonic() >= deadline:
                if found is None:
                    raise FileNotFoundError(f"no run-*.wandb file under {path} (waited {timeout:g}s)")
                raise TimeoutError(
                    f"{found}: no exit record after {timeout:g}s: W&B is still writing this run, or its process "
                    "died before finishing it (read it as it is with WandbRunFile.read(path, timeout=0))"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    @classmethod
    def _parse(cls, path: Path) -> WandbRunFile:
        out = cls()
        for record in read_wandb_records(path):
            which = record.WhichOneof("record_type")
            if which == "exit":
                out.complete = True
            if which == "history":
                out.history.append({_key(item): json.loads(item.value_json) for item in record.history.item})
            elif which == "metric":
                m = record.metric
                out.metrics[m.name or m.glob_name] = {
                    "glob": bool(m.glob_name),
                    "step_metric": m.step_metric,
                    "summary": [
                        name for name in ("min", "max", "mean", "last", "best") if getattr(m.summary, name, False)
                    ],
                }
            elif which == "alert":
                a = record.alert
                out.alerts.append(
                    {"title": a.title, "text": a.text, "level": a.level, "wait_duration": a.wait_duration}
                )
            elif which == "summary":
                for item in record.summary.update:
                    out.summary[_key(item)] = json.loads(item.value_json)
            elif which == "config":
                for item in record.config.update:
                    out.config[_key(item)] = json.loads(item.value_json)
        return out


def _run_file(path: Path) -> Path | None:
    """``path`` itself, or the newest ``run-*.wandb`` in a run folder (or one level below); None if absent."""
    if path.is_dir():
        files = sorted(path.glob("run-*.wandb")) or sorted(path.glob("*/run-*.wandb"))
        return files[-1] if files else None
    return path if path.exists() else None


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)
