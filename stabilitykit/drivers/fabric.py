"""FabricGuard: ``StabilityGuard`` over ``fabric.backward`` and Fabric's routed optimizer step."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.drivers import missing
from stabilitykit.drivers.loop import StabilityGuard
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink

try:
    from lightning.fabric import Fabric
    from lightning.fabric.wrappers import is_wrapped
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.fabric", "lightning", "lightning") from exc

__all__ = ["FabricGuard"]


class FabricGuard(StabilityGuard):
    """The plain-loop guard over ``fabric.setup``'s objects; ``log_to_loggers``: metrics to ``fabric.loggers``."""

    def __init__(
        self,
        fabric: Fabric,
        model: nn.Module,
        optimizer: Any | Sequence[Any],
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        scheduler: Any | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        log_to_loggers: bool = True,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        scaler = getattr(fabric.strategy.precision, "scaler", None)
        inner: nn.Module = model.module if is_wrapped(model) else model  # type: ignore[assignment]  # user's tree
        super().__init__(
            inner, optimizer, config, scaler=scaler, scheduler=scheduler, sinks=sinks, hooks=hooks, rules=rules
        )
        self.fabric = fabric
        self.fabric_model = model
        if log_to_loggers:
            for logger in fabric.loggers:
                self.hooks.add_sink(logger, owned=False)  # type: ignore[arg-type]  # Fabric finalizes its loggers

    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> None:
        """``fabric.backward(loss)`` (scaled by Fabric's precision plugin); the loss is recorded as given."""
        self.record_loss(loss, optimizer)
        self.fabric.backward(loss, **kwargs)

    def step(self, replay: Callable[[], Tensor] | None = None, *, optimizer: Any | None = None) -> StepReport:  # type: ignore[override]
        """The plain guard's ``step``; Fabric's optimizer step updates its GradScaler itself."""
        return super().step(replay, optimizer=optimizer)

    def _optimizer_step(self, engine: StabilityEngine, update_scaler: bool) -> None:
        """Fabric's optimizer step: strategy, precision plugin, GradScaler step and update."""
        self._outer(engine).step()
