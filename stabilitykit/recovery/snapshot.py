"""What a snapshot holds, how it is taken, and how it is put back in place.

A snapshot is the training state at the end of one optimizer step: parameters, buffers, the
optimizer's per-parameter state and param-group settings (the learning rate a scheduler set),
each LR scheduler's ``state_dict()``, the GradScaler's scale and growth tracker, the guard's own
state (``StabilityEngine.state_dict()``) and the random generators. Tensors are host copies
(``host_copy.py``: no host sync when taken).

Restoring copies into the tensors that exist (``Tensor.copy_``): the parameters, buffers and
optimizer state tensors keep their identity, so the optimizer's references, fused kernels and
anything holding a parameter keep working, and the values equal the snapshot bitwise. A DTensor
(FSDP2, tensor parallel) is saved and restored as this rank's local shard: every rank restores its
own part, with no collective. Optimizer
state a parameter did not have at the snapshot is removed; state it had and lost is recreated on
the parameter's device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.recovery.host_copy import HostCopier, HostTree, Saved, map_saved
from stabilitykit.recovery.rng import capture_rng, restore_rng
from stabilitykit.scaler import ScalerAdapter

__all__ = ["Snapshot", "TrainingObjects", "restore_snapshot", "take_snapshot"]


@dataclass
class TrainingObjects:
    """What snapshots cover, handed over once by the driver core."""

    params: list[Tensor]  # the model's parameters, then any the optimizer holds that the model does not
    buffers: list[Tensor]
    optimizer: Any
    optimizer_params: list[Tensor]  # the optimizer's parameters in param-group order (its state's keys)
    scaler: ScalerAdapter
    guard_state: Callable[[], dict[str, Any]]
    schedulers: list[Any] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        model: nn.Module | None,
        optimizer: Any,
        optimizer_params: Sequence[Tensor],
        scaler: ScalerAdapter,
        guard_state: Callable[[], dict[str, Any]],
    ) -> TrainingObjects:
        """Every parameter and buffer of ``model`` plus the optimizer's parameters, each once."""
        params: list[Tensor] = list(model.parameters()) if model is not None else []
        seen = {id(p) for p in params}
        params.extend(p for p in optimizer_params if id(p) not in seen)
        buffers = [b for b in model.buffers() if b is not None] if model is not None else []
        return cls(params, buffers, optimizer, list(optimizer_params), scaler, guard_state)


@dataclass
class Snapshot:
    """The state before optimizer step ``step`` (after step ``step - 1``).

    ``confirmed``: step ``step - 1`` is known to have been taken (not skipped); only confirmed
    snapshots are restored. ``tree``: the host copy while in memory; ``path``: its file on disk.
    """

    step: int
    tree: HostTree | None
    confirmed: bool
    nbytes: int = 0
    path: Path | None = None


def _optimizer_state(objects: TrainingObjects) -> dict[str, Any]:
    state = objects.optimizer.state
    per_param = [dict(state[p]) if state.get(p) else None for p in objects.optimizer_params]
    groups = [{k: v for k, v in group.items() if k != "params"} for group in objects.optimizer.param_groups]
    return {"state": per_param, "groups": groups}


def take_snapshot(objects: TrainingObjects, copier: HostCopier, step: int, confirmed: bool) -> Snapshot:
    """Copy the training state to the host now (no host sync; on CUDA the copies finish on a side stream)."""
    with torch.no_grad():
        tree = {
            "params": list(objects.params),
            "buffers": list(objects.buffers),
            "optimizer": _optimizer_state(objects),
            "schedulers": [s.state_dict() for s in objects.schedulers],
            "scaler": objects.scaler.state_tensors(),
            "guard": objects.guard_state(),
            "rng": capture_rng(),
        }
        host = copier.copy(tree)
    return Snapshot(step, host, confirmed, host.nbytes)


def _copy_into(target: Any, saved: Saved) -> Any:
    """``saved``'s values in ``target`` when it is a tensor of the same shape and dtype, else a new tensor."""
    if isinstance(target, Tensor) and saved.copy_into(target):
        return target
    return saved.to_device()


def _restore_optimizer(objects: TrainingObjects, saved: dict[str, Any]) -> None:
    state = objects.optimizer.state
    for p, entry in zip(objects.optimizer_params, saved["state"], strict=True):
        if entry is None:
            state.pop(p, None)  # no state at the snapshot: the first step after it creates it again
            continue
        current = state[p]
        for key in [k for k in current if k not in entry]:
            del current[key]
        for key, value in entry.items():
            current[key] = _copy_into(current.get(key), value) if isinstance(value, Saved) else map_saved(value, _new)
    for group, values in zip(objects.optimizer.param_groups, saved["groups"], strict=True):
        for key, value in values.items():
            group[key] = _copy_into(group.get(key), value) if isinstance(value, Saved) else map_saved(value, _new)


def _new(saved: Saved) -> Tensor:
    return saved.to_device()


def restore_snapshot(objects: TrainingObjects, tree: Any, rng: bool) -> dict[str, Any]:
    """Put ``tree`` (a snapshot's host tree) back in place; returns the guard state it held (device tensors).

    The caller restores the guard state (the engine decides what of it comes back).
    """
    n_groups = len(objects.optimizer.param_groups)
    if len(tree["optimizer"]["groups"]) != n_groups or len(tree["params"]) != len(objects.params):
        raise ValueError("the snapshot was taken for another set of parameters or param groups")
    with torch.no_grad():
        for target, saved in zip([*objects.params, *objects.buffers], [*tree["params"], *tree["buffers"]], strict=True):
            if not saved.copy_into(target):
                raise ValueError(f"a snapshot tensor of shape {tuple(saved.data.shape)} does not fit its parameter")
        _restore_optimizer(objects, tree["optimizer"])
        for scheduler, state in zip(objects.schedulers, tree["schedulers"], strict=True):
            scheduler.load_state_dict(map_saved(state, _new))
        if tree["scaler"] is not None:
            objects.scaler.load_state_tensors(map_saved(tree["scaler"], _new))
    if rng:
        restore_rng(map_saved(tree["rng"], lambda s: s.data.clone()))
    guard: dict[str, Any] = map_saved(tree["guard"], _new)
    return guard
