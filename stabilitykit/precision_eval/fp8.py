"""The precision report's "fp8" variant: the model's linear layers converted with torchao.

A copy of the model gets torchao's ``convert_to_float8_training`` with the recipe this project tested
(dynamic tensorwise scaling: e4m3 input and weight, e5m2 output gradient), emulated where the device
has no FP8 matmul (the casts are the real ones; the matmuls run on the dequantized values). Everything
else runs as the fp32 reference does, so the rows isolate what FP8 casting costs each layer. The
layers left in high precision (not an ``nn.Linear``, or a weight dimension not divisible by 16) are
listed with the reason in ``notes``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from stabilitykit.compat import torchao_float8


class Fp8Transform:
    """``model -> model``: convert the linear layers with torchao; ``notes`` says what it did.

    Raises ImportError naming the ``fp8`` extra when torchao is missing (when built, before any run).
    """

    def __init__(self, recipe: str = torchao_float8.TESTED_RECIPE, emulate: bool | None = None) -> None:
        if not torchao_float8.available():
            raise ImportError(f"the precision report's 'fp8' variant: {torchao_float8.INSTALL_HINT}")
        self.recipe = recipe
        self.emulate = emulate
        self.notes: dict[str, Any] = {}

    def __call__(self, model: nn.Module) -> nn.Module:
        device = next((p.device for p in model.parameters()), None)
        emulate = self.emulate
        if emulate is None:
            emulate = device is None or not torchao_float8.device_has_fp8_matmul(device)
        conversion = torchao_float8.convert(model, emulate=emulate, recipe=self.recipe)
        self.notes = conversion.to_dict()
        return model
