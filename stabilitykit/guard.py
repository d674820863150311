"""StabilityGuard: the driver for plain PyTorch loops (and Accelerate, Fabric) over the driver core.

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
from stabilitykit.core import DriverCore, optimizer_params
from stabilitykit.engine import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NaNTracer, NonFiniteRecord
from stabilitykit.precision import PrecisionChoice
from stabilitykit.report import StepReport
from stabilitykit.sinks.base import Sink

__all__ = ["StabilityGuard", "optimizer_params"]


class StabilityGuard:
    """Keeps a plain training loop finite: clipping, skip-the-batch, metrics and events.

    The guard owns ``backward`` (so it can scale the loss and remember it) and ``step`` (so it can
    unscale exactly once, clip, and skip). A skipped step leaves parameters, optimizer state and the
    LR scheduler bitwise unchanged. Calling ``scaler.unscale_(optimizer)`` yourself before ``step``
    (the PyTorch AMP recipe) is fine: the guard sees it and never unscales twice.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        scaler: Any | None = None,
        scheduler: Any | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        extra_group: Any | None = None,
    ) -> None:
        """``extra_group``: a process group the norms also sum over (pipeline stages; see the distributed guide)."""
        self.hooks = hooks or HookManager()
        for sink in sinks or []:
            self.hooks.add_sink(sink)
        self.core = DriverCore(model, optimizer, config, hooks=self.hooks, scaler=scaler, extra_group=extra_group)
        self.config = self.core.config
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.scheduler = scheduler

    @property
    def engine(self) -> StabilityEngine:
        """The engine behind this guard (counters, layer names, journal)."""
        return self.core.engine

    @property
    def precision_choice(self) -> PrecisionChoice | None:
        """What ``sk.select_precision()`` recommends for the model's device (``config.precision``)."""
        return self.core.precision_choice

    @property
    def tracer(self) -> NaNTracer | None:
        """The NaN tracer, when ``config.nan_trace`` uses one."""
        return self.core.tracer

    @property
    def last_nonfinite(self) -> NonFiniteRecord | None:
        """Where the latest traced or replayed non-finite value came from."""
        return self.core.last_nonfinite

    # ------------------------------------------------------------------ the loop API
    def check_batch(self, batch: Any) -> None:
        """The data guard (``config.data``) on one micro-batch; call it for each before its forward.

        ``mode="raise"``: raise ``BadBatchError`` naming the path, index and step (one sync).
        ``mode="skip"``: the coming step is skipped on the device when any of its micro-batches was
        bad (no sync); a ``bad_batch`` event reports it.
        """
        self.core.check_batch(batch)

    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` (scaled when a GradScaler is enabled) and remember its value."""
        self.core.backward(loss, **kwargs)

    def step(self, replay: Callable[[], Tensor] | None = None) -> StepReport:
        """Measure, clip, and step the optimizer, or skip the step; returns this step's report.

        ``replay``: recomputes this batch's loss (forward only). With ``nan_trace.mode="on_nonfinite"``
        a skipped step is replayed once with hooks and anomaly mode to name where it went non-finite.
        """
        core = self.core
        core.evaluate(replay=replay)
        undo = core.wrap_optimizer_step(self.optimizer)
        try:
            if core.scaler.enabled:
                self.scaler.step(self.optimizer)  # type: ignore[union-attr]  # skips an fp16 overflow itself
                self.scaler.update()  # type: ignore[union-attr]  # the scale backs off after an overflow
            else:
                self.optimizer.step()
        finally:
            undo()
        if self.scheduler is not None and not core.should_hold_scheduler():
            self.scheduler.step()
        report = core.finish()
        assert report is not None
        return report

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad``: grads of a skipped step are dropped like any other."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def step_count(self) -> int:
        """Optimizer steps attempted so far, skipped ones included."""
        return self.core.engine.step

    @property
    def skipped_total(self) -> int:
        """Skipped steps as of the host's last look (exact on logging steps and for non-fused optimizers)."""
        return self.core.engine.skipped_total

    def summary(self) -> dict[str, Any]:
        """Totals for a run summary (reads the steps since the last logging step first: one sync)."""
        self.core.flush()
        c = self.core.engine.counters
        return {
            "steps": self.core.engine.step,
            "skipped": c.skipped_total,
            "clipped": c.clipped_total,
            "max_grad_norm": c.max_norm,
            "nonfinite_steps": c.nonfinite_total,
            "nonfinite_source": str(self.last_nonfinite) if self.last_nonfinite is not None else None,
        }

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, EMAs, detector state and unread journal rows (optimizer, scaler, scheduler save their own)."""
        return self.core.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.core.load_state_dict(state)

    def close(self) -> None:
        """Process the steps since the last logging step, remove tracing hooks and close the sinks."""
        self.core.close()
        self.hooks.close()
