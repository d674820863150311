"""LR schedulers handed to a driver the wrong way: each mistake named, with its fix, before the first step.

A driver that steps and holds a scheduler (``StabilityGuard(..., scheduler=...)``) meets the
mistakes users make in the first hour: a scheduler passed where the scaler goes (the fourth
positional argument), a class instead of an instance, Lightning's ``{"scheduler": ..., "interval":
...}`` dict, ``ReduceLROnPlateau`` (it steps on a metric the driver does not have), the optimizer
itself, a scheduler built on another optimizer, and a scheduler passed and also stepped by hand
(which doubles the schedule). This module only inspects public attributes; it never steps anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def _is_scheduler(obj: Any) -> bool:
    """An LR scheduler instance (torch's, or anything that drives an optimizer and steps)."""
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    return hasattr(obj, "step") and hasattr(obj, "optimizer") and not isinstance(obj, torch.optim.Optimizer)


def _target(scheduler: Any) -> Any:
    """The torch optimizer ``scheduler`` drives (through an Accelerate wrapper), or None."""
    inner = getattr(scheduler, "scheduler", None)
    base = inner if inner is not None and hasattr(inner, "step") else scheduler
    optimizer = getattr(base, "optimizer", None)
    from stabilitykit.drivers.optimizers import unwrap_optimizer  # the drivers import this module

    return unwrap_optimizer(optimizer) if optimizer is not None else None


def check_arguments(scaler: Any, schedulers: Sequence[Any], optimizers: Sequence[Any]) -> None:
    """The plain loop's ``scaler=`` and ``scheduler=`` (see ``check_scaler``, ``check_schedulers``)."""
    check_scaler(scaler)
    check_schedulers(schedulers, optimizers)


def check_scaler(scaler: Any) -> None:
    """A scheduler where the GradScaler goes (``StabilityGuard(model, opt, cfg, sched)``) is named."""
    if scaler is not None and _is_scheduler(scaler):
        raise TypeError(
            f"scaler= got {type(scaler).__name__}, an LR scheduler: the fourth positional argument of "
            "StabilityGuard is the GradScaler. Pass the scheduler by name: "
            "StabilityGuard(model, optimizer, config, scheduler=scheduler)"
        )


def check_schedulers(schedulers: Sequence[Any], optimizers: Sequence[Any]) -> None:
    """Refuse, by name and with the fix, a ``scheduler=`` the driver cannot step and hold correctly."""
    from stabilitykit.drivers.optimizers import unwrap_optimizer  # the drivers import this module

    ours = [unwrap_optimizer(o) for o in optimizers]
    for scheduler in schedulers:
        name = type(scheduler).__name__
        if isinstance(scheduler, type):
            raise TypeError(
                f"scheduler= got the class {scheduler.__name__}, not a scheduler: build it on the optimizer "
                f"first, scheduler={scheduler.__name__}(optimizer, ...)"
            )
        if isinstance(scheduler, Mapping):
            inner = scheduler.get("scheduler")
            interval = scheduler.get("interval", "epoch")
            fix = (
                f"pass the scheduler itself, scheduler=config[{'scheduler'!r}] ({type(inner).__name__})"
                if interval == "step"
                else "step it yourself once per epoch and do not pass it (the guard steps a scheduler once per "
                "optimizer step)"
            )
            raise TypeError(f"scheduler= got a dict (Lightning's lr_scheduler config, interval={interval!r}); {fix}")
        if isinstance(scheduler, torch.optim.Optimizer) or hasattr(scheduler, "param_groups"):
            raise TypeError(
                f"scheduler= got the optimizer {name}: the guard already steps the optimizer, so it would step "
                "twice. Pass an LR scheduler built on it (scheduler=torch.optim.lr_scheduler.X(optimizer, ...)), "
                "or none"
            )
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or isinstance(
            getattr(scheduler, "scheduler", None), torch.optim.lr_scheduler.ReduceLROnPlateau
        ):
            raise TypeError(
                "scheduler= got ReduceLROnPlateau, which steps on a metric (scheduler.step(val_loss)) that the "
                "guard does not have: do not pass it; call scheduler.step(val_loss) yourself after each "
                "validation (a skipped step changes no metric it reads, so it needs no holding)"
            )
        if not hasattr(scheduler, "step"):
            raise TypeError(f"scheduler= got {name}, which has no step(): pass an LR scheduler instance")
        target = _target(scheduler)
        if target is not None and ours and all(target is not o for o in ours):
            raise ValueError(
                f"scheduler= got a {name} built on another optimizer ({type(target).__name__} at "
                f"{id(target):#x}) than the one the guard steps: build it on the optimizer you pass, "
                f"{name}(optimizer, ...)"
            )


class StepWatch:
    """Warns once when a scheduler the driver steps was also stepped by hand (its schedule runs twice).

    The driver calls ``before()`` just before it steps its schedulers and ``after()`` just after; a
    scheduler whose ``last_epoch`` moved between one ``after()`` and the next ``before()`` was stepped
    by someone else. A host integer compare: no device work.
    """

    def __init__(self, schedulers: Sequence[Any] = (), warn: Callable[[str], None] | None = None) -> None:
        self.schedulers: list[Any] = []
        self._seen: dict[int, int] = {}
        self._warned = False
        self._warn = warn or (lambda message: warnings.warn(message, UserWarning, stacklevel=5))
        for scheduler in schedulers:
            self.add(scheduler)

    def add(self, scheduler: Any) -> None:
        """Watch ``scheduler`` too (one with an integer ``last_epoch``, as torch's schedulers have)."""
        if isinstance(getattr(scheduler, "last_epoch", None), int):
            self.schedulers.append(scheduler)

    def before(self) -> None:
        """Check that nobody stepped the schedulers since ``after()``."""
        if self._warned:
            return
        for scheduler in self.schedulers:
            seen = self._seen.get(id(scheduler))
            if seen is not None and scheduler.last_epoch != seen:
                self._warned = True
                self._warn(
                    f"stabilitykit: {type(scheduler).__name__}.step() was called outside the guard "
                    f"(last_epoch {seen} -> {scheduler.last_epoch} between two guard.step() calls): "
                    "StabilityGuard(scheduler=...) already steps it after each optimizer step, so the schedule "
                    "runs twice as fast. Remove your scheduler.step() call, or do not pass scheduler="
                )
                return

    def after(self) -> None:
        """Remember where each scheduler stands now."""
        if self._warned:
            return
        for scheduler in self.schedulers:
            self._seen[id(scheduler)] = scheduler.last_epoch
