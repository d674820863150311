"""DeepSpeedGuard: the plain-loop guard over a DeepSpeed engine (ZeRO stages 0-3).

This rank's pieces of the final grads are measured where DeepSpeed keeps them (``GradPartitions``), so
the norms are DeepSpeed's own with nothing gathered. A skipped step runs none of DeepSpeed's optimizer
step and leaves its counters, on every rank alike; in fp16 an overflow alone is DeepSpeed's own skip.
Refused by name: optimizer offload, the pipeline engine, monitors, update ratios, rerun in fp16; no NaN tracing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor

from stabilitykit.compat.deepspeed import (
    DeepSpeedLossScale,
    GradPartitions,
    clear_overflow_mark,
    drop_step,
    engine_counters,
    inner_optimizer,
    put_engine_counters,
    rank_state,
)
from stabilitykit.config import StabilityConfig, coerce_config, refuse_two_clippers
from stabilitykit.distributed import all_objects, own_entry
from stabilitykit.drivers import missing
from stabilitykit.drivers.base import Driver
from stabilitykit.drivers.loop import StabilityGuard
from stabilitykit.engine.decision import StepDecision
from stabilitykit.engine.lr import noting_lr
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.report import StepReport
from stabilitykit.rerun.deepspeed import recompute, refuse_rerun, watch
from stabilitykit.rules import SkipRule
from stabilitykit.sinks.base import Sink

try:
    from deepspeed.runtime.engine import DeepSpeedEngine
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    base = missing("stabilitykit.drivers.deepspeed", "deepspeed", "deepspeed")
    raise ImportError(
        f"{base}; DeepSpeed is a source distribution: install it after torch with --no-build-isolation "
        "(pip install --no-build-isolation deepspeed), or pip builds it against a CUDA torch it downloads; "
        "bash scripts/setup.sh does this"
    ) from exc

__all__ = ["DeepSpeedGuard"]

#: The key of the guard's state in a DeepSpeed checkpoint's ``client_state``.
CLIENT_STATE_KEY = "stabilitykit"


def _refuse_unsupported(deepspeed_engine: Any, config: StabilityConfig) -> None:
    """Refuse, by name and with the fix, what the DeepSpeed driver does not handle (yet)."""
    if not isinstance(deepspeed_engine, DeepSpeedEngine):
        raise TypeError(
            f"DeepSpeedGuard needs the engine deepspeed.initialize returned (a DeepSpeedEngine), got "
            f"{type(deepspeed_engine).__name__}; for a plain torch model use stabilitykit.StabilityGuard"
        )
    if deepspeed_engine.optimizer is None:
        raise ValueError(
            "DeepSpeedGuard needs an engine with an optimizer: give deepspeed.initialize an optimizer (or an "
            '"optimizer" section in its config)'
        )
    refuse_two_clippers(config, "gradient_clipping", deepspeed_engine.gradient_clipping(), "remove it from its config")
    refuse_rerun(config, deepspeed_fp16=bool(deepspeed_engine.fp16_enabled()))  # rerun/refusals.py says why
    not_yet = [  # what the guard does not support yet, and the fix
        (
            type(deepspeed_engine).__name__ == "PipelineEngine",
            "DeepSpeed's pipeline engine (PipelineEngine.train_batch steps inside its own schedule); use a "
            "DeepSpeedEngine from deepspeed.initialize without a PipelineModule",
        ),
        (
            deepspeed_engine.zero_cpu_offload(),
            "ZeRO optimizer offload (offload_optimizer): the grads then live in CPU buffers the guard does not "
            "read; remove offload_optimizer from the ZeRO config",
        ),
        (config.monitors is not None, "monitors (MonitorConfig): it does not hook the module; remove monitors"),
        (
            bool(config.grad_norm.update_ratio),
            "update ratios (GradNormConfig(update_ratio=...)): the parameters are partitioned inside DeepSpeed; "
            "turn update_ratio off",
        ),
    ]
    for refused, what in not_yet:
        if refused:
            raise NotImplementedError(f"DeepSpeedGuard does not support {what} yet")


class DeepSpeedGuard(StabilityGuard):
    """Keeps a loop over a DeepSpeed engine finite. ``deepspeed_engine``: what ``deepspeed.initialize``
    returned; its ``backward``, ``step`` and checkpoints are routed through the guard, so a loop,
    Accelerate or the HF Trainer calling them is guarded as it is; the rest is the plain-loop guard's."""

    host_decides = True  #: DeepSpeed's step cannot skip on the device: the host decides (``Driver``)

    def __init__(
        self,
        deepspeed_engine: Any,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        cfg = coerce_config(config)
        cfg = cfg.model_copy(update={"nan_trace": cfg.nan_trace.model_copy(update={"mode": "off"})})
        _refuse_unsupported(deepspeed_engine, cfg)
        Driver.__init__(self, cfg, sinks=sinks, hooks=hooks, rules=rules)  # not a torch optimizer's guard
        self.deepspeed_engine = deepspeed_engine  # DeepSpeed's (``self.engine``: the guard's own)
        self.partitions = GradPartitions(deepspeed_engine)
        self.fp16 = bool(deepspeed_engine.fp16_enabled())  # DeepSpeed's loss scaler skips an overflow itself
        self.checkpoint_states: list[dict[str, Any]] | None = None  # every rank's, as save_checkpoint wrote it
        self._last_report: StepReport | None = None
        self._deepspeed_step: Any = None  # DeepSpeed's own ``step`` of the step in flight
        self._replay: Callable[[], Tensor] | None = None  # guard.step(replay=...), for a rerun
        self._start(None, [self.partitions], names=self.partitions.names)
        watch(self.engine.rerun, deepspeed_engine)  # the random state at each forward; ZeRO 0: this rank's grads
        if self.fp16:
            self.engine.scaler = DeepSpeedLossScale(deepspeed_engine)
        self.engine.lr_optimizer = inner_optimizer(deepspeed_engine)  # the LRs DeepSpeed steps with: lr/<group>
        if self.engine.recovery is not None:  # snapshots of this rank's partitions, not of the stand-ins
            self.engine.recovery.cover(functools.partial(rank_state, deepspeed_engine))
        self.scheduler = deepspeed_engine.lr_scheduler
        self.schedulers = [self.scheduler] if self.scheduler is not None else []
        for scheduler in self.schedulers:  # DeepSpeed steps it (not after a skip); recovery restores it
            self.track_scheduler(scheduler)

    def _route_step(self, _: StabilityEngine) -> None:
        """DeepSpeed's ``backward``, ``step`` and checkpoints, and its optimizer's ``step``, through the guard."""
        self.patch(self.deepspeed_engine.optimizer, "step", self._zero_step)
        self.patch(self.deepspeed_engine, "backward", self._routed_backward)
        self.patch(self.deepspeed_engine, "step", self._routed_step)
        self.patch(self.deepspeed_engine, "save_checkpoint", self._save_checkpoint)
        self.patch(self.deepspeed_engine, "load_checkpoint", self._load_checkpoint)

    def backward(self, loss: Tensor, *, optimizer: Any | None = None, **kwargs: Any) -> Any:
        """``deepspeed_engine.backward(loss)`` (its route records the loss)."""
        self.check_open("backward")
        return self.deepspeed_engine.backward(loss, **kwargs)

    def step(self, replay: Callable[[], Tensor] | None = None, **kwargs: Any) -> StepReport | None:  # type: ignore[override]
        """``deepspeed_engine.step()``: the report at an accumulation boundary, else None (``replay``: a rerun's)."""
        self.check_open("step")
        self._last_report, self._replay = None, replay
        self.deepspeed_engine.step(**kwargs)
        return self._last_report

    def decide(
        self,
        engine: StabilityEngine,
        replay: Callable[[], Tensor] | None = None,
        log_step: int | None = None,
        backward: Callable[[Tensor], None] | None = None,
        rerun_replay: Callable[[], Tensor] | None = None,
    ) -> StepDecision:
        """The base's ``decide`` over this rank's pieces of the final grads (bound first)."""
        self.partitions.bind()
        return super().decide(engine, replay, log_step, *recompute(self, self._replay, backward, rerun_replay))

    def _optimizer_step(self, engine: StabilityEngine, update_scaler: bool) -> None:
        """DeepSpeed's own ``step``; a step the guard skipped leaves DeepSpeed's counters as they were."""
        counters = engine_counters(self.deepspeed_engine)
        self._deepspeed_step()
        decision = engine.in_flight
        if decision is not None and decision.skipped_now and not self._deepspeed_skips(decision):
            put_engine_counters(self.deepspeed_engine, counters)

    def _routed_backward(self, original: Callable[..., Any], loss: Tensor, *args: Any, **kwargs: Any) -> Any:
        """``deepspeed_engine.backward``: the loss recorded (divided by the accumulation steps, as DeepSpeed does)."""
        if not self.closed:
            steps = self.deepspeed_engine.gradient_accumulation_steps()
            self.record_loss(loss.detach() / steps if steps > 1 else loss.detach())
        return original(loss, *args, **kwargs)

    def _routed_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``deepspeed_engine.step``: at an accumulation boundary, the loop's step (DeepSpeed's as its optimizer's)."""
        if self.closed or not self.deepspeed_engine.is_gradient_accumulation_boundary():
            return original(*args, **kwargs)  # type: ignore[no-any-return]
        self._deepspeed_step = functools.partial(original, *args, **kwargs)
        try:
            self._last_report = StabilityGuard.step(self)
        finally:
            self._deepspeed_step = self._replay = None

    def _zero_step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """DeepSpeed's optimizer ``step``: applied, or skipped with DeepSpeed's own clean-up."""
        clear_overflow_mark(self.deepspeed_engine.optimizer)  # stage 0 in fp32: the last skip's mark
        decision = self.engine.in_flight
        if decision is None:  # deepspeed_engine.optimizer.step() called directly: still decided
            decision = self.decide(self.engine)
        if self._deepspeed_skips(decision):  # DeepSpeed's own overflow skip: it also lowers its loss scale
            with noting_lr(self.engine.lr_optimizer, lambda: decision):  # the LR it held, logged all the same
                return original(*args, **kwargs)
        result = self.routes.run(self.engine, lambda: original(*args, **kwargs))
        if decision.skipped_now:
            drop_step(self.deepspeed_engine.optimizer, self.partitions.stage)
        return result

    def _deepspeed_skips(self, decision: Any) -> bool:
        """An fp16 overflow alone, which DeepSpeed's own step skips (decided from agreed rules: alike on every rank)."""
        fp16_skip = bool(self.fp16 and decision.skipped_now)
        return fp16_skip and self.engine.rules.raised_anywhere(decision.outcome.code) == ["fp16_overflow"]

    def save_checkpoint(
        self, save_dir: str, tag: Any = None, client_state: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> Any:
        """``deepspeed_engine.save_checkpoint`` (its route puts every rank's guard state in the client state)."""
        return self.deepspeed_engine.save_checkpoint(save_dir, tag=tag, client_state=dict(client_state or {}), **kwargs)

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """``deepspeed_engine.load_checkpoint`` (its route restores this rank's guard state from the client state)."""
        path, client_state = self.deepspeed_engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        return path, dict(client_state or {})

    def load_rank_state(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Load this rank's entry of every rank's saved state (``checkpoint_states``)."""
        self.load_state_dict(own_entry(states))

    def _save_checkpoint(
        self, original: Callable[..., Any], save_dir: str, tag: Any = None, client_state: Any = None, **kwargs: Any
    ) -> Any:
        """``deepspeed_engine.save_checkpoint``: every rank's guard state in the client state (``"stabilitykit"``)."""
        state = dict(client_state or {})
        if not self.closed:
            self.checkpoint_states = all_objects(self.state_dict())  # each rank's differs: keep them all
            state[CLIENT_STATE_KEY] = {"ranks": self.checkpoint_states}
        return original(save_dir, tag=tag, client_state=state, **kwargs)

    def _load_checkpoint(self, original: Callable[..., Any], load_dir: str, *args: Any, **kwargs: Any) -> Any:
        """``deepspeed_engine.load_checkpoint``: this rank's guard state restored from the client state (taken out)."""
        path, client_state = original(load_dir, *args, **kwargs)
        if self.closed or not isinstance(client_state, dict):
            return path, client_state
        if (saved := client_state.pop(CLIENT_STATE_KEY, None)) is not None:
            self.load_rank_state(saved["ranks"])
        return path, client_state


class DeepSpeedLater:
    """A ``DeepSpeedGuard``'s arguments, kept until a framework has made its engine; ``guard``: the run's."""

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
    ) -> None:
        self.config = coerce_config(config)  # read before the run (clipping refused twice), coerced once
        refuse_rerun(self.config, framework_deepspeed=True)  # no point to drop DeepSpeed's grads before a rerun
        self.sinks = list(sinks or [])
        self.hooks = hooks or HookManager()
        self.rules = list(rules)
        self.guard: DeepSpeedGuard | None = None

    def start_guard(
        self, deepspeed_engine: Any, config: StabilityConfig | None = None, sinks: Sequence[Sink] = ()
    ) -> None:
        """Guard ``deepspeed_engine`` (a guard of an earlier run closed first); ``sinks`` beside the user's."""
        self.close_guard()
        every_sink, cfg = [*self.sinks, *sinks], config or self.config
        self.guard = DeepSpeedGuard(deepspeed_engine, cfg, sinks=every_sink, hooks=self.hooks, rules=self.rules)

    def close_guard(self) -> None:
        """The run is over: the guard's last row and summary, its routes undone, the sinks closed."""
        if self.guard is not None:
            self.guard.close()
