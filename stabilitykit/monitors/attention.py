"""Attention capture: the largest attention logit, measured at the call that computes the attention.

Every attention we know of ends in one call that receives the final query and key (after rotary,
QK-norm and scaling) with the mask, the window and the soft-cap already folded in:

* ``F.scaled_dot_product_attention(query, key, value, attn_mask, is_causal, scale, enable_gqa)``:
  Hugging Face's ``sdpa`` attention function, timm, nanoGPT-style modules and
  ``nn.MultiheadAttention(need_weights=False)`` (``nn.TransformerEncoderLayer``) call it. The max
  logit is recomputed from exactly these tensors: ``q·kᵀ * scale`` (``1/sqrt(head_dim)`` when
  ``scale`` is None), grouped-query heads as ``enable_gqa`` says, the boolean mask as positions
  allowed, a float mask added, ``is_causal`` as SDPA's own top-left causal mask.
* ``F.softmax(scores)``: every eager attention (Hugging Face's ``eager_attention_forward`` and the
  eager paths of GPT-2, BERT, T5, ViT, GPT-NeoX, ``nn.MultiheadAttention(need_weights=True)``)
  normalises its pre-softmax logits with it, after the mask (an additive ``finfo.min`` or
  ``torch.where``), the sliding window, relative position biases and the soft-cap. The max logit is
  the max of that very input.

While a monitor exists, these two functions of ``torch.nn.functional`` are replaced by thin
wrappers (restored when the last monitor closes). A wrapper measures only while a monitored
attention module's forward runs on a sampled step; otherwise it calls the original function and
nothing else, so an unsampled step dispatches exactly the bare model's device ops. Monitored
attention modules are the innermost modules whose class name contains ``Attention`` or ``Attn``
(``LlamaAttention``, ``GPT2Attention``, ``T5Attention``, timm's ``Attention``,
``nn.MultiheadAttention``, a user's ``CausalSelfAttention``); a forward pre-hook marks the module
whose forward is running. A module whose forward made neither call on a sampled step (a flash or
custom kernel, ``Tensor.softmax``) is reported as not measured.

The value is the signed maximum (the logit that saturates a softmax; QK-clip and
``QKNormAttention`` measure the same), over every head and every position the mask allows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.compat.functional import FunctionalWrappers

#: Receives (module name, 0-d device tensor) for each measured attention call.
Keep = Callable[[str, Tensor], None]


def sdpa_max_logit(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """The largest logit ``F.scaled_dot_product_attention`` computes before its softmax, in float32.

    Same arguments as SDPA. ``query``: (..., H, L, D); ``key``: (..., H_kv, S, D). A boolean mask
    marks the positions that take part, a float mask is added; ``is_causal`` hides the positions
    above the top-left diagonal, as SDPA does.
    """
    q, k = query.detach(), key.detach()
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1))  # a fresh tensor: masked in place below
    mask = attn_mask.detach() if attn_mask is not None else None
    additive = mask is not None and mask.dtype != torch.bool
    if additive or factor < 0:
        scores.mul_(factor)  # an added mask comes after the scale
    if is_causal:
        length, source = scores.shape[-2:]
        hidden = torch.ones(length, source, dtype=torch.bool, device=scores.device).triu_(1)
        scores.masked_fill_(hidden, -torch.inf)
    if mask is not None:
        if additive:
            scores.add_(mask.float())
        else:
            scores.masked_fill_(~mask, -torch.inf)
    top = scores.amax()
    return top if additive or factor < 0 else top * factor  # max(x) * s == max(x * s) for s >= 0


def _is_attention(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return isinstance(module, nn.MultiheadAttention) or "attention" in name or "attn" in name


def attention_modules(named: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The innermost attention modules of ``named`` (``named_modules()`` order): those whose class
    name says attention and that hold no other such module (``BertSelfAttention``, not
    ``BertAttention``)."""
    candidates = [(n, m) for n, m in named if _is_attention(m)]
    return [(n, m) for n, m in candidates if not any(c is not m and _is_attention(c) for c in m.modules())]


class _Current:
    """The capture whose attention module's forward is running on a sampled step."""

    def __init__(self) -> None:
        self.capture: AttentionCapture | None = None
        self.name: str = ""


_CURRENT = _Current()


def _sdpa_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def sdpa(*args: Any, **kwargs: Any) -> Any:
        capture = _CURRENT.capture
        if capture is not None:
            capture.measure_sdpa(_CURRENT.name, args, kwargs)
        return original(*args, **kwargs)

    return sdpa


def _softmax_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def softmax(*args: Any, **kwargs: Any) -> Any:
        capture = _CURRENT.capture
        if capture is not None:
            capture.measure_softmax(_CURRENT.name, args, kwargs)
        return original(*args, **kwargs)

    return softmax


#: Installed in ``torch.nn.functional`` while any capture is open.
_ATTENTION_CALLS = FunctionalWrappers({"scaled_dot_product_attention": _sdpa_wrapper, "softmax": _softmax_wrapper})


class AttentionCapture:
    """Marks the running attention module on sampled steps and measures its attention call.

    ``active()`` says whether the coming forward passes are sampled; ``keep(name, value)`` keeps a
    value; ``failed(name, reason)`` is told once when measuring a module raised (the module is then
    left alone: the step itself never sees the exception).
    """

    def __init__(
        self,
        modules: list[tuple[str, nn.Module]],
        active: Callable[[], bool],
        keep: Keep,
        failed: Callable[[str, str], None],
    ) -> None:
        self.modules = modules
        self.active = active
        self.keep = keep
        self.failed = failed
        #: Modules whose measurement raised: never measured again.
        self.disabled: set[str] = set()
        self.handles: list[Any] = []
        self._outer: list[tuple[AttentionCapture | None, str]] = []
        _ATTENTION_CALLS.acquire()
        self._patched = True
        for name, module in modules:
            if callable(getattr(module, "stability_metrics", None)):
                continue  # measures itself (QKNormAttention): attention/max_logit
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._exit(name), always_call=True))

    @property
    def names(self) -> list[str]:
        """The attention modules this capture watches."""
        return [n for n, m in self.modules if not callable(getattr(m, "stability_metrics", None))]

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self.active() or not module.training or name in self.disabled:
                return
            self._outer.append((_CURRENT.capture, _CURRENT.name))
            _CURRENT.capture, _CURRENT.name = self, name

        return hook

    def _exit(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _CURRENT.capture is self and _CURRENT.name == name and self._outer:
                _CURRENT.capture, _CURRENT.name = self._outer.pop()

        return hook

    def measure_sdpa(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Measure an ``F.scaled_dot_product_attention`` call made in ``name``'s forward."""
        try:
            params = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            bound = dict(zip(params, args, strict=False)) | kwargs
            value = sdpa_max_logit(
                bound["query"],
                bound["key"],
                bound.get("attn_mask"),
                bool(bound.get("is_causal", False)),
                bound.get("scale"),
                bool(bound.get("enable_gqa", False)),
            )
        except Exception as error:  # a measurement never breaks the user's step
            self._fail(name, f"its scaled_dot_product_attention call could not be measured ({error})")
            return
        self.keep(name, value)

    def measure_softmax(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Measure the input of an ``F.softmax`` call made in ``name``'s forward: the pre-softmax logits."""
        try:
            scores = args[0] if args else kwargs["input"]
            value = scores.detach().amax().float()
        except Exception as error:  # a measurement never breaks the user's step
            self._fail(name, f"its softmax call could not be measured ({error})")
            return
        self.keep(name, value)

    def _fail(self, name: str, reason: str) -> None:
        self.disabled.add(name)
        self.failed(name, reason)

    def close(self) -> None:
        """Remove the hooks and, with the last monitor, the wrappers."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if _CURRENT.capture is self:
            _CURRENT.capture, _CURRENT.name = None, ""
        if self._patched:
            self._patched = False
            _ATTENTION_CALLS.release()
