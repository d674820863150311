"""StabilityTrainerCallback: the Hugging Face ``Trainer``'s hooks mapped onto the driver base.

``accelerator.backward`` records the loss; ``accelerator.clip_grad_norm_`` (the final grads, before
anything clips them) measures, clips and decides, so ``grad_norm`` is the pre-clip norm; the optimizer's
step is routed, the scheduler held on skips; logs join the Trainer's (``sinks/trainers.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from stabilitykit.config import StabilityConfig, refuse_two_clippers, with_cadence
from stabilitykit.drivers import missing
from stabilitykit.drivers.base import Driver
from stabilitykit.engine.cadence import TrainerAlignedEngine
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.grads import clip_to_norm
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.run_log import RunSummary
from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.trainers import TrainerLogs
from stabilitykit.sinks.wandb import ALERT_KINDS

try:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from stabilitykit.drivers.accelerate import route_accelerated_step
    from stabilitykit.drivers.hf_attach import AttachedCallback
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.hf", "transformers", "transformers accelerate") from exc

__all__ = ["StabilityTrainerCallback", "stabilize"]

#: The key, in the saved state, of the steps the Trainer's max_grad_norm clipped.
_TRAINER_CLIPPED = "trainer_clipped"
#: ``console=``: "short" prints the keys a person reads, "all" every key.
ConsoleMode = Literal["short", "all"]


# ---------------------------------------------------------------------- the Trainer's cadence
class _FirstStepEngine(TrainerAlignedEngine):
    log_first_step = True


class StabilityTrainerCallback(AttachedCallback):
    """Norms, clipping, skip-the-batch, metrics and events for a Hugging Face ``Trainer``. ``sinks``: besides the
    Trainer's logs; ``alerts``: True (or kinds) for W&B alerts; ``log_events``: events as log entries;
    ``console``: "short" (the keys a person reads) or "all". Logs every ``logging_steps`` by default."""

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        alerts: bool | Iterable[str] = False,
        log_events: bool = True,
        *,
        rules: Sequence[SkipRule] = (),
        console: ConsoleMode = "short",
        restore_into_attached: bool = False,
    ) -> None:
        if self.restored(restore_into_attached):
            return  # the attached callback came back from __new__ (``AttachedCallback``): keep all it holds
        #: The lifecycle every driver shares (``drivers/base.py``): engines, losses, rules, state, the end.
        self.driver = Driver(config, sinks=sinks, rules=rules, final_row=False)  # the Trainer's own rows only
        self.config = self.driver.config
        self.hooks = self.driver.hooks
        kinds = ALERT_KINDS if alerts is True else [] if alerts is False else alerts
        self.logs = TrainerLogs(self.config.metric_prefix, kinds)  # the Trainer's log entries, W&B alerts
        self.hooks.add_sink(self.logs)
        self.alert_on = self.logs.alerts
        self.log_events = log_events
        if console not in ("short", "all"):
            raise ValueError(f"console={console!r}: expected 'short' or 'all'")
        self.console: ConsoleMode = console
        self.saved_state: dict[str, Any] | None = None  # set by the Trainer's callback-state restore
        self._global_step = 0
        self._warned_fallback = False
        #: steps the Trainer's own max_grad_norm clipped (a device count; None before the first)
        self._trainer_clipped: Tensor | None = None
        self._rerun_step: Callable[[], Any] | None = None  # the step's training_step again (RerunConfig)

    # ------------------------------------------------------------------ attaching
    def attach(self, trainer: Trainer) -> StabilityTrainerCallback:
        """Bind to ``trainer`` (and add this callback to it); refuses two clippers and DeepSpeed (``stabilize``)."""
        refuse_two_clippers(self.config, "max_grad_norm", trainer.args.max_grad_norm, "set max_grad_norm=0")
        if trainer.is_deepspeed_enabled:
            raise ValueError(
                "StabilityTrainerCallback does not support DeepSpeed (it clips and steps inside backward); "
                "use stabilitykit.integrations.stabilize(trainer, config), which guards the DeepSpeed engine"
            )
        # an exception still ends the run (sinks closed); the route stays for the callback's life (``detach``)
        self.driver.patch(trainer, "train", self._train, lasting=True)
        self.bind(trainer)
        return self

    @property
    def engine(self) -> StabilityEngine | None:
        """The engine over the Trainer's optimizer (None before training starts)."""
        return self.driver.engines[0] if self.driver.engines else None

    def record(self, name: str, value: Tensor | float, reduce: str = "mean") -> None:
        """Record a metric of the coming optimizer step (no sync); see ``stabilitykit.record``."""
        self.driver.record(name, value, reduce)

    def _train(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``trainer.train``: a run that raises ends here (wrappers undone, sinks closed)."""
        try:
            return original(*args, **kwargs)
        except BaseException:
            self.driver.end_run()
            raise

    @property
    def last_report(self) -> StepReport | None:
        """The latest step's report."""
        return self.engine.last_report if self.engine is not None else None

    # ------------------------------------------------------------------ training starts and ends
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Build the engine over the prepared optimizer; restore a resumed run's state; install the routes."""
        trainer = self.bound()
        self.driver.release()
        config = self.config
        if args.logging_strategy == "steps":
            config = with_cadence(config, int(state.logging_steps or args.logging_steps or 1))
        accelerator = trainer.accelerator
        engine_cls = _FirstStepEngine if args.logging_first_step else TrainerAlignedEngine
        (engine,) = self.driver.build_engines(
            trainer.model, [trainer.optimizer], config, scaler=accelerator.scaler, engine_cls=engine_cls
        )
        saved = self.resumed_state(state, engine.device)
        self._trainer_clipped = None
        if saved:
            clipped = int(saved.pop(_TRAINER_CLIPPED, 0))
            self.driver.load_state_dict(saved)
            self._trainer_clipped = torch.tensor(clipped, device=engine.device)
        self._global_step = state.global_step
        self.driver.route_steps(lambda engine: route_accelerated_step(self.driver.routes, engine, trainer.optimizer))
        if trainer.lr_scheduler is not None:  # the Trainer steps it: held on skipped steps, restored by recovery
            self.driver.add_scheduler(trainer.lr_scheduler, stepped_here=False)
        self.driver.patch(accelerator, "backward", functools.partial(self._backward, accelerator))
        if engine.rerun is not None:  # what a rerun computes again: the Trainer's step
            self.driver.patch(trainer, "training_step", self._training_step)
            engine.rerun.watch_local_grads(trainer.model_wrapped)  # the Accelerator's DDP wrapper, if any
        self.driver.patch(accelerator, "clip_grad_norm_", functools.partial(self._clip_grad_norm, accelerator))
        self.driver.patch(trainer, "log", self._log)
        for printer in trainer.callback_handler.callbacks:  # the console: no per-layer keys
            if type(printer).__name__ in ("ProgressCallback", "PrinterCallback"):
                self.driver.patch(printer, "on_log", functools.partial(self._on_log, self.logs.console_keys()))

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The run is over: the last steps folded, events logged, the summary line, routes undone, sinks closed."""
        if self.engine is not None:
            self.driver.end_step(self.engine)
            self.engine.flush()
            self._write_events(at_end=state)
        self.driver.end_run(self.summary())

    def detach(self) -> None:
        """Undo everything this callback installed on its Trainer, the ``train`` route included."""
        self.driver.release(lasting=True)

    # ------------------------------------------------------------------ the routes
    def _on_log(self, keep: Callable[[str], bool], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A console printer's ``on_log``: with ``console="short"`` each entry cut to what a person reads."""
        logs = kwargs.get("logs")
        if logs is not None and self.console == "short":
            kwargs["logs"] = {k: v for k, v in logs.items() if keep(k)}
        return original(*args, **kwargs)

    def _backward(self, accelerator: Any, original: Callable[..., Any], loss: Tensor, **kwargs: Any) -> Any:
        """``accelerator.backward``: the loss recorded as backpropagated (divided by the accumulation steps)."""
        if self.engine is not None:
            self.engine.inputs.add_loss(loss.detach() / accelerator.gradient_accumulation_steps)
        return original(loss, **kwargs)

    def _training_step(self, original: Callable[..., Any], model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        """``trainer.training_step`` (``config.rerun``): the call kept (a shallow copy of its inputs:
        ``compute_loss`` may pop the labels) and its random state taken, so a rerun calls it again."""
        engine = self.engine
        if engine is not None and engine.rerun is not None:
            engine.rerun.start_step()
            kept = copy.copy(inputs)
            self._rerun_step = lambda: original(model, copy.copy(kept), *args, **kwargs)
        return original(model, inputs, *args, **kwargs)

    def _rerun_args(self) -> dict[str, Any]:
        """``decide``'s rerun arguments: the Trainer's own step again (its backward route records the loss)."""
        step, self._rerun_step = self._rerun_step, None
        return {} if step is None else {"rerun_replay": step, "backward": lambda _loss: None}

    def _clip_grad_norm(
        self, accelerator: Any, original: Callable[..., Any], parameters: Any, max_norm: float, norm_type: float = 2
    ) -> Any:
        """``accelerator.clip_grad_norm_``: measure, clip, decide; ``max_grad_norm`` from that norm; the norm back."""
        engine = self.engine
        if engine is None or engine.in_flight is not None or not accelerator.sync_gradients:
            return original(parameters, max_norm, norm_type)
        decision = self.driver.decide(engine, log_step=self._global_step + 1, **self._rerun_args())
        norm = decision.report.grad_norm
        if max_norm is not None and math.isfinite(max_norm) and max_norm > 0:  # max_grad_norm, from that norm
            grads = [p.grad for p in engine.params if p.grad is not None]
            hit = (clip_to_norm(grads, norm, float(max_norm)) & ~decision.report.skipped).to(torch.int64)
            self._trainer_clipped = hit if self._trainer_clipped is None else self._trainer_clipped + hit
        return norm

    def summary(self) -> RunSummary | None:
        """The run's totals (None before training), the steps the Trainer's ``max_grad_norm`` clipped counted."""
        if self.engine is None:
            return None
        summary = self.driver.summary()
        clipped = int(self._trainer_clipped) if self._trainer_clipped is not None else 0
        return dataclasses.replace(summary, clipped=summary.clipped + clipped)

    def _log(self, original: Callable[..., Any], logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
        """``trainer.log``: a logging step's metrics join the Trainer's training log entry."""
        if "loss" in logs and self.logs.metrics:
            logs.update(self.logs.metrics)
            self.logs.metrics = {}
        return original(logs, *args, **kwargs)

    # ------------------------------------------------------------------ the step
    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Grads are final; when the Trainer did not call ``clip_grad_norm_`` (mixed meshes) decide here."""
        engine = self.engine
        if engine is None or engine.in_flight is not None:
            return
        if args.max_grad_norm and args.max_grad_norm > 0 and not self._warned_fallback:
            warnings.warn(
                "stabilitykit: the Trainer clipped without accelerator.clip_grad_norm_; "
                "grad norms are read after its max_grad_norm clipping",
                RuntimeWarning,
                stacklevel=2,
            )
            self._warned_fallback = True
        self.driver.decide(engine, log_step=state.global_step + 1, **self._rerun_args())

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """After the optimizer and scheduler: events, sinks, the divergence check; events to the Trainer's logs."""
        self._global_step = state.global_step
        if self.engine is None:
            return
        self.driver.end_step(self.engine)
        self._write_events(merge=bool(control.should_log))

    def _write_events(self, merge: bool = False, at_end: TrainerState | None = None) -> None:
        """The events since the last step as log keys: joined to a logged step's entry (a log call of ours would
        reset ``should_log``), to the summary entry at the end, else an entry of their own."""
        entry = self.logs.take_events(self.log_events)
        trainer = self.bound_trainer()
        if entry is None or trainer is None:
            return
        if merge:
            self.logs.metrics.update(entry)
        elif at_end is not None and at_end.log_history:
            at_end.log_history[-1].update(entry)  # after the run's summary entry: join it, never follow it
        else:
            trainer.log(entry)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """What the Trainer writes into ``trainer_state.json`` at each checkpoint (JSON values only)."""
        saved = self.driver.state_dict() if self.engine is not None else None
        if saved is not None and self._trainer_clipped is not None:
            saved[_TRAINER_CLIPPED] = int(self._trainer_clipped)  # a checkpoint: syncs anyway
        return self.exported(saved)


def stabilize(
    trainer: Trainer,
    config: StabilityConfig | Mapping[str, Any] | str | None = None,
    **kwargs: Any,
) -> StabilityTrainerCallback:
    """Guard ``trainer`` in one line; returns the callback (``kwargs`` go to it). With ``deepspeed=`` it
    is a ``DeepSpeedTrainerCallback`` (``sinks``, ``hooks``, ``rules``), which guards the engine."""
    if trainer.is_deepspeed_enabled:
        from stabilitykit.drivers.deepspeed_hf import DeepSpeedTrainerCallback

        return DeepSpeedTrainerCallback(config, **kwargs).attach(trainer)  # type: ignore[return-value]
    return StabilityTrainerCallback(config, **kwargs).attach(trainer)
