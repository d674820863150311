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
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "count_host_syncs"]

_PATCHED = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")

#: The installed package's own folder. Sites are matched against it, never against a folder name:
#: a checkout named ``stabilitykit`` holds its tests under ``.../stabilitykit/tests/`` too.
PACKAGE_DIR = Path(__file__).resolve().parent.parent
_TESTING_DIR = Path(__file__).resolve().parent


def _site_file(site: str) -> Path | None:
    """The file a site names (``"what at /path/file.py:123"``), or None for a site with no frame."""
    if " at " not in site:
        return None
    where = site.split(" at ", 1)[1]
    return Path(where.rsplit(":", 1)[0])


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

    def library_sites(self) -> list[str]:
        """The sites inside the stabilitykit package itself (its ``testing`` helpers excluded).

        Matched by the package's real location, so a test file or a reference model that lives in
        a folder which happens to be called ``stabilitykit`` is never counted as the library.
        """
        ours = []
        for site in self.sites:
            path = _site_file(site)
            if path is None:
                continue
            resolved = path.resolve()
            if resolved.is_relative_to(PACKAGE_DIR) and not resolved.is_relative_to(_TESTING_DIR):
                ours.append(site)
        return ours


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
