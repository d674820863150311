"""Capturing every module's forward output and input gradient, sampled deterministically, in fp32."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn


def _floats(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _floats(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _floats(item)


def sample(tensors: list[Tensor], max_elements: int) -> Tensor:
    """All floating values of ``tensors`` flattened in order, strided down to at most ``max_elements`` (fp32, CPU).

    The stride depends only on the sizes, so the reference and every variant sample the same positions.
    """
    flat = (
        torch.cat([t.detach().reshape(-1).float() for t in tensors])
        if len(tensors) > 1
        else tensors[0].detach().reshape(-1).float()
    )
    n = flat.numel()
    if n > max_elements:
        stride = math.ceil(n / max_elements)
        flat = flat[::stride]
    return flat.cpu()


class Capture:
    """Forward hooks and full backward hooks on every submodule; keyed by name and call index.

    ``forward`` and ``backward`` are ordered dicts in execution order: ``{"blocks.0.attn": sample}``;
    a module called twice gets ``"name#1"`` for its second call.
    """

    def __init__(self, model: nn.Module, max_elements: int = 4096, grad_scale: float = 1.0) -> None:
        self.model = model
        self.max_elements = max_elements
        self.grad_scale = grad_scale
        self.forward: dict[str, Tensor] = {}
        self.backward: dict[str, Tensor] = {}
        self._calls: dict[str, int] = {}
        self._bwd_calls: dict[str, int] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> Capture:
        for name, module in self.model.named_modules():
            if not name:
                continue
            self._handles.append(module.register_forward_hook(self._fwd(name)))
            self._handles.append(module.register_full_backward_hook(self._bwd(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @staticmethod
    def _key(name: str, counts: dict[str, int]) -> str:
        index = counts.get(name, 0)
        counts[name] = index + 1
        return name if index == 0 else f"{name}#{index}"

    def _fwd(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            tensors = list(_floats(output))
            if tensors:
                self.forward[self._key(name, self._calls)] = sample(tensors, self.max_elements)

        return hook

    def _bwd(self, name: str) -> Any:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            tensors = [g for g in _floats(grad_input) if g is not None]
            if tensors:
                values = sample(tensors, self.max_elements)
                self.backward[self._key(name, self._bwd_calls)] = values / self.grad_scale

        return hook
