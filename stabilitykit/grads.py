"""Fused gradient norms: one ``torch._foreach_norm`` pass, per-layer sums on the device, clipping.

Nothing here reads a value back to the host. Per-tensor norms come out in fp32 (bf16/fp16
grads accumulate in fp32), are raised to the p-th power, segment-summed into layers with a
single ``index_add_``, and the total is the p-th root of their sum. A non-finite total never
multiplies the grads.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from stabilitykit.distributed import reducer_for, to_local

__all__ = [
    "GradNormPlan",
    "NormResult",
    "apply_clip_coefficient",
    "clip_coefficient",
    "clip_grad_norm_",
    "grad_norms",
]

#: Added to the total norm before dividing, exactly as ``torch.nn.utils.clip_grad_norm_`` does.
CLIP_EPS = 1e-6

#: Reduces per-layer sums of p-th powers across processes in place (see ``distributed.py``).
LayerSumReducer = Callable[[Tensor, float], None]


@dataclass
class NormResult:
    """Norms of one step; every field is a device tensor (fp32)."""

    total: Tensor
    layer_norms: Tensor | None
    layer_names: list[str]
    #: 0-d bool: every grad is finite on every rank (a reduction may hide a NaN, so this is kept apart).
    finite: Tensor | None = None

    def __post_init__(self) -> None:
        if self.finite is None:
            self.finite = torch.isfinite(self.total)

    def as_dict(self) -> dict[str, Tensor]:
        """``{"layer name": norm, ..., "total": norm}`` (0-d tensors, no host sync)."""
        out: dict[str, Tensor] = {}
        if self.layer_norms is not None:
            out = {name: self.layer_norms[i] for i, name in enumerate(self.layer_names)}
        out["total"] = self.total
        return out


@dataclass
class _Group:
    indices: list[int]


@dataclass
class _Layout:
    groups: list[_Group]
    segments: Tensor | None  # layer index of each present grad, in group order, on the main device
    device: torch.device
    weights: Tensor | None = None  # 1/world for replicated grads when others are sharded (one SUM counts them once)


def _pow(values: Tensor, p: float) -> Tensor:
    if p == 2.0:
        return values * values
    if p == 1.0:
        return values
    return values.pow(p)


def _root(values: Tensor, p: float) -> Tensor:
    if p == 2.0:
        return values.sqrt()
    if p == 1.0:
        return values
    return values.pow(1.0 / p)


class GradNormPlan:
    """Precomputed grouping of a fixed parameter list into (device, dtype) groups and layers.

    ``compute()`` makes one ``_foreach_norm`` call per group and a handful of small ops;
    the layout is cached per set of parameters that have grads.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        layer_of: Sequence[int] | None = None,
        layer_names: Sequence[str] | None = None,
        norm_type: float = 2.0,
        reducer: LayerSumReducer | None = None,
    ) -> None:
        if norm_type != math.inf and not (norm_type > 0 and math.isfinite(norm_type)):
            raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
        self.params = list(params)
        self.layer_of = list(layer_of) if layer_of is not None else [0] * len(self.params)
        self.layer_names = list(layer_names) if layer_names is not None else ["all"]
        if len(self.layer_of) != len(self.params):
            raise ValueError("layer_of must give one layer index per parameter")
        self.per_layer = layer_names is not None
        self.norm_type = float(norm_type)
        self.reducer = reducer
        self._local = any(to_local(q) is not q for q in self.params) or reducer is not None
        self._layouts: dict[tuple[bool, ...], _Layout] = {}
        self._warned_empty = False

    def _layout(self, present: tuple[bool, ...]) -> _Layout:
        layout = self._layouts.get(present)
        if layout is not None:
            return layout
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, has_grad in enumerate(present):
            if has_grad:
                p = self.params[i]
                by_key.setdefault((p.device, p.dtype), []).append(i)
        groups = [_Group(indices) for indices in by_key.values()]
        device = self.params[groups[0].indices[0]].device if groups else torch.device("cpu")
        segments = None
        if self.per_layer and groups:
            order = [self.layer_of[i] for g in groups for i in g.indices]
            segments = torch.tensor(order, dtype=torch.long, device=device)
        weights = None
        flags = getattr(self.reducer, "shard_flags", None)
        if flags is not None and not all(flags) and groups:
            world = float(getattr(self.reducer, "world", 1))
            values = [1.0 if flags[i] else 1.0 / world for g in groups for i in g.indices]
            weights = torch.tensor(values, dtype=torch.float32, device=device)
        layout = _Layout(groups, segments, device, weights)
        self._layouts[present] = layout
        return layout

    def _grouped(self, layout: _Layout) -> list[list[Tensor]]:
        """The current grads, one list per (device, dtype) group; DTensor grads as their local shards."""
        grouped = [[self.params[i].grad for i in g.indices] for g in layout.groups]
        if self._local:
            return [[to_local(g) for g in grads] for grads in grouped]  # type: ignore[arg-type]
        return grouped  # type: ignore[return-value]

    def compute(self, grad_scale: Tensor | None = None) -> tuple[NormResult, list[list[Tensor]]]:
        """Norms of the current grads and the grads themselves grouped for ``_foreach`` ops.

        ``grad_scale``: the loss scale still applied to the grads; the returned norms are unscaled.
        """
        present = tuple(p.grad is not None for p in self.params)
        layout = self._layout(present)
        grouped = self._grouped(layout)
        p = self.norm_type
        if not grouped:
            if not self._warned_empty:
                self._warned_empty = True
                rank = torch.distributed.get_rank() if self.reducer is not None else 0
                warnings.warn(
                    f"stabilitykit: no parameter has a gradient on rank {rank}; its grad norm is 0",
                    RuntimeWarning,
                    stacklevel=3,
                )
            device = self.params[0].device if self.params else torch.device("cpu")
            sums = torch.zeros(len(self.layer_names) if self.per_layer else 1, dtype=torch.float32, device=device)
            if self.reducer is not None:  # still join the all-reduce: the other ranks wait for it
                self.reducer(sums, p)
            total = sums.max() if p == math.inf else _root(sums.sum(), p)
            layers = (sums if p == math.inf else _root(sums, p)) if self.per_layer else None
            return NormResult(total, layers, self.layer_names), []
        pieces = [
            torch.stack(torch._foreach_norm(grads, p, dtype=torch.float32)).to(layout.device)  # type: ignore[arg-type]
            for grads in grouped
        ]
        per_tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if self.per_layer:
            assert layout.segments is not None
            sums = torch.zeros(len(self.layer_names), dtype=torch.float32, device=layout.device)
            if p == math.inf:
                sums.scatter_reduce_(0, layout.segments, per_tensor, reduce="amax", include_self=True)
            else:
                powered = _pow(per_tensor, p)
                sums.index_add_(0, layout.segments, powered * layout.weights if layout.weights is not None else powered)
        elif p == math.inf:
            sums = per_tensor.max().reshape(1)
        else:
            powered = _pow(per_tensor, p)
            sums = (powered * layout.weights if layout.weights is not None else powered).sum().reshape(1)
        if self.reducer is not None:
            self.reducer(sums, p)
        if p == math.inf:
            total = sums.max()
            layers = sums if self.per_layer else None
        else:
            total = _root(sums.sum(), p)
            layers = _root(sums, p) if self.per_layer else None
        if grad_scale is not None:
            inv = grad_scale.to(device=layout.device, dtype=torch.float32).reciprocal()
            total = total * inv
            layers = layers * inv if layers is not None else None
        return NormResult(total, layers, self.layer_names), grouped


def clip_coefficient(total: Tensor, max_norm: float | Tensor, finite: Tensor | None = None) -> Tensor:
    """``min(1, max_norm / (total + 1e-6))``, and 1 where ``total`` is not finite (``finite`` if known)."""
    coef = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    return torch.where(torch.isfinite(total) if finite is None else finite, coef, 1.0)


def apply_clip_coefficient(grouped_grads: Sequence[Sequence[Tensor]], coef: Tensor) -> None:
    """Multiply every grad by ``coef`` in place: one ``_foreach_mul_`` per (device, dtype) group."""
    for grads in grouped_grads:
        if grads:
            torch._foreach_mul_(list(grads), coef.to(grads[0].device))


def _as_param_list(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        return [parameters]
    return list(parameters)


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor] | nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    model: nn.Module | None = None,
) -> Tensor:
    """Clip grads to a global norm in place and return the pre-clip total norm (fp32, on device).

    Same result as ``torch.nn.utils.clip_grad_norm_`` on finite grads, but a NaN/Inf total
    leaves the grads untouched instead of spreading NaN into every grad. The norm is the true
    global one under DDP, FSDP2 (DTensor grads) and FSDP1; for FSDP1 pass the wrapped module as
    ``parameters`` or ``model`` so its sharded flat parameters are known (see ``stabilitykit.distributed``).
    Every rank must call it (it may all-reduce), including a rank without grads.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    if isinstance(parameters, nn.Module):
        model = model or parameters
        parameters = parameters.parameters()
    params = [p for p in _as_param_list(parameters) if p.requires_grad or p.grad is not None]
    plan = GradNormPlan(params, norm_type=float(norm_type), reducer=reducer_for(params, model))
    result, grouped = plan.compute()
    if error_if_nonfinite and not bool(torch.isfinite(result.total)):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be clipped.")
    apply_clip_coefficient(grouped, clip_coefficient(result.total, max_norm))
    return result.total


def grad_norms(
    model: nn.Module,
    norm_type: float = 2.0,
    grouping: str | Sequence[str] = "auto",
) -> dict[str, Tensor]:
    """Per-layer grad norms and the total: ``{"blocks.0": t, ..., "total": t}`` (0-d fp32 tensors)."""
    from stabilitykit.engine.layers import build_layer_map  # the engine imports this module

    params = [p for p in model.parameters() if p.requires_grad]
    layers = build_layer_map(params, model, grouping)
    plan = GradNormPlan(
        params, layers.layer_of, layers.layer_names, norm_type=float(norm_type), reducer=reducer_for(params, model)
    )
    result, _ = plan.compute()
    return result.as_dict()
