"""The sink protocol: anything with ``log_metrics(metrics, step)`` receives stabilitykit's metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable


@runtime_checkable
class Sink(Protocol):
    """Receives host-side metrics once per logging step.

    Optional methods, called when present: ``log_event(event)`` and ``close()``. A Lightning
    logger has exactly this shape, so it can be used as a sink directly.
    """

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Record one logging step's metrics."""
