"""Replica consistency: every N steps, check that data-parallel replicas still hold the same weights.

A bit flip in one device's parameter or optimizer state leaves a finite, silently different replica:
no NaN check sees it, and DDP averages gradients over it from then on. Every ``every_n_steps`` steps
each rank fingerprints what must be equal across replicas, on the device: one integer per tensor,
the wrap-around sum of the tensor's bit patterns (any single flipped bit changes it), for every
parameter and every optimizer state tensor. One small all-gather per replica group puts every
replica's fingerprints side by side; the replica that differs from the majority (with two, the
second) is named with the first tensor that differs, by its clean name, in a ``replica_mismatch``
event. The check step reads one small tensor (one host sync); other steps cost nothing.

What must be equal: a plain tensor (DDP, a module outside any sharding) is whole on every rank, so
it is compared across the world; a DTensor (FSDP2, HSDP, tensor parallel) is compared across its
first ``Replicate`` mesh dimension (HSDP's replicate dimension), shard against the same shard; a
tensor sharded with no replicated dimension (FSDP2 over one mesh dimension, FSDP1, DeepSpeed ZeRO
partitions) has nothing to compare and is left out. Which groups run is decided from the layout,
so every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor, nn

from stabilitykit.distributed import all_gather, is_distributed, is_dtensor, reduce_groups_for, to_local
from stabilitykit.events import Event, ReplicaMismatchError
from stabilitykit.hooks import HookManager
from stabilitykit.section import Section

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaCheckConfig(Section):
    """Check every N steps that data-parallel replicas hold the same parameters and optimizer state."""

    every_n_steps: int = Field(
        100,
        ge=1,
        description=(
            "Optimizer steps between checks (after the step whose number + 1 is a multiple of it). A check "
            "fingerprints every parameter and optimizer state tensor on the device and all-gathers the "
            "fingerprints once per replica group (one host sync on that step; none on the others)."
        ),
    )
    optimizer_state: bool = Field(True, description="Compare the optimizer's state tensors too (Adam's moments).")
    on_mismatch: Literal["warn", "raise"] = Field(
        "warn",
        description=(
            "'warn': a replica_mismatch event and a warning, training goes on (restore a checkpoint or "
            "broadcast from a healthy replica); 'raise': ReplicaMismatchError after the event."
        ),
    )


def fingerprint(tensor: Tensor) -> Tensor:
    """A 0-d int64 device tensor: the wrap-around sum of ``tensor``'s bit patterns (no host sync).

    Any single flipped bit changes it; equal tensors give equal fingerprints on every device.
    """
    local = to_local(tensor).detach()
    if local.is_complex():
        local = torch.view_as_real(local)
    if local.dtype == torch.bool:
        local = local.to(torch.uint8)
    if local.is_floating_point():
        local = local.view(_INT_VIEW[local.element_size()])
    return local.sum(dtype=torch.int64)


@dataclass
class _Group:
    """Tensors compared across one process group (None: the world)."""

    group: Any
    names: list[str]
    tensors: list[Tensor]

    def ranks(self) -> list[int]:
        if self.group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self.group))


def _replicate_group(tensor: Tensor) -> Any | None:
    """The group over which a DTensor's local piece must be equal: its first Replicate mesh dimension."""
    for dim, placement in enumerate(tensor.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            return tensor.device_mesh.get_group(dim)  # type: ignore[attr-defined]
    return None


class ReplicaCheck:
    """One optimizer's replica check (``ReplicaCheckConfig``): fingerprints, the gather, the event."""

    def __init__(
        self,
        config: ReplicaCheckConfig,
        params: Sequence[Tensor],
        names: Sequence[str],
        optimizer: Any,
        model: nn.Module | None,
        hooks: HookManager,
    ) -> None:
        self.config = config
        self.params = list(params)
        self.names = list(names)
        self.optimizer = optimizer
        self.model = model
        self.hooks = hooks
        #: Mismatches found so far (one per replica named).
        self.mismatches: list[Event] = []
        self.enabled = is_distributed()
        self._groups: list[_Group] | None = None

    def due(self, step: int) -> bool:
        """A check runs after ``step`` (the same answer on every rank)."""
        return self.enabled and (step + 1) % self.config.every_n_steps == 0

    def _layout(self) -> list[_Group]:
        """The tensors to compare, grouped by the process group they must be equal over, in a fixed order.

        Built at the first check (optimizer state exists by then), from the layout only."""
        shard_groups = reduce_groups_for(self.params, self.model)
        groups: dict[Any, _Group] = {}
        for name, param, sharded in zip(self.names, self.params, shard_groups, strict=True):
            if is_dtensor(param):
                group = _replicate_group(param)
                if group is None:
                    continue
            elif sharded:
                continue  # FSDP1 or ZeRO shards: no replica to compare with
            else:
                group = None  # whole on every rank: the world
            entry = groups.setdefault(group, _Group(group, [], []))
            entry.names.append(name)
            entry.tensors.append(param)
            if self.config.optimizer_state:
                state = self.optimizer.state.get(param, {})
                for key in sorted(state):
                    value = state[key]
                    if isinstance(value, Tensor):  # a DTensor param's state is laid out as the param
                        entry.names.append(f"{name}:{key}")
                        entry.tensors.append(value)
        return list(groups.values())  # first-seen order: the parameters' order, the same on every rank

    def check(self, step: int) -> list[Event]:
        """Compare replicas now (after ``step``); returns the events of the replicas that differ."""
        if self._groups is None:
            self._groups = self._layout()
        results: list[Tensor] = []
        for entry in self._groups:
            prints = torch.stack([fingerprint(t) for t in entry.tensors])
            table = all_gather(prints, entry.group)  # (replicas, tensors)
            results.append(_first_differing(table))
        if not results:
            return []
        flat = torch.cat(results).tolist()  # the one host read of a check step
        events: list[Event] = []
        offset = 0
        for entry in self._groups:
            ranks = entry.ranks()
            for i, column in enumerate(flat[offset : offset + len(ranks)]):
                if column >= 0:
                    tensor = entry.names[int(column)]
                    rank = ranks[i]
                    events.append(
                        Event(
                            "replica_mismatch",
                            step,
                            f"rank {rank} holds another {tensor} than its replicas (ranks {ranks}) after step "
                            f"{step}: a silent corruption on that device",
                            {"rank": rank, "tensor": tensor, "replicas": ranks},
                        )
                    )
            offset += len(ranks)
        for event in events:
            self.mismatches.append(event)
            self.hooks.emit(event)
            warnings.warn(f"stabilitykit: {event.message}", RuntimeWarning, stacklevel=3)
        if events and self.config.on_mismatch == "raise":
            raise ReplicaMismatchError(events[0].step, events[0].details["rank"], events[0].details["tensor"])
        return events


def _first_differing(table: Tensor) -> Tensor:
    """Per replica (row), the first column where it differs from the majority row, or -1 (on the device).

    The majority row is the one equal to the most rows (the first such on a tie: with two replicas
    that differ, the second is named)."""
    same = (table[:, None, :] == table[None, :, :]).all(dim=-1)  # (replicas, replicas)
    majority = same.sum(dim=1).argmax()
    differs = table != table[majority]
    first = differs.int().argmax(dim=1)
    return torch.where(differs.any(dim=1), first, torch.full_like(first, -1))
