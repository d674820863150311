"""ConsoleSink: a compact line per logging step and one line per event, for terminals and logs."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import IO

from stabilitykit.events import Event

_DEFAULT_KEYS = ("loss", "grad_norm/total", "clip/coef", "skipped/total")


class ConsoleSink:
    """Prints chosen metrics (matched by suffix) every ``every`` logging steps, and every event."""

    def __init__(self, keys: Sequence[str] = _DEFAULT_KEYS, every: int = 1, stream: IO[str] | None = None) -> None:
        self.keys = tuple(keys)
        self.every = max(1, every)
        self.stream = stream
        self._calls = 0

    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stdout

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Print ``step N | key=value ...`` for the configured keys."""
        self._calls += 1
        if (self._calls - 1) % self.every:
            return
        parts = []
        for key in self.keys:
            for name, value in metrics.items():
                if name.endswith(key):
                    parts.append(f"{key}={value:.4g}")
                    break
        print(f"step {step:>6} | " + " ".join(parts), file=self._out())

    def log_event(self, event: Event) -> None:
        """Print the event on one line."""
        print(str(event), file=self._out())
