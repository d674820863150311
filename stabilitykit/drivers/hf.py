"""StabilityTrainerCallback: the Hugging Face ``Trainer``'s hooks mapped onto the driver base.

One line: ``stabilize(trainer, config)`` (or ``StabilityTrainerCallback(config).attach(trainer)``).

* ``accelerator.backward`` records each micro-batch's loss as backpropagated (the Trainer has
  already divided it by the accumulation steps): no change to ``compute_loss``.
* ``accelerator.clip_grad_norm_``, which the Trainer calls once per optimizer step on the final,
  accumulated grads before anything clips them, is where the engine measures, clips and decides.
  The Trainer's own ``grad_norm`` log is then the true pre-clip norm, and ``max_grad_norm`` (when
  stabilitykit does not clip) is applied from that same norm, with no second pass.
* the optimizer's step is routed through the engine (``AcceleratedOptimizer`` and its GradScaler
  included); the LR scheduler is held on skipped steps by a class swap that leaves its saved
  state alone, so ``save_steps`` checkpoints keep working.
* ``on_step_end``: events and sinks; the metrics of a logging step are merged into the Trainer's
  own log entry at its ``logging_steps`` (so ``log_history`` and every ``report_to``
  integration get them), and each event is a log entry ``<prefix>/events/<kind>``.
* the engine's state rides in ``trainer_state.json`` through the Trainer's stateful-callback
  mechanism and is restored by ``resume_from_checkpoint``.

Requires the ``transformers`` extra: ``pip install 'stabilitykit[transformers]'``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from stabilitykit.config import StabilityConfig
from stabilitykit.drivers._extras import missing
from stabilitykit.drivers.base import Driver
from stabilitykit.engine.cadence import TrainerAlignedEngine
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.events import Event
from stabilitykit.grads import CLIP_EPS, apply_clip_coefficient, clip_coefficient, device_groups
from stabilitykit.report import StepReport
from stabilitykit.rules import SkipRule
from stabilitykit.run_log import RunSummary
from stabilitykit.sinks.base import Sink
from stabilitykit.sinks.wandb import ALERT_KINDS, send_alert

try:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from stabilitykit.drivers.accelerate import route_accelerated_step
    from stabilitykit.drivers.hf_attach import AttachedCallback, from_json, to_json
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise missing("stabilitykit.drivers.hf", "transformers", "transformers accelerate") from exc

__all__ = ["StabilityTrainerCallback", "stabilize"]

#: Event kinds kept out of the Trainer's logs (the device's precision advice is not a training event).
_NOT_LOGGED = ("precision",)


#: The key, in the saved state, of the steps the Trainer's max_grad_norm clipped.
_TRAINER_CLIPPED = "trainer_clipped"
#: What the Trainer's console shows of our keys with ``console="short"`` (besides the events).
CONSOLE_KEYS = ("grad_norm/total", "skipped/total", "nonfinite/total")
#: ``console=``: "short" prints the keys a person reads, "all" every key.
ConsoleMode = Literal["short", "all"]


def _event_value(event: Event) -> float:
    """An event's value in the Trainer's logs: 1, or the grad norm's z-score when that z-score itself
    raised a spike warning (then at least ``z_warning``). A warning raised by a layer or a
    precursor logs 1: the total's z-score may then be low or negative, which reads as no spike."""
    if event.kind == "spike_warning" and event.details.get("signal") == "grad_norm":
        return float(event.details.get("z", 1.0))
    return 1.0


# ---------------------------------------------------------------------- the Trainer's cadence
class _FirstStepEngine(TrainerAlignedEngine):
    log_first_step = True


class _TrainerLogs:
    """A sink that holds one logging step's metrics until the Trainer writes its log entry."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}
        self.events: list[Event] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.metrics = dict(metrics)

    def log_event(self, event: Event) -> None:
        self.events.append(event)


class StabilityTrainerCallback(AttachedCallback):
    """Norms, clipping, skip-the-batch, metrics and events for a Hugging Face ``Trainer``.

    ``config``: a ``StabilityConfig`` (or mapping / path). Its ``log_every_n_steps`` defaults to
    the Trainer's ``logging_steps``. ``sinks``: extra sinks besides the Trainer's logs.
    ``alerts``: True (or event kinds) to send W&B alerts for those events when a W&B run is active
    (``report_to="wandb"``). ``log_events``: write each event as a Trainer log entry.
    """

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
        self.logs = _TrainerLogs()
        self.hooks.add_sink(self.logs)
        self.alert_on: set[str] = set(ALERT_KINDS if alerts is True else [] if alerts is False else alerts)
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
        """Bind to ``trainer`` (and add this callback to it); returns self.

        Refuses settings that would make the guarantees false: ``max_grad_norm > 0`` together with
        stabilitykit clipping (two clippers) and DeepSpeed (which steps inside ``backward``).
        ``restore_callback_states_from_checkpoint=True`` is supported: the Trainer's restore hands
        the saved state to this same callback (``AttachedCallback``).
        """
        args = trainer.args
        if self.config.clip.mode != "off" and args.max_grad_norm and args.max_grad_norm > 0:
            raise ValueError(
                f"TrainingArguments(max_grad_norm={args.max_grad_norm}) and stabilitykit's "
                f"ClipConfig(mode={self.config.clip.mode!r}) both clip gradients; keep one: set "
                "max_grad_norm=0 (stabilitykit clips, GradScaler-aware) or ClipConfig(mode='off')"
            )
        if trainer.is_deepspeed_enabled:
            raise ValueError(
                "StabilityTrainerCallback does not support DeepSpeed (it clips and steps inside backward); "
                "use stabilitykit.integrations.stabilize(trainer, config), which guards the DeepSpeed engine"
            )
        # an exception still ends the run (sinks closed); the route stays for the callback's life (``detach``)
        self.driver.patch(trainer, "train", self._train_route(), lasting=True)
        self.bind(trainer)
        return self

    def _bound(self) -> Trainer:
        trainer = self.bound_trainer()
        if trainer is None:
            raise RuntimeError(
                "StabilityTrainerCallback is not attached to a Trainer: use "
                "stabilitykit.integrations.stabilize(trainer, config) or callback.attach(trainer) "
                "instead of passing it in callbacks=[...]"
            )
        return trainer

    @property
    def engine(self) -> StabilityEngine | None:
        """The engine over the Trainer's optimizer (None before training starts)."""
        return self.driver.engines[0] if self.driver.engines else None

    def record(self, name: str, value: Tensor | float, reduce: str = "mean") -> None:
        """Record a metric of the coming optimizer step (no sync); see ``stabilitykit.record``, which
        does the same from a model's forward or ``compute_loss`` without a handle on the callback."""
        self.driver.record(name, value, reduce)

    def _train_route(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def route(original: Callable[..., Any]) -> Callable[..., Any]:
            def train(*args: Any, **kwargs: Any) -> Any:
                try:
                    return original(*args, **kwargs)
                except BaseException:
                    self.driver.end_run()  # the run ends here: wrappers undone, sinks closed
                    raise

            return train

        return route

    @property
    def last_report(self) -> StepReport | None:
        """The latest step's report."""
        return self.engine.last_report if self.engine is not None else None

    # ------------------------------------------------------------------ training starts and ends
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Build the engine over the prepared optimizer; restore a resumed run's state; install the routes."""
        trainer = self._bound()
        self.driver.release()
        config = self.config
        if "log_every_n_steps" not in config.model_fields_set and args.logging_strategy == "steps":
            every = max(1, int(state.logging_steps or args.logging_steps or 1))
            config = config.model_copy(update={"log_every_n_steps": every})
        accelerator = trainer.accelerator
        engine_cls = _FirstStepEngine if args.logging_first_step else TrainerAlignedEngine
        (engine,) = self.driver.build_engines(
            trainer.model, [trainer.optimizer], config, scaler=accelerator.scaler, engine_cls=engine_cls
        )
        saved = self.saved_state or self.saved_in(state, "saved_state")
        self.saved_state = None
        self._trainer_clipped = None
        if saved and state.global_step > 0:
            saved = dict(saved)
            clipped = int(saved.pop(_TRAINER_CLIPPED, 0))
            self.driver.load_state_dict(from_json(saved, engine.device))
            self._trainer_clipped = torch.tensor(clipped, device=engine.device)
        self._global_step = state.global_step
        self.driver.route_steps(lambda engine: route_accelerated_step(self.driver.routes, engine, trainer.optimizer))
        if trainer.lr_scheduler is not None:  # the Trainer steps it: held on skipped steps, restored by recovery
            self.driver.add_scheduler(trainer.lr_scheduler, stepped_here=False)
        self.driver.patch(accelerator, "backward", self._backward_route(accelerator))
        if engine.rerun is not None:  # what a rerun computes again: the Trainer's step
            self.driver.patch(trainer, "training_step", self._step_route())
            engine.rerun.watch_local_grads(trainer.model_wrapped)  # the Accelerator's DDP wrapper, if any
        self.driver.patch(accelerator, "clip_grad_norm_", self._clip_route(accelerator))
        self.driver.patch(trainer, "log", self._log_route(trainer))
        for printer in trainer.callback_handler.callbacks:  # the console: no per-layer keys
            if type(printer).__name__ in ("ProgressCallback", "PrinterCallback"):
                self.driver.patch(printer, "on_log", self._console_route())

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The run is over: the last steps folded (a last row for your sinks, events into the Trainer's
        log), the summary line, every route undone, sinks closed."""
        if self.engine is not None:
            self.driver.end_step(self.engine)
            self.engine.flush()
            self._write_events(at_end=state)
        self.driver.end_run(self.summary())

    def detach(self) -> None:
        """Undo everything this callback installed on its Trainer, the ``train`` route included (the
        callback itself stays in the Trainer's list: remove it with ``trainer.remove_callback``)."""
        self.driver.release(lasting=True)

    def _console_route(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """The Trainer's console printers get each log entry cut to what a person reads (every
        ``report_to`` integration, and ``trainer.state.log_history``, still get every key).

        ``console="short"`` (default): the Trainer's own keys (loss, grad_norm, learning_rate, ...),
        and of ours the total grad norm, the skip and non-finite counts and the events; ``"all"``:
        every key, as the Trainer prints them without stabilitykit.
        """
        prefix = f"{self.config.metric_prefix}/".lstrip("/")
        shown = {f"{prefix}{name}" for name in CONSOLE_KEYS}
        events = f"{prefix}events/"

        def ours(key: str) -> bool:
            return key.startswith(prefix) if prefix else "/" in key

        def keep(key: str) -> bool:
            return not ours(key) or key in shown or key.startswith(events)

        def route(original: Callable[..., Any]) -> Callable[..., Any]:
            def on_log(*args: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
                if logs is not None and self.console == "short":
                    logs = {k: v for k, v in logs.items() if keep(k)}
                return original(*args, logs=logs, **kwargs)

            return on_log

        return route

    # ------------------------------------------------------------------ the routes
    def _backward_route(self, accelerator: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def route(original: Callable[..., Any]) -> Callable[..., Any]:
            def backward(loss: Tensor, **kwargs: Any) -> Any:
                if self.engine is not None:  # the loss as backpropagated (Accelerate divides by its own steps)
                    self.engine.inputs.add_loss(loss.detach() / accelerator.gradient_accumulation_steps)
                return original(loss, **kwargs)

            return backward

        return route

    def _step_route(self) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Keep the micro-batch's ``training_step`` call (a shallow copy of its inputs: ``compute_loss`` may
        pop the labels) and take the random state it starts with: a rerun calls it again."""

        def route(original: Callable[..., Any]) -> Callable[..., Any]:
            def training_step(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
                engine = self.engine
                if engine is not None and engine.rerun is not None:
                    engine.rerun.start_step()
                    kept = copy.copy(inputs)
                    self._rerun_step = lambda: original(model, copy.copy(kept), *args, **kwargs)
                return original(model, inputs, *args, **kwargs)

            return training_step

        return route

    def _rerun_args(self) -> dict[str, Any]:
        """``Driver.decide``'s rerun arguments: the Trainer's own step again (forward, and backward through
        ``accelerator.backward``, whose route records the loss), so the backward given has nothing to do."""
        step, self._rerun_step = self._rerun_step, None
        return {} if step is None else {"rerun_replay": step, "backward": lambda _loss: None}

    def _clip_route(self, accelerator: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def route(original: Callable[..., Any]) -> Callable[..., Any]:
            def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
                engine = self.engine
                if engine is None or engine.in_flight is not None or not accelerator.sync_gradients:
                    return original(parameters, max_norm, norm_type)
                decision = self.driver.decide(engine, log_step=self._global_step + 1, **self._rerun_args())
                norm = decision.report.grad_norm
                if max_norm is not None and math.isfinite(max_norm) and max_norm > 0:
                    self._trainer_clip(engine, norm, float(max_norm))
                    self._count_trainer_clip(norm, float(max_norm), decision.report.skipped)
                return norm

            return clip_grad_norm_

        return route

    def _count_trainer_clip(self, norm: Tensor, max_norm: float, skipped: Tensor) -> None:
        """Count a step ``max_grad_norm`` clipped (finite norm above it, step not skipped), on the
        device: read once, by ``summary()``."""
        hit = (torch.isfinite(norm) & (max_norm / (norm + CLIP_EPS) < 1) & ~skipped).to(torch.int64)
        self._trainer_clipped = hit if self._trainer_clipped is None else self._trainer_clipped + hit

    def summary(self) -> RunSummary | None:
        """The run's totals (None before training starts): the steps the Trainer's ``max_grad_norm``
        clipped are counted in ``clipped``, rollbacks apart (see ``RunSummary``)."""
        if self.engine is None:
            return None
        summary = self.driver.summary()
        clipped = int(self._trainer_clipped) if self._trainer_clipped is not None else 0
        return dataclasses.replace(summary, clipped=summary.clipped + clipped)

    @staticmethod
    def _trainer_clip(engine: StabilityEngine, norm: Tensor, max_norm: float) -> None:
        """``max_grad_norm`` applied from the norm just measured (as torch's clip_grad_norm_ does)."""
        grads = [p.grad for p in engine.params if p.grad is not None]
        if not grads:
            return
        # an Inf norm gives coefficient 0 (torch zeroes the grads); only a NaN coefficient becomes 1
        coef = clip_coefficient(norm, max_norm, finite=torch.isfinite(max_norm / (norm + CLIP_EPS)))
        apply_clip_coefficient([[grads[i] for i in group] for group in device_groups(grads)], coef)

    def _log_route(self, trainer: Trainer) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def route(original: Callable[..., Any]) -> Callable[..., Any]:
            def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
                if "loss" in logs and self.logs.metrics:  # the Trainer's training log entry
                    logs.update(self.logs.metrics)
                    self.logs.metrics = {}
                return original(logs, *args, **kwargs)

            return log

        return route

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
        """Each event as ``<prefix>/events/<kind>`` (and ``..._step``, the 0-based optimizer step).

        On a step the Trainer logs, they join its log entry (a log call of our own would reset
        ``control.should_log`` and drop the Trainer's); at the end of training they join the run's
        summary entry (``log_history[-1]`` keeps ``train_loss``); otherwise they are a log entry of
        their own.
        """
        events, self.logs.events = self.logs.events, []
        events = [e for e in events if e.kind not in _NOT_LOGGED]
        if not events:
            return
        for event in events:
            if event.kind in self.alert_on:
                _page(event)
        trainer = self.bound_trainer()
        if not self.log_events or trainer is None:
            return
        prefix = self.config.metric_prefix
        entry: dict[str, float] = {}
        for event in events:
            key = f"{prefix}/events/{event.kind}".lstrip("/")
            entry[key] = _event_value(event)
            entry[f"{key}_step"] = float(event.step)
        if merge:
            self.logs.metrics.update(entry)
        elif at_end is not None and at_end.log_history:
            at_end.log_history[-1].update(entry)  # after the run's summary entry: join it, never follow it
        else:
            trainer.log(entry)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """What the Trainer writes into ``trainer_state.json`` at each checkpoint (JSON values only)."""
        saved = to_json(self.driver.state_dict()) if self.engine is not None else None
        if saved is not None and self._trainer_clipped is not None:
            saved[_TRAINER_CLIPPED] = int(self._trainer_clipped)  # a checkpoint: syncs anyway
        return {"args": {"restore_into_attached": True}, "attributes": {"saved_state": saved}}


def _page(event: Event) -> None:
    """A W&B alert on the active run, made as ``WandbSink`` makes them; never stops training."""
    try:
        send_alert(event)
    except Exception as exc:
        warnings.warn(f"stabilitykit: W&B alert failed: {exc!r}", RuntimeWarning, stacklevel=3)


def stabilize(
    trainer: Trainer,
    config: StabilityConfig | Mapping[str, Any] | str | None = None,
    **kwargs: Any,
) -> StabilityTrainerCallback:
    """Guard ``trainer`` in one line; returns the callback (``kwargs`` go to ``StabilityTrainerCallback``).

    A Trainer with ``deepspeed=`` gets a ``DeepSpeedTrainerCallback`` instead (its ``kwargs``:
    ``sinks``, ``hooks``, ``rules``), which guards the DeepSpeed engine (the DeepSpeed guide)."""
    if trainer.is_deepspeed_enabled:
        from stabilitykit.drivers.deepspeed_hf import DeepSpeedTrainerCallback

        return DeepSpeedTrainerCallback(config, **kwargs).attach(trainer)  # type: ignore[return-value]
    return StabilityTrainerCallback(config, **kwargs).attach(trainer)
