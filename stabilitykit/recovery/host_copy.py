"""Copying nested training state into host memory and back, without a host sync on the step path.

A snapshot is a tree (dicts, lists, tuples) of tensors and plain values. ``HostCopier.copy`` puts a
host copy of every tensor of a tree in place of it (a ``Saved`` leaf that remembers the tensor's
device); plain values are deep-copied. On the CPU a tensor is copied into a host buffer. A CUDA
tensor is copied into a pinned host buffer with ``non_blocking=True`` on a side stream that first
waits for the compute stream; the compute stream then waits for the side stream. Both waits are on
the device, so the host never blocks, and the next step's in-place updates cannot overwrite a
tensor before it has been copied. ``HostTree.wait()`` is the one host sync, paid only when the copy
is read (a restore on the step thread; before a write to disk, on the writer thread).

A DTensor (FSDP2, tensor parallel) is copied as its local shard: each rank keeps its own part and
puts it back into its own part, with no collective; ``Saved.layout`` remembers the DTensor's mesh
and placements so a state that has to be recreated comes back as the same DTensor.

Host buffers of snapshots that are dropped go back to a pool and are reused, so a run that takes
snapshots for 100k steps allocates host memory for ``keep`` (plus pending) snapshots only.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from stabilitykit.distributed import is_dtensor, to_local


@dataclass(frozen=True)
class DTensorLayout:
    """How a DTensor was laid out: enough to rebuild it from its saved local shard."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, tensor: Tensor) -> DTensorLayout:
        """The layout of the DTensor ``tensor``."""
        return cls(tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride())  # type: ignore[attr-defined]

    def __reduce__(self) -> Any:
        """Written to disk without its mesh (a process group cannot be saved): the shard is still restored
        in place into the existing DTensor; only a state that must be recreated needs the mesh."""
        return (DTensorLayout, (None, self.placements, self.shape, self.stride))


@dataclass
class Saved:
    """One tensor's host copy (a DTensor's local shard) and where the tensor lived."""

    data: Tensor
    device: torch.device
    layout: DTensorLayout | None = None  # set when the tensor was a DTensor

    def to_device(self) -> Tensor:
        """A new tensor on the original device holding the saved values (a DTensor again if it was one)."""
        local = self.data.to(self.device, copy=True)
        if self.layout is None:
            return local
        if self.layout.mesh is None:
            raise ValueError("a DTensor state saved to disk cannot be recreated on its own: it has no device mesh")
        from torch.distributed.tensor import DTensor

        layout = self.layout
        return DTensor.from_local(
            local, layout.mesh, layout.placements, run_check=False, shape=layout.shape, stride=layout.stride
        )

    def copy_into(self, target: Tensor) -> bool:
        """Copy the saved values into ``target`` (a DTensor: into its local shard) when shape and dtype match."""
        local = to_local(target)
        if local.shape != self.data.shape or local.dtype != self.data.dtype:
            return False
        local.copy_(self.data)
        return True


@dataclass
class HostTree:
    """A tree whose tensors are ``Saved`` host copies; ``ready`` is None once nothing is in flight."""

    tree: Any
    ready: Any | None = None  # a torch.cuda.Event recorded after the copies, when any ran on a side stream
    nbytes: int = 0

    def wait(self) -> None:
        """Block until every copy has landed in host memory (a host sync on CUDA; nothing on the CPU)."""
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


def saved_tensors(tree: Any) -> Iterator[Saved]:
    """Every ``Saved`` leaf of ``tree``, depth first."""
    if isinstance(tree, Saved):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from saved_tensors(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from saved_tensors(value)


def map_saved(tree: Any, fn: Callable[[Saved], Any]) -> Any:
    """``tree`` with each ``Saved`` leaf replaced by ``fn(leaf)``; plain values are deep-copied."""
    if isinstance(tree, Saved):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: map_saved(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [map_saved(v, fn) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(map_saved(v, fn) for v in tree)
    return copy.deepcopy(tree)


class HostCopier:
    """Makes ``HostTree`` copies; keeps a pool of host buffers and, on CUDA, one side stream per device."""

    def __init__(self) -> None:
        self._pool: dict[tuple[tuple[int, ...], torch.dtype, bool], list[Tensor]] = defaultdict(list)
        self._streams: dict[torch.device, Any] = {}

    @property
    def pooled(self) -> int:
        """Host buffers waiting in the pool for the next snapshot."""
        return sum(len(free) for free in self._pool.values())

    def copy(self, tree: Any) -> HostTree:
        """A host copy of ``tree`` (no host sync: on CUDA the copies run on a side stream)."""
        pending: dict[torch.device, list[tuple[Tensor, Tensor]]] = defaultdict(list)
        nbytes = 0

        def leaf(t: Tensor) -> Saved:
            nonlocal nbytes
            layout = DTensorLayout.of(t) if is_dtensor(t) else None
            src = to_local(t.detach())
            host = self._buffer(src)
            nbytes += host.numel() * host.element_size()
            if src.device.type == "cuda":
                pending[src.device].append((host, src))
            else:
                host.copy_(src)
            return Saved(host, src.device, layout)

        out = _map_tensors(tree, leaf)
        ready = None
        for device, pairs in pending.items():
            ready = self._copy_on_side_stream(device, pairs)
        return HostTree(out, ready, nbytes)

    def _buffer(self, src: Tensor) -> Tensor:
        pinned = src.device.type == "cuda"
        free = self._pool.get((tuple(src.shape), src.dtype, pinned))
        if free:
            return free.pop()
        return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pinned)

    def _copy_on_side_stream(self, device: torch.device, pairs: list[tuple[Tensor, Tensor]]) -> Any:
        """Copy ``(host, device tensor)`` pairs on a side stream, ordered after the work queued so far."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        compute = torch.cuda.current_stream(device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            for host, src in pairs:
                host.copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        compute.wait_stream(stream)  # the next in-place update waits for the copy, on the device
        return ready

    def release(self, tree: HostTree) -> None:
        """Give ``tree``'s host buffers back to the pool once its copies have landed (never waits: buffers
        still being written are left to torch's pinned-memory allocator, which frees them after the copy)."""
        if tree.ready is not None and not tree.ready.query():
            return
        tree.ready = None
        for saved in saved_tensors(tree.tree):
            pinned = saved.data.is_pinned()
            self._pool[(tuple(saved.data.shape), saved.data.dtype, pinned)].append(saved.data)


def _map_tensors(tree: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``tree`` with every tensor replaced by ``fn(tensor)``; other leaves deep-copied."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map_tensors(v, fn) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_map_tensors(v, fn) for v in tree)
    return copy.deepcopy(tree)
