"""Counting the device ops a block asks for: ``with count_device_ops() as c: ...; c.ops``.

Every ATen op dispatched inside the block counts once (what the device is asked to do), so a test
or a benchmark can say "the monitor adds no op to a forward" without timing anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DeviceOpCounter", "count_device_ops"]


class DeviceOpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched while it is the active dispatch mode (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_device_ops() -> Iterator[DeviceOpCounter]:
    """Count the ATen ops dispatched inside the block."""
    with DeviceOpCounter() as counter:
        yield counter
