"""FSDP1's own gradient reduction as a communication hook that first measures this rank's local gradient.

``FullyShardedDataParallel.register_comm_hook`` (public) replaces how FSDP1 reduces each flat parameter's
unsharded gradient across ranks. The hook registered here hands the local gradient to ``measure`` and then
reduces it exactly as FSDP1 does without a hook, through torch's own default hooks
(``torch.distributed.algorithms._comm_hooks.default_hooks``, a private module: the reason this is here):
divide by the pre-division factor, reduce-scatter (all-reduce under ``NO_SHARD``), divide by the
post-division factor. The reduced gradients are bitwise those of FSDP1 without the hook.

Not hooked (False): a model that is not an FSDP1 root, FSDP1 units over other process groups than the
root's (one hook state serves every unit), a hybrid sharding strategy (FSDP1 takes no hook there), a
model that has a hook of its own, and a torch without these modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn


def hook_fsdp1_reduction(model: nn.Module, measure: Callable[[Tensor], None]) -> bool:
    """Register the measuring hook on FSDP1 root ``model`` (see the module docstring); whether it was."""
    try:
        from torch.distributed.algorithms._comm_hooks.default_hooks import (
            DefaultState,
            allreduce_hook,
            reduce_scatter_hook,
        )
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    if not isinstance(model, FullyShardedDataParallel):
        return False
    group = model.process_group
    if group is None or any(unit.process_group is not group for unit in FullyShardedDataParallel.fsdp_modules(model)):
        return False
    state = DefaultState(group)

    def hook(hook_state: Any, grad: Tensor, output: Tensor | None = None) -> None:
        measure(grad)
        if output is None:  # NO_SHARD
            allreduce_hook(hook_state, grad)
        else:
            reduce_scatter_hook(hook_state, grad, output)

    try:
        model.register_comm_hook(state, hook)
    except (AssertionError, RuntimeError, ValueError):  # not the root, a hybrid strategy, a hook of its own
        return False
    return True
