"""Every read of a torch or framework private attribute, each named for what it tells us.

Each function is the single place that knows the private name; when a release renames one, this
is the file to change (the tests of the module that calls it fail first).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

F = TypeVar("F", bound=Callable[..., Any])

#: Name segments wrappers add to a parameter's qualified name (FSDP1, activation checkpointing,
#: ``torch.compile``), dropped to give the user's own names.
WRAPPER_NAME_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def compiled_inner_module(module: nn.Module) -> nn.Module | None:
    """The module inside ``torch.compile``'s ``OptimizedModule`` (its ``_orig_mod``), or None."""
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def is_compiled_module(module: nn.Module) -> bool:
    """``module`` is a ``torch.compile`` wrapper, or was compiled in place (``module.compile()``)."""
    return compiled_inner_module(module) is not None or getattr(module, "_compiled_call_impl", None) is not None


def dynamo_disable(fn: F) -> F:
    """``fn`` run eagerly under ``torch.compile`` (one graph break, no tracing of our hooks)."""
    return torch._dynamo.disable(fn)  # type: ignore[no-any-return]


def fsdp1_inner_module(module: nn.Module) -> nn.Module | None:
    """The module an FSDP1 root wraps (its ``_fsdp_wrapped_module``), or None."""
    inner = getattr(module, "_fsdp_wrapped_module", None)
    return inner if isinstance(inner, nn.Module) else None


def fsdp1_flat_handle(module: nn.Module) -> Any | None:
    """An FSDP1 module's flat-parameter handle (torch exposes no public accessor), or None."""
    return getattr(module, "_handle", None)


def fsdp1_original_params(flat_param: Tensor) -> list[Tensor]:
    """The original parameters an FSDP1 flat parameter holds (``use_orig_params=True``): own and shared."""
    return list(getattr(flat_param, "_params", None) or []) + list(getattr(flat_param, "_shared_params", None) or [])


def is_fsdp1_flattened(param: Tensor) -> bool:
    """``param`` is an FSDP1 flat parameter (or a view into one)."""
    return bool(getattr(param, "_fsdp_flattened", False))


def supports_amp_scaling(optimizer: Any) -> bool:
    """The optimizer's step takes ``grad_scale``/``found_inf`` (torch's fused Adam, AdamW, SGD)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def wrapped_optimizer(wrapper: Any) -> Any | None:
    """The optimizer a framework wrapper keeps privately (Lightning's ``LightningOptimizer``), or None."""
    return getattr(wrapper, "_optimizer", None)


def live_tqdm_bars() -> Any | None:
    """tqdm's set of bars on screen (empty or None: none, or tqdm not imported)."""
    tqdm_module = sys.modules.get("tqdm")
    return getattr(getattr(tqdm_module, "tqdm", None), "_instances", None)
