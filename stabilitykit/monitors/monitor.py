"""``ModelMonitor``: sampled forward hooks that measure inside a model, read on logging steps.

The monitor is one of the engine's metric sources: the engine tells it, after each optimizer
step, which step comes next (``begin_step``); on a sampled step its hooks measure on the device
into a small store of 0-d tensors, and on a logging step the engine takes the store with
``stability_metrics()`` and reads it in the journal copy it makes anyway. So a monitor adds no host
sync, and on an unsampled step each hook returns after one Python attribute check.

Hooks are installed once, when the monitor is built, and removed by ``close()``; nothing grows
per step. Metric names, under the engine's prefix: ``monitors/<signal>/<module>`` with signal one of
``act_rms``, ``act_max``, ``resid_norm``, ``attn_logit_max``, ``logits_max``, ``log_z``.

A measurement never breaks a step: a hook that raises disables itself with one warning naming the
module and the reason, and the step goes on. Modules that cannot be measured are listed once, by
name and reason, after the first sampled step (``unmeasured``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from stabilitykit.events import Event
from stabilitykit.monitors.attention import AttentionCapture, attention_modules
from stabilitykit.monitors.fp8 import FP8_SIGNALS, Fp8Monitor, Fp8MonitorConfig
from stabilitykit.monitors.routers import RouterConfig, RouterMonitor
from stabilitykit.monitors.select import MonitorTargets, select_targets
from stabilitykit.monitors.stats import activation_stats, first_tensor, logit_stats
from stabilitykit.section import Section


class MonitorConfig(Section):
    """Sampled activation, attention-logit and output-logit monitors for any model.

    Off unless ``StabilityConfig(monitors=MonitorConfig(...))`` is given; hooks are installed once,
    when the driver starts.

    On a sampled step, forward hooks measure on the device: the output RMS and max |x| of the
    selected modules, the residual-stream norm after each block of every stack, the largest
    attention logit of each attention module, taken at the call that computes the attention
    (``F.scaled_dot_product_attention`` with the model's mask, window and scale, or the input of the
    eager path's softmax, after mask, window and soft-cap), and the max and log Z of the model's own
    output logits over real (unpadded) positions. The values are read with the logging step's one
    device-to-host copy; on other steps every hook returns at once. A measurement that fails
    disables itself with one warning; modules that cannot be measured are named once and in the
    run summary.
    """

    every: int | None = Field(
        None,
        ge=1,
        description=(
            "Measure on every n-th optimizer step (None: on logging steps). Values measured between "
            "logging steps stay on the device until the next logging read (maxima are kept as running maxima)."
        ),
    )
    modules: list[str] | None = Field(
        None,
        description=(
            "Modules whose output RMS and max |x| are measured, as clean names or globs "
            "('model.layers.*', 'lm_head'). None: each transformer block, the embeddings and the final norm."
        ),
    )
    activations: bool = Field(True, description="Output RMS and max |x| of the selected modules.")
    attention: bool = Field(
        True, description="Largest attention logit of each attention module, at its attention call."
    )
    logits: bool = Field(
        True, description="Max |logit| and mean log Z of the model's output logits (after any final soft-cap)."
    )
    residual: bool = Field(True, description="Residual-stream norm (mean L2 norm per token) after each block.")
    causal: bool | None = Field(
        None,
        description=(
            "Deprecated, no effect: the attention logits are measured with the mask the model itself "
            "hands its attention call (causal or not, padding, sliding window)."
        ),
    )
    log_z_positions: int | None = Field(
        256,
        ge=1,
        description=(
            "Token positions (spread evenly over the whole batch, padding left out) whose log Z is averaged: "
            "a log-sum-exp over the whole vocabulary at every position costs about as much as the LM head's "
            "own matmul. None: all positions."
        ),
    )
    routers: RouterConfig | None = Field(
        default_factory=RouterConfig,
        description=(
            "Mixture-of-experts router monitors (expert_load_max, experts_dead, router_entropy, router_z) and the "
            "'router_collapse' event; None: off."
        ),
    )
    precursors: list[
        Literal[
            "attn_logit_max",
            "logits_max",
            "log_z",
            "act_max",
            "act_rms",
            "resid_norm",
            "expert_load_max",
            "experts_dead",
            "router_entropy",
            "router_z",
        ]
    ] = Field(
        default_factory=lambda: ["attn_logit_max", "logits_max", "log_z"],  # type: ignore[arg-type]
        description=(
            "Signals fed to the spike detector's trend warnings (SpikeConfig.trend_warning); the others are "
            "logged only."
        ),
    )

    fp8: Fp8MonitorConfig | None = Field(
        default_factory=Fp8MonitorConfig,
        description=(
            "FP8 health of each torchao Float8Linear, per role (input, weight, grad_output): amax, scale, "
            "underflow share, saturation share, relative error; event 'fp8_warning'. Measures only when the "
            "model has Float8Linear layers. None: off."
        ),
    )

    @field_validator("causal")
    @classmethod
    def _causal_is_read_from_the_model(cls, value: bool | None) -> bool | None:
        if value is not None:
            import warnings

            warnings.warn(
                "MonitorConfig.causal has no effect: attention logits are measured with the mask the model "
                "hands its attention call",
                DeprecationWarning,
                stacklevel=2,
            )
        return value


LOGGER = logging.getLogger("stabilitykit")

#: Every signal a monitor records, and whether values measured on several sampled steps between
#: two reads keep their running maximum (True) or the latest value (False).
SIGNALS = {
    "act_rms": False,
    "act_max": True,
    "resid_norm": False,
    "attn_logit_max": True,
    "logits_max": True,
    "log_z": False,
    **FP8_SIGNALS,
    "expert_load_max": True,
    "experts_dead": True,
    "router_entropy": False,
    "router_z": True,
    "router_collapsed": True,
}


class _Slot:
    """One metric's value since the last read. Its value is always a tensor on a sampled step (primed
    before the step by ``begin_step``, outside any compiled code), so a hook's running max reads no
    Python state that changes between forward passes: a compiled model keeps one graph for sampled
    forward passes, whether values from earlier micro-batches or steps are waiting or not."""

    __slots__ = ("filled", "value")

    def __init__(self) -> None:
        self.value: Tensor | None = None
        self.filled = False


class ModelMonitor:
    """Activation, residual, attention-logit and output-logit monitors over ``model``.

    Sampled on the engine's logging steps when ``MonitorConfig.every`` is None (whatever cadence the
    driver follows: Lightning and the HF Trainer log after steps n-1, 2n-1, ...), else on the
    optimizer steps ``0, every, 2 * every, ...``. Hooks measure only while the hooked module is in
    training mode.
    """

    def __init__(self, model: nn.Module, config: MonitorConfig) -> None:
        self.config = config
        self.every = config.every
        #: True while the coming forward passes belong to a sampled step.
        self.sampling = False
        self.targets: MonitorTargets = select_targets(model, config.modules)
        self._slots: dict[str, _Slot] = {}
        self._device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
        self._handles: list[Any] = []
        #: Modules (and the output logits) that are not measured, with the reason: a hook that
        #: raised, an attention module whose forward made no attention call we can read.
        self.unmeasured: dict[str, str] = {}
        self._sampled = False  # a sampled step has run since the monitor was built
        self._reported = False
        self.capture: AttentionCapture | None = None
        #: The mixture-of-experts router monitors (``MonitorConfig.routers``), or None.
        self.routers: RouterMonitor | None = None
        self._mask: Tensor | None = None
        #: The FP8 monitors (``MonitorConfig.fp8``) when the model has torchao Float8Linear layers, else None.
        self.fp8: Fp8Monitor | None = None
        self._install(model)

    # ------------------------------------------------------------------ hooks

    def _active(self) -> bool:
        return self.sampling

    def _install(self, model: nn.Module) -> None:
        cfg, targets = self.config, self.targets
        block_names = {n for n, _ in targets.blocks} if cfg.residual else set()
        act_names = {n for n, _ in targets.activations} if cfg.activations else set()
        for name, module in targets.modules:
            if name in block_names or name in act_names:
                if name in act_names:
                    self._slot("act_rms", name)
                    self._slot("act_max", name)
                if name in block_names:
                    self._slot("resid_norm", name)
                hook = self._activation_hook(name, name in act_names, name in block_names)
                self._handles.append(module.register_forward_hook(hook))
        if cfg.attention:
            record = self._recorder("attn_logit_max")
            self.capture = AttentionCapture(attention_modules(targets.modules), self._active, record, self._failed)
            for name in self.capture.names:
                self._slot("attn_logit_max", name)
        if cfg.logits:
            self._install_logits(targets.root)
        if cfg.fp8 is not None:
            fp8 = Fp8Monitor(targets.modules, cfg.fp8, self._active, self.record, self._slot, self._guarded)
            self.fp8 = fp8 if fp8.layers else None
        if cfg.routers is not None:
            self.routers = RouterMonitor(
                targets.model,
                targets.modules,
                cfg.routers,
                self._active,
                self._slot,
                self.record,
                self._failed,
                self._device,
            )

    def _install_logits(self, root: nn.Module) -> None:
        """Measure the model's own output logits, after any final soft-cap or scale (Gemma 2's cap,
        Cohere's ``logit_scale``): the ``logits`` of the output of the module that owns the LM head
        when it is a Hugging Face model (it has a ``config``), else the LM head's output. The model's
        ``attention_mask`` keyword (read by a pre-hook on the model) keeps padding out."""
        head = self.targets.head
        self.logits_name = head[0] if head is not None else "logits"
        self._slot("logits_max", self.logits_name)
        self._slot("log_z", self.logits_name)
        from_output = head is None or getattr(root, "config", None) is not None
        model = self.targets.model
        self._handles.append(model.register_forward_pre_hook(self._take_mask, with_kwargs=True))
        if from_output:
            self._handles.append(root.register_forward_hook(self._output_hook))
        elif head is not None:
            self._handles.append(head[1].register_forward_hook(self._head_hook))

    def _failed(self, name: str, reason: str) -> None:
        """A measurement raised: that module is left alone from now on, said once."""
        if name in self.unmeasured:
            return
        self.unmeasured[name] = reason
        warnings.warn(f"stabilitykit monitors: {name} is not measured: {reason}", RuntimeWarning, stacklevel=2)

    def _guarded(self, name: str, measure: Callable[[], None]) -> None:
        """Run one measurement; an exception disables ``name`` with one warning, the step goes on."""
        if name in self.unmeasured:
            return
        try:
            measure()
        except Exception as error:  # a monitor never breaks a step
            message = str(error).splitlines()[0][:200] if str(error) else ""
            self._failed(name, f"measuring it raised {type(error).__name__}: {message}")

    def _recorder(self, signal: str) -> Callable[[str, Tensor], None]:
        def record(module: str, value: Tensor) -> None:
            self.record(signal, module, value)

        return record

    def _activation_hook(self, name: str, activations: bool, residual: bool) -> Any:
        def measure(x: Tensor) -> None:
            rms, top, norm = activation_stats(x)
            if activations:
                self.record("act_rms", name, rms)
                self.record("act_max", name, top)
            if residual:
                self.record("resid_norm", name, norm)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.sampling or not module.training:
                return
            x = first_tensor(output)
            if x is None or not x.is_floating_point() or x.dim() == 0:
                return
            self._guarded(name, lambda: measure(x))

        return hook

    def _take_mask(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self.sampling or not module.training:
            return
        encoder_decoder = bool(getattr(getattr(module, "config", None), "is_encoder_decoder", False))
        mask = kwargs.get("decoder_attention_mask" if encoder_decoder else "attention_mask")
        self._mask = mask if isinstance(mask, Tensor) else None

    def _head_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.sampling or not module.training:
            return
        logits = first_tensor(output)
        if logits is not None and logits.is_floating_point() and logits.dim() > 0:
            self._logits(logits)

    # The output hook runs where the model returns, outside a compiled model's graph when the model
    # itself is compiled: kept out of Dynamo so that it compiles no graph of its own.
    @torch.compiler.disable
    def _output_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.sampling or not module.training:
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
        self._guarded(self.logits_name, lambda: self._measure_logits(logits, mask))

    def _measure_logits(self, logits: Tensor, mask: Tensor | None) -> None:
        top, log_z = logit_stats(logits, self.config.log_z_positions, mask)
        self.record("logits_max", self.logits_name, top)
        self.record("log_z", self.logits_name, log_z)

    def _slot(self, signal: str, module: str) -> None:
        """Declare a metric when its hook is installed (the set of slots never changes afterwards)."""
        self._slots.setdefault(f"monitors/{signal}/{module}", _Slot())

    def record(self, signal: str, module: str, value: Tensor) -> None:
        """Keep one measured value on the device (a running max for max signals) until the next read."""
        slot = self._slots.get(f"monitors/{signal}/{module}")
        if slot is None:
            return
        if SIGNALS[signal] and slot.value is not None:
            slot.value = torch.maximum(slot.value, value.float())
        else:
            slot.value = value.float()
        slot.filled = True

    def _prime(self) -> None:
        """Before a sampled step: every unfilled slot holds its own -inf (one tensor per slot: a compiled
        graph must not see two slots as one input; sampled steps only)."""
        empty = [slot for slot in self._slots.values() if slot.value is None]
        for slot in empty:
            slot.value = torch.full((), -torch.inf, device=self._device)

    # ------------------------------------------------------------------ the engine's side

    def begin_step(self, step: int, logging: bool) -> None:
        """The engine's call before step ``step``'s forward passes (``logging``: it is a logging step)."""
        if self.sampling:
            self._sampled = True
        if self._sampled and not self._reported:
            self._report_unmeasured()
        self.sampling = logging if self.every is None else step % self.every == 0
        if self.routers is not None:
            self.routers.begin_step(self.sampling)
        if self.sampling:
            self._prime()

    def stability_metrics(self) -> dict[str, Tensor]:
        """The values measured since the last read (device tensors), emptied: each is read once."""
        if self.sampling:
            self._sampled = True  # read on the sampled step itself (every=None)
        if self._sampled and not self._reported:
            self._report_unmeasured()
        if self.routers is not None:
            self.routers.finish()
        out = {key: slot.value for key, slot in self._slots.items() if slot.filled and slot.value is not None}
        self._clear()
        if self.sampling:
            self._prime()  # read in the middle of a sampled step: its later forward passes still measure
        return out

    def _clear(self) -> None:
        for slot in self._slots.values():
            slot.value, slot.filled = None, False

    def _report_unmeasured(self) -> None:
        """After the first sampled step: list once every module that was not measured, and why."""
        self._reported = True
        if self.capture is not None:
            for name in self.capture.names:
                slot = self._slots.get(f"monitors/attn_logit_max/{name}")
                if (slot is None or not slot.filled) and name not in self.unmeasured:
                    self.unmeasured[name] = (
                        "no scaled_dot_product_attention or softmax call in its forward on a sampled step "
                        "(a flash or custom kernel, Tensor.softmax, or not run in training mode)"
                    )
        if self.unmeasured:
            listed = "; ".join(f"{name}: {reason}" for name, reason in self.unmeasured.items())
            warnings.warn(f"stabilitykit monitors: not measured: {listed}", RuntimeWarning, stacklevel=3)

    def step_values(self) -> dict[str, Tensor]:
        """This step's router values by metric name (``monitors/<signal>/<router>``), for the skip rules:
        measured on a sampled step, NaN otherwise (``routers.py``). Called when the step is decided."""
        return self.routers.finish() if self.routers is not None else {}

    def discard(self) -> None:
        """Drop the values measured since the last read (a rollback undid the steps they came from)."""
        if self.routers is not None:
            self.routers.discard()
        self._clear()
        if self.sampling:
            self._prime()

    def events(self, step: int, values: dict[str, float]) -> list[Event]:
        """Warning events from a logging step's host values (``"fp8_warning"``, ``"router_collapse"``)."""
        events = self.fp8.events(step, values) if self.fp8 is not None else []
        return events + (self.routers.events(step, values) if self.routers is not None else [])

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the FP8 monitors' fallbacks and counters (empty without them)."""
        return {"fp8": self.fp8.state_dict()} if self.fp8 is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``."""
        saved = state.get("fp8") or {}
        if self.fp8 is not None and saved:
            self.fp8.load_state_dict(saved)
        elif saved.get("fallen_back"):
            raise ValueError(
                "FP8 monitor state names layers this model has no Float8Linear for: "
                f"{saved['fallen_back']} (convert the model as the saved run did, or turn MonitorConfig.fp8 on)"
            )

    def is_precursor(self, key: str) -> bool:
        """Whether the spike detector's trend warnings should watch ``key`` (``MonitorConfig.precursors``)."""
        parts = key.split("/", 2)
        return len(parts) == 3 and parts[1] in self.config.precursors

    def close(self) -> None:
        """Remove every hook (the monitor measures nothing afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.capture is not None:
            self.capture.close()
        if self.fp8 is not None:
            self.fp8.close()
        if self.routers is not None:
            self.routers.close()
        self.sampling = False

    @property
    def hooked_modules(self) -> list[str]:
        """Names of the modules with activation or LM-head hooks, then of the attention modules probed."""
        names = [n for n, _ in self.targets.activations] if self.config.activations else []
        names += [n for n, _ in self.targets.blocks if self.config.residual and n not in names]
        if self.config.logits and self.targets.head is not None:
            names.append(self.targets.head[0])
        names += self.capture.names if self.capture is not None else []
        return names + (self.routers.names if self.routers is not None else [])
