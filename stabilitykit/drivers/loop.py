"""StabilityGuard: the driver for plain PyTorch loops, on the base; Accelerate, Fabric and DeepSpeed subclass
it and change only how the loss is backpropagated and how the optimizer steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.drivers.base import Driver, guard_batch
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.nan import NaNTracer, NonFiniteRecord
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.schedulers import check_arguments
from stabilitykit.sinks.base import Sink


def _as_list(value: Any) -> list[Any]:
    """``None`` -> [], a list or tuple -> a list, anything else -> [value]."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _refuse_accumulating(optimizers: Sequence[Any]) -> None:
    """An optimizer accumulating over micro-batches (Accelerate's) is refused: use AccelerateGuard."""
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


class StabilityGuard(Driver):
    """Keeps a plain training loop finite: clipping, skip-the-batch, metrics and events.

    The guard owns ``backward`` (to scale and remember the loss) and ``step`` (to unscale exactly once,
    clip and skip); a skipped step leaves parameters, optimizer state and the LR scheduler bitwise
    unchanged, and a ``scaler.unscale_`` of yours before ``step`` is seen, never repeated. ``optimizer``
    and ``scheduler`` may be lists: each optimizer is guarded on its own (metrics under ``<prefix>/opt<i>``).
    The lifecycle (state, ``summary()``, ``close()``, ``with``, ``record``) is the driver base's.
    """

    follows_accumulation = False  #: whether it follows a framework's gradient accumulation (Accelerate's)

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
        check_arguments(scaler, _as_list(scheduler), optimizers)  # each mistake named with its fix
        if not self.follows_accumulation:
            _refuse_accumulating(optimizers)
        super().__init__(config, sinks=sinks, hooks=hooks, rules=rules)
        self._start(model, optimizers, scaler=scaler, extra_group=extra_group)
        for sched in _as_list(scheduler):
            self.add_scheduler(sched, stepped_here=True)  # step() steps it, and holds it on skips
        self.scheduler = scheduler
        self.schedulers = _as_list(scheduler)

    def _start(
        self,
        model: nn.Module | None,
        optimizers: list[Any],
        scaler: Any | None = None,
        extra_group: Any | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        """The run starts: one engine per optimizer, each optimizer's step routed through it."""
        self.build_engines(model, optimizers, scaler=scaler, extra_group=extra_group, names=names)
        #: The (first optimizer's) engine behind this guard (counters, layer names, journal, recovery).
        self.engine = self.engines[0]
        self.config = self.engine.config
        self.model = model
        self.optimizers = optimizers
        self.optimizer = optimizers[0]
        self.scaler = scaler
        self.route_steps(self._route_step)

    @property
    def tracer(self) -> NaNTracer | None:
        """The NaN tracer, when ``config.nan_trace`` uses one."""
        return self.engine.tracing.tracer if self.engine.tracing is not None else None

    @property
    def last_nonfinite(self) -> NonFiniteRecord | None:
        """Where the latest traced or replayed non-finite value came from."""
        return self.engine.tracing.last_nonfinite if self.engine.tracing is not None else None

    def _outer(self, engine: StabilityEngine) -> Any:
        """The object the user gave for ``engine``'s optimizer (a framework wrapper, maybe)."""
        return self.optimizers[self.engines.index(engine)]

    # ------------------------------------------------------------------ the loop API
    def check_batch(self, batch: Any) -> None:
        """The data guard (``config.data``) on one micro-batch, before its forward (``raise`` or skip the step)."""
        for engine in self.engines:
            guard_batch(engine, batch)

    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> None:
        """Backpropagate ``loss`` (scaled under a GradScaler) and record it for the named or the next ``step``."""
        if self.closed:
            self.check_open("backward")
        self.record_loss(loss, optimizer)
        self.engine.scaler.scale(loss).backward(**kwargs)

    def step(
        self,
        replay: Callable[[], Tensor] | None = None,
        *,
        optimizer: Any | None = None,
        update_scaler: bool = True,
    ) -> StepReport:
        """Measure, clip, and step the optimizer, or skip the step; returns this step's report.

        ``optimizer``: which one steps (required with several). ``replay``: this batch's loss again
        (forward only), to name where a skipped step went non-finite (``nan_trace``) and to compute a
        flagged step again (``config.rerun``). ``update_scaler``: ``scaler.update()`` after the step (several
        optimizers under one GradScaler: False for all but the last to step).
        """
        if self.closed:
            self.check_open("step")
        engine = self.engines[0] if optimizer is None and len(self.engines) == 1 else self.engine_for(optimizer)

        def backward(loss: Tensor) -> None:  # a rerun of a flagged step backpropagates as the guard does
            self.backward(loss, optimizer=optimizer)

        def optimizer_step() -> None:
            self._optimizer_step(engine, update_scaler)

        return self.train_step(engine, optimizer_step, replay=replay, backward=backward)

    def _route_step(self, engine: StabilityEngine) -> Callable[[], None] | None:
        """Route the optimizer's step through ``engine`` (installed once, at construction); returns the undo."""
        return self.routes.route(engine, engine.optimizer)

    def _optimizer_step(self, engine: StabilityEngine, update_scaler: bool) -> None:
        """Step the optimizer (its routed step applies the skip); GradScaler-aware."""
        if engine.scaler.enabled:
            self.scaler.step(engine.optimizer)  # type: ignore[union-attr]  # skips an fp16 overflow itself
            if update_scaler:
                self.scaler.update()  # type: ignore[union-attr]  # the scale backs off after an overflow
        else:
            engine.optimizer.step()

    def zero_grad(self, set_to_none: bool = True, *, optimizer: Any | None = None) -> None:
        """``optimizer.zero_grad`` (every optimizer when none is named): grads of a skipped step are dropped."""
        targets = self.optimizers if optimizer is None else [optimizer]
        for opt in targets:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def step_count(self) -> int:
        """Optimizer steps attempted so far, skipped ones included (the first optimizer's)."""
        return self.engine.step

    @property
    def schedule_step(self) -> int:
        """The step a hand-set LR schedule should use: steps so far less the skipped (held) ones, so an LR
        written into ``param_group["lr"]`` by hand is held through a skip as ``scheduler=`` is."""
        return self.engine.step - self.engine.held_steps

    @property
    def skipped_total(self) -> int:
        """Skipped steps as of the host's last look (exact on logging steps and for non-fused optimizers)."""
        return self.engine.skipped_total

    def restore_last_good(self) -> int:
        """Put back the last healthy recovery snapshot; returns its step. After ``RollbackLimitError``: the one kept
        when recovery gave up (it outlives ``close()``; on disk as ``last-good-<step>.pt``); else the newest."""
        recovery = self.engine.recovery
        if recovery is None:
            raise RuntimeError("stabilitykit: restore_last_good() needs recovery on (StabilityConfig(recovery=...))")
        return recovery.restore_last_good()
