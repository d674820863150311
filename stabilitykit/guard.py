"""StabilityGuard: drives the engine from a plain PyTorch loop.

guard.backward(loss)   # scaled when a GradScaler is given; call it once per micro-batch
report = guard.step()  # unscale once, norms, clip, skip or step, scheduler, scaler.update()
guard.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.engine import StabilityEngine, StepDecision, is_fused
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NaNTracer, NonFiniteRecord, batch_is_bad, check_batch, replay_nonfinite
from stabilitykit.precision import apply_precision_config
from stabilitykit.report import StepReport
from stabilitykit.sinks.base import Sink

__all__ = ["StabilityGuard", "optimizer_params"]


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every parameter the optimizer updates, in param-group order, without duplicates."""
    seen: set[int] = set()
    params: list[Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def scaler_enabled(scaler: Any) -> bool:
    """True for a GradScaler that actually scales (``enabled=True``)."""
    return scaler is not None and bool(scaler.is_enabled())


def unscale_once(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """``scaler.unscale_(optimizer)`` unless it already ran since the last ``update()`` (a second call raises)."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is OptState.READY:
        scaler.unscale_(optimizer)


class StabilityGuard:
    """Keeps a plain training loop finite: clipping, skip-the-batch, metrics and events.

    The guard owns ``backward`` (so it can scale the loss and remember it) and ``step`` (so it can
    unscale exactly once, clip, and skip). A skipped step leaves parameters, optimizer state and the
    LR scheduler bitwise unchanged.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: StabilityConfig | Mapping[str, Any] | None = None,
        scaler: Any | None = None,
        scheduler: Any | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
    ) -> None:
        if isinstance(config, Mapping):
            config = StabilityConfig.from_mapping(config)
        self.config = config or StabilityConfig()
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler
        self.hooks = hooks or HookManager()
        for sink in sinks or []:
            self.hooks.add_sink(sink)
        self.engine = StabilityEngine(
            optimizer_params(optimizer), self.config, model=model, hooks=self.hooks, fused=is_fused(optimizer)
        )
        self.precision_choice = apply_precision_config(self.config.precision, self.engine.device, self.hooks)
        self.tracer: NaNTracer | None = None
        self.last_nonfinite: NonFiniteRecord | None = None
        self._trace_left = 0
        self._bad_batch: Tensor | None = None
        mode = self.config.nan_trace.mode
        if mode == "always" or (mode == "every_n" and self.engine.is_logging_step(0)):
            self._start_tracing()

    # ------------------------------------------------------------------ tracing
    def _start_tracing(self) -> None:
        if self.tracer is None:
            self.tracer = NaNTracer(self.model)
        self.tracer.attach()
        self.tracer.step = self.engine.step

    def _trace_source(self, decision: StepDecision) -> None:
        """On a skip the host saw, hand the tracer's first non-finite module to the engine's events."""
        if self.tracer is not None and self.tracer._handles and decision.skip_known:
            found = self.tracer.first
            if found is not None:
                self.last_nonfinite = found
                self.engine.source_hint = found

    def _tracing_after_step(self, decision: StepDecision) -> None:
        mode = self.config.nan_trace.mode
        if self.tracer is not None:
            self.tracer.clear()
        next_step = self.engine.step
        if mode == "always":
            self._start_tracing()
            return
        wants = False
        if mode == "every_n":
            wants = next_step % self.config.nan_trace.every_n_steps == 0
        elif mode == "on_nonfinite":
            if decision.skip_known:
                self._trace_left = 10
            wants = self._trace_left > 0
            self._trace_left = max(0, self._trace_left - 1)
        if wants:
            self._start_tracing()
        elif self.tracer is not None:
            self.tracer.detach()

    def _replay(self, decision: StepDecision, replay: Callable[[], Tensor] | None) -> None:
        """on_nonfinite: re-run the bad batch with hooks and anomaly mode, and name its source."""
        reason = decision.report.reason
        if replay is None or not decision.skip_known or reason == "bad_batch":
            return
        record = replay_nonfinite(self.model, replay, self.engine.params, step=self.engine.step)
        if record is not None:
            self.last_nonfinite = record
            self.engine.source_hint = record

    # ------------------------------------------------------------------ the loop API
    def check_batch(self, batch: Any) -> None:
        """The data guard: check ``batch`` before training on it (``config.data``).

        ``mode="raise"`` (and ``"off"``, when called anyway): raise ``BadBatchError`` naming the
        path, index and step (one sync). ``mode="skip"``: the coming step is skipped on the device
        when the batch is bad (no sync); a ``bad_batch`` event reports it.
        """
        dcfg = self.config.data
        if dcfg.mode == "skip":
            self._bad_batch = batch_is_bad(batch, dcfg.num_classes, dcfg.label_keys)
        else:
            check_batch(batch, dcfg.num_classes, step=self.engine.step, label_keys=dcfg.label_keys)

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` (scaled when a GradScaler is enabled) and remember its value."""
        self.engine.record_loss(loss)
        if scaler_enabled(self.scaler):
            self.scaler.scale(loss).backward(**kwargs)  # type: ignore[union-attr]
        else:
            loss.backward(**kwargs)

    def step(self, replay: Callable[[], Tensor] | None = None) -> StepReport:
        """Measure, clip, and step the optimizer, or skip the step; returns this step's report.

        ``replay``: recomputes this batch's loss (forward only). With ``nan_trace.mode="on_nonfinite"``
        a skipped step is replayed once with hooks and anomaly mode to name where it went non-finite.
        """
        scaler_on = scaler_enabled(self.scaler)
        grad_scale = None
        if scaler_on:
            if self.engine.fused:
                grad_scale = self.scaler._get_scale_async()  # type: ignore[union-attr]  # grads stay scaled
            else:
                unscale_once(self.scaler, self.optimizer)
        loss_scale = getattr(self.scaler, "_scale", None) if scaler_on else None
        decision = self.engine.evaluate(
            grad_scale=grad_scale, scaler_active=scaler_on, loss_scale=loss_scale, force_skip=self._bad_batch
        )
        self._bad_batch = None
        replaying = self.config.nan_trace.mode == "on_nonfinite" and self.config.nan_trace.replay and replay is not None
        if replaying:
            self.engine.resolve(decision)  # the replay needs to know now: one sync per step in this mode
        if scaler_on:
            if self.engine.fused or decision.skip_known is not True:
                self.scaler.step(self.optimizer)  # type: ignore[union-attr]  # fused: skips via its found_inf
            self.scaler.update()  # type: ignore[union-attr]  # the scale backs off after an overflow
        else:
            self.engine.apply(decision, self.optimizer.step, self.optimizer)
        if self.scheduler is not None and not self.engine.hold_scheduler(decision):
            self.scheduler.step()
        self._trace_source(decision)
        if replaying:
            self._replay(decision, replay)
        try:
            report = self.engine.finish(decision)
        finally:
            self._tracing_after_step(decision)
        return report

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``: grads of a skipped step are dropped like any other."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def step_count(self) -> int:
        """Optimizer steps attempted so far, skipped ones included."""
        return self.engine.step

    @property
    def skipped_total(self) -> int:
        """Skipped steps as of the host's last look (exact on logging steps and for non-fused optimizers)."""
        return self.engine.skipped_total

    def summary(self) -> dict[str, Any]:
        """Totals for a run summary (reads the steps since the last logging step first: one sync)."""
        self.engine.flush()
        c = self.engine.counters
        return {
            "steps": self.engine.step,
            "skipped": c.skipped_total,
            "clipped": c.clipped_total,
            "max_grad_norm": c.max_norm,
            "nonfinite_steps": c.nonfinite_total,
            "nonfinite_source": str(self.last_nonfinite) if self.last_nonfinite is not None else None,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Engine counters, EMAs and detector state (optimizer/scaler/scheduler are saved by their owners)."""
        return {"engine": self.engine.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.engine.load_state_dict(dict(state["engine"]))

    def close(self) -> None:
        """Process the steps since the last logging step, remove tracing hooks and close the sinks."""
        self.engine.flush()
        if self.tracer is not None:
            self.tracer.detach()
        self.hooks.close()
