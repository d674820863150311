"""AccelerateGuard: ``StabilityGuard`` for hand-written Accelerate loops: it steps only when
``accelerator.sync_gradients``, backpropagates through ``accelerator.backward`` and logs to its trackers."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.drivers import missing
from stabilitykit.drivers.loop import StabilityGuard
from stabilitykit.drivers.routing import StepRoutes
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.trainers import AcceleratorTrackers

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.accelerate", "accelerate", "accelerate") from exc

__all__ = ["AccelerateGuard"]


def route_accelerated_step(routes: StepRoutes, engine: StabilityEngine, optimizer: Any) -> Callable[[], None]:
    """Route ``optimizer.step`` through ``engine``; an ``AcceleratedOptimizer`` with a GradScaler re-captures the
    inner ``step`` (``__getstate__``/``__setstate__``) after the route and after its undo. Returns the undo."""
    undo_wrap = routes.route(engine, optimizer)
    recapture = isinstance(optimizer, AcceleratedOptimizer) and optimizer.scaler is not None
    if recapture:
        optimizer.__setstate__(optimizer.__getstate__())

    def undo() -> None:
        undo_wrap()
        if recapture:
            optimizer.__setstate__(optimizer.__getstate__())

    return undo


class AccelerateGuard(StabilityGuard):
    """The plain-loop guard over ``accelerator.prepare``'s objects, following ``accelerator.accumulate``;
    ``scaler``: default ``accelerator.scaler``; ``log_to_trackers``: metrics to ``accelerator.log`` too."""

    follows_accumulation = True

    def __init__(
        self,
        accelerator: Accelerator,
        model: nn.Module,
        optimizer: Any | Sequence[Any],
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        scheduler: Any | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        scaler: Any | None = None,
        log_to_trackers: bool = True,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        super().__init__(
            model,
            optimizer,
            config,
            scaler=scaler if scaler is not None else accelerator.scaler,
            scheduler=scheduler,
            sinks=sinks,
            hooks=hooks,
            rules=rules,
        )
        self.accelerator = accelerator
        if log_to_trackers:
            self.hooks.add_sink(AcceleratorTrackers(accelerator, self.config.metric_prefix))

    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> None:
        """``accelerator.backward(loss)``; the loss is recorded divided by the accumulation steps, as backpropagated."""
        self.record_loss(loss.detach() / self.accelerator.gradient_accumulation_steps, optimizer)
        self.accelerator.backward(loss, **kwargs)

    def step(  # type: ignore[override]  # None on accumulation micro-batches
        self,
        replay: Callable[[], Tensor] | None = None,
        *,
        optimizer: Any | None = None,
    ) -> StepReport | None:
        """On the micro-batch that syncs grads: measure, clip, step or skip (its report); else None."""
        if not self.accelerator.sync_gradients:  # a micro-batch inside an accumulation
            return None
        return super().step(replay, optimizer=optimizer)

    def _route_step(self, engine: StabilityEngine) -> Callable[[], None]:
        return route_accelerated_step(self.routes, engine, self._outer(engine))

    def _optimizer_step(self, engine: StabilityEngine, update_scaler: bool) -> None:
        """``AcceleratedOptimizer.step()``: Accelerate runs its GradScaler's step and update itself."""
        self._outer(engine).step()
