"""The model's own output logits: their max |logit| and mean log Z over real (unpadded) positions.

Measured after any final soft-cap or scale (Gemma 2's cap, Cohere's ``logit_scale``): the ``logits``
of the output of the module that owns the LM head when it is a Hugging Face model (it has a
``config``), else the LM head's output. The model's ``attention_mask`` keyword (read by a pre-hook
on the model) keeps padding out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.monitors.failures import Unmeasured
from stabilitykit.monitors.select import MonitorTargets
from stabilitykit.monitors.stats import first_tensor, logit_stats
from stabilitykit.monitors.store import MetricStore


class OutputLogits:
    """Hooks that measure ``logits_max`` and ``log_z`` of the model's output logits on sampled steps."""

    def __init__(
        self,
        targets: MonitorTargets,
        positions: int | None,
        sampling: Callable[[], bool],
        store: MetricStore,
        unmeasured: Unmeasured,
    ) -> None:
        head = targets.head
        #: The metric's module name: the LM head's clean name, or ``logits``.
        self.name = head[0] if head is not None else "logits"
        self._positions = positions
        self._sampling = sampling
        self._store = store
        self._unmeasured = unmeasured
        self._mask: Tensor | None = None
        store.declare("logits_max", self.name)
        store.declare("log_z", self.name)
        root = targets.root
        from_output = head is None or getattr(root, "config", None) is not None
        self.handles: list[Any] = [targets.model.register_forward_pre_hook(self._take_mask, with_kwargs=True)]
        if from_output:
            self.handles.append(root.register_forward_hook(self._output_hook))
        elif head is not None:
            self.handles.append(head[1].register_forward_hook(self._head_hook))

    def _take_mask(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self._sampling() or not module.training:
            return
        encoder_decoder = bool(getattr(getattr(module, "config", None), "is_encoder_decoder", False))
        mask = kwargs.get("decoder_attention_mask" if encoder_decoder else "attention_mask")
        self._mask = mask if isinstance(mask, Tensor) else None

    def _head_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._sampling() or not module.training:
            return
        logits = first_tensor(output)
        if logits is not None and logits.is_floating_point() and logits.dim() > 0:
            self._logits(logits)

    # The output hook runs where the model returns, outside a compiled model's graph when the model
    # itself is compiled: kept out of Dynamo so that it compiles no graph of its own.
    @torch.compiler.disable
    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._sampling() or not module.training:
            return
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, dict):
            logits = output.get("logits")
        if isinstance(logits, Tensor) and logits.is_floating_point() and logits.dim() > 0:
            self._logits(logits)

    def _logits(self, logits: Tensor) -> None:
        mask, self._mask = self._mask, None
        if mask is not None and tuple(mask.shape) != tuple(logits.shape[:-1]):
            mask = None  # not a mask over these logits' positions
        self._unmeasured.guarded(self.name, lambda: self._measure(logits, mask))

    def _measure(self, logits: Tensor, mask: Tensor | None) -> None:
        top, log_z = logit_stats(logits, self._positions, mask)
        self._store.keep("logits_max", self.name, top)
        self._store.keep("log_z", self.name, log_z)

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
