"""Fused gradient norms: one ``torch._foreach_norm`` pass, per-layer sums on the device, clipping.

Nothing here reads a value back to the host. Per-tensor norms come out in fp32 (bf16/fp16
grads accumulate in fp32), are raised to the p-th power, segment-summed into layers with a
single ``index_add_``, and the total is the p-th root of their sum. A non-finite total never
multiplies the grads. On request (``per_tensor=True``, for per-tensor clipping) the plan also
returns each parameter's own global norm, reduced in the same collectives as the layers.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from stabilitykit.distributed import LayoutReducer, is_distributed, is_dtensor, local_for_norm, reducer_for, to_local
from stabilitykit.section import Section


def _check_norm_type(value: float) -> float:
    if value == math.inf:
        return value
    if not math.isfinite(value) or value <= 0:
        raise ValueError("norm_type must be a positive number or inf (e.g. 1, 2, 'inf')")
    return float(value)


def _check_patterns(patterns: list[str] | None) -> list[str] | None:
    for pattern in patterns or []:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"invalid regular expression {pattern!r}: {exc}") from exc
    return patterns


class GradNormConfig(Section):
    """How gradient norms are measured and grouped into layers."""

    norm_type: float = Field(2.0, description="p of the p-norm: 1, 2, any p > 0, or inf.")
    per_layer: bool = Field(True, description="Also compute and log one norm per layer.")
    grouping: Literal["auto", "top", "param"] | list[str] = Field(
        "auto",
        description=(
            "How parameters form layers. 'auto': each child of the largest ModuleList/Sequential "
            "of same-type modules is a layer ('blocks.3'), other parameters group by top-level "
            "module. 'top': by top-level module. 'param': one layer per parameter. A list of "
            "regular expressions: the first pattern that matches a parameter name gives the "
            "layer name (the matched text); unmatched parameters fall back to 'auto'."
        ),
    )
    include: list[str] | None = Field(
        None, description="Regexes: only layers whose name matches one are logged per layer."
    )
    exclude: list[str] | None = Field(
        None, description="Regexes: layers whose name matches one are not logged per layer."
    )
    update_ratio: bool = Field(
        False,
        description=(
            "Also log the update-to-weight ratio ||Δw|| / ||w|| and the weight norm, per layer and in total, "
            "on logging steps (the update of the optimizer step just before). Costs a copy of the "
            "parameters (one parameter-sized buffer, in the parameters' dtype and device) held during "
            "one optimizer step per logging interval, and no host sync."
        ),
    )

    @field_validator("norm_type", mode="before")
    @classmethod
    def _parse_inf(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in {"inf", "infinity", "+inf"}:
            return math.inf
        return value

    @field_validator("norm_type")
    @classmethod
    def _valid_norm_type(cls, value: float) -> float:
        return _check_norm_type(value)

    @field_validator("grouping")
    @classmethod
    def _valid_grouping(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("grouping as a list needs at least one regular expression")
            _check_patterns(value)
        return value

    @field_validator("include", "exclude")
    @classmethod
    def _valid_filters(cls, value: list[str] | None) -> list[str] | None:
        return _check_patterns(value)


#: Added to the total norm before dividing, exactly as ``torch.nn.utils.clip_grad_norm_`` does.
CLIP_EPS = 1e-6


@dataclass
class NormResult:
    """Norms of one step; every field is a device tensor (fp32, or fp64 when measured in fp64)."""

    total: Tensor
    layer_norms: Tensor | None
    layer_names: list[str]
    #: 0-d bool: every grad is finite on every rank (a reduction may hide a NaN, so this is kept apart).
    finite: Tensor | None = None
    #: ``per_tensor`` plans only: each parameter's global grad norm, in the plan's parameter order (0 without a grad).
    tensor_norms: Tensor | None = None
    #: ``per_tensor`` plans only: bool per parameter, it has a grad on some rank this step.
    tensor_present: Tensor | None = None

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
    #: distributed only: where each present grad's [value, count, world count] lands in the packed matrix
    scatter: Tensor | None = None
    #: per-tensor plans only: the parameter index of each present grad (group order), and which parameters have one
    positions: Tensor | None = None
    present: Tensor | None = None
    #: one group holding every parameter in plan order (one device and dtype, every grad present)
    whole: bool = False


def device_groups(tensors: Sequence[Tensor], indices: Iterable[int] | None = None) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (device, dtype), groups in first-seen order: one
    ``torch._foreach_*`` call per group. ``indices``: only these (default: all)."""
    by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in range(len(tensors)) if indices is None else indices:
        t = tensors[i]
        by_key.setdefault((t.device, t.dtype), []).append(i)
    return list(by_key.values())


def norm_dtype(requested: torch.dtype, grad_dtypes: Sequence[torch.dtype]) -> torch.dtype:
    """Where norms accumulate: ``requested`` (fp32 by default), or fp64 when any grad is fp64.

    ``_foreach_norm`` refuses to narrow (an fp64 grad measured in fp32), and an fp64 model is
    measured at its own precision; the whole step then accumulates in fp64 (one dtype to combine).
    """
    if requested != torch.float64 and torch.float64 in grad_dtypes:
        return torch.float64
    return requested


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
    the layout is cached per set of parameters that have grads. With a ``reducer``
    (``stabilitykit.distributed.reducer_for``) the per-layer sums and non-finite counts are
    packed into one matrix and reduced across processes as the parameters' layout requires.
    ``per_tensor``: also give each parameter's global norm (``NormResult.tensor_norms``); its
    p-th powers and presence flags ride in the same matrix, so no collective is added.
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        layer_of: Sequence[int] | None = None,
        layer_names: Sequence[str] | None = None,
        norm_type: float = 2.0,
        reducer: LayoutReducer | None = None,
        per_tensor: bool = False,
    ) -> None:
        if norm_type != math.inf and not (norm_type > 0 and math.isfinite(norm_type)):
            raise ValueError(f"norm_type must be a positive number or inf, got {norm_type!r}")
        self.params = list(params)
        self.layer_of = list(layer_of) if layer_of is not None else [0] * len(self.params)
        self.layer_names = list(layer_names) if layer_names is not None else ["all"]
        if len(self.layer_of) != len(self.params):
            raise ValueError("layer_of must give one layer index per parameter")
        if reducer is not None and len(reducer.row_of) != len(self.params):
            raise ValueError("the reducer was built for a different parameter list")
        self.per_layer = layer_names is not None
        self.norm_type = float(norm_type)
        self.reducer = reducer
        self.per_tensor = per_tensor
        self._local = any(is_dtensor(q) for q in self.params)
        self._layouts: dict[tuple[bool, ...], _Layout] = {}
        #: which parameters had a grad in the last ``compute()`` (plan order)
        self.present: tuple[bool, ...] = ()
        self._current: _Layout | None = None  # the layout of the last ``compute()``
        self._warned_empty = False
        self._zero_cache: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    @property
    def _tensor_columns(self) -> int:
        """Columns per packed row for per-tensor norms: [p-th powers..., presence flags...]."""
        return 2 * len(self.params) if self.per_tensor else 0

    def _layout(self, present: tuple[bool, ...]) -> _Layout:
        layout = self._layouts.get(present)
        if layout is not None:
            return layout
        with_grads = [i for i, has_grad in enumerate(present) if has_grad]
        groups = [_Group(indices) for indices in device_groups(self.params, with_grads)]
        device = self.params[groups[0].indices[0]].device if groups else self._device()
        order = [i for g in groups for i in g.indices]
        segments = None
        if self.per_layer and groups:
            segments = torch.tensor([self.layer_of[i] for i in order], dtype=torch.long, device=device)
        scatter = None
        if self.reducer is not None:
            n_layers = len(self.layer_names) if self.per_layer else 1
            width = 2 * n_layers + self._tensor_columns  # one packed row: [values, counts, per-tensor columns]
            world_row = self.reducer.n_rows
            layers = [self.layer_of[i] if self.per_layer else 0 for i in order]
            rows = [self.reducer.row_of[i] for i in order]
            value = [r * width + layer for r, layer in zip(rows, layers, strict=True)]
            count = [r * width + n_layers + layer for r, layer in zip(rows, layers, strict=True)]
            world = [world_row * width + n_layers + layer for layer in layers]
            index = value + count + world
            if self.per_tensor:
                m, base = len(self.params), 2 * n_layers
                index += [r * width + base + i for r, i in zip(rows, order, strict=True)]
                index += [r * width + base + m + i for r, i in zip(rows, order, strict=True)]
            scatter = torch.tensor(index, dtype=torch.long, device=device)
        positions = present_mask = None
        if self.per_tensor:
            positions = torch.tensor(order, dtype=torch.long, device=device)
            present_mask = torch.tensor(present, dtype=torch.bool, device=device)
        whole = len(groups) == 1 and groups[0].indices == list(range(len(self.params)))
        layout = _Layout(groups, segments, device, scatter, positions, present_mask, whole)
        self._layouts[present] = layout
        return layout

    def _device(self) -> torch.device:
        return to_local(self.params[0]).device if self.params else torch.device("cpu")

    def _grouped(self, layout: _Layout) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        """The current grads per (device, dtype) group: (to measure, to clip). DTensor grads as local shards."""
        grouped = [[self.params[i].grad for i in g.indices] for g in layout.groups]
        if not self._local:
            return grouped, grouped  # type: ignore[return-value]
        clip = [[to_local(g) for g in grads] for grads in grouped]  # type: ignore[arg-type]
        measure = [
            [local_for_norm(self.params[i].grad, self.params[i]) for i in g.indices]  # type: ignore[arg-type]
            for g in layout.groups
        ]
        return measure, clip

    def _warn_empty(self) -> None:
        if self._warned_empty:
            return
        self._warned_empty = True
        rank = torch.distributed.get_rank() if is_distributed() else 0
        warnings.warn(
            f"stabilitykit: no parameter has a gradient on rank {rank}; its grad norm is 0",
            RuntimeWarning,
            stacklevel=4,
        )

    def compute(
        self,
        grad_scale: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        extra: Tensor | None = None,
    ) -> tuple[NormResult, list[list[Tensor]]]:
        """Norms of the current grads and the grads themselves grouped for ``_foreach`` ops.

        ``grad_scale``: the loss scale still applied to the grads; the returned norms are unscaled.
        ``dtype``: where the norms accumulate. fp32 (the default, the fast path) overflows once a
        tensor's sum of squares passes ~3.4e38 (a norm above ~1.8e19); fp64 does not, at many times
        the cost on the CPU, so the engine uses it only to re-measure a step whose fp32 norm overflowed.
        ``extra``: other per-row sums, shaped ``(reducer.n_rows + 1, k, n_layers)``, that ride in the
        grads' reduction (SUM, so not with the inf-norm) and are reduced in place; untouched without
        a reducer.
        """
        current = [p.grad for p in self.params]
        present = tuple([g is not None for g in current])
        self.present = present
        layout = self._layout(present)
        self._current = layout
        measure: list[list[Tensor]]
        grouped: list[list[Tensor]]
        if layout.whole and not self._local:  # the usual case: the grads as they are, one group
            measure = grouped = [current]  # type: ignore[list-item]  # every grad is present
        else:
            measure, grouped = self._grouped(layout)
        if not grouped:
            self._warn_empty()
        p = self.norm_type
        dtype = norm_dtype(dtype, [grads[0].dtype for grads in measure if grads])
        device = layout.device
        pieces = []
        for grads in measure:  # a group's grads share their parameters' dtype (torch requires it)
            if grads[0].dtype is dtype:  # no dtype to ask for: the faster call, the same norms
                piece = torch.stack(torch._foreach_norm(grads, p))  # type: ignore[arg-type]
            else:
                piece = torch.stack(torch._foreach_norm(grads, p, dtype=dtype))  # type: ignore[arg-type]
            pieces.append(piece if piece.device == device else piece.to(device))
        if not pieces:
            per_tensor = torch.zeros(0, dtype=dtype, device=layout.device)
        else:
            per_tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if self.reducer is not None:
            result = self._reduced(per_tensor, layout, self.reducer, extra)
        else:
            result = self._local_result(per_tensor, layout)
        if grad_scale is not None:
            inv = grad_scale.to(device=layout.device, dtype=dtype).reciprocal()
            result.total = result.total * inv
            result.layer_norms = result.layer_norms * inv if result.layer_norms is not None else None
            result.tensor_norms = result.tensor_norms * inv if result.tensor_norms is not None else None
        return result, grouped

    def scale_tensors(self, grouped_grads: Sequence[Sequence[Tensor]], coefs: Tensor) -> None:
        """Multiply each grad by its own coefficient in place (``coefs``: one per parameter, plan order).

        ``grouped_grads`` is what the last ``compute()`` returned: one ``_foreach_mul_`` per group.
        """
        layout = self._current
        if layout is None or layout.positions is None:
            raise RuntimeError("scale_tensors needs a per_tensor plan and a compute() first")
        if not layout.groups:
            return
        ordered = coefs.to(layout.device).index_select(0, layout.positions)
        sizes = [len(g.indices) for g in layout.groups]
        for grads, part in zip(grouped_grads, ordered.split(sizes), strict=True):
            if grads:
                torch._foreach_mul_(list(grads), list(part.to(grads[0].device).unbind()))

    def _tensor_result(self, per_tensor: Tensor, layout: _Layout) -> tuple[Tensor, Tensor] | None:
        """One process (or whole grads): each parameter's norm in plan order, and which have a grad."""
        if layout.positions is None or layout.present is None:
            return None
        norms = torch.zeros(len(self.params), dtype=per_tensor.dtype, device=layout.device)
        norms.index_copy_(0, layout.positions, per_tensor)
        return norms, layout.present

    def _local_result(self, per_tensor: Tensor, layout: _Layout) -> NormResult:
        """One process (or grads whole on every rank): sums and maxima propagate NaN by themselves."""
        p = self.norm_type
        n = len(self.layer_names) if self.per_layer else 1
        if self.per_layer and layout.segments is not None:
            if p == math.inf:
                sums = torch.zeros(n, dtype=per_tensor.dtype, device=layout.device)
                sums.scatter_reduce_(0, layout.segments, per_tensor, reduce="amax", include_self=True)
            else:  # added into a copy of zeros kept for it: one call where zeros() and index_add_() were two
                powered = per_tensor * per_tensor if p == 2.0 else _pow(per_tensor, p)
                sums = torch.index_add(self._zeros(n, per_tensor), 0, layout.segments, powered)
        elif per_tensor.numel() == 0:
            sums = torch.zeros(n, dtype=per_tensor.dtype, device=layout.device)
        elif p == math.inf:
            sums = per_tensor.max().reshape(1)
        else:
            sums = _pow(per_tensor, p).sum().reshape(1)
        if p == math.inf:
            total = sums.max()
            layers = sums if self.per_layer else None
        else:
            # the total as torch.nn.utils.clip_grad_norm_ computes it (one vector norm of the per-tensor
            # norms, in parameter order), bitwise, so a driver's clip is the framework's own
            total = torch.linalg.vector_norm(per_tensor, p) if per_tensor.numel() else _root(sums.sum(), p)
            layers = (sums.sqrt() if p == 2.0 else _root(sums, p)) if self.per_layer else None
        result = NormResult(total, layers, self.layer_names, torch.isfinite(total))
        if layout.positions is not None:
            tensors = self._tensor_result(per_tensor, layout)
            if tensors is not None:
                result.tensor_norms, result.tensor_present = tensors
        return result

    def _zeros(self, n: int, like: Tensor) -> Tensor:
        """A kept tensor of ``n`` zeros of ``like``'s dtype and device (read only: never written to)."""
        key = (n, like.dtype, like.device)
        zeros = self._zero_cache.get(key)
        if zeros is None:
            zeros = self._zero_cache[key] = torch.zeros(n, dtype=like.dtype, device=like.device)
        return zeros

    def _reduced(
        self, per_tensor: Tensor, layout: _Layout, reducer: LayoutReducer, extra: Tensor | None = None
    ) -> NormResult:
        """Distributed: pack [per-layer sums, per-layer non-finite counts] per row, reduce, combine.

        Finiteness comes from the counts, never from the reduced values (a MAX may drop a NaN).
        A non-finite total is NaN on every rank. ``extra`` columns join the packed matrix (see ``compute``).
        """
        p = self.norm_type
        n = len(self.layer_names) if self.per_layer else 1
        rows = reducer.n_rows
        width = 2 * n + self._tensor_columns
        packed = torch.zeros((rows + 1) * width, dtype=per_tensor.dtype, device=layout.device)
        if layout.scatter is not None and per_tensor.numel():
            bad = (~torch.isfinite(per_tensor)).to(per_tensor.dtype)
            powered = per_tensor if p == math.inf else _pow(per_tensor, p)
            parts = [powered, bad, bad]
            if self.per_tensor:
                parts += [powered, torch.ones_like(per_tensor)]
            if p == math.inf:
                packed.scatter_reduce_(0, layout.scatter, torch.cat(parts), reduce="amax", include_self=True)
            else:
                packed.index_add_(0, layout.scatter, torch.cat(parts))
        matrix = packed.view(rows + 1, width)
        if extra is not None:
            if p == math.inf:
                raise ValueError("extra sums ride in a SUM reduction; the inf-norm reduces with MAX")
            matrix = torch.cat([matrix, extra.to(matrix).reshape(rows + 1, -1)], dim=1)
        reducer.reduce_rows(matrix, p)
        if extra is not None:
            extra.copy_(matrix[:, width:].reshape(extra.shape))
        packed = matrix[:, : 2 * n].reshape(rows + 1, 2, n)  # a view when there are no per-tensor columns
        values, counts = packed[:rows, 0], packed[:rows, 1]
        layer_values = values.amax(0) if p == math.inf else values.sum(0)
        layer_bad = counts.sum(0)
        if reducer.world_row_folded:
            layer_bad = layer_bad + packed[rows, 1]  # world-wide per layer (same layers on every rank)
        stage = layer_values.max() if p == math.inf else layer_values.sum()
        pair = torch.stack([stage, packed[rows, 1].sum()])
        reducer.reduce_total(pair, p)
        total = pair[0] if p == math.inf else _root(pair[0], p)
        any_bad = pair[1] > 0
        finite = ~any_bad & torch.isfinite(total)
        total = torch.where(any_bad, torch.full_like(total, math.nan), total)
        layers = None
        if self.per_layer:
            layers = layer_values if p == math.inf else _root(layer_values, p)
            layers = torch.where(layer_bad > 0, torch.full_like(layers, math.nan), layers)
        result = NormResult(total, layers, self.layer_names, finite)
        if self.per_tensor:
            m = len(self.params)
            tensor_values = matrix[:rows, 2 * n : 2 * n + m]
            reduced = tensor_values.amax(0) if p == math.inf else _root(tensor_values.sum(0), p)
            result.tensor_norms = reduced
            result.tensor_present = matrix[:rows, 2 * n + m :].sum(0) > 0
        return result


def clip_coefficient(
    total: Tensor, max_norm: float | Tensor, finite: Tensor | None = None, one: Tensor | None = None
) -> Tensor:
    """``min(1, max_norm / (total + 1e-6))``, and 1 where ``total`` is not finite (``finite`` if known).

    Computed as torch's ``clip_grad_norm_`` computes it (``max_norm / tensor`` is the reciprocal times
    ``max_norm``), so the coefficient, and the clipped grads, are bitwise torch's. ``one``: a 0-d 1.0
    of ``total``'s dtype and device to select (saves making one from the Python number every call).
    """
    coef = torch.clamp((total + CLIP_EPS).reciprocal() * max_norm, max=1.0)
    return torch.where(torch.isfinite(total) if finite is None else finite, coef, 1.0 if one is None else one)


def apply_clip_coefficient(grouped_grads: Sequence[Sequence[Tensor]], coef: Tensor) -> None:
    """Multiply every grad by ``coef`` in place: one ``_foreach_mul_`` per (device, dtype) group."""
    for grads in grouped_grads:
        if grads:
            device = grads[0].device
            torch._foreach_mul_(
                grads if isinstance(grads, list) else list(grads), coef if coef.device == device else coef.to(device)
            )


def clip_to_norm(grads: Sequence[Tensor], norm: Tensor, max_norm: float) -> Tensor:
    """Clip ``grads`` in place to ``max_norm`` from their measured total ``norm``, as torch's ``clip_grad_norm_``
    does (an Inf norm zeroes them; only a NaN coefficient leaves them); returns whether a finite norm was
    above ``max_norm`` (a device bool)."""
    coef_finite = torch.isfinite(max_norm / (norm + CLIP_EPS))
    if grads:
        coef = clip_coefficient(norm, max_norm, finite=coef_finite)
        apply_clip_coefficient([[grads[i] for i in group] for group in device_groups(grads)], coef)
    return torch.isfinite(norm) & (max_norm / (norm + CLIP_EPS) < 1)


def _as_param_list(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        return [parameters]
    return list(parameters)


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor] | nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    model: nn.Module | None = None,
    extra_group: Any | None = None,
) -> Tensor:
    """Clip grads to a global norm in place and return the pre-clip total norm (fp32, on device).

    A drop-in for ``torch.nn.utils.clip_grad_norm_`` (same positional arguments and keywords;
    ``foreach`` is accepted and ignored: the pass is always fused), with the same result on finite
    grads, but a NaN/Inf total leaves the grads untouched instead of spreading NaN into every grad.
    ``error_if_nonfinite=True`` raises torch's own error text. The norm is the true global one
    under DDP, FSDP1 (every sharding strategy, hybrid included), FSDP2/HSDP and tensor parallel
    (DTensor grads on any mesh); under torch.distributed a non-finite grad on any rank makes the
    total NaN on every rank. For FSDP1 pass the wrapped module as ``parameters`` or ``model=``
    (its parameters alone raise ``ValueError``: their shards cannot be told apart).
    ``extra_group``: a process group to sum over as well, e.g. the pipeline-parallel group. The
    result is fp32 (fp64 with fp64 grads) even for fp16/bf16 grads (torch returns the grads' dtype).
    Every rank must call it (it may all-reduce), including a rank without grads.
    """
    if foreach is not None and not isinstance(foreach, bool):
        raise TypeError(
            f"clip_grad_norm_'s fifth argument is torch's foreach (None or a bool), got {type(foreach).__name__}; "
            "pass the wrapped module as model=..."
        )
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
    if isinstance(parameters, nn.Module):
        model = model or parameters
        parameters = parameters.parameters()
    params = [p for p in _as_param_list(parameters) if p.requires_grad or p.grad is not None]
    plan = GradNormPlan(params, norm_type=float(norm_type), reducer=reducer_for(params, model, extra_group))
    result, grouped = plan.compute()
    if error_if_nonfinite and not bool(result.finite):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    apply_clip_coefficient(grouped, clip_coefficient(result.total, max_norm, result.finite))
    return result.total


def grad_norms(
    model: nn.Module,
    norm_type: float = 2.0,
    grouping: str | Sequence[str] = "auto",
    extra_group: Any | None = None,
) -> dict[str, Tensor]:
    """Per-layer grad norms and the total: ``{"blocks.0": t, ..., "total": t}`` (0-d fp32 tensors).

    Global under torch.distributed like ``clip_grad_norm_``; with ``extra_group`` (pipeline
    stages) the total spans the stages and each layer's norm is its own stage's.
    """
    from stabilitykit.engine.layers import build_layer_map  # the engine imports this module

    params = [p for p in model.parameters() if p.requires_grad]
    layers = build_layer_map(params, model, grouping)
    plan = GradNormPlan(
        params,
        layers.layer_of,
        layers.layer_names,
        norm_type=float(norm_type),
        reducer=reducer_for(params, model, extra_group),
    )
    result, _ = plan.compute()
    return result.as_dict()
