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

from typing import Any, Literal

import torch
from pydantic import Field, field_validator
from torch import Tensor, nn

from stabilitykit.events import Event
from stabilitykit.monitors.attention import AttentionCapture, attention_modules
from stabilitykit.monitors.failures import Unmeasured
from stabilitykit.monitors.fp8 import Fp8Monitor, Fp8MonitorConfig
from stabilitykit.monitors.logits import OutputLogits
from stabilitykit.monitors.routers import RouterConfig, RouterMonitor
from stabilitykit.monitors.select import MonitorTargets, select_targets
from stabilitykit.monitors.stats import activation_stats, first_tensor
from stabilitykit.monitors.store import MetricStore
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


class ModelMonitor:
    """Activation, residual, attention-logit and output-logit monitors over ``model``.

    Sampled on the engine's logging steps when ``MonitorConfig.every`` is None (whatever cadence the
    driver follows: Lightning and the HF Trainer log after steps n-1, 2n-1, ...), else on the
    optimizer steps ``0, every, 2 * every, ...``. Hooks measure only while the hooked module is in
    training mode. The values live in a ``MetricStore`` (``store.py``); what could not be measured is
    kept by ``Unmeasured`` (``failures.py``); the output logits are ``OutputLogits`` (``logits.py``).
    """

    def __init__(self, model: nn.Module, config: MonitorConfig) -> None:
        self.config = config
        self.every = config.every
        #: True while the coming forward passes belong to a sampled step.
        self.sampling = False
        self.targets: MonitorTargets = select_targets(model, config.modules)
        device = next((t.device for t in [*model.parameters(), *model.buffers()]), torch.device("cpu"))
        self.store = MetricStore(device)
        self._handles: list[Any] = []
        self._failures = Unmeasured()
        #: Modules (and the output logits) that are not measured, with the reason: a hook that
        #: raised, an attention module whose forward made no attention call we can read.
        self.unmeasured: dict[str, str] = self._failures.reasons
        self._sampled = False  # a sampled step has run since the monitor was built
        self._reported = False
        self.capture: AttentionCapture | None = None
        #: The output-logit monitor (``MonitorConfig.logits``), or None.
        self.logits: OutputLogits | None = None
        #: The mixture-of-experts router monitors (``MonitorConfig.routers``), or None.
        self.routers: RouterMonitor | None = None
        #: The FP8 monitors (``MonitorConfig.fp8``) when the model has torchao Float8Linear layers, else None.
        self.fp8: Fp8Monitor | None = None
        self._install()

    # ------------------------------------------------------------------ hooks

    def _active(self) -> bool:
        return self.sampling

    def _install(self) -> None:
        cfg, targets, store, failures = self.config, self.targets, self.store, self._failures
        block_names = {n for n, _ in targets.blocks} if cfg.residual else set()
        act_names = {n for n, _ in targets.activations} if cfg.activations else set()
        for name, module in targets.modules:
            if name in block_names or name in act_names:
                if name in act_names:
                    store.declare("act_rms", name)
                    store.declare("act_max", name)
                if name in block_names:
                    store.declare("resid_norm", name)
                hook = self._activation_hook(name, name in act_names, name in block_names)
                self._handles.append(module.register_forward_hook(hook))
        if cfg.attention:

            def keep(module: str, value: Tensor) -> None:
                store.keep("attn_logit_max", module, value)

            self.capture = AttentionCapture(attention_modules(targets.modules), self._active, keep, failures.failed)
            for name in self.capture.names:
                store.declare("attn_logit_max", name)
        if cfg.logits:
            self.logits = OutputLogits(targets, cfg.log_z_positions, self._active, store, failures)
        if cfg.fp8 is not None:
            fp8 = Fp8Monitor(targets.modules, cfg.fp8, self._active, store.keep, store.declare, failures.guarded)
            self.fp8 = fp8 if fp8.layers else None
        if cfg.routers is not None:
            self.routers = RouterMonitor(
                targets.model,
                targets.modules,
                cfg.routers,
                self._active,
                store.declare,
                store.keep,
                failures.failed,
                store.device,
            )

    def _activation_hook(self, name: str, activations: bool, residual: bool) -> Any:
        store = self.store

        def measure(x: Tensor) -> None:
            rms, top, norm = activation_stats(x)
            if activations:
                store.keep("act_rms", name, rms)
                store.keep("act_max", name, top)
            if residual:
                store.keep("resid_norm", name, norm)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.sampling or not module.training:
                return
            x = first_tensor(output)
            if x is None or not x.is_floating_point() or x.dim() == 0:
                return
            self._failures.guarded(name, lambda: measure(x))

        return hook

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
            self.store.prime()

    def stability_metrics(self) -> dict[str, Tensor]:
        """The values measured since the last read (device tensors), emptied: each is read once."""
        if self.sampling:
            self._sampled = True  # read on the sampled step itself (every=None)
        if self._sampled and not self._reported:
            self._report_unmeasured()
        if self.routers is not None:
            self.routers.finish()
        out = self.store.take()
        if self.sampling:
            self.store.prime()  # read in the middle of a sampled step: its later forward passes still measure
        return out

    def _report_unmeasured(self) -> None:
        """After the first sampled step: list once every module that was not measured, and why."""
        self._reported = True
        if self.capture is not None:
            for name in self.capture.names:
                if not self.store.filled("attn_logit_max", name):
                    self._failures.note(
                        name,
                        "no scaled_dot_product_attention or softmax call in its forward on a sampled step "
                        "(a flash or custom kernel, Tensor.softmax, or not run in training mode)",
                    )
        self._failures.report()

    def step_values(self) -> dict[str, Tensor]:
        """This step's router values by metric name (``monitors/<signal>/<router>``), for the skip rules:
        measured on a sampled step, NaN otherwise (``routers.py``). Called when the step is decided."""
        return self.routers.finish(agree=True) if self.routers is not None else {}

    def discard(self) -> None:
        """Drop the values measured since the last read (a rollback undid the steps they came from)."""
        if self.routers is not None:
            self.routers.discard()
        self.store.clear()
        if self.sampling:
            self.store.prime()

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
        for part in (self.capture, self.logits, self.fp8, self.routers):
            if part is not None:
                part.close()
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
