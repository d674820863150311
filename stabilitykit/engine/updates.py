"""The update-to-weight ratio ``||Δw|| / ||w||`` per layer: the step-size diagnostic, on the device.

Timing (no extra host sync): the update is only known after an optimizer step, but a logging step
reads the journal before its own optimizer step. So the update measured is the one of the step just
BEFORE each logging step: ``snapshot`` copies the parameters before that step's optimizer step
(one ``_foreach_copy_`` per (device, dtype) group), ``measure`` after it turns the copy into
``-Δw`` in place (``_foreach_sub_``) and keeps per-layer sums of ``||Δw||²`` and ``||w||²``
(``_foreach_norm`` and one ``index_add_``) as a device tensor, and the logging step reads them
with its one journal read. The ratio logged at step N is the update that produced the weights
step N starts from; with ``log_every_n_steps=1`` that is every step. Other steps pay nothing.

Distributed: the sums are packed per row of the grad-norm plan's ``LayoutReducer`` (the same
layout rules: shards summed over the groups that hold them, replicas counted once) and ride in
the logging step's grad-norm all-reduce (``GradNormPlan.compute(extra=...)``): no collective of
their own. With the inf grad norm (a MAX reduction) they get one SUM reduction of their own.

A skipped step leaves the parameters untouched, so its update is exactly 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from stabilitykit.distributed import all_reduce, is_dtensor, to_local
from stabilitykit.grads import GradNormPlan, device_groups


class UpdateMonitor:
    """Snapshot before one optimizer step, per-layer update and weight norms after it, read later."""

    def __init__(self, plan: GradNormPlan) -> None:
        self.plan = plan
        self.params = plan.params
        self.n_layers = len(plan.layer_names) if plan.per_layer else 1
        reducer = plan.reducer
        self.n_rows = reducer.n_rows + 1 if reducer is not None else 1  # + the reducer's world count row
        self.fold = reducer is not None and plan.norm_type != math.inf
        self.groups = device_groups([to_local(p) for p in self.params])
        self.device = to_local(self.params[0]).device
        order = [i for g in self.groups for i in g]
        n = self.n_layers
        rows = [reducer.row_of[i] if reducer is not None else 0 for i in order]
        layers = [plan.layer_of[i] for i in order]
        update_at = [2 * r * n + layer for r, layer in zip(rows, layers, strict=True)]
        weight_at = [(2 * r + 1) * n + layer for r, layer in zip(rows, layers, strict=True)]
        self._index = torch.tensor(update_at + weight_at, dtype=torch.long, device=self.device)
        sharded = any(is_dtensor(p) for p in self.params)  # a DTensor's local shard is taken afresh each time
        self._fixed = None if sharded else [[self.params[i] for i in g] for g in self.groups]  # follows .data swaps
        self._before: list[list[Tensor]] | None = None
        self._sums: Tensor | None = None  # (n_rows, 2, n_layers): sums of ||Δw||² and ||w||² per row and layer
        self._step: int | None = None  # the optimizer step whose update ``_sums`` holds
        self._folded = False

    def _locals(self) -> list[list[Tensor]]:
        """The parameters' local tensors (a DTensor's shard) per (device, dtype) group."""
        if self._fixed is not None:
            return self._fixed
        return [[to_local(self.params[i]) for i in g] for g in self.groups]

    @torch.no_grad()
    def snapshot(self, step: int) -> None:
        """Copy the parameters before optimizer step ``step`` (its update is read at the next step)."""
        now = self._locals()
        before = [[torch.empty_like(t) for t in tensors] for tensors in now]
        for copy, tensors in zip(before, now, strict=True):
            torch._foreach_copy_(copy, tensors)
        self._before, self._step, self._sums = before, step, None

    @torch.no_grad()
    def measure(self) -> None:
        """After the optimizer step: per-layer ``||Δw||²`` and ``||w||²`` on the device; the copy is freed."""
        before, self._before = self._before, None
        if before is None:
            return
        now = self._locals()
        updates: list[Tensor] = []
        weights: list[Tensor] = []
        for copy, tensors in zip(before, now, strict=True):
            weights.append(torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).to(self.device))
            torch._foreach_sub_(copy, tensors)  # w_before - w_after = -Δw, in the copy's memory
            updates.append(torch.stack(torch._foreach_norm(copy, 2.0, dtype=torch.float32)).to(self.device))
        del before
        per_tensor = torch.cat(updates + weights)
        sums = torch.zeros(self.n_rows * 2 * self.n_layers, dtype=torch.float32, device=self.device)
        sums.index_add_(0, self._index, per_tensor * per_tensor)
        self._sums = sums.view(self.n_rows, 2, self.n_layers)
        self._folded = False
        reducer = self.plan.reducer
        if reducer is not None and not self.fold:
            reducer.reduce_rows(self._sums, 2.0)  # the grads reduce with MAX: these need their own SUM

    def to_fold(self, step: int) -> Tensor | None:
        """The sums to reduce in place with step ``step``'s grad norms (those of step ``step - 1``), else None."""
        if not self.fold or self._sums is None or self._step != step - 1:
            return None
        self._folded = True
        return self._sums

    def values(self, step: int) -> Tensor | None:
        """``[total ratio, total weight norm, ratio per layer..., weight norm per layer...]`` of the update
        of step ``step - 1``, a device tensor (no sync), or None when that step was not measured."""
        sums, self._sums = self._sums, None
        if sums is None or self._step != step - 1 or (self.fold and not self._folded):
            return None
        reducer = self.plan.reducer
        layer = sums[0] if reducer is None else sums[: reducer.n_rows].sum(0)  # every row's shards, summed
        total = layer.sum(1)
        if reducer is not None and reducer.extra_group is not None:
            all_reduce(total, dist.ReduceOp.SUM, reducer.extra_group)  # pipeline stages: each holds its own layers
        layer_norms, total_norms = layer.sqrt(), total.sqrt()
        ratios = _ratio(torch.cat([total_norms[:1], layer_norms[0]]), torch.cat([total_norms[1:], layer_norms[1]]))
        return torch.cat([ratios[:1], total_norms[1:], ratios[1:], layer_norms[1]])

    def named(self, values: Sequence[float], layer_names: Sequence[str], logged: Sequence[int]) -> dict[str, float]:
        """Metric names for the host copy of ``values``: totals, then the ``logged`` layers."""
        n = self.n_layers
        metrics = {"update_ratio": values[0], "weight_norm": values[1]}
        if self.plan.per_layer:
            for i in logged:
                metrics[f"update_ratio/{layer_names[i]}"] = values[2 + i]
                metrics[f"weight_norm/{layer_names[i]}"] = values[2 + n + i]
        return metrics

    def reset(self) -> None:
        """Forget a snapshot or sums in flight (the engine's state was replaced)."""
        self._before, self._sums, self._step = None, None, None


def _ratio(update: Tensor, weight: Tensor) -> Tensor:
    """``update / weight``, exactly 0 where nothing moved (a skipped step, a frozen zero layer)."""
    return torch.where(update == 0, torch.zeros_like(update), update / weight)
