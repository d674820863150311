"""The judged steps of a rerun: one JSON line per verdict, beside the run, read back by a resumed run.

A line: ``{"step", "batch", "verdict", "rank", "host", "reasons"}``. ``batch`` is the batch index the
driver knows (the step, in a loop that trains on one batch per step). Steps judged
``reproducible`` are the known-bad batches a resumed run skips (as Megatron-LM's
``iterations_to_skip``); ``transient`` lines name the rank and host that computed a wrong result.
Only rank 0 writes; every rank reads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


class RerunRecord:
    """The verdicts of a run (and of the runs before it with the same file)."""

    def __init__(self, path: str | None, writer: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self.writer = writer
        self.entries: list[dict[str, Any]] = []
        if self.path is not None and self.path.is_file():
            for number, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash: the rest is still good
                    warnings.warn(
                        f"stabilitykit: {self.path}:{number} is not JSON; ignored", RuntimeWarning, stacklevel=2
                    )
                    continue
                if isinstance(entry, dict):
                    self.entries.append(entry)
        #: Steps judged reproducible (known-bad batches): skipped when a run reaches them.
        self.bad_steps = {int(e["step"]) for e in self.entries if e.get("verdict") == "reproducible" and "step" in e}

    def add(self, entry: dict[str, Any]) -> None:
        """Keep ``entry`` and append it to the file (rank 0; a failing write only warns)."""
        self.entries.append(entry)
        if entry.get("verdict") == "reproducible":
            self.bad_steps.add(int(entry["step"]))
        if self.path is None or not self.writer:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            warnings.warn(
                f"stabilitykit: could not write the rerun record {self.path}: {exc}", RuntimeWarning, stacklevel=3
            )
