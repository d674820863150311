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
then not named; register yours before the guard is built, or without rerun). FSDP, DeepSpeed and the
frameworks' own DDP wrappers reduce otherwise and are not hooked.
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn


class LocalGrads:
    """This rank's local gradient sum of squares per step, measured in DDP's communication hook."""

    def __init__(self, model: nn.Module | None) -> None:
        self.total: Tensor | None = None
        self.hooked = False
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

    def take(self) -> Tensor | None:
        """This rank's local sum of squares since the last take (None: not measured); the next starts at 0."""
        total, self.total = self.total, None
        return total

    def close(self) -> None:
        """Stop measuring (DDP cannot remove a hook: it goes on averaging as DDP does)."""
        self.hooked = False
        self.total = None
