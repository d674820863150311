"""torchao float8 training: the one place that imports torchao and reads its ``Float8Linear`` layers.

torchao (the ``fp8`` extra) swaps ``nn.Linear`` layers for ``Float8Linear``, whose matmuls cast the
input, the weight and the output gradient to float8 with a scale computed from each tensor's amax
(dynamic scaling). stabilitykit uses it for three things, all here:

* the precision report's ``"fp8"`` variant converts a copy of a model (``convert``), emulated where
  the device has no FP8 matmul, and says which linear layers it left in high precision and why;
* the FP8 monitors re-run the very cast a layer runs on the tensors it receives (``role_casts``,
  ``cast_stats``): torchao's own ``tensor_to_scale`` and ``to_fp8_saturated``, with the layer's
  own cast configuration (dtype, granularity, axis, power-of-two rounding);
* a per-layer fallback to high precision (``set_high_precision``) replaces one layer's
  configuration by one whose casts are all disabled, so its matmuls run in the input's precision.

``Float8Linear`` is not a public torchao API; a torchao release that renames what is read here
breaks this module only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

#: What the error says when torchao is missing.
INSTALL_HINT = "FP8 needs torchao: pip install 'stabilitykit[fp8]' (torchao>=0.18)"
#: The recipe this project tested (torchao's default: dynamic tensorwise scaling, e4m3 for the
#: input and the weight, e5m2 for the output gradient).
TESTED_RECIPE = "tensorwise"
#: FP8 GEMMs (``torch._scaled_mm``) need both dimensions of a weight divisible by 16.
ALIGNMENT = 16


def available() -> bool:
    """Whether torchao's float8 training is importable (the ``fp8`` extra is installed)."""
    return importlib.util.find_spec("torchao") is not None


def _float8() -> Any:
    """``torchao.float8``, imported once; its loader's warnings about optional CUDA kernels kept quiet."""
    if not available():
        raise ImportError(INSTALL_HINT)
    loader = logging.getLogger("torchao")
    level = loader.level
    loader.setLevel(logging.ERROR)  # "Failed to load ..._C_cutlass_90a.so" on a machine without those kernels
    try:
        import torchao.float8 as float8
    finally:
        loader.setLevel(level)
    return float8


def is_float8_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a torchao ``Float8Linear`` (checked without importing torchao when it is not loaded)."""
    if type(module).__name__ != "Float8Linear":
        return False
    from torchao.float8.float8_linear import Float8Linear

    return isinstance(module, Float8Linear)


def device_has_fp8_matmul(device: torch.device | str) -> bool:
    """A CUDA device of compute capability 8.9 or newer (Ada, Hopper, Blackwell): FP8 tensor cores."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(dev) >= (8, 9)


def recipe_config(emulate: bool, recipe: str = TESTED_RECIPE) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe`` ("tensorwise" or "rowwise"); ``emulate``: the
    matmuls dequantize and run in high precision (the casts are exactly the real ones)."""
    float8 = _float8()
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate)


def high_precision_reason(module: nn.Module) -> str | None:
    """Why a linear layer stays in high precision under FP8 training, or None when it converts.

    An ``nn.Linear`` whose weight has a dimension not divisible by 16 cannot feed an FP8 GEMM
    (torchao's own auto-filter leaves it out for the same reason)."""
    if not isinstance(module, nn.Linear):
        return None
    out_features, in_features = module.weight.shape
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return f"weight {out_features}x{in_features}: FP8 GEMMs need both dimensions divisible by {ALIGNMENT}"
    return None


def _linear_like(module: nn.Module) -> str | None:
    """A layer that computes a matmul with a weight but is not an ``nn.Linear`` (transformers' Conv1D)."""
    if isinstance(module, nn.Linear):
        return None
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.dim() == 2 and not isinstance(module, nn.Embedding):
        return f"{type(module).__name__} is not an nn.Linear: convert_to_float8_training swaps nn.Linear only"
    return None


@dataclass
class Conversion:
    """What ``convert`` did: the layers now in FP8, and those left in high precision with the reason."""

    converted: list[str]
    high_precision: dict[str, str]
    emulated: bool
    recipe: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def convert(
    model: nn.Module,
    emulate: bool,
    recipe: str = TESTED_RECIPE,
    keep: Callable[[str, nn.Module], str | None] | None = None,
) -> Conversion:
    """Swap ``model``'s eligible ``nn.Linear`` layers for ``Float8Linear`` in place (torchao's
    ``convert_to_float8_training``); list every linear-like layer left in high precision and why.

    ``keep(name, module)``: a reason to leave a layer in high precision (None: convert it)."""
    float8 = _float8()
    high: dict[str, str] = {}
    for name, module in model.named_modules():
        reason = _linear_like(module) or high_precision_reason(module)
        if reason is None and keep is not None and isinstance(module, nn.Linear):
            reason = keep(name, module)
        if reason is not None:
            high[name] = reason

    def eligible(module: nn.Module, name: str) -> bool:
        return name not in high

    float8.convert_to_float8_training(model, module_filter_fn=eligible, config=recipe_config(emulate, recipe))
    converted = [name for name, module in model.named_modules() if is_float8_linear(module)]
    return Conversion(converted, high, emulate, recipe)


@dataclass(frozen=True)
class RoleCast:
    """How a ``Float8Linear`` casts one tensor role for its forward (input, weight) or grad-input
    (grad_output) matmul: the float8 dtype, the scaling granularity and axis, power-of-two scales."""

    role: str
    dtype: torch.dtype
    granularity: Any
    axiswise_dim: int | None
    round_pow2: bool


def role_casts(module: nn.Module) -> dict[str, RoleCast]:
    """The casts ``module`` (a ``Float8Linear``) applies, per role; a role whose cast is disabled is absent.

    The axes are those of ``matmul_with_hp_or_float8_args``: the input and the output gradient are
    scaled along their last dimension, the transposed weight along its first."""
    from torchao.float8.config import ScalingType
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim

    config: Any = module.config
    out: dict[str, RoleCast] = {}
    for role, cast, dim in (
        ("input", config.cast_config_input, -1),
        ("weight", config.cast_config_weight, 0),
        ("grad_output", config.cast_config_grad_output, -1),
    ):
        if cast.scaling_type is ScalingType.DISABLED:
            continue
        axis = get_maybe_axiswise_dim(dim, cast.scaling_granularity)
        out[role] = RoleCast(role, cast.target_dtype, cast.scaling_granularity, axis, config.round_scales_to_power_of_2)
    return out


def layer_input(x: Tensor) -> Tensor:
    """The input a ``Float8Linear`` casts: its ``forward`` first moves it to the CUDA autocast dtype
    when CUDA autocast is on (as ``F.linear`` would)."""
    if torch.is_autocast_enabled():
        return x.to(torch.get_autocast_gpu_dtype())
    return x


def weight_operand(module: nn.Module) -> Tensor | None:
    """The weight operand of the forward matmul (``weight.t()``), or None when it is already float8
    (FSDP2's float8 all-gather casts it before the layer sees it)."""
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8

    weight: Tensor = module.weight  # type: ignore[assignment]
    if tensor_already_casted_to_fp8(weight):
        return None
    return weight.t()


@dataclass
class CastStats:
    """One cast, measured on the device (0-d float32 tensors, no host sync)."""

    amax: Tensor
    scale: Tensor
    underflow: Tensor
    saturation: Tensor
    error: Tensor


def saturation_limit(dtype: torch.dtype) -> float:
    """The scaled magnitude above which a value is clamped, not rounded: the float8 maximum plus half a
    step at the maximum (a value within it rounds to the maximum anyway, like the amax itself, which
    the scale maps to the maximum up to float32 rounding)."""
    info = torch.finfo(dtype)
    return float(info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2)


@torch.no_grad()
def cast_stats(x: Tensor, cast: RoleCast) -> CastStats:
    """Cast ``x`` as the layer does (torchao's ``tensor_to_scale`` and ``to_fp8_saturated``), dequantize
    (``bits / scale``, as torchao's ``to_original_precision``) and measure:

    * ``amax``: max |x| (the largest over rows for rowwise scaling);
    * ``scale``: the scale torchao used (the smallest over rows for rowwise scaling);
    * ``underflow``: the share of nonzero values that are zero after scaling and casting;
    * ``saturation``: the share of nonzero values the cast clamped (scaled magnitude above
      ``saturation_limit``): zero under dynamic scaling unless the scale was not computed from this
      very tensor;
    * ``error``: ‖dequantized - x‖ / ‖x‖.
    """
    from torchao.float8.float8_utils import tensor_to_amax, tensor_to_scale, to_fp8_saturated

    x = x.detach()
    amax = tensor_to_amax(x, scaling_granularity=cast.granularity, axiswise_dim=cast.axiswise_dim)
    scale = tensor_to_scale(
        x,
        cast.dtype,
        scaling_granularity=cast.granularity,
        axiswise_dim=cast.axiswise_dim,
        round_scales_to_power_of_2=cast.round_pow2,
    )
    scaled = x.to(torch.float32) * scale
    bits = to_fp8_saturated(scaled, cast.dtype)
    restored = bits.to(torch.float32) / scale
    nonzero = x != 0
    count = nonzero.sum().clamp_min(1).float()
    underflow = (nonzero & (bits.to(torch.float32) == 0)).sum().float() / count
    saturation = (scaled.abs() > saturation_limit(cast.dtype)).sum().float() / count
    original = x.to(torch.float32)
    norm = torch.linalg.vector_norm(original)
    error = torch.linalg.vector_norm(restored - original) / norm.clamp_min(torch.finfo(torch.float32).tiny)
    return CastStats(amax.amax().float(), scale.amin().float(), underflow, saturation, error)


def set_high_precision(module: nn.Module) -> None:
    """Run ``module`` (a ``Float8Linear``) in high precision from now on: every cast disabled, so its
    three matmuls take their operands as they come (torchao's ``ScalingType.DISABLED``)."""
    from torchao.float8.config import CastConfig, ScalingType

    off = CastConfig(scaling_type=ScalingType.DISABLED)
    config: Any = module.config
    module.config = dataclasses.replace(
        config,
        cast_config_input=off,
        cast_config_input_for_grad_weight=off,
        cast_config_weight=off,
        cast_config_weight_for_grad_input=off,
        cast_config_grad_output=off,
        cast_config_grad_output_for_grad_weight=off,
        enable_fsdp_float8_all_gather=False,
    )


def in_high_precision(module: nn.Module) -> bool:
    """Whether every cast of ``module`` (a ``Float8Linear``) is disabled."""
    return not role_casts(module)
