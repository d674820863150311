"""The optimizer a driver guards: found through framework wrappers, its parameters, and what is refused by
name (at construction and when a param group is added mid-run)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.compat.private import wrapped_optimizer


def check_supported(model: nn.Module | None, optimizer: Any, params: list[Tensor]) -> None:
    """Refuse, at construction and by name, what the step cannot guard."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "stabilitykit cannot guard torch.optim.LBFGS: its step() re-evaluates a closure several times, "
            "so there is no single set of final grads to measure, clip or skip. Clip inside your closure "
            "(torch.nn.utils.clip_grad_norm_) or use an optimizer that steps once per batch."
        )
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for i, p in enumerate(params):
        if p.is_complex():
            name = names.get(id(p), f"param_{i}")
            raise TypeError(
                f"parameter {name!r} is complex ({p.dtype}); stabilitykit's fused norms are real-valued. "
                "Keep it out of the guarded optimizer, or store it as a real view (torch.view_as_real)."
            )
    if model is not None:
        ids = {id(p) for p in params}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if getattr(module, "sparse", False) and isinstance(weight, Tensor) and id(weight) in ids:
                raise TypeError(
                    f"module {name!r} ({type(module).__name__}(sparse=True)) makes sparse gradients, which "
                    "fused norms cannot read; use sparse=False, or give its parameters their own optimizer"
                )


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside framework wrappers (Lightning, Accelerate, Fabric, HF)."""
    seen: set[int] = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or not hasattr(inner, "param_groups"):
            inner = wrapped_optimizer(optimizer)
        if inner is None or not hasattr(inner, "param_groups") or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def refuse_non_optimizer(optimizer: Any) -> None:
    """A clear error when the optimizer argument is something else (a config passed in its place)."""
    if hasattr(optimizer, "param_groups"):
        return
    name = type(optimizer).__name__
    hint = ""
    if name == "StabilityConfig" or isinstance(optimizer, (Mapping, str)):
        hint = (
            f"; a {name} was given where the optimizer goes: the optimizer comes second, "
            "e.g. StabilityGuard(model, optimizer, config)"
        )
    raise TypeError(f"stabilitykit needs a torch optimizer (an object with param_groups), got {name}{hint}")


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """Every parameter the optimizer updates, in param-group order, without duplicates."""
    seen: set[int] = set()
    params: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def guarded_params(model: nn.Module | None, optimizer: Any) -> list[Tensor]:
    """The parameters ``optimizer`` guards: none is refused, a frozen model named (it may be unfrozen later)."""
    refuse_non_optimizer(optimizer)
    params = optimizer_params(optimizer)
    if not params:
        raise ValueError(
            f"stabilitykit has nothing to guard: {type(optimizer).__name__} holds no parameters "
            "(check what configure_optimizers / your optimizer was given)"
        )
    if not any(p.requires_grad for p in params):
        warnings.warn(
            f"stabilitykit: none of the {len(params)} parameters {type(optimizer).__name__} holds "
            "requires grad (the model is frozen): no step changes them until something unfreezes them "
            "(p.requires_grad_(True))",
            UserWarning,
            stacklevel=4,
        )
    check_supported(model, optimizer, params)
    return params


def param_count(optimizer: Any) -> int:
    """How many parameters ``optimizer``'s groups hold (a group added mid-run changes it)."""
    return sum(len(group["params"]) for group in optimizer.param_groups)
