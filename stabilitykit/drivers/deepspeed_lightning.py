"""Lightning's DeepSpeed strategy: ``DeepSpeedStabilityCallback`` puts a ``DeepSpeedGuard`` on its engine.

    trainer = L.Trainer(strategy="deepspeed_stage_2", accelerator="gpu", devices=2,
                        callbacks=[DeepSpeedStabilityCallback(cfg)])

Under ``DeepSpeedStrategy`` Lightning does not step a torch optimizer: its precision plugin calls
``engine.backward(loss)`` and its optimizer step ``engine.step()``. The callback builds a
``DeepSpeedGuard`` on ``trainer.strategy.deepspeed_engine`` when the fit starts (the strategy has
made the engine by then); the guard routes the engine's ``backward`` and ``step``, so every
optimizer step is measured, clipped and applied or skipped as in any DeepSpeed loop. Metrics go to
every logger of the Trainer and to the sinks given. Lightning's ``gradient_clip_val`` becomes
DeepSpeed's ``gradient_clipping``: with stabilitykit's clipping on as well the guard refuses (one
clipper).

Lightning runs its DeepSpeed strategy on CUDA GPUs only (``DeepSpeedStrategy.setup_environment``
raises "The DeepSpeed strategy is only supported on CUDA GPUs" for any other accelerator), so this
callback is tested in ``tests/cuda`` only; the guard under it is tested on the CPU
(``tests/test_deepspeed.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stabilitykit.config import StabilityConfig, coerce_config
from stabilitykit.drivers._extras import missing
from stabilitykit.drivers.deepspeed import DeepSpeedGuard
from stabilitykit.hooks import HookManager
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.deepspeed_lightning", "lightning", "lightning") from exc


class DeepSpeedStabilityCallback(pl.Callback):
    """Guards the DeepSpeed engine of a Lightning ``DeepSpeedStrategy`` fit."""

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        self.config = coerce_config(config)
        self.sinks = list(sinks or [])
        self.hooks = hooks or HookManager()
        self.rules = list(rules)
        self.guard: DeepSpeedGuard | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The strategy has made the engine: guard it (metrics to every logger of the Trainer)."""
        engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if engine is None:
            raise TypeError(
                f"DeepSpeedStabilityCallback needs Lightning's DeepSpeedStrategy, got "
                f"{type(trainer.strategy).__name__}; use stabilitykit.lightning.StabilityCallback for other strategies"
            )
        if self.guard is not None:
            self.guard.close()
        config = self.config
        if "log_every_n_steps" not in config.model_fields_set:
            config = config.model_copy(update={"log_every_n_steps": max(1, trainer.log_every_n_steps)})  # type: ignore[attr-defined]
        for logger in trainer.loggers:
            if not any(sink is logger for sink in self.hooks.sinks):
                self.hooks.add_sink(logger, owned=False)  # type: ignore[arg-type]  # Lightning finalizes it
        self.guard = DeepSpeedGuard(engine, config, sinks=self.sinks, hooks=self.hooks, rules=self.rules)

    def _close(self) -> None:
        if self.guard is not None:
            self.guard.close()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The fit is over: the guard's last row and summary, its routes undone, the sinks closed."""
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """An interrupted fit ends the same way."""
        self._close()
