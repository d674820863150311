"""Explicit reductions for torch.distributed: sharded grad norms and rank-consistent skip flags.

Plain functions, each saying what it reduces and over which group:

* DDP grads are already identical on every rank after backward, so their norms need no reduction.
* FSDP2 (``fully_shard``) grads are DTensors sharded over a mesh; FSDP1 (``FullyShardedDataParallel``)
  grads are shards of flat parameters (``FULL_SHARD``, ``SHARD_GRAD_OP``) or full copies
  (``NO_SHARD``). Each rank sums the p-th powers of its local shards per layer and ONE all-reduce
  of that packed vector (SUM, or MAX for inf) gives the global per-layer sums. Replicated grads
  in the same model (NO_SHARD submodules, parameters left out of ``fully_shard``) enter that sum
  divided by the world size, so the one all-reduce counts them once. ``.item()`` of a partial
  DTensor is never used.
* A rank with no grads still joins the all-reduce with zeros, so nothing hangs.
* The skip flag is MAX-all-reduced so every rank takes the same decision.
"""

from __future__ import annotations

import math
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


def _dtensor_sharded(p: Tensor) -> bool | None:
    """True/False for a DTensor with/without a Shard placement; None for a plain tensor."""
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(p, dtensor):
        return None
    from torch.distributed.tensor import Shard

    return any(isinstance(pl, Shard) for pl in p.placements)  # type: ignore[attr-defined]


def fsdp1_sharded_ids(model: Any | None) -> tuple[set[int], set[int]]:
    """ids of parameters FSDP1 shards, and of those it keeps whole (NO_SHARD), under ``model``.

    Flat parameters and, with ``use_orig_params=True``, the original parameters they hold.
    """
    sharded: set[int] = set()
    whole: set[int] = set()
    if model is None:
        return sharded, whole
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return sharded, whole
    for module in model.modules():
        if not isinstance(module, FullyShardedDataParallel):
            continue
        handle = getattr(module, "_handle", None)
        if handle is None:
            continue
        target = sharded if handle.uses_sharded_strategy else whole
        flat = handle.flat_param
        target.add(id(flat))
        for p in getattr(flat, "_params", None) or []:
            target.add(id(p))
    return sharded, whole


def shard_flags(params: Sequence[Tensor], model: Any | None = None) -> list[bool]:
    """Per parameter: True when each rank holds only a shard of its grad (so norms need a sum)."""
    sharded_ids, _ = fsdp1_sharded_ids(model)
    flags = []
    for p in params:
        kind = _dtensor_sharded(p)
        flags.append(bool(kind) if kind is not None else id(p) in sharded_ids)
    return flags


def _group_of(params: Sequence[Tensor]) -> Any | None:
    """The process group of the DTensor mesh (its first dimension), or the default group."""
    dtensor = _dtensor_type()
    for p in params:
        if dtensor is not None and isinstance(p, dtensor):
            mesh = p.device_mesh  # type: ignore[attr-defined]
            return mesh.get_group() if mesh.ndim == 1 else mesh.get_group(0)
    return None


def reducer_for(params: Sequence[Tensor], model: Any | None = None) -> Any | None:
    """A function that all-reduces per-layer p-th-power sums in place, when any grad is sharded.

    None on one process, under DDP, and wherever every grad is whole on every rank.
    """
    if not is_distributed():
        return None
    flags = shard_flags(params, model)
    if not any(flags):
        return None
    group = _group_of([p for p, f in zip(params, flags, strict=True) if f])

    def reduce_layer_sums(sums: Tensor, norm_type: float) -> None:
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(sums, op=op, group=group)

    reduce_layer_sums.shard_flags = flags  # type: ignore[attr-defined]
    reduce_layer_sums.world = dist.get_world_size(group)  # type: ignore[attr-defined]
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
