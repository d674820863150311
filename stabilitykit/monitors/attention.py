"""Attention probes: the largest attention logit of attention modules we did not write.

A probe reads the query and key projections of one attention module with forward hooks and
computes ``max |q·kᵀ| * scaling`` on the device (``stats.max_attention_logit``), whatever kernel the
module then runs (eager, SDPA, flash): the logits are rebuilt from q and k, never read from the
kernel. Recognised layouts:

* separate ``q_proj`` / ``k_proj`` children (HF Llama, Mistral, Qwen2/3, Gemma, ...): their outputs,
  the optional per-head ``q_norm`` / ``k_norm``, and the rotary embedding the module receives as its
  ``position_embeddings`` keyword (cos, sin), applied with the model file's own
  ``apply_rotary_pos_emb``;
* separate ``query`` / ``key`` children (HF BERT / ViT style), as above without rotary;
* a fused ``c_attn`` (HF GPT-2) or ``qkv`` child (timm, nanoGPT-style models): its output split
  into [q | k | v] along the features.

The scale is the module's own ``scaling`` (HF sets it, GPT-2's inverse layer index included) or
``scale`` (timm) when it has one, else ``1/sqrt(head_dim)``. The causal mask follows the module's
``is_causal`` attribute (True when it has none, or as ``MonitorConfig.causal`` says). Padding
masks and sliding windows are not applied.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.monitors.stats import max_attention_logit

__all__ = ["AttentionProbe", "FusedQKVProbe", "QKProjProbe", "attention_probe"]

#: Receives (metric kind, module name, 0-d device tensor) from a probe.
Record = Callable[[str, str, Tensor], None]
#: True on sampled steps; read first by every hook.
Active = Callable[[], bool]


def _head_dim(module: nn.Module, q_width: int | None) -> int | None:
    """The head dim from the module's attributes or its ``config``, else the query width / heads."""
    config = getattr(module, "config", None)
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    heads = next(
        (h for h in (getattr(module, a, None) for a in ("num_heads", "n_head", "n_heads", "num_attention_heads"))
         if isinstance(h, int) and h > 0),
        getattr(config, "num_attention_heads", None),
    )  # fmt: skip
    if isinstance(heads, int) and heads > 0 and q_width:
        return q_width // heads
    return None


def _scaling(module: nn.Module, head_dim: int) -> float:
    for attribute in ("scaling", "scale"):
        scaling = getattr(module, attribute, None)
        if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
            return float(scaling)
    return 1.0 / math.sqrt(head_dim)


def _out_features(module: nn.Module | None) -> int | None:
    """A projection's output width: ``nn.Linear.out_features`` or GPT-2 ``Conv1D.nf``."""
    width = getattr(module, "out_features", None) or getattr(module, "nf", None)
    return int(width) if isinstance(width, int) else None


class AttentionProbe:
    """Hooks on one attention module; ``close()`` removes them. Subclasses say where q and k come from."""

    def __init__(
        self, name: str, module: nn.Module, head_dim: int, active: Active, record: Record, causal: bool | None
    ) -> None:
        self.name = name
        self.module = module
        self.head_dim = head_dim
        self.scaling = _scaling(module, head_dim)
        self.causal = bool(getattr(module, "is_causal", True)) if causal is None else causal
        self.active = active
        self.record = record
        self.handles: list[Any] = []

    def _emit(self, q: Tensor, k: Tensor) -> None:
        """q: (B, H, T, D), k: (B, H_kv, T, D): record this module's max logit."""
        self.record("attn_logit_max", self.name, max_attention_logit(q, k, self.scaling, self.causal))

    def _split(self, x: Tensor) -> Tensor:
        """(B, T, H*D) -> (B, H, T, D)."""
        return x.detach().unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class QKProjProbe(AttentionProbe):
    """``q_proj`` / ``k_proj`` (or ``query`` / ``key``) outputs, per-head norms and the rotary
    ``position_embeddings`` keyword."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        head_dim: int,
        active: Active,
        record: Record,
        causal: bool | None,
        children: tuple[str, str] = ("q_proj", "k_proj"),
    ) -> None:
        super().__init__(name, module, head_dim, active, record, causal)
        self._q: Tensor | None = None
        self._k: Tensor | None = None
        self._rope: Any = None
        self._rotate = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
        q_proj, k_proj = module.get_submodule(children[0]), module.get_submodule(children[1])
        self.handles = [
            module.register_forward_pre_hook(self._enter, with_kwargs=True),
            q_proj.register_forward_hook(self._take_q),
            k_proj.register_forward_hook(self._take_k),
            module.register_forward_hook(self._exit),
        ]

    def _enter(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self.active() or not module.training:
            return
        self._rope = kwargs.get("position_embeddings")

    def _take_q(self, module: nn.Module, args: Any, output: Tensor) -> None:
        if not self.active() or not module.training:
            return
        self._q = output

    def _take_k(self, module: nn.Module, args: Any, output: Tensor) -> None:
        if not self.active() or not module.training:
            return
        self._k = output

    def _norm(self, which: str, x: Tensor) -> Tensor:
        """The module's own per-head ``q_norm`` / ``k_norm`` (Qwen3, Gemma 3), applied as it does."""
        norm = getattr(self.module, which, None)
        return norm(x) if isinstance(norm, nn.Module) else x

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.active() or not module.training:
            return
        q_out, k_out, rope = self._q, self._k, self._rope
        self._q = self._k = self._rope = None
        if q_out is None or k_out is None:
            return
        with torch.no_grad():  # a measurement: nothing here joins the graph the loss backpropagates through
            q = self._norm("q_norm", self._split(q_out))
            k = self._norm("k_norm", self._split(k_out))
            if rope is not None and self._rotate is not None:
                cos, sin = rope
                q, k = self._rotate(q, k, cos, sin)
            self._emit(q, k)


class FusedQKVProbe(AttentionProbe):
    """GPT-2's ``c_attn`` or a ``qkv`` projection: one output that is [q | k | v] along the features."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        head_dim: int,
        active: Active,
        record: Record,
        causal: bool | None,
        child: str = "c_attn",
    ) -> None:
        super().__init__(name, module, head_dim, active, record, causal)
        projection = module.get_submodule(child)
        self.width = (_out_features(projection) or 0) // 3
        self.handles = [projection.register_forward_hook(self._take)]

    def _take(self, module: nn.Module, args: Any, output: Tensor) -> None:
        if not self.active() or not module.training:
            return
        qkv = output.detach()
        self._emit(self._split(qkv[..., : self.width]), self._split(qkv[..., self.width : 2 * self.width]))


def attention_probe(
    name: str, module: nn.Module, active: Active, record: Record, causal: bool | None = None
) -> AttentionProbe | None:
    """A probe for ``module`` when it is an attention module of a recognised layout, else None.

    ``causal``: mask the logits causally (None: the module's ``is_causal``, True without one).
    Modules that measure themselves (``stability_metrics()``: ``QKNormAttention``) are left alone.
    """
    if callable(getattr(module, "stability_metrics", None)):
        return None
    children = dict(module.named_children())
    for q_name, k_name in (("q_proj", "k_proj"), ("query", "key")):
        if q_name in children and k_name in children:
            head_dim = _head_dim(module, _out_features(children[q_name]))
            if head_dim is None:
                return None
            return QKProjProbe(name, module, head_dim, active, record, causal, (q_name, k_name))
    for fused in ("c_attn", "qkv"):
        width = _out_features(children.get(fused))
        if width and width % 3 == 0 and not getattr(module, "is_cross_attention", False):
            head_dim = _head_dim(module, width // 3)
            if head_dim is None:
                return None
            return FusedQKVProbe(name, module, head_dim, active, record, causal, fused)
    return None
