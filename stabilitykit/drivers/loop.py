"""StabilityGuard: the driver for plain PyTorch loops over the driver core, one core per optimizer.

guard.backward(loss)   # scaled when a GradScaler is given; call it once per micro-batch
report = guard.step()  # unscale once, norms, clip, skip or step, scheduler, scaler.update()
guard.zero_grad()

With several optimizers (GANs, alternating updates) each one is guarded on its own: its own skip
decision, its own step count and logging cadence, metrics under ``<prefix>/opt<i>/``; name the
optimizer in ``step(optimizer)``. The Accelerate and Fabric drivers
(``stabilitykit.drivers.accelerate``, ``.fabric``) are subclasses that only change how the loss is backpropagated
and how the framework's optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.drivers.base import Driver
from stabilitykit.drivers.core import DriverCore, unwrap_optimizer
from stabilitykit.engine import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NaNTracer, NonFiniteRecord
from stabilitykit.precision import PrecisionChoice
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.run_log import RunSummary
from stabilitykit.sinks.base import Sink


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
        rules: Sequence[SkipRule] = (),
    ) -> None:
        """``extra_group``: a process group the norms also sum over (pipeline stages; see the distributed guide).
        ``rules``: your own skip rules (``stabilitykit.SkipRule`` instances), run after the built-in ones."""
        optimizers = _as_list(optimizer)
        if not optimizers:
            raise ValueError("StabilityGuard needs an optimizer; got an empty list")
        if not self.follows_accumulation:
            _refuse_accumulating(optimizers)
        #: The lifecycle every driver shares (``drivers/base.py``): cores, losses, rules, state, the end.
        self.driver = Driver(config, sinks=sinks, hooks=hooks, rules=rules)
        self.hooks = self.driver.hooks
        self.cores: list[DriverCore] = self.driver.build_cores(
            model, optimizers, scaler=scaler, extra_group=extra_group
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
                core.engine.note_scheduler_held()  # step() holds it on skips
        # each optimizer's step is routed through its core once, for the guard's life (undone by close())
        self._unroute = [self._route_step(core) for core in self.cores]
        self._closed = False

    def __enter__(self) -> StabilityGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the guard however the block ends: wrappers undone, the last row logged, sinks closed."""
        self.close()

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
        return self.core.tracing.tracer

    @property
    def last_nonfinite(self) -> NonFiniteRecord | None:
        """Where the latest traced or replayed non-finite value came from."""
        return self.core.tracing.last_nonfinite

    # ------------------------------------------------------------------ optimizers
    def core_for(self, optimizer: Any | None = None) -> DriverCore:
        """The core guarding ``optimizer`` (a wrapper is looked through); None: the only one."""
        return self.driver.core_for(optimizer)

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
        self._check_open("record_loss")
        self.driver.record_loss(loss, optimizer)

    def record(self, name: str, value: Tensor | float, reduce: str = "mean", *, optimizer: Any | None = None) -> None:
        """Record a metric of the coming step (a 0-d device tensor; no sync): logged as
        ``<prefix>/metrics/<name>`` at logging steps, agreed across ranks with ``reduce`` ("mean",
        "sum", "max", "min", "any", "all"), seen by your skip rules (``values[name]``) and the spike
        detector. Record every name from the first step on."""
        self._check_open("record")
        self.driver.record(name, value, reduce, optimizer)

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"stabilitykit: guard.{what}() after guard.close(): the guard no longer measures, skips or counts "
                "steps, so a non-finite update would be applied. Build a new StabilityGuard (and load_state_dict) "
                "to go on"
            )

    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> None:
        """Backpropagate ``loss`` (scaled when a GradScaler is enabled) and remember its value.

        With several optimizers, ``optimizer`` names the one whose step this loss feeds; without it
        the loss goes to the next ``step``.
        """
        self._check_open("backward")
        self.driver.record_loss(loss, optimizer)
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
        with hooks and anomaly mode to name where it went non-finite; with ``config.rerun`` a flagged
        step is computed again through it (forward here, backward by the guard) to tell a transient
        fault of the machine from bad data. ``update_scaler``: call
        ``scaler.update()`` after the step (several optimizers under one GradScaler: pass False for
        all but the last one that steps this iteration).
        """
        self._check_open("step")
        core = self.core_for(optimizer)
        self.driver.claim_losses(core)
        core.evaluate(replay=replay, backward=lambda loss: self.backward(loss, optimizer=optimizer))
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
        Reading it changes nothing ``close()`` writes.
        """
        return self.driver.summary()

    def restore_last_good(self) -> int:
        """Put back the last healthy recovery snapshot in place; returns its step (the state before that step).

        After ``RollbackLimitError`` this is the snapshot recovery kept when it gave up (it outlives
        ``close()``; on disk as ``last-good-<step>.pt`` with disk storage or a ``record_dir``): restore it,
        then save a checkpoint. Otherwise the newest snapshot of the ring. Needs recovery on.
        """
        recovery = self.core.recovery
        if recovery is None:
            raise RuntimeError("stabilitykit: restore_last_good() needs recovery on (StabilityConfig(recovery=...))")
        return recovery.restore_last_good()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, EMAs, detector state and unread journal rows (optimizer, scaler, scheduler save their own):
        ``{"version", "optimizers": [one state per optimizer]}``, the format every driver saves."""
        return self.driver.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned (validated as a whole first: nothing loads unless all can)."""
        self.driver.load_state_dict(state)

    def close(self) -> None:
        """Process the steps since the last logging step, remove tracing hooks and wrappers, log the
        summary line and close the sinks. Idempotent; ``with StabilityGuard(...) as guard:`` calls it."""
        for undo in self._unroute:
            undo()
        self._unroute = []
        self._closed = True
        self.driver.end_run()
