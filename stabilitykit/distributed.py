"""Explicit reductions for torch.distributed, derived from where each grad actually lives.

For every parameter we work out the process groups that hold *distinct shards* of its grad
(those must be summed over; MAX for the inf-norm) and ignore the ones that hold *replicas*
(identical copies, counted once by not reducing over them):

* a plain tensor (DDP, a module left out of sharding): whole on every rank, nothing to reduce;
* FSDP1 (``FullyShardedDataParallel``): a sharded handle (``FULL_SHARD``, ``SHARD_GRAD_OP``,
  ``HYBRID_SHARD``, ``_HYBRID_SHARD_ZERO2``) holds shards over its handle's process group, which
  for the hybrid strategies is the intra-node *shard* group (the replicas across nodes are
  already all-reduced); ``NO_SHARD`` holds whole copies;
* a DTensor (FSDP2 ``fully_shard``, HSDP meshes, tensor parallel, 2-D): each mesh dimension
  whose placement is ``Shard``/``_StridedShard`` adds that dimension's group; ``Replicate`` adds
  nothing; a ``Partial`` grad is first redistributed to the parameter's placements.

Parameters with the same tuple of groups share one row of a packed matrix (per-layer sums of
p-th powers and per-layer non-finite counts). Each distinct group is all-reduced ONCE per step
with the rows that need it (a row over two mesh dimensions is reduced over one, then the other:
the grid's sum). Finiteness never rides on the values: counts of non-finite per-tensor norms
travel in the same tensors, and a world-wide count (folded into a world-sized reduction when
there is one, else one more all-reduce of a single number) makes the flag identical on every
rank, whatever a backend's MAX does with NaN. Pipeline stages cannot be seen from the model: pass ``extra_group`` (the
pipeline group) and the stage totals are summed over it, as torchtitan does.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from stabilitykit.compat.private import fsdp1_flat_handle, fsdp1_original_params, is_fsdp1_flattened

# --------------------------------------------------------------------------- the one place collectives run

#: Set to 1 to record every collective stabilitykit runs, per rank (``recorded_collectives()``).
RECORD_COLLECTIVES_ENV = "STABILITYKIT_RECORD_COLLECTIVES"
_RECORDING = os.environ.get(RECORD_COLLECTIVES_ENV, "") not in ("", "0")
_recorded: list[str] = []
_step_label: int | None = None


def mark_collective_step(step: int) -> None:
    """Label the collectives that follow with the optimizer step the engine is deciding."""
    global _step_label
    _step_label = step


def recorded_collectives() -> list[str]:
    """This rank's collectives since the last clear, in order, one line each:
    ``"<step> all_reduce <op> <dtype>[<numel>] ranks=<ranks>"``. Empty unless
    ``STABILITYKIT_RECORD_COLLECTIVES=1`` was set before stabilitykit was imported.

    Every rank must hold the same list: tests compare them across ranks.
    """
    return list(_recorded)


def clear_recorded_collectives() -> None:
    """Forget what ``recorded_collectives`` holds."""
    _recorded.clear()


def all_reduce(tensor: Tensor, op: Any, group: Any | None = None) -> None:
    """``dist.all_reduce`` in place: every collective of stabilitykit's step goes through here.

    Callers run it unconditionally on every rank of ``group``; whether extra work follows is decided
    from its result (already agreed), never from a value one rank holds alone.
    """
    if _RECORDING:
        ranks = "world" if group is None or group is dist.group.WORLD else f"group of {len(_ranks(group))}"
        name = str(op).rsplit(".", 1)[-1]
        _recorded.append(f"{_step_label} all_reduce {name} {str(tensor.dtype)[6:]}[{tensor.numel()}] ranks={ranks}")
    dist.all_reduce(tensor, op=op, group=group)


def all_gather(tensor: Tensor, group: Any | None = None) -> Tensor:
    """Every rank's ``tensor`` stacked in rank order (``dist.all_gather``; recorded like ``all_reduce``)."""
    if _RECORDING:
        ranks = "world" if group is None or group is dist.group.WORLD else f"group of {len(_ranks(group))}"
        _recorded.append(f"{_step_label} all_gather {str(tensor.dtype)[6:]}[{tensor.numel()}] ranks={ranks}")
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.stack(parts)


def all_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` in rank order (one ``all_gather_object``; call it on every rank); ``[obj]`` alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def own_entry(entries: Sequence[Any]) -> Any:
    """This rank's entry of a list ``all_objects`` made (the first when the world that made it was smaller)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return entries[rank] if rank < len(entries) else entries[0]


def is_distributed() -> bool:
    """True when a default process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks in the default group (1 without torch.distributed)."""
    return dist.get_world_size() if is_distributed() else 1


try:  # resolved once: asked per tensor on a snapshot's copy and a rollback's restore
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - very old torch
    _DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return _DTensor is not None and isinstance(tensor, _DTensor)


def to_local(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (a view sharing storage), or the tensor itself."""
    if _DTensor is not None and isinstance(tensor, _DTensor):
        return tensor.to_local()  # type: ignore[attr-defined,no-any-return]
    return tensor


def local_for_norm(grad: Tensor, param: Tensor) -> Tensor:
    """The local tensor whose norm counts for ``param``'s grad.

    A DTensor grad whose placements differ from its parameter's (a ``Partial`` grad, say) is
    redistributed to the parameter's placements first: the norm of a partial sum is not the
    sum of the partial norms. This costs a collective for that grad only, and is rare.
    """
    if not is_dtensor(grad):
        return grad
    if is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):  # type: ignore[attr-defined]
        grad = grad.redistribute(grad.device_mesh, param.placements)  # type: ignore[attr-defined]
    return grad.to_local()  # type: ignore[attr-defined,no-any-return]


# --------------------------------------------------------------------------- layout discovery


def _fsdp1_groups(model: Any | None) -> dict[int, tuple[Any, ...]]:
    """id of every FSDP1-managed parameter under ``model`` -> the groups that hold its shards.

    Flat parameters and, with ``use_orig_params=True``, the original parameters they hold.
    """
    out: dict[int, tuple[Any, ...]] = {}
    if model is None:
        return out
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return out
    for module in model.modules():
        if not isinstance(module, FullyShardedDataParallel):
            continue
        handle = fsdp1_flat_handle(module)
        if handle is None:
            continue
        groups = (handle.process_group,) if handle.uses_sharded_strategy else ()
        flat = handle.flat_param
        out[id(flat)] = groups
        for p in fsdp1_original_params(flat):
            out[id(p)] = groups
    return out


def _dtensor_groups(p: Tensor) -> tuple[Any, ...]:
    """The mesh groups over which a DTensor holds distinct shards (Replicate/Partial dims add none)."""
    mesh = p.device_mesh  # type: ignore[attr-defined]
    groups = []
    for dim, placement in enumerate(p.placements):  # type: ignore[attr-defined]
        if placement.is_replicate() or placement.is_partial():
            continue
        groups.append(mesh.get_group(dim))  # Shard, _StridedShard and any other sharded placement
    return tuple(groups)


def _is_fsdp1_flattened(p: Tensor) -> bool:
    return is_fsdp1_flattened(p)


#: An attribute a driver sets on a tensor whose grad is this rank's shard over those process groups
#: (a tuple): DeepSpeed ZeRO's partitions, which carry no DTensor or FSDP layout of their own.
SHARD_GROUPS_ATTR = "_stabilitykit_shard_groups"


def reduce_groups_for(params: Sequence[Tensor], model: Any | None = None) -> list[tuple[Any, ...]]:
    """Per parameter: the process groups holding distinct shards of its grad (empty: whole here).

    Raises ``ValueError`` for an FSDP1-managed parameter when ``model`` does not contain its
    FSDP module: its shards cannot be told from the tensor alone, and a local norm would be wrong.
    """
    fsdp1 = _fsdp1_groups(model)
    out: list[tuple[Any, ...]] = []
    for i, p in enumerate(params):
        declared = getattr(p, SHARD_GROUPS_ATTR, None)  # a driver's partition (DeepSpeed ZeRO)
        if declared is not None:
            out.append(tuple(declared))
        elif is_dtensor(p):
            out.append(_dtensor_groups(p))
        elif id(p) in fsdp1:
            out.append(fsdp1[id(p)])
        elif _is_fsdp1_flattened(p):
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) is managed by FSDP1 (FullyShardedDataParallel) but "
                "its FSDP module was not given, so its shards cannot be reduced correctly; pass the wrapped "
                "module: sk.clip_grad_norm_(fsdp_model, ...) or sk.clip_grad_norm_(params, ..., model=fsdp_model)"
            )
        else:
            out.append(())
    return out


# --------------------------------------------------------------------------- the reducer


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


@dataclass
class LayoutReducer:
    """Reduces a plan's packed matrix across the groups its parameters' layout names.

    ``row_of[i]``: the row of parameter ``i`` (one row per distinct tuple of groups);
    ``groups``: the distinct groups, in first-seen order (the same on every rank);
    ``rows_of_group[g]``: the rows reduced over ``groups[g]``; the last row (index ``n_rows``)
    is the world-wide non-finite count row. ``extra_group``: summed over last (pipeline stages).
    """

    row_of: list[int]
    n_rows: int
    groups: list[Any]
    rows_of_group: list[list[int]]
    extra_group: Any | None = None
    #: the world count row rides in a world-sized reduction of the rows (per-layer flags global)
    world_row_folded: bool = False
    _index: dict[tuple[int, str], Tensor] = field(default_factory=dict)

    @property
    def separate_world_count(self) -> bool:
        """The non-finite count needs its own world all-reduce (one int, layer lists may differ by rank)."""
        return not self.world_row_folded and self.extra_group is not dist.group.WORLD

    @property
    def collectives_per_step(self) -> int:
        """All-reduces one ``compute()`` makes (without any Partial-grad redistribution)."""
        return len(self.groups) + (self.extra_group is not None) + self.separate_world_count

    def _rows_index(self, g: int, device: torch.device) -> Tensor:
        key = (g, str(device))
        index = self._index.get(key)
        if index is None:
            index = torch.tensor(self.rows_of_group[g], dtype=torch.long, device=device)
            self._index[key] = index
        return index

    def reduce_rows(self, packed: Tensor, norm_type: float) -> None:
        """All-reduce ``packed`` (rows x ...) in place: each group once, with the rows that need it."""
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        total_rows = self.n_rows + 1
        for g, group in enumerate(self.groups):
            rows = self.rows_of_group[g]
            if len(rows) == total_rows:
                all_reduce(packed, op, group)
                continue
            index = self._rows_index(g, packed.device)
            part = packed.index_select(0, index)
            all_reduce(part, op, group)
            packed.index_copy_(0, index, part)

    def reduce_total(self, pair: Tensor, norm_type: float) -> None:
        """Make ``[stage total, non-finite count]`` global in place: the count over the world (unless
        already), then both over ``extra_group`` (pipeline stages). A count stays > 0 under SUM or MAX."""
        if self.separate_world_count:
            count = pair[1:].clone()
            all_reduce(count, dist.ReduceOp.MAX)
            pair[1:] = count
        if self.extra_group is not None:
            op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
            all_reduce(pair, op, self.extra_group)


def reducer_for(
    params: Sequence[Tensor],
    model: Any | None = None,
    extra_group: Any | None = None,
) -> LayoutReducer | None:
    """The reductions a plan over ``params`` needs, or None when every grad is whole everywhere.

    None on one process and under plain DDP (grads identical on every rank; the step record's one
    all-reduce makes the skip decision global there). ``extra_group``: a group to sum
    the totals over as well (pipeline stages: each stage holds different layers).
    """
    if not is_distributed():
        return None
    keys = reduce_groups_for(params, model)
    if extra_group is None and not any(keys):
        return None
    world = dist.get_world_size()
    canonical: dict[tuple[int, ...], Any] = {}

    def canon(group: Any) -> Any | None:
        ranks = _ranks(group)
        if len(ranks) <= 1:
            return None
        if len(ranks) == world:
            ranks = tuple(range(world))
            return canonical.setdefault(ranks, dist.group.WORLD)
        return canonical.setdefault(ranks, group)

    row_keys: dict[tuple[int, ...], int] = {}
    groups: list[Any] = []
    group_index: dict[int, int] = {}
    row_of: list[int] = []
    row_groups: list[list[int]] = []
    for key in keys:
        idx: list[int] = []
        for group in key:
            c = canon(group)
            if c is None:
                continue
            if id(c) not in group_index:
                group_index[id(c)] = len(groups)
                groups.append(c)
            if group_index[id(c)] not in idx:
                idx.append(group_index[id(c)])
        ident = tuple(idx)
        if ident not in row_keys:
            row_keys[ident] = len(row_groups)
            row_groups.append(idx)
        row_of.append(row_keys[ident])
    n_rows = len(row_groups)
    rows_of_group = [[r for r, gs in enumerate(row_groups) if g in gs] for g in range(len(groups))]
    extra = canon(extra_group) if extra_group is not None else None
    # the world-wide non-finite count row joins a world-sized reduction of the rows when there is
    # one (every rank then has the same layers); otherwise it is one separate int (reduce_total)
    world_group = canonical.get(tuple(range(world)))
    folded = world_group is not None and world_group in groups
    if folded:
        rows_of_group[groups.index(world_group)].append(n_rows)
    return LayoutReducer(row_of, n_rows, groups, rows_of_group, extra, world_row_folded=folded)
