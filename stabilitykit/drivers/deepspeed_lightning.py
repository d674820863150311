"""Lightning's DeepSpeed strategy: ``DeepSpeedStabilityCallback`` puts a ``DeepSpeedGuard`` on its engine at fit
start (metrics to every logger). Lightning runs the strategy on CUDA only: tested in ``tests/cuda``."""

from __future__ import annotations

from stabilitykit.config import with_cadence
from stabilitykit.drivers import missing
from stabilitykit.drivers.deepspeed import DeepSpeedLater

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.deepspeed_lightning", "lightning", "lightning") from exc


class DeepSpeedStabilityCallback(DeepSpeedLater, pl.Callback):
    """Guards the DeepSpeed engine of a Lightning ``DeepSpeedStrategy`` fit."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The strategy has made the engine: guard it (metrics to every logger of the Trainer)."""
        deepspeed_engine = getattr(trainer.strategy, "deepspeed_engine", None)
        if deepspeed_engine is None:
            raise TypeError(
                f"DeepSpeedStabilityCallback needs Lightning's DeepSpeedStrategy, got "
                f"{type(trainer.strategy).__name__}; use stabilitykit.lightning.StabilityCallback for other strategies"
            )
        config = with_cadence(self.config, trainer.log_every_n_steps)  # type: ignore[attr-defined]
        for logger in trainer.loggers:
            if not any(sink is logger for sink in self.hooks.sinks):
                self.hooks.add_sink(logger, owned=False)  # type: ignore[arg-type]  # Lightning finalizes it
        self.start_guard(deepspeed_engine, config)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close_guard()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close_guard()  # an interrupted fit ends the same way
