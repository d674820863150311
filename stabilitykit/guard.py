"""StabilityGuard: the driver for plain PyTorch loops over the driver core, one core per optimizer.

guard.backward(loss)   # scaled when a GradScaler is given; call it once per micro-batch
report = guard.step()  # unscale once, norms, clip, skip or step, scheduler, scaler.update()
guard.zero_grad()

With several optimizers (GANs, alternating updates) each one is guarded on its own: its own skip
decision, its own step count and logging cadence, metrics under ``<prefix>/opt<i>/``; name the
optimizer in ``step(optimizer)``. The Accelerate and Fabric drivers
(``stabilitykit.integrations``) are subclasses that only change how the loss is backpropagated
and how the framework's optimizer steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.core import DriverCore, coerce_config, optimizer_params, unwrap_optimizer
from stabilitykit.engine import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NaNTracer, NonFiniteRecord
from stabilitykit.precision import PrecisionChoice
from stabilitykit.recovery import refuse_several_optimizers
from stabilitykit.report import StepReport
from stabilitykit.run_log import RunSummary
from stabilitykit.sinks.base import Sink

__all__ = ["StabilityGuard", "optimizer_params"]


def _as_list(value: Any) -> list[Any]:
    """``None`` -> [], a list or tuple -> a list, anything else -> [value]."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def scheduler_target(scheduler: Any) -> Any:
    """The torch optimizer an LR scheduler drives (through framework wrappers), or None."""
    inner = getattr(scheduler, "scheduler", None)  # accelerate's AcceleratedScheduler
    base = inner if inner is not None and hasattr(inner, "step") else scheduler
    optimizer = getattr(base, "optimizer", None)
    return unwrap_optimizer(optimizer) if optimizer is not None else None


def _refuse_accumulating(optimizers: Sequence[Any]) -> None:
    """An Accelerate optimizer accumulating over several micro-batches steps only on the last one; the
    plain guard would count every micro-batch as a step and measure partial grads."""
    for opt in optimizers:
        state = getattr(opt, "gradient_state", None)
        steps = getattr(state, "num_steps", 1) if state is not None else 1
        if steps > 1:
            raise TypeError(
                f"{type(opt).__name__} accumulates gradients over {steps} micro-batches "
                "(accelerator.accumulate), which StabilityGuard would count as separate steps with partial "
                "grads: use stabilitykit.integrations.AccelerateGuard(accelerator, model, optimizer, config), "
                "which follows accelerator.sync_gradients"
            )


class StabilityGuard:
    """Keeps a plain training loop finite: clipping, skip-the-batch, metrics and events.

    The guard owns ``backward`` (so it can scale the loss and remember it) and ``step`` (so it can
    unscale exactly once, clip, and skip). A skipped step leaves parameters, optimizer state and the
    LR scheduler bitwise unchanged. Calling ``scaler.unscale_(optimizer)`` yourself before ``step``
    (the PyTorch AMP recipe) is fine: the guard sees it and never unscales twice.

    ``optimizer`` may be a list: each optimizer gets its own core (skip decision, step count,
    cadence) and metrics under ``<metric_prefix>/opt<i>``; ``scheduler`` may be a list too, each
    scheduler held with the optimizer it drives.
    """

    #: Whether this driver follows a framework's gradient accumulation (AccelerateGuard does).
    follows_accumulation = False

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
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
        optimizers = _as_list(optimizer)
        if not optimizers:
            raise ValueError("StabilityGuard needs an optimizer; got an empty list")
        if not self.follows_accumulation:
            _refuse_accumulating(optimizers)
        base = coerce_config(config)
        refuse_several_optimizers(base.recovery, len(optimizers))
        many = len(optimizers) > 1
        self.cores: list[DriverCore] = []
        for i, opt in enumerate(optimizers):
            cfg = base
            if many:  # one set of monitor hooks on the model: the first optimizer's core reads it
                prefix = f"{base.metric_prefix}/opt{i}".strip("/")
                cfg = base.model_copy(update={"metric_prefix": prefix, "monitors": base.monitors if i == 0 else None})
            first = i == 0
            self.cores.append(
                DriverCore(
                    model,
                    opt,
                    cfg,
                    hooks=self.hooks,
                    scaler=scaler,
                    tracing=first,
                    apply_precision=first,
                    extra_group=extra_group,
                )
            )
        self.core = self.cores[0]
        self.config = self.core.config
        self.model = model
        self.optimizers = optimizers
        self.optimizer = optimizers[0]
        self.scaler = scaler
        self.schedulers = _as_list(scheduler)
        self.scheduler = scheduler
        for core in self.cores:
            for sched in self._schedulers_of(core):
                core.track_scheduler(sched)  # recovery saves and restores it with each snapshot
                core.engine.ledger.holds_scheduler = True  # step() holds it on skips
        self._pending_losses: list[Tensor] = []  # several optimizers: losses not yet claimed by a step
        # each optimizer's step is routed through its core once, for the guard's life (undone by close())
        self._unroute = [self._route_step(core) for core in self.cores]
        self._closed = False

    @property
    def engine(self) -> StabilityEngine:
        """The (first optimizer's) engine behind this guard (counters, layer names, journal)."""
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

    # ------------------------------------------------------------------ optimizers
    def core_for(self, optimizer: Any | None = None) -> DriverCore:
        """The core guarding ``optimizer`` (a wrapper is looked through); None: the only one."""
        if optimizer is None:
            if len(self.cores) > 1:
                raise ValueError(
                    f"this guard has {len(self.cores)} optimizers: name the one that steps, "
                    "e.g. guard.step(optimizer=opt_d) / guard.backward(loss, optimizer=opt_d)"
                )
            return self.core
        target = unwrap_optimizer(optimizer)
        for core in self.cores:
            if core.optimizer is target:
                return core
        raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this guard was built with")

    def _outer(self, core: DriverCore) -> Any:
        """The object the user gave for ``core``'s optimizer (a framework wrapper, maybe)."""
        return self.optimizers[self.cores.index(core)]

    def _schedulers_of(self, core: DriverCore) -> list[Any]:
        if len(self.cores) == 1:
            return self.schedulers
        return [s for s in self.schedulers if scheduler_target(s) is core.optimizer]

    # ------------------------------------------------------------------ the loop API
    def check_batch(self, batch: Any) -> None:
        """The data guard (``config.data``) on one micro-batch; call it for each before its forward.

        ``mode="raise"``: raise ``BadBatchError`` naming the path, index and step (one sync).
        ``mode="skip"``: the coming step is skipped on the device when any of its micro-batches was
        bad (no sync); a ``bad_batch`` event reports it.
        """
        for core in self.cores:
            core.check_batch(batch)

    def record_loss(self, loss: Tensor, optimizer: Any | None = None) -> None:
        """Remember a backpropagated micro-batch loss (device tensor, no sync) for the step it feeds."""
        if optimizer is not None or len(self.cores) == 1:
            self.core_for(optimizer).record_loss(loss)
        else:
            self._pending_losses.append(loss.detach())

    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> None:
        """Backpropagate ``loss`` (scaled when a GradScaler is enabled) and remember its value.

        With several optimizers, ``optimizer`` names the one whose step this loss feeds; without it
        the loss goes to the next ``step``.
        """
        self.record_loss(loss, optimizer)
        self.core.scaler.scale(loss).backward(**kwargs)

    def step(
        self,
        replay: Callable[[], Tensor] | None = None,
        *,
        optimizer: Any | None = None,
        update_scaler: bool = True,
    ) -> StepReport:
        """Measure, clip, and step the optimizer, or skip the step; returns this step's report.

        ``optimizer``: which one steps (required with several). ``replay``: recomputes this batch's
        loss (forward only); with ``nan_trace.mode="on_nonfinite"`` a skipped step is replayed once
        with hooks and anomaly mode to name where it went non-finite. ``update_scaler``: call
        ``scaler.update()`` after the step (several optimizers under one GradScaler: pass False for
        all but the last one that steps this iteration).
        """
        core = self.core_for(optimizer)
        for loss in self._pending_losses:
            core.record_loss(loss)
        self._pending_losses = []
        core.evaluate(replay=replay)
        self._optimizer_step(core, update_scaler)
        if not core.should_hold_scheduler():
            for scheduler in self._schedulers_of(core):
                scheduler.step()
        report = core.finish()
        assert report is not None
        return report

    def _route_step(self, core: DriverCore) -> Callable[[], None]:
        """Route the optimizer's step through ``core`` (installed once, at construction); returns the undo."""
        return core.wrap_optimizer_step(core.optimizer)

    def _optimizer_step(self, core: DriverCore, update_scaler: bool) -> None:
        """Step the optimizer (its routed step applies the skip); GradScaler-aware."""
        if core.scaler.enabled:
            self.scaler.step(core.optimizer)  # type: ignore[union-attr]  # skips an fp16 overflow itself
            if update_scaler:
                self.scaler.update()  # type: ignore[union-attr]  # the scale backs off after an overflow
        else:
            core.optimizer.step()

    def zero_grad(self, set_to_none: bool = True, *, optimizer: Any | None = None) -> None:
        """``optimizer.zero_grad`` (every optimizer when none is named): grads of a skipped step are dropped."""
        targets = self.optimizers if optimizer is None else [optimizer]
        for opt in targets:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def step_count(self) -> int:
        """Optimizer steps attempted so far, skipped ones included (the first optimizer's)."""
        return self.core.engine.step

    @property
    def schedule_step(self) -> int:
        """The step a hand-set LR schedule should use: steps so far less the skipped (held) ones.

        ``lr = get_lr(guard.schedule_step)`` holds an LR written into ``param_group["lr"]`` by hand
        through a skip, as a scheduler passed as ``scheduler=`` is held (see the skipping guide).
        """
        return self.core.schedule_step

    @property
    def skipped_total(self) -> int:
        """Skipped steps as of the host's last look (exact on logging steps and for non-fused optimizers)."""
        return self.core.engine.skipped_total

    def summary(self) -> RunSummary:
        """The run's totals (reads the steps since the last logging step first: one sync).

        With several optimizers the first optimizer's totals, with ``optimizers``: one entry each.
        Readable by key too (``guard.summary()["skipped"]``); ``.line()`` is the end-of-run line.
        """
        rows = [core.summary() for core in self.cores]
        first = rows[0]
        if len(rows) > 1:
            first = dataclasses.replace(first, optimizers=tuple(rows))
        return first

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, EMAs, detector state and unread journal rows (optimizer, scaler, scheduler save their own)."""
        if len(self.cores) == 1:
            return self.core.state_dict()
        return {"optimizers": [core.state_dict() for core in self.cores]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        states = state.get("optimizers")
        if states is None:
            states = [state]
        if len(states) != len(self.cores):
            raise ValueError(f"guard state holds {len(states)} optimizer(s), this guard has {len(self.cores)}")
        for core, core_state in zip(self.cores, states, strict=True):
            core.load_state_dict(core_state)

    def close(self) -> None:
        """Process the steps since the last logging step, remove tracing hooks and wrappers, close the sinks."""
        for undo in self._unroute:
            undo()
        self._unroute = []
        if not self._closed:
            for core in self.cores:
                core.flush(final_row=True)  # the steps after the last logging step get their row
            self.summary().log()  # the run's one line: steps, skips, clips, max norm, first NaN source
        self._closed = True
        for core in self.cores:
            core.close()
        self.hooks.close()
