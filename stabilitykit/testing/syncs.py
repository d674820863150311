"""Counting device-to-host syncs: ``with count_host_syncs() as c: ...; c.count``.

Two nets catch a sync: a TorchDispatchMode that sees every ``aten._local_scalar_dense`` (what
``.item()``, ``bool(t)`` and ``float(t)`` lower to), and patches of ``Tensor.item``, ``tolist``,
``__bool__``, ``__float__``, ``__int__`` and ``numpy`` (``tolist`` of a CPU tensor never reaches the
dispatcher). A sync seen by both nets counts once.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_host_syncs"]

_PATCHED = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")


@dataclass
class SyncCounter:
    """Host syncs seen so far, with a short stack for each (to find who synced)."""

    count: int = 0
    sites: list[str] = field(default_factory=list)
    _depth: int = 0

    def _hit(self, what: str) -> None:
        self.count += 1
        frames = [f for f in traceback.extract_stack(limit=12) if "syncs.py" not in f.filename]
        where = frames[-1] if frames else None
        self.sites.append(f"{what} at {where.filename}:{where.lineno}" if where else what)


class _Mode(TorchDispatchMode):
    def __init__(self, counter: SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and self.counter._depth == 0:
            self.counter._hit("aten._local_scalar_dense")
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_syncs() -> Iterator[SyncCounter]:
    """Count host syncs made inside the block (see the module docstring for what counts)."""
    counter = SyncCounter()
    originals = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def wrap(name: str, original: Any) -> Any:
        def patched(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if counter._depth == 0:
                counter._hit(f"Tensor.{name}")
            counter._depth += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                counter._depth -= 1

        return patched

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        with _Mode(counter):
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
