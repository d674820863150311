"""Explicit reductions for torch.distributed: sharded grad norms and rank-consistent skip flags.

Plain functions, each saying what it reduces and over which group:

* DDP grads are already identical on every rank after backward, so their norms need no reduction.
* FSDP2 (``fully_shard``) grads are DTensors sharded over a mesh: each rank sums the p-th powers of
  its local shards per layer and ONE all-reduce of that packed vector (SUM, or MAX for inf) gives
  the global per-layer sums. ``.item()`` of a partial DTensor is never used.
* The skip flag is MAX-all-reduced so every rank takes the same decision.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_ranks_agree",
    "is_distributed",
    "reducer_for",
    "to_local",
    "world_size",
]


def is_distributed() -> bool:
    """True when a default process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks in the default group (1 without torch.distributed)."""
    return dist.get_world_size() if is_distributed() else 1


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - very old torch
        return None
    return DTensor


def to_local(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (a view sharing storage), or the tensor itself."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        return tensor.to_local()  # type: ignore[attr-defined,no-any-return]
    return tensor


def _shard_group(params: Sequence[Tensor]) -> Any | None:
    """The process group over which DTensor params are sharded (None when nothing is sharded)."""
    dtensor = _dtensor_type()
    if dtensor is None:
        return None
    for p in params:
        if isinstance(p, dtensor):
            from torch.distributed.tensor import Shard

            if any(isinstance(pl, Shard) for pl in p.placements):  # type: ignore[attr-defined]
                mesh = p.device_mesh  # type: ignore[attr-defined]
                return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(0)
    return None


def reducer_for(params: Sequence[Tensor]) -> Any | None:
    """A function that all-reduces per-layer p-th-power sums in place, when grads are sharded."""
    group = _shard_group(params)
    if group is None:
        return None

    def reduce_layer_sums(sums: Tensor, norm_type: float) -> None:
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(sums, op=op, group=group)

    return reduce_layer_sums


def all_ranks_agree(flag: Tensor) -> Tensor:
    """MAX-all-reduce a 0-d bool flag so every rank sees True if any rank does (no host sync)."""
    if not is_distributed():
        return flag
    as_int = flag.to(torch.int32).reshape(1)
    if dist.get_backend() == "nccl" and as_int.device.type != "cuda":  # pragma: no cover - GPU only
        as_int = as_int.cuda()
    dist.all_reduce(as_int, op=dist.ReduceOp.MAX)
    return as_int.to(flag.device).reshape(()).bool()


def warn_no_grads(rank: int) -> None:
    """One warning when a rank has no grads at all: it contributes zero to the global norm."""
    warnings.warn(
        f"stabilitykit: rank {rank} has no parameters with gradients; it contributes 0 to the norm",
        stacklevel=3,
    )
