"""StabilityCallback: drives the engine from Lightning's hooks.

Hook placement:

* ``on_before_backward``: the micro-batch loss is recorded (device tensor, no sync).
* ``on_before_optimizer_step``: grads are final here (after accumulation, after DDP reduction,
  after the precision plugin's unscale, before clipping); the engine measures, clips and decides.
* the optimizer's ``step`` is wrapped at fit start: a skipped step never reaches the optimizer
  (fused optimizers get the skip flag as ``found_inf`` on the device instead), and step-interval
  LR schedulers are held on skipped steps. ``training_step`` never has to return None, so nothing
  hangs or raises under DDP: every rank takes the same, all-reduced decision.

Requires the ``lightning`` extra.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from stabilitykit.config import StabilityConfig
from stabilitykit.engine import StabilityEngine, StepDecision, is_fused
from stabilitykit.guard import optimizer_params, scaler_enabled
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NonFiniteRecord, batch_is_bad, check_batch, replay_nonfinite
from stabilitykit.precision import apply_precision_config
from stabilitykit.report import StepReport
from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.wandb import WandbSink

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "stabilitykit.lightning needs Lightning: pip install 'stabilitykit[lightning]' (or pip install lightning)"
    ) from exc

__all__ = ["StabilityCallback"]


class StabilityCallback(Callback):
    """Norms, clipping, skip-the-batch, metrics and events for a Lightning ``Trainer``.

    Metrics go to every logger in ``trainer.loggers`` (any Lightning logger) with
    ``step=trainer.global_step``, and to any extra ``sinks``. The logging cadence is
    ``config.log_every_n_steps`` when you set it, else ``trainer.log_every_n_steps``.
    """

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | None = None,
        sinks: Iterable[Sink] | None = None,
        name: str | None = None,
    ) -> None:
        if isinstance(config, Mapping):
            config = StabilityConfig.from_mapping(config)
        self.config = config or StabilityConfig()
        self.name = name
        self.hooks = HookManager(sinks)
        self.engine: StabilityEngine | None = None
        self.last_report: StepReport | None = None
        self._pending: StepDecision | None = None
        self._pending_state: dict[str, Any] | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._original_step: Any = None
        self._held_schedulers: list[tuple[Any, Any]] = []
        self._state_key = self._generate_state_key(name=name or "default")
        self.precision_choice: Any | None = None
        self._bad_batch: Tensor | None = None
        self._batch: tuple[Any, int] | None = None
        self.last_nonfinite: NonFiniteRecord | None = None

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; ``name`` lets several instances coexist."""
        return self._state_key  # Lightning reads it around every hook call: computed once

    # ------------------------------------------------------------------ setup
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a second clipper: Lightning's gradient_clip_val would clip after our norms were read."""
        if self.config.clip.mode != "off" and trainer.gradient_clip_val:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) and StabilityCallback's "
                f"ClipConfig(mode={self.config.clip.mode!r}) both clip gradients; keep one: set "
                "gradient_clip_val=None (the callback clips, GradScaler-aware) or ClipConfig(mode='off')"
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the engine over the first optimizer and wrap its step and step-interval schedulers."""
        if not trainer.optimizers:
            raise ValueError("StabilityCallback needs an optimizer: configure_optimizers returned none")
        optimizer = trainer.optimizers[0]
        config = self.config
        if "log_every_n_steps" not in config.model_fields_set:
            config = config.model_copy(update={"log_every_n_steps": max(1, trainer.log_every_n_steps)})  # type: ignore[attr-defined]
        self.engine = StabilityEngine(
            optimizer_params(optimizer),
            config,
            model=pl_module,
            hooks=self.hooks,
            fused=is_fused(optimizer),
        )
        if self._pending_state is not None:
            self.engine.load_state_dict(self._pending_state)
            self._pending_state = None
        self.engine.step = trainer.global_step
        has_wandb_sink = any(isinstance(sink, WandbSink) for sink in self.hooks.sinks)
        for logger in trainer.loggers:
            if has_wandb_sink and type(logger).__name__ == "WandbLogger":
                continue  # the WandbSink logs to W&B already (with alerts and markers): once is enough
            if logger not in self.hooks.sinks:
                self.hooks.add_sink(logger)  # type: ignore[arg-type]  # a Logger has the sink's shape
        self._wrap_optimizer(optimizer)
        if self.precision_choice is None:
            self.precision_choice = apply_precision_config(config.precision, self.engine.device, self.hooks)
        for sched_cfg in trainer.lr_scheduler_configs:
            if sched_cfg.interval == "step" and getattr(sched_cfg.scheduler, "optimizer", optimizer) is optimizer:
                self._wrap_scheduler(sched_cfg.scheduler)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Catch up on the last steps' events, then undo the optimizer and scheduler wrapping."""
        if self.engine is not None:
            self.engine.flush()
        if self._optimizer is not None and self._original_step is not None:
            self._optimizer.step = self._original_step  # type: ignore[method-assign]
        for scheduler, original in self._held_schedulers:
            scheduler.step = original
        self._held_schedulers.clear()
        self._optimizer = None
        self._original_step = None

    def _wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        original = optimizer.step
        callback = self

        original_step: Any = original

        @functools.wraps(original)
        def step(closure: Any = None, **kwargs: Any) -> Any:
            result = None
            if closure is not None:  # the closure runs training_step, backward and our hook
                result = closure()

            def call_original() -> Any:
                return original_step(**kwargs) if closure is None else original_step(closure=lambda: result, **kwargs)

            decision = callback._pending
            if decision is None or hasattr(optimizer, "found_inf"):  # GradScaler (fused) set found_inf itself
                return call_original()
            callback.engine.apply(decision, call_original, optimizer)  # type: ignore[union-attr]
            return result

        self._optimizer = optimizer
        self._original_step = original
        optimizer.step = step  # type: ignore[method-assign]

    def _wrap_scheduler(self, scheduler: Any) -> None:
        original = scheduler.step
        callback = self

        @functools.wraps(original)
        def step(*args: Any, **kwargs: Any) -> Any:
            decision = callback._pending  # Lightning steps schedulers before on_train_batch_end
            if decision is not None and callback.engine is not None and callback.engine.hold_scheduler(decision):
                return None
            return original(*args, **kwargs)

        self._held_schedulers.append((scheduler, original))
        scheduler.step = step

    # ------------------------------------------------------------------ the step
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The data guard (``config.data``): raise on a bad batch, or have the coming step skipped."""
        if self._replaying:
            self._batch = (batch, batch_idx)  # kept for a replay if this step goes non-finite
        dcfg = self.config.data
        if dcfg.mode == "off" or self.engine is None:
            return
        if dcfg.mode == "skip":
            bad = batch_is_bad(batch, dcfg.num_classes, dcfg.label_keys)
            self._bad_batch = bad if self._bad_batch is None or bad is None else self._bad_batch | bad
        else:
            check_batch(batch, dcfg.num_classes, step=trainer.global_step, label_keys=dcfg.label_keys)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Remember each micro-batch's loss (stays on the device)."""
        if self.engine is not None:
            self.engine.record_loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Grads are final here: measure, clip and decide; the wrapped optimizer step acts on it."""
        engine = self.engine
        if engine is None or optimizer is not self._optimizer:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scaler_on = scaler_enabled(scaler)
        grad_scale = None
        if scaler_on and engine.fused:
            grad_scale = scaler._get_scale_async()  # type: ignore[union-attr]  # Lightning leaves fused grads scaled
        engine.step = trainer.global_step
        loss_scale = getattr(scaler, "_scale", None) if scaler_on else None
        self._pending = engine.evaluate(
            grad_scale=grad_scale, scaler_active=scaler_on, loss_scale=loss_scale, force_skip=self._bad_batch
        )
        self._bad_batch = None
        if self._replaying:
            # the replay must know now (one sync per step in this mode); it runs before the skipped
            # step, so training_step sees the same global_step as the bad batch did
            if engine.resolve(self._pending) and self._pending.report.reason != "bad_batch" and self._batch:
                self._replay(pl_module, *self._batch, self._pending)
            self._batch = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the optimizer step: sinks, events and the divergence check."""
        decision, self._pending = self._pending, None
        if decision is None or self.engine is None:
            return
        self.last_report = self.engine.finish(decision)

    @property
    def _replaying(self) -> bool:
        trace = self.config.nan_trace
        return trace.mode == "on_nonfinite" and trace.replay

    def _replay(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, decision: StepDecision) -> None:
        """Re-run ``training_step`` on the skipped batch with hooks and anomaly mode to name the source."""
        assert self.engine is not None

        def loss_fn() -> Tensor:
            out = pl_module.training_step(batch, batch_idx)
            return out["loss"] if isinstance(out, dict) else out  # type: ignore[return-value]

        record = replay_nonfinite(pl_module, loss_fn, self.engine.params, step=decision.report.step)
        if record is not None:
            self.last_nonfinite = record
            self.engine.source_hint = record

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The engine's counters, EMAs and detector state."""
        if self.engine is None:
            return dict(self._pending_state or {})
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the engine state (applied at fit start when the engine does not exist yet)."""
        if not state_dict:
            return
        if self.engine is None:
            self._pending_state = state_dict
        else:
            self.engine.load_state_dict(state_dict)
