"""What a snapshot holds, how it is taken, and how it is put back in place.

A snapshot is the training state at the end of one optimizer step: parameters, buffers, the
optimizer's per-parameter state (tensors and Python values), entries of its ``state`` not keyed by a
parameter (MADGRAD's step count), its param-group settings (the learning rate a scheduler set), the
extra top-level keys an optimizer adds to its own ``state_dict()`` (SPAM's ``warmup`` and
``total_step``), each LR scheduler's ``state_dict()`` and that of any other object a driver adds
(DeepSpeed's step counters), the GradScaler's scale and growth tracker, the guard's own state
(``StabilityEngine.state_dict()``) and the random generators. Tensors are host copies
(``host_copy.py``: no host sync when taken).

Restoring copies into the tensors that exist (``Tensor.copy_``): the parameters, buffers and
optimizer state tensors keep their identity, so the optimizer's references, fused kernels and
anything holding a parameter keep working, and the values equal the snapshot bitwise. A DTensor
(FSDP2, tensor parallel) is saved and restored as this rank's local shard: every rank restores its
own part, with no collective. Optimizer
state a parameter did not have at the snapshot is removed; state it had and lost is recreated on
the parameter's device. Extra ``state_dict()`` keys are handed to the optimizer's own
``load_state_dict()`` (the one place that knows what they mean), after which every state tensor
that existed is put back in place, holding what the load left in it.

Nothing is half-restored: the whole snapshot is read (and a file verified) before anything is
touched, and it is checked to fit the parameters, optimizer and schedulers before the first copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.distributed import to_local
from stabilitykit.recovery.host_copy import HostCopier, HostTree, Saved, map_saved
from stabilitykit.recovery.rng import capture_rng, restore_rng


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
    #: Other objects saved and restored through their own ``state_dict()`` / ``load_state_dict()`` (DeepSpeed's
    #: step counters).
    stateful: list[Any] = field(default_factory=list)
    #: Whether the optimizer's ``state_dict()`` adds top-level keys (None: not asked yet).
    extra_keys: bool | None = None

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
    snapshots are restored. ``tree``: the host copy while in memory; ``path``: its file on disk;
    ``checksum``: the file's SHA-256, taken as it was written and checked when it is read.
    ``vetted``: the spike detectors have scored step ``step - 1`` and found it settled (under
    torch.distributed: on every rank, by the health agreed in ``vetting.py``); a snapshot not yet
    vetted does not push an older one out of the ring.
    """

    step: int
    tree: HostTree | None
    confirmed: bool
    nbytes: int = 0
    path: Path | None = None
    checksum: str | None = None
    vetted: bool = True


_OWN_KEYS = ("state", "param_groups")


def _extra_state_dict(objects: TrainingObjects) -> dict[str, Any]:
    """The top-level keys an optimizer's own ``state_dict()`` adds to torch's.

    torch's optimizers are not asked (building a state dict every snapshot costs time for nothing),
    nor is one whose first answer held no extra key, or whose ``state_dict()`` cannot be called on
    its own (``ZeroRedundancyOptimizer`` needs a consolidation first)."""
    optimizer = objects.optimizer
    if objects.extra_keys is False or type(optimizer).state_dict is torch.optim.Optimizer.state_dict:
        return {}
    try:
        extra = {k: v for k, v in optimizer.state_dict().items() if k not in _OWN_KEYS}
    except Exception:
        extra = {}
    objects.extra_keys = bool(extra)
    return extra


def _optimizer_state(objects: TrainingObjects) -> dict[str, Any]:
    optimizer = objects.optimizer
    state = optimizer.state
    per_param = [dict(state[p]) if state.get(p) else None for p in objects.optimizer_params]
    others = {k: v for k, v in state.items() if not isinstance(k, Tensor)}  # not keyed by a parameter
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"state": per_param, "others": others, "groups": groups, "extra": _extra_state_dict(objects)}


def take_snapshot(objects: TrainingObjects, copier: HostCopier, step: int, confirmed: bool) -> Snapshot:
    """Copy the training state to the host now (no host sync; on CUDA the copies finish on a side stream)."""
    with torch.no_grad():
        tree = {
            "params": list(objects.params),
            "buffers": list(objects.buffers),
            "optimizer": _optimizer_state(objects),
            "schedulers": [s.state_dict() for s in objects.schedulers],
            "stateful": [s.state_dict() for s in objects.stateful],
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
    others = saved.get("others", {})
    for key in [k for k in state if not isinstance(k, Tensor) and k not in others]:
        del state[key]
    for key, value in others.items():
        state[key] = _copy_into(state.get(key), value) if isinstance(value, Saved) else map_saved(value, _new)
    for group, values in zip(objects.optimizer.param_groups, saved["groups"], strict=True):
        for key, value in values.items():
            group[key] = _copy_into(group.get(key), value) if isinstance(value, Saved) else map_saved(value, _new)
    if saved.get("extra"):
        _load_extra(objects.optimizer, map_saved(saved["extra"], _new))


def _load_extra(optimizer: Any, extra: dict[str, Any]) -> None:
    """Hand the extra ``state_dict()`` keys to the optimizer's own ``load_state_dict()``, then put back the
    state dicts, param groups and tensors that existed before it (holding what the load left in them)."""
    state, groups = optimizer.state, optimizer.param_groups
    before = {key: dict(entry) if isinstance(entry, dict) else entry for key, entry in state.items()}
    optimizer.load_state_dict({**optimizer.state_dict(), **extra})
    loaded_state, loaded_groups = optimizer.state, optimizer.param_groups
    state.clear()
    for key, entry in loaded_state.items():
        old = before.get(key)
        if isinstance(entry, dict) and old is not None:
            entry = {k: _in_place(old.get(k), v) for k, v in entry.items()}
        else:
            entry = _in_place(old, entry)
        state[key] = entry
    for group, loaded in zip(groups, loaded_groups, strict=True):
        values = {k: _in_place(group.get(k), v) for k, v in loaded.items() if k != "params"}
        for key in [k for k in group if k != "params" and k not in values]:
            del group[key]
        group.update(values)
    optimizer.state, optimizer.param_groups = state, groups


def _in_place(old: Any, new: Any) -> Any:
    """``new``'s values in the tensor ``old`` when it fits (same shape, dtype and device), else ``new``."""
    if (
        isinstance(old, Tensor)
        and isinstance(new, Tensor)
        and old is not new
        and old.shape == new.shape
        and old.dtype == new.dtype
        and old.device == new.device
    ):
        old.copy_(new)
        return old
    return new


def _new(saved: Saved) -> Tensor:
    return saved.to_device()


def _check_fits(objects: TrainingObjects, tree: Any) -> None:
    """Refuse, before anything is copied, a snapshot that does not fit what it would be restored into."""
    if len(tree["optimizer"]["groups"]) != len(objects.optimizer.param_groups) or len(tree["params"]) != len(
        objects.params
    ):
        raise ValueError("the snapshot was taken for another set of parameters or param groups")
    if len(tree["buffers"]) != len(objects.buffers) or len(tree["optimizer"]["state"]) != len(objects.optimizer_params):
        raise ValueError("the snapshot was taken for another set of buffers or optimizer parameters")
    if len(tree["schedulers"]) != len(objects.schedulers):
        raise ValueError(
            f"the snapshot holds {len(tree['schedulers'])} LR scheduler(s), this run has {len(objects.schedulers)}"
        )
    if len(tree.get("stateful", [])) != len(objects.stateful):
        raise ValueError("the snapshot was taken for another set of stateful objects")
    for target, saved in zip([*objects.params, *objects.buffers], [*tree["params"], *tree["buffers"]], strict=True):
        local = to_local(target)
        if local.shape != saved.data.shape or local.dtype != saved.data.dtype:
            raise ValueError(
                f"a snapshot tensor of shape {tuple(saved.data.shape)} ({saved.data.dtype}) does not fit its "
                f"parameter or buffer of shape {tuple(local.shape)} ({local.dtype})"
            )


def restore_snapshot(objects: TrainingObjects, tree: Any, rng: bool) -> dict[str, Any]:
    """Put ``tree`` (a snapshot's host tree) back in place; returns the guard state it held (device tensors).

    The caller restores the guard state (the engine decides what of it comes back).
    """
    _check_fits(objects, tree)
    with torch.no_grad():
        for target, saved in zip([*objects.params, *objects.buffers], [*tree["params"], *tree["buffers"]], strict=True):
            if not saved.copy_into(target):
                raise ValueError(f"a snapshot tensor of shape {tuple(saved.data.shape)} does not fit its parameter")
        _restore_optimizer(objects, tree["optimizer"])
        for scheduler, state in zip(objects.schedulers, tree["schedulers"], strict=True):
            scheduler.load_state_dict(map_saved(state, _new))
        for stateful, state in zip(objects.stateful, tree.get("stateful", []), strict=True):
            stateful.load_state_dict(map_saved(state, _new))
        if tree["scaler"] is not None:
            objects.scaler.load_state_tensors(map_saved(tree["scaler"], _new))
    if rng:
        restore_rng(map_saved(tree["rng"], lambda s: s.data.clone()))
    guard: dict[str, Any] = map_saved(tree["guard"], _new)
    return guard
