"""QK-clip (MuonClip, Kimi K2): rescale a head's query and key rows after the optimizer step
whenever its largest pre-softmax attention logit exceeded a threshold ``tau``.

For a head whose max logit ``S`` this step exceeded ``tau``, with ``eta = tau / S``, the rows of
its query projection are multiplied by ``eta ** query_share`` (the paper's alpha) and the rows of its key
projection by ``eta ** (1 - query_share)``: its logits scale by ``eta`` and the max becomes ``tau``. Other heads are
untouched (factor exactly 1, so bitwise unchanged). Megatron-LM ships it as
``qk_clip_threshold=100``, ``qk_clip_alpha=0.5``.

Any attention module takes part by implementing ``QKClipTarget`` (three members, see there).
``QKClip(model)`` finds those modules, asks them to track per-head max logits on every training
forward, keeps the running max over a step's forwards (gradient accumulation) through a forward
hook, and ``apply()`` rescales on the device: a few vectorised ops per module, one
``torch._foreach_mul_`` for all of them, no host sync.

Grouped-query attention (fewer key heads than query heads) follows Megatron-LM: the query heads
sharing a key head form a group, the group's max logit is the max over its query heads, and the
group's ``eta`` scales all of its query heads (``eta ** query_share``) and its key head
(``eta ** (1 - query_share)``). A group under ``tau`` is untouched.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast, runtime_checkable

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor, nn

from stabilitykit.distributed import all_reduce, is_distributed, is_dtensor, to_local
from stabilitykit.section import Section


class QKClipConfig(Section):
    """QK-clip (MuonClip): after each optimizer step, rescale the q/k rows of heads whose max logit exceeded tau."""

    enabled: bool = Field(
        False,
        description=(
            "Run stabilitykit.nn.QKClip after every optimizer step that is not skipped; the model needs "
            "attention modules implementing stabilitykit.nn.QKClipTarget."
        ),
    )
    threshold: float = Field(
        100.0,
        gt=0,
        allow_inf_nan=False,
        description="tau: the largest max pre-softmax logit a head keeps (Megatron: 100).",
    )
    query_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Share of the rescale on the queries (the paper's alpha: eta ** query_share); keys get "
            "eta ** (1 - query_share)."
        ),
    )


@dataclass(frozen=True)
class QKLayout:
    """Where a module's query and key heads live in its projection weights.

    Rows are head-major: query head ``h`` is rows ``q_row + h * head_dim`` up to
    ``q_row + (h + 1) * head_dim`` of ``q_weight`` (and of ``q_bias``), key head ``g`` likewise
    from ``k_row`` in ``k_weight``. A fused ``qkv`` Linear passes the same weight twice with
    ``k_row = num_heads * head_dim`` (see ``fused``); separate projections pass each (``separate``).

    ``num_heads`` is the number of query heads the module's forward computes in this process: all
    of them, or under tensor parallelism (separate q/k projections sharded by rows, each rank
    computing its own heads) the local ones. QK-clip then rescales the local rows.
    """

    num_heads: int
    head_dim: int
    q_weight: Tensor
    k_weight: Tensor
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None
    num_kv_heads: int | None = None  #: key heads; None: ``num_heads`` (no grouped-query attention)
    q_row: int = 0
    k_row: int | None = None  #: None: ``num_heads * head_dim`` when ``k_weight is q_weight``, else 0

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def k_start(self) -> int:
        if self.k_row is not None:
            return self.k_row
        return self.q_row + self.num_heads * self.head_dim if self.k_weight is self.q_weight else 0

    @classmethod
    def fused(cls, qkv: nn.Linear, num_heads: int, head_dim: int, num_kv_heads: int | None = None) -> QKLayout:
        """A fused projection whose output is ``[q heads | k heads | v heads]`` (nanoGPT, many others)."""
        return cls(num_heads, head_dim, qkv.weight, qkv.weight, qkv.bias, qkv.bias, num_kv_heads)

    @classmethod
    def separate(
        cls, q_proj: nn.Linear, k_proj: nn.Linear, num_heads: int, head_dim: int, num_kv_heads: int | None = None
    ) -> QKLayout:
        """Separate ``q_proj`` and ``k_proj`` Linears (Llama, Qwen, Mistral, torchtitan)."""
        return cls(num_heads, head_dim, q_proj.weight, k_proj.weight, q_proj.bias, k_proj.bias, num_kv_heads)


@runtime_checkable
class QKClipTarget(Protocol):
    """An attention module QK-clip can rescale.

    * ``qk_clip_tracking``: set to True by ``QKClip``; while it is True, every training forward
      computes the per-head max pre-softmax logit (after any qk-norm, before any soft-cap or mask
      value is added: the masked-out positions do not count).
    * ``qk_clip_layout()``: the projection weights and the row layout of the heads (``QKLayout``).
      Called on every ``apply``, so parameters replaced later (``load_state_dict(assign=True)``,
      sharding) are picked up.
    * ``qk_clip_max_logits()``: the (num_heads,) device tensor of the last forward's per-head max
      logits, or None when that forward did not compute one.
    """

    qk_clip_tracking: bool

    def qk_clip_layout(self) -> QKLayout: ...

    def qk_clip_max_logits(self) -> Tensor | None: ...


def is_qk_clip_target(module: object) -> bool:
    """True when ``module`` has the three members of ``QKClipTarget``."""
    return isinstance(module, QKClipTarget)


def _local_rows(vector: Tensor, weight: Tensor) -> Tensor:
    """The entries of a per-row vector (global rows) for the rows of ``weight`` this process holds."""
    if not is_dtensor(weight):
        return vector
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = weight.device_mesh  # type: ignore[attr-defined]
    placements = [p if p.is_shard(0) else Replicate() for p in weight.placements]  # type: ignore[attr-defined]
    return distribute_tensor(vector, mesh, placements, src_data_rank=None).to_local()


class _Entry:
    """One target module: its name, the running max of its per-head logits this step, its hook."""

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.target = cast(QKClipTarget, module)
        self.running: Tensor | None = None
        self.handle: Any = None


class QKClip:
    """QK-clip over every ``QKClipTarget`` module of ``model``: ``opt.step(); qk.apply()``.

    ``threshold``: tau, the largest max logit a head keeps. ``query_share``: the share of the rescale
    put on the queries (0.5: split evenly). ``params``: only modules whose query weight is among
    these are clipped (the driver passes its optimizer's parameters, so two optimizers never clip
    twice). ``group``: ranks whose forwards saw different data of the same heads; their per-head
    maxima are MAX-reduced over it in one all-reduce per ``apply``. ``"auto"``: the default
    process group when torch.distributed runs (DDP, FSDP, HSDP), except for modules whose heads
    are split by tensor parallelism (no reduction for those: every tensor-parallel rank sees the
    same data). Pass the data-parallel group for tensor parallel + data parallel, or pipelines.
    """

    def __init__(
        self,
        model: nn.Module,
        threshold: float = 100.0,
        query_share: float = 0.5,
        params: Iterable[Tensor] | None = None,
        group: Any = "auto",
    ) -> None:
        if isinstance(threshold, bool) or not math.isfinite(threshold) or threshold <= 0:
            raise ValueError(f"QKClip: threshold must be a finite number > 0, got {threshold!r}")
        if not 0.0 <= query_share <= 1.0:
            raise ValueError(f"QKClip: query_share must lie in [0, 1], got {query_share!r}")
        self.threshold = float(threshold)
        self.query_share = float(query_share)
        self.group = group
        self.entries = [_Entry(n, m) for n, m in model.named_modules() if is_qk_clip_target(m)]
        if not self.entries:
            raise ValueError(
                f"QKClip: no module of {type(model).__name__} implements stabilitykit.nn.QKClipTarget "
                "(qk_clip_tracking, qk_clip_layout(), qk_clip_max_logits()); use "
                "stabilitykit.nn.QKNormAttention(qk_norm=False) or add those three members to your attention "
                "module (docs: guides/qk-clip.md)"
            )
        if params is not None:
            ids = {id(p) for p in params}
            self.entries = [e for e in self.entries if id(e.target.qk_clip_layout().q_weight) in ids]
        for entry in self.entries:
            self._mode(entry, entry.target.qk_clip_layout())  # a layout that does not fit fails here, by name
        for entry in self.entries:
            entry.target.qk_clip_tracking = True
            entry.handle = entry.module.register_forward_hook(functools.partial(self._record, entry))
        self._last: dict[str, Tensor] = {}

    @classmethod
    def from_config(
        cls, config: QKClipConfig, model: nn.Module | None, params: Iterable[Tensor] | None = None
    ) -> QKClip | None:
        """The driver's QK-clip for ``StabilityConfig.qk_clip``: None when it is off, or when no target
        module's weights are among ``params`` (another optimizer's engine clips them)."""
        if not config.enabled:
            return None
        if model is None:
            raise ValueError("StabilityConfig.qk_clip.enabled needs the model: pass it to the guard or engine")
        try:
            clip = cls(model, config.threshold, config.query_share, params=params)
        except ValueError as exc:
            raise ValueError(f"StabilityConfig.qk_clip.enabled is True, but {exc}") from exc
        return clip if clip.entries else None

    # ------------------------------------------------------------------ tracking

    def _record(self, entry: _Entry, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: fold this forward's per-head max logits into the step's running max."""
        if not module.training:
            return
        latest = entry.target.qk_clip_max_logits()
        if latest is None:
            return
        latest = latest.detach().float()
        entry.running = latest if entry.running is None else torch.maximum(entry.running, latest)

    def remove(self) -> None:
        """Detach from the model: hooks removed, tracking off."""
        for entry in self.entries:
            if entry.handle is not None:
                entry.handle.remove()
                entry.handle = None
            entry.target.qk_clip_tracking = False

    # ------------------------------------------------------------------ layout

    def _mode(self, entry: _Entry, lay: QKLayout) -> Literal["global", "local"]:
        """Whose heads the rows are: "local" when tensor parallelism split them (each rank computes and
        owns some heads), else "global" (all heads, whatever part of the rows this process stores)."""
        hq, hkv, d = lay.num_heads, lay.kv_heads, lay.head_dim
        where = f"QKClip: module {entry.name!r} ({type(entry.module).__name__})"
        if hq < 1 or d < 1 or hkv < 1 or hq % hkv:
            raise ValueError(f"{where}: num_heads ({hq}) must be a positive multiple of num_kv_heads ({hkv})")
        q, k = lay.q_weight, lay.k_weight
        if (
            is_dtensor(q)
            and is_dtensor(k)
            and q is not lay.k_weight
            and lay.q_row == 0
            and lay.k_start == 0
            and to_local(q).shape[0] == hq * d != q.shape[0]
        ):
            if to_local(k).shape[0] != hkv * d:
                raise ValueError(
                    f"{where}: the query rows are split by heads ({hq} local heads) but the local key rows "
                    f"({to_local(k).shape[0]}) are not {hkv} heads of {d}"
                )
            return "local"
        if is_dtensor(q) and q is not k and lay.q_row == 0 and hq * d != q.shape[0]:
            raise ValueError(
                f"{where}: its {hq} query heads cover neither all {q.shape[0]} rows of its sharded q weight nor "
                f"the {to_local(q).shape[0]} rows this rank holds; QK-clip supports FSDP/DDP (all heads computed) "
                "or tensor parallelism (each rank computes the heads it holds), not both on one weight"
            )
        if lay.q_row + hq * d > q.shape[0] or lay.k_start + hkv * d > k.shape[0]:
            raise ValueError(
                f"{where}: {hq} query heads from row {lay.q_row} and {hkv} key heads from row {lay.k_start} "
                f"(head_dim {d}) do not fit its weights of {q.shape[0]} and {k.shape[0]} rows"
            )
        return "global"

    # ------------------------------------------------------------------ the step

    def _maxima(self, layouts: list[QKLayout], skip_reduce: list[bool]) -> list[Tensor]:
        """Each module's per-head max logits of this step (-inf where no forward ran), reduced over ranks."""
        maxima = []
        for entry, lay in zip(self.entries, layouts, strict=True):
            if entry.running is not None:
                maxima.append(entry.running)
            else:
                device = to_local(lay.q_weight).device
                maxima.append(torch.full((lay.num_heads,), -math.inf, device=device))
        group = self.group
        if isinstance(group, str):
            group = dist.group.WORLD if is_distributed() else None
            reduce = [not local for local in skip_reduce]
        else:
            reduce = [True] * len(maxima)
        chosen = [m for m, r in zip(maxima, reduce, strict=True) if r]
        if group is None or not chosen:
            return maxima
        packed = torch.cat(chosen)
        packed = torch.where(torch.isnan(packed), math.inf, packed)  # a NaN must survive MAX on every backend
        all_reduce(packed, dist.ReduceOp.MAX, group)
        parts = iter(packed.split([m.numel() for m in chosen]))
        return [next(parts) if r else m for m, r in zip(maxima, reduce, strict=True)]

    @torch.no_grad()
    def apply(self, skip: Tensor | None = None) -> None:
        """Rescale the q and k rows of every head whose max logit this step exceeded the threshold.

        ``skip``: a 0-d device bool; where it is true nothing changes (a skipped step). A non-finite
        max logit never rescales. No host sync. The running maxima start afresh afterwards.
        """
        layouts = [entry.target.qk_clip_layout() for entry in self.entries]
        modes = [self._mode(entry, lay) for entry, lay in zip(self.entries, layouts, strict=True)]
        maxima = self._maxima(layouts, [mode == "local" for mode in modes])
        tensors: list[Tensor] = []
        factors: list[Tensor] = []
        clipped: list[Tensor] = []
        last: dict[str, Tensor] = {}
        for entry, lay, mode, head_max in zip(self.entries, layouts, modes, maxima, strict=True):
            entry.running = None
            if head_max.shape != (lay.num_heads,):
                raise ValueError(
                    f"QKClip: module {entry.name!r} returned max logits of shape {tuple(head_max.shape)}, "
                    f"expected ({lay.num_heads},) (one per query head)"
                )
            group_size = lay.num_heads // lay.kv_heads
            group_max, over = self._groups_over(lay, head_max)
            if skip is not None:
                over = over & ~skip
            eta = torch.where(over, torch.full_like(group_max, self.threshold) / group_max, 1.0)
            rows_q = eta.pow(self.query_share).repeat_interleave(group_size * lay.head_dim)
            rows_k = eta.pow(1.0 - self.query_share).repeat_interleave(lay.head_dim)
            for tensor, factor in self._row_factors(lay, mode, rows_q, rows_k):
                tensors.append(tensor)
                factors.append(factor)
            clipped.append(over.sum() * group_size)
            last[f"qk_clip/max_logit/{entry.name}"] = head_max.amax()
        if tensors:
            torch._foreach_mul_(tensors, factors)
        if clipped:
            last["qk_clip/heads_clipped"] = torch.stack(clipped).sum().float()
        self._last = last

    def _groups_over(self, lay: QKLayout, head_max: Tensor) -> tuple[Tensor, Tensor]:
        """Per key-head group: the max logit over its query heads, and whether it is finite and above tau."""
        group_max = head_max.view(lay.kv_heads, lay.num_heads // lay.kv_heads).amax(dim=1)
        return group_max, torch.isfinite(group_max) & (group_max > self.threshold)

    @staticmethod
    def _row_factors(lay: QKLayout, mode: str, rows_q: Tensor, rows_k: Tensor) -> list[tuple[Tensor, Tensor]]:
        """(local tensor, broadcastable factor) for each distinct weight and bias of the layout."""
        vectors: dict[int, tuple[Tensor, Tensor]] = {}
        segments = [
            (lay.q_weight, lay.q_row, rows_q),
            (lay.q_bias, lay.q_row, rows_q),
            (lay.k_weight, lay.k_start, rows_k),
            (lay.k_bias, lay.k_start, rows_k),
        ]
        for param, start, rows in segments:
            if param is None:
                continue
            if id(param) not in vectors:
                n = param.shape[0] if mode == "global" else to_local(param).shape[0]
                vectors[id(param)] = (param, torch.ones(n, dtype=torch.float32, device=rows.device))
            vectors[id(param)][1].narrow(0, start, rows.numel()).copy_(rows)
        out = []
        for param, vector in vectors.values():
            local = to_local(param)
            factor = _local_rows(vector, param) if mode == "global" else vector
            out.append((local, factor.view(-1, *([1] * (local.dim() - 1)))))
        return out

    # ------------------------------------------------------------------ metrics

    def stability_metrics(self) -> dict[str, Tensor]:
        """Device tensors for the engine's logging-step read: ``qk_clip/heads_clipped`` and
        ``qk_clip/max_logit/<module name>``.

        They describe the latest step: when forwards ran since the last ``apply`` (a driver reads
        metrics before its optimizer step), this rank's max logits so far and the heads above the
        threshold (clipped at this step's ``apply`` unless the step is skipped); otherwise what
        the last ``apply`` saw (reduced over ranks) and did.
        """
        if not any(entry.running is not None for entry in self.entries):
            return dict(self._last)
        metrics: dict[str, Tensor] = {}
        over: list[Tensor] = []
        for entry in self.entries:
            if entry.running is None:
                continue
            lay = entry.target.qk_clip_layout()
            _, above = self._groups_over(lay, entry.running)
            over.append(above.sum() * (lay.num_heads // lay.kv_heads))
            metrics[f"qk_clip/max_logit/{entry.name}"] = entry.running.amax()
        metrics["qk_clip/heads_clipped"] = torch.stack(over).sum().float()
        return metrics

    def __repr__(self) -> str:
        names = ", ".join(e.name for e in self.entries[:3]) + (", ..." if len(self.entries) > 3 else "")
        return f"QKClip(threshold={self.threshold}, query_share={self.query_share}, modules=[{names}])"
