"""``ModelMonitor``: sampled forward hooks that measure inside a model, read on logging steps.

The monitor is one of the engine's metric sources: the engine tells it, after each optimizer
step, which step comes next (``begin_step``); on a sampled step its hooks measure on the device
into a small store of 0-d tensors, and on a logging step the engine takes the store with
``stability_metrics()`` and reads it in the journal copy it makes anyway. So a monitor adds no host
sync, and on an unsampled step each hook returns after one Python attribute check.

Hooks are installed once, when the monitor is built, and removed by ``close()``; nothing grows
per step. Metric names, under the engine's prefix: ``monitors/<signal>/<module>`` with signal one of
``act_rms``, ``act_max``, ``resid_norm``, ``attn_logit_max``, ``logits_max``, ``log_z``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import MonitorConfig
from stabilitykit.monitors.attention import AttentionProbe, attention_probe
from stabilitykit.monitors.select import MonitorTargets, select_targets
from stabilitykit.monitors.stats import activation_stats, first_tensor, logit_stats

__all__ = ["SIGNALS", "ModelMonitor"]

#: Every signal a monitor records, and whether values measured on several sampled steps between
#: two reads keep their running maximum (True) or the latest value (False).
SIGNALS = {
    "act_rms": False,
    "act_max": True,
    "resid_norm": False,
    "attn_logit_max": True,
    "logits_max": True,
    "log_z": False,
}


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
        self._store: dict[str, Tensor] = {}
        self._handles: list[Any] = []
        self.probes: list[AttentionProbe] = []
        self._install()

    # ------------------------------------------------------------------ hooks

    def _active(self) -> bool:
        return self.sampling

    def _install(self) -> None:
        cfg, targets = self.config, self.targets
        block_names = {n for n, _ in targets.blocks} if cfg.residual else set()
        act_names = {n for n, _ in targets.activations} if cfg.activations else set()
        for name, module in targets.modules:
            if name in block_names or name in act_names:
                hook = self._activation_hook(name, name in act_names, name in block_names)
                self._handles.append(module.register_forward_hook(hook))
        if cfg.attention:
            for name, module in targets.modules:
                probe = attention_probe(name, module, self._active, self.record, cfg.causal)
                if probe is not None:
                    self.probes.append(probe)
        if cfg.logits and targets.head is not None:
            self._handles.append(targets.head[1].register_forward_hook(self._head_hook(targets.head[0])))

    def _activation_hook(self, name: str, activations: bool, residual: bool) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.sampling or not module.training:
                return
            x = first_tensor(output)
            if x is None or not x.is_floating_point() or x.dim() == 0:
                return
            rms, top, norm = activation_stats(x)
            if activations:
                self.record("act_rms", name, rms)
                self.record("act_max", name, top)
            if residual:
                self.record("resid_norm", name, norm)

        return hook

    def _head_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.sampling or not module.training:
                return
            logits = first_tensor(output)
            if logits is None or not logits.is_floating_point():
                return
            top, log_z = logit_stats(logits, self.config.log_z_positions)
            self.record("logits_max", name, top)
            self.record("log_z", name, log_z)

        return hook

    def record(self, signal: str, module: str, value: Tensor) -> None:
        """Keep one measured value on the device (a running max for max signals) until the next read."""
        key = f"monitors/{signal}/{module}"
        previous = self._store.get(key)
        self._store[key] = torch.maximum(previous, value) if previous is not None and SIGNALS[signal] else value

    # ------------------------------------------------------------------ the engine's side

    def begin_step(self, step: int, logging: bool) -> None:
        """The engine's call before step ``step``'s forward passes (``logging``: it is a logging step)."""
        self.sampling = logging if self.every is None else step % self.every == 0

    def stability_metrics(self) -> dict[str, Tensor]:
        """The values measured since the last read (device tensors), emptied: each is read once."""
        out, self._store = self._store, {}
        return out

    def discard(self) -> None:
        """Drop the values measured since the last read (a rollback undid the steps they came from)."""
        self._store = {}

    def is_precursor(self, key: str) -> bool:
        """Whether the spike detector's trend warnings should watch ``key`` (``MonitorConfig.precursors``)."""
        parts = key.split("/", 2)
        return len(parts) == 3 and parts[1] in self.config.precursors

    def close(self) -> None:
        """Remove every hook (the monitor measures nothing afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for probe in self.probes:
            probe.close()
        self.sampling = False

    @property
    def hooked_modules(self) -> list[str]:
        """Names of the modules with activation or LM-head hooks, then of the attention modules probed."""
        names = [n for n, _ in self.targets.activations] if self.config.activations else []
        names += [n for n, _ in self.targets.blocks if self.config.residual and n not in names]
        if self.config.logits and self.targets.head is not None:
            names.append(self.targets.head[0])
        return names + [p.name for p in self.probes]
