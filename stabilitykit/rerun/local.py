"""A rank's own gradient before DDP's all-reduce: what names the rank of a fault in a local gradient.

Under DDP every rank's grads are averaged across ranks before stabilitykit sees them, so a flipped
bit in one rank's local gradient reaches every rank alike: the grad norms after the reduction cannot
say whose it was. A DDP communication hook sees each bucket of this rank's local grads before the
all-reduce; it adds the bucket's sum of squares to a device total (no sync) and then does exactly what
DDP does without a hook (``allreduce_hook``: divide by the world size, all-reduce). A rerun compares
each rank's own total from the first pass and the recomputation, so the one rank whose local grads
differed is named.

Only where it can be: the model is a ``DistributedDataParallel`` with no communication hook of its own
(DDP takes one hook per model: a model that has one keeps it, and the rank of a local-gradient fault is
then not named; register yours before the guard is built, or without rerun).

FSDP2 (``fully_shard``): each module's forward computes with unsharded parameters, whose grads backward
accumulates before FSDP2 reduce-scatters them; a hook after each one's accumulation adds its sum of
squares (one small kernel per parameter per step, no sync). FSDP1 (a root ``FullyShardedDataParallel``):
its public communication hook sees each flat parameter's unsharded local gradient before the
reduce-scatter; the hook adds its sum of squares, then reduces exactly as FSDP1 does without one
(``compat/fsdp1.py``). DeepSpeed at ZeRO 0 all-reduces the grads at the end of ``engine.backward``: a hook
after each parameter's accumulation measures them first (``watch_params``). Under ZeRO 1-3 DeepSpeed is
not hooked: its optimizer's own hooks after each gradient's accumulation, registered when the engine is
built, take the gradient into its reduction buffers before any hook of ours would run. A local-gradient
fault there is judged ``transient`` with no rank named when every rank's reduced grads differ alike.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stabilitykit.compat.fsdp1 import hook_fsdp1_reduction


class LocalGrads:
    """This rank's local gradient sum of squares per step, measured before a data-parallel reduction."""

    def __init__(self, model: nn.Module | None) -> None:
        self.total: Tensor | None = None
        self.hooked = False
        self._handles: list[Any] = []
        if model is not None and _is_fsdp2(model):
            self._hook_unsharded(model)
            return
        if model is not None and hook_fsdp1_reduction(model, self._add):
            self.hooked = True
            return
        if model is None or not isinstance(model, nn.parallel.DistributedDataParallel):
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        group = getattr(model, "process_group", None)

        def hook(_state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            grads = bucket.buffer()
            if self.hooked:
                part = grads.detach().float().pow(2).sum()
                self.total = part if self.total is None else self.total + part
            return allreduce_hook(group, bucket)  # type: ignore[arg-type]  # None: the default group, as DDP

        try:
            model.register_comm_hook(None, hook)
        except RuntimeError:  # the model has a hook of its own: it keeps it
            return
        self.hooked = True

    def _add(self, grad: Tensor) -> None:
        """Add ``grad``'s sum of squares (this rank's, before a reduction) to the step's device total."""
        if self.hooked:
            part = grad.detach().float().pow(2).sum()
            self.total = part if self.total is None else self.total + part

    def _hook_unsharded(self, model: nn.Module) -> None:
        """FSDP2: each module's forward computes with the unsharded parameters (the sharded ones get their
        grads after the reduce-scatter); a hook after each unsharded parameter's accumulation adds its sum of
        squares before the reduce-scatter reads it. The unsharded parameters are found at the forward (a
        forward pre-hook on every module with parameters of its own), hooked once each."""
        seen: list[Tensor] = []

        def before_forward(module: nn.Module, _args: Any) -> None:
            for _name, param in module.named_parameters(recurse=False):
                if hasattr(param, "to_local") or not param.requires_grad or any(param is p for p in seen):
                    continue  # a sharded DTensor (outside FSDP2's forward), frozen, or already hooked
                seen.append(param)
                self._handles.append(param.register_post_accumulate_grad_hook(self._on_grad))

        for module in model.modules():
            if next(module.parameters(recurse=False), None) is not None:
                self._handles.append(module.register_forward_pre_hook(before_forward))
        self.hooked = True

    def _on_grad(self, param: Tensor) -> None:
        """After ``param``'s accumulation: its gradient's sum of squares (this rank's, before a reduction)."""
        if self.hooked and param.grad is not None:
            part = param.grad.detach().float().pow(2).sum()
            self.total = part if self.total is None else self.total + part

    def watch_params(self, params: list[Tensor]) -> None:
        """Measure ``params``' grads after their accumulation, before the reduction a framework runs once backward
        is over (DeepSpeed's ZeRO 0 all-reduce at the end of ``engine.backward``: ``rerun/deepspeed.py``)."""
        if self.hooked or not params:
            return
        self._handles += [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self.hooked = True

    def take(self) -> Tensor | None:
        """This rank's local sum of squares since the last take (None: not measured); the next starts at 0."""
        total, self.total = self.total, None
        return total

    def close(self) -> None:
        """Stop measuring (DDP and FSDP1 cannot remove a hook: it goes on reducing as they do; FSDP2's are removed)."""
        self.hooked = False
        self.total = None
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _is_fsdp2(model: nn.Module) -> bool:
    """Some module of ``model`` is sharded by FSDP2's ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
