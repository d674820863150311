"""FP8 health monitors: what torchao's float8 casts do to the tensors each ``Float8Linear`` really sees.

A ``Float8Linear`` (torchao's ``convert_to_float8_training``) casts three tensors per matmul to
float8 with a scale computed from the tensor's amax: its ``input`` and ``weight`` (e4m3 under the
tested recipe) and, in the backward, the gradient of its output (``grad_output``, e5m2). On a sampled
step this monitor re-runs that very cast (torchao's own functions with the layer's own
configuration, ``compat/torchao_float8.py``) on the same tensors, on the device:

* the input, in a forward pre-hook (after the layer's own autocast cast);
* the weight operand, in the same hook;
* the output gradient, in a hook the forward hook puts on the layer's output (sampled steps only).

Per layer and role it records ``monitors/fp8_amax|fp8_scale|fp8_underflow|fp8_saturation|fp8_error/
<layer>/<role>``, read with the logging step's one copy (unsampled steps: every hook returns after
one attribute check). The host side (``events``) raises ``"fp8_warning"`` (details ``layer``,
``role``) when a role's underflow share or relative error stays above its threshold for
``patience`` reads in a row; with ``fallback`` on, that layer then runs in high precision for the
rest of the run, and the state (``state_dict``) carries the list so a resume keeps it.

Why both signals: a massive activation (one value far above the rest of a tensor) sets the per-tensor
scale, and everything else falls below float8's smallest subnormal; the relative error stays small
because the outlier dominates the norm, so the underflow share is what shows it. A tensor whose
values spread over more binades than float8 holds shows in the error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from stabilitykit.events import Event
from stabilitykit.section import Section

LOGGER = logging.getLogger("stabilitykit")

#: The signals this monitor records, and whether values from several sampled steps between two reads
#: keep their running maximum (True) or the latest value (False).
FP8_SIGNALS = {
    "fp8_amax": True,
    "fp8_scale": False,
    "fp8_underflow": True,
    "fp8_saturation": True,
    "fp8_error": True,
}


class Fp8MonitorConfig(Section):
    """FP8 health monitors for torchao ``Float8Linear`` layers (``MonitorConfig(fp8=...)``).

    They measure only when the model has ``Float8Linear`` layers; a model without them costs nothing.
    """

    underflow: float = Field(
        0.05,
        gt=0,
        le=1,
        description=(
            "Warn when the share of a tensor's nonzero values that become zero in float8 stays above this "
            "(TransformerEngine's fallback criterion). Healthy tiny Llama / GPT-2 training, every layer and "
            "role: at most 0.005; one value a million times the rest in a layer's input: 0.9999 (docs/fp8.md)."
        ),
    )
    error: float = Field(
        0.2,
        gt=0,
        description=(
            "Warn when the relative quantization error ||dequantized - x|| / ||x|| stays above this. Healthy "
            "training: up to 0.03 for e4m3 (input, weight), 0.06 for e5m2 (grad_output) (docs/fp8.md)."
        ),
    )
    patience: int = Field(
        2,
        ge=1,
        description=(
            "Consecutive reads (logging steps) above a threshold before the warning: one odd batch is not a trend."
        ),
    )
    fallback: bool = Field(
        False,
        description=(
            "After a warning, run that layer in high precision for the rest of the run (all its casts "
            "disabled). Kept in the state, so a resume keeps the layers that fell back."
        ),
    )


Keep = Callable[[str, str, Tensor], None]
Guarded = Callable[[str, Callable[[], None]], None]


class Fp8Monitor:
    """The FP8 monitors over the ``Float8Linear`` layers of ``modules`` (clean name, module)."""

    def __init__(
        self,
        modules: list[tuple[str, nn.Module]],
        config: Fp8MonitorConfig,
        active: Callable[[], bool],
        keep: Keep,
        declare: Callable[[str, str], None],
        guarded: Guarded,
    ) -> None:
        from stabilitykit.compat import torchao_float8

        self.config = config
        self._compat = torchao_float8
        self._active = active
        self._keep = keep
        self._guarded = guarded
        self.layers: dict[str, nn.Module] = {n: m for n, m in modules if _maybe_float8(m) and self._is_fp8(m)}
        #: Layers running in high precision after a warning (``Fp8MonitorConfig.fallback``), in order.
        self.fallen_back: list[str] = []
        self._above: dict[str, int] = {}  # "<layer>/<role>" -> consecutive reads above a threshold
        self._warned: set[str] = set()  # "<layer>/<role>" warned about and not back below since
        self._casts: dict[str, dict[str, Any]] = {}
        self.handles: list[Any] = []
        for name, module in self.layers.items():
            casts = torchao_float8.role_casts(module)
            self._casts[name] = casts
            for role in casts:
                for signal in FP8_SIGNALS:
                    declare(signal, f"{name}/{role}")
            self.handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self.handles.append(module.register_forward_hook(self._post_hook(name)))

    def _is_fp8(self, module: nn.Module) -> bool:
        return self._compat.is_float8_linear(module)

    # ------------------------------------------------------------------ device side (sampled steps)

    def _measure(self, name: str, role: str, x: Tensor) -> None:
        stats = self._compat.cast_stats(x, self._casts[name][role])
        key = f"{name}/{role}"
        self._keep("fp8_amax", key, stats.amax)
        self._keep("fp8_scale", key, stats.scale)
        self._keep("fp8_underflow", key, stats.underflow)
        self._keep("fp8_saturation", key, stats.saturation)
        self._keep("fp8_error", key, stats.error)

    def _pre_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self._active() or not module.training or not self._casts.get(name):
                return
            self._measure_operands(name, module, args[0] if args else None)

        return hook

    # The measurements run outside a compiled graph: on a sampled step a compiled model breaks its
    # graph at each converted layer; an unsampled step only reads the flags above.
    @torch.compiler.disable
    def _measure_operands(self, name: str, module: nn.Module, x: Any) -> None:
        casts = self._casts[name]

        def measure() -> None:
            if "input" in casts and isinstance(x, Tensor) and x.is_floating_point():
                self._measure(name, "input", self._compat.layer_input(x))
            weight = self._compat.weight_operand(module) if "weight" in casts else None
            if weight is not None:
                self._measure(name, "weight", weight)

        self._guarded(name, measure)

    def _post_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self._active() or not module.training or "grad_output" not in self._casts.get(name, {}):
                return
            self._watch_gradient(name, output)

        return hook

    @torch.compiler.disable
    def _watch_gradient(self, name: str, output: Any) -> None:
        """Measure the gradient of ``output`` when the backward reaches it (a hook on this tensor only)."""
        if isinstance(output, Tensor) and output.requires_grad:

            def on_grad(grad: Tensor) -> None:
                self._guarded(name, lambda: self._measure(name, "grad_output", grad))

            output.register_hook(on_grad)

    # ------------------------------------------------------------------ host side (logging steps)

    def events(self, step: int, values: dict[str, float]) -> list[Event]:
        """``"fp8_warning"`` for each layer and role whose underflow or error has stayed above its
        threshold for ``patience`` reads (``values``: this read's host metrics); falls back when asked."""
        out: list[Event] = []
        cfg = self.config
        for name, casts in self._casts.items():
            for role in casts:
                key = f"{name}/{role}"
                underflow = values.get(f"monitors/fp8_underflow/{key}")
                error = values.get(f"monitors/fp8_error/{key}")
                if underflow is None and error is None:
                    continue  # not measured since the last read
                high = [
                    (what, value, limit)
                    for what, value, limit in (("underflow", underflow, cfg.underflow), ("error", error, cfg.error))
                    if value is not None and value > limit
                ]
                if not high:
                    self._above.pop(key, None)
                    self._warned.discard(key)
                    continue
                self._above[key] = self._above.get(key, 0) + 1
                if self._above[key] < cfg.patience or key in self._warned:
                    continue
                self._warned.add(key)
                out.append(self._warning(step, name, role, high, underflow, error))
        return out

    def _warning(
        self,
        step: int,
        name: str,
        role: str,
        high: list[tuple[str, float, float]],
        underflow: float | None,
        error: float | None,
    ) -> Event:
        said = ", ".join(f"{what} {value:.3g} > {limit:g}" for what, value, limit in high)
        message = f"FP8 {role} of {name}: {said} for {self._above[f'{name}/{role}']} reads"
        fallback = self.config.fallback and self._fall_back(name)
        if fallback:
            message += "; the layer runs in high precision from now on"
        details = {
            "layer": name,
            "role": role,
            "underflow": underflow,
            "error": error,
            "reads": self._above[f"{name}/{role}"],
            "fallback": fallback,
        }
        return Event("fp8_warning", step, message, details)

    def _fall_back(self, name: str) -> bool:
        """Run ``name`` in high precision from now on (its casts disabled); False if that failed."""
        if name in self.fallen_back:
            return True
        try:
            self._compat.set_high_precision(self.layers[name])
        except Exception as error:  # a monitor never breaks a step
            LOGGER.warning("stabilitykit monitors: FP8 fallback of %s failed: %s", name, error)
            return False
        self.fallen_back.append(name)
        self._casts[name] = {}
        return True

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The layers that fell back to high precision and the reads above a threshold so far."""
        return {"fallen_back": list(self.fallen_back), "above": dict(self._above), "warned": sorted(self._warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``: the layers that fell back run in high precision again."""
        unknown = [n for n in state.get("fallen_back", []) if n not in self.layers]
        if unknown:
            raise ValueError(f"FP8 monitor state names layers this model has no Float8Linear for: {unknown}")
        for name in state.get("fallen_back", []):
            self._fall_back(name)
        self._above = {k: int(v) for k, v in state.get("above", {}).items()}
        self._warned = set(state.get("warned", []))

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _maybe_float8(module: nn.Module) -> bool:
    """Cheap pre-check before importing torchao: the class is called ``Float8Linear``."""
    return type(module).__name__ == "Float8Linear"
