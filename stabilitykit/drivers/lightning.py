"""StabilityCallback: Lightning's hooks mapped onto the driver base, one engine per optimizer.

``on_before_backward`` records the loss; ``on_before_optimizer_step`` (grads final, unscaled, before
clipping) measures, clips and decides; each optimizer's ``step`` is routed; ``on_train_batch_end`` ends it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from stabilitykit.config import StabilityConfig, refuse_two_clippers, with_cadence
from stabilitykit.drivers.base import Driver, guard_batch
from stabilitykit.engine.cadence import TrainerAlignedEngine
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.nan import NonFiniteRecord
from stabilitykit.precision import PrecisionChoice
from stabilitykit.report import StepReport
from stabilitykit.rerun.lightning import manual_rerun
from stabilitykit.rules import SkipRule
from stabilitykit.run_log import RunSummary
from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.loggers import sinks_for_loggers

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "stabilitykit.lightning needs Lightning: pip install 'stabilitykit[lightning]' (or pip install lightning)"
    ) from exc

__all__ = ["StabilityCallback"]


class StabilityCallback(Callback):
    """Norms, clipping, skip-the-batch, metrics and events for a Lightning ``Trainer``: metrics to every
    logger at ``trainer.global_step`` and to ``sinks``, every ``log_every_n_steps`` (default: the Trainer's)
    of each optimizer's own steps; several optimizers each guarded on their own (``<prefix>/opt<i>/``)."""

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        name: str | None = None,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        """``rules``: your own skip rules (``stabilitykit.SkipRule``), run after the built-in ones."""
        #: The lifecycle every driver shares (``drivers/base.py``): engines, losses, rules, state, the end.
        self.driver = Driver(config, sinks=sinks, rules=rules, final_row=False)  # Lightning's own rows only
        self.config = self.driver.config
        self.name = name
        self.hooks = self.driver.hooks
        self._batch: tuple[Any, int] | None = None
        self._state_key = self._generate_state_key(name=name or "default")

    @property
    def engines(self) -> list[StabilityEngine]:
        """One engine per optimizer (empty before fit starts)."""
        return self.driver.engines

    def record(self, name: str, value: Tensor | float, reduce: str = "mean") -> None:
        """Record a metric of the coming optimizer step (no sync); see ``stabilitykit.record``."""
        self.driver.record(name, value, reduce)

    def summary(self) -> RunSummary:
        """The run's totals (the first optimizer's; ``optimizers``: each one's)."""
        return self.driver.summary()

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint; ``name`` lets several instances coexist."""
        return self._state_key  # Lightning reads it around every hook call: computed once

    @property
    def engine(self) -> StabilityEngine | None:
        """The first optimizer's engine (None before fit starts)."""
        return self.engines[0] if self.engines else None

    @property
    def last_report(self) -> StepReport | None:
        """The first optimizer's latest step report."""
        return self.engines[0].last_report if self.engines else None

    @property
    def last_nonfinite(self) -> NonFiniteRecord | None:
        """Where the latest traced or replayed non-finite value came from."""
        tracing = self.engines[0].tracing if self.engines else None
        return tracing.last_nonfinite if tracing is not None else None

    @property
    def precision_choice(self) -> PrecisionChoice | None:
        """What ``sk.select_precision()`` recommends for the model's device."""
        return self.driver.precision_choice

    # ------------------------------------------------------------------ setup and teardown
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a second clipper: Lightning's gradient_clip_val would clip after our norms were read."""
        refuse_two_clippers(self.config, "gradient_clip_val", trainer.gradient_clip_val, "set gradient_clip_val=None")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """One engine per optimizer; route each optimizer's step and its step-interval schedulers through it."""
        if not trainer.optimizers:
            raise ValueError("StabilityCallback needs an optimizer: configure_optimizers returned none")
        self.driver.release()
        if all(type(opt).__name__ == "_MockOptimizer" for opt in trainer.optimizers):
            warnings.warn(
                "StabilityCallback: configure_optimizers returned None, so this fit has no optimizer step to "
                "guard; the callback does nothing (return an optimizer from configure_optimizers to use it)",
                UserWarning,
                stacklevel=2,
            )
            return
        config = with_cadence(self.config, trainer.log_every_n_steps)  # type: ignore[attr-defined]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        for sink, owned in sinks_for_loggers(trainer.loggers, self.hooks.sinks, trainer.is_global_zero):
            self.hooks.add_sink(sink, owned=owned)  # a WandbLogger's run gets a WandbSink: markers and alerts
        self.driver.build_engines(
            pl_module,
            trainer.optimizers,
            config,
            scaler=scaler,
            engine_cls=TrainerAlignedEngine,  # Lightning's logging rows: global steps n-1, 2n-1, ...
        )
        self.driver.route_steps()
        for engine in self.engines:
            if engine.rerun is not None:  # the strategy's DDP wrapper, for the rank of a local-gradient fault
                engine.rerun.watch_local_grads(trainer.strategy.model)
        for sched_cfg in trainer.lr_scheduler_configs:
            if sched_cfg.interval == "step":  # Lightning steps it; held on skipped steps
                self.driver.add_scheduler(sched_cfg.scheduler, stepped_here=False)
            else:  # recovery restores it with each snapshot
                self.driver.track_scheduler(sched_cfg.scheduler)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The run is over: the last steps folded and logged, the summary line, wrappers undone, sinks closed."""
        self.driver.end_run()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """An interrupted fit ends the same way: the optimizer and schedulers as they were, sinks closed."""
        self.driver.end_run()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Undo every wrapper (idempotent) and remove tracing hooks."""
        self.driver.release()
        for engine in self.engines:
            if engine.tracing is not None:
                engine.tracing.detach()

    # ------------------------------------------------------------------ the step

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The data guard on this micro-batch; the batch is kept for a replay if the step goes non-finite."""
        self._batch = (batch, batch_idx)
        for engine in self.engines:
            guard_batch(engine, batch)
            if engine.rerun is not None:
                engine.rerun.start_step()  # the random state training_step starts with, for a rerun

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        """Remember each micro-batch's loss (stays on the device) for the optimizer that steps next."""
        self.driver.record_loss(loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Grads are final here: measure, clip and decide; the optimizer's routed step acts on it."""
        engine = self.driver.find_engine(optimizer)
        if engine is None:
            return
        self.driver.claim_losses(engine)
        batch = self._batch
        if batch is None or not pl_module.automatic_optimization:  # manual optimization: its own rerun
            self.driver.decide(engine, log_step=trainer.global_step, **manual_rerun(self, trainer, batch))
            return

        def loss_of(training_step: Callable[..., Any]) -> Callable[[], Tensor]:
            def replay() -> Tensor:
                out = training_step(*batch)
                return out["loss"] if isinstance(out, Mapping) else out  # type: ignore[no-any-return]

            return replay

        def backward(loss: Tensor) -> None:  # Lightning's own backward (its hooks record the loss)
            trainer.strategy.backward(loss, optimizer)
            self.driver.claim_losses(engine)

        rerun_replay = loss_of(trainer.strategy.training_step)  # through the strategy's DDP wrapper and precision
        self.driver.decide(engine, loss_of(pl_module.training_step), trainer.global_step, backward, rerun_replay)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the optimizer step(s): sinks, events and the divergence check."""
        self._batch = None
        for engine in self.engines:
            self.driver.end_step(engine)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Each engine's state (counters, EMAs, detectors, unread journal rows), as every driver saves it."""
        return self.driver.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the engines (the base applies it at fit start when they do not exist yet)."""
        if state_dict:
            self.driver.load_state_dict(state_dict)
