"""The driver base: the lifecycle every driver shares, so a driver only maps its framework's hooks.

Engines per optimizer (``build.py``), loss and ``optimizer.step`` routing (``routing.py``), scheduler
track and hold, the one undo list and closed flag, the step top to bottom (``train_step``: recovery
asked once before and once after), the one state format, ``summary()`` and the end of every run.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

from torch import Tensor, nn

from stabilitykit.compat.attributes import replace_attribute
from stabilitykit.compat.schedulers import hold_scheduler, release_scheduler
from stabilitykit.config import StabilityConfig, coerce_config, warn_contradictions
from stabilitykit.drivers.build import build_engine
from stabilitykit.drivers.optimizers import check_supported, optimizer_params, param_count, unwrap_optimizer
from stabilitykit.drivers.routing import StepRoutes
from stabilitykit.engine.decision import NO_ASK, RecoveryAsk, StepDecision
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.events import Event
from stabilitykit.hooks import HookManager
from stabilitykit.nan import batch_is_bad, check_batch
from stabilitykit.precision import PrecisionChoice, apply_precision_config
from stabilitykit.recovery import refuse_several_optimizers
from stabilitykit.report import StepReport
from stabilitykit.rerun.recompute import recompute_step, warn_no_rerun
from stabilitykit.rules import RuleSet, SkipRule
from stabilitykit.run_log import RunSummary, engine_summary
from stabilitykit.schedulers import StepWatch
from stabilitykit.sinks.base import Sink
from stabilitykit.state import driver_state, load_driver_state

_ACTIVE: list[weakref.ReferenceType[Driver]] = []


def active_drivers() -> list[Driver]:
    """The drivers of runs in progress (started and not closed), oldest first."""
    _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None]
    return [d for d in (ref() for ref in _ACTIVE) if d is not None]


def record(name: str, value: Tensor | float, reduce: str = "mean") -> None:
    """Record a metric for the step in flight in the running driver (no host sync).

    For code with no handle on its driver (a loss function, a model's forward, ``training_step``,
    ``compute_loss``). ``reduce``: how ranks agree on it ("mean", "sum", "max", "min", "any", "all").
    Logged as ``<prefix>/metrics/<name>``, seen by skip rules as ``values[name]`` and by the spike
    detector; nothing without a running driver; the driver started last gets it.
    """
    drivers = active_drivers()
    if drivers:
        drivers[-1].record(name, value, reduce=reduce)


def scheduler_target(scheduler: Any) -> Any:
    """The torch optimizer an LR scheduler drives (through framework wrappers), or None."""
    inner = getattr(scheduler, "scheduler", None)  # accelerate's AcceleratedScheduler
    base = inner if inner is not None and hasattr(inner, "step") else scheduler
    optimizer = getattr(base, "optimizer", None)
    return unwrap_optimizer(optimizer) if optimizer is not None else None


class Driver:
    """The lifecycle every driver shares; a driver maps its framework's hooks onto these calls."""

    #: The framework's step cannot skip on the device (DeepSpeed): ``decide`` reads every decision (one sync).
    host_decides = False

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
        final_row: bool = True,
    ) -> None:
        """``final_row``: the last steps get a row of their own at the end (False: the framework logs its own)."""
        self.final_row = final_row
        self.config = coerce_config(config)
        self.hooks = hooks or HookManager()
        for sink in sinks or []:
            self.hooks.add_sink(sink)
        RuleSet(list(rules))  # refuse bad rules now, by name
        self.rules = list(rules)
        #: One engine per guarded optimizer (``drivers/build.py``), and the model they measure.
        self.engines: list[StabilityEngine] = []
        self.model: nn.Module | None = None
        #: The run is over (``end_run``); a driver that refuses calls afterwards asks ``check_open``.
        self.closed = False
        #: What ``sk.select_precision()`` recommends for the model's device (``config.precision``).
        self.precision_choice: PrecisionChoice | None = None
        #: Start-of-run events (precision), emitted at the first step with its number (a resumed run's).
        self._start_events: list[Event] = []
        self._pending_losses: list[Tensor] = []  # several optimizers: losses not yet claimed by a step
        self._pending_state: dict[str, Any] | None = None  # loaded before the engines exist
        #: The one undo list: every patch and hook of the run, with whether it outlives the run.
        self._undo: list[tuple[Callable[[], None], bool]] = []
        self.routes = StepRoutes()  # each optimizer's step routed through its engine
        self._stepped: dict[int, list[Any]] = {}  # engine id -> the schedulers ``train_step`` steps
        self._scheduler_watch = StepWatch()  # a scheduler stepped here and by hand too is named
        self._param_counts: dict[int, int] = {}  # engine id -> its optimizer's parameter count
        self._warned_no_rerun = False

    # ------------------------------------------------------------------ engines
    def build_engines(
        self,
        model: nn.Module | None,
        optimizers: Sequence[Any],
        config: StabilityConfig | None = None,
        scaler: Any | None = None,
        extra_group: Any | None = None,
        engine_cls: type[StabilityEngine] = StabilityEngine,
        names: Sequence[str] | None = None,
    ) -> list[StabilityEngine]:
        """One engine per optimizer (several: under ``<prefix>/opt<i>``); a state loaded earlier restored into them."""
        base = config or self.config
        warn_contradictions(base)
        refuse_several_optimizers(base.recovery, len(optimizers))
        many = len(optimizers) > 1
        closers: list[Callable[[], None]] = []

        def precision(engine: StabilityEngine) -> None:
            emitter = types.SimpleNamespace(emit=self._start_events.append)
            self.precision_choice = apply_precision_config(
                base.precision, engine.device, emitter, engine.scaler.enabled, engine.params
            )

        self.engines, self.model, self._stepped = [], model, {}
        for i, opt in enumerate(optimizers):
            cfg = base
            if many:  # one set of monitor hooks on the model: the first optimizer's engine reads it
                prefix = f"{base.metric_prefix}/opt{i}".strip("/")
                cfg = base.model_copy(update={"metric_prefix": prefix, "monitors": base.monitors if i == 0 else None})
            engine = build_engine(
                model,
                opt,
                cfg,
                self.hooks,
                closers,
                scaler=scaler,
                tracing=i == 0,
                extra_group=extra_group,
                engine_cls=engine_cls,
                names=names,
                rules=self.rules,
                precision=precision if i == 0 else None,
            )
            self._param_counts[id(engine)] = param_count(engine.optimizer)
            self.engines.append(engine)
        self._undo.extend((closer, False) for closer in closers)
        self.closed = False
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
        _ACTIVE.append(weakref.ref(self))  # the newest started run is the one ``record`` feeds
        return self.engines

    def find_engine(self, optimizer: Any) -> StabilityEngine | None:
        """The engine guarding ``optimizer`` (a wrapper is looked through), or None."""
        target = unwrap_optimizer(optimizer)
        return next((engine for engine in self.engines if engine.optimizer is target), None)

    def engine_for(self, optimizer: Any | None = None) -> StabilityEngine:
        """The engine guarding ``optimizer``; None: the only one (several: refused, naming the fix)."""
        if optimizer is None:
            if len(self.engines) > 1:
                raise ValueError(
                    f"this run has {len(self.engines)} optimizers: name the one that steps, "
                    "e.g. guard.step(optimizer=opt_d) / guard.backward(loss, optimizer=opt_d)"
                )
            if not self.engines:
                raise RuntimeError("stabilitykit: no optimizer is guarded yet (the run has not started)")
            return self.engines[0]
        engine = self.find_engine(optimizer)
        if engine is None:
            raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this run guards")
        return engine

    # ------------------------------------------------------------------ patches, routes, schedulers
    def patch(self, owner: Any, name: str, around: Callable[..., Any], lasting: bool = False) -> None:
        """Route ``owner.<name>(...)`` through ``around(original, ...)`` until the run ends (``lasting``: longer)."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            return around(original, *args, **kwargs)

        self._undo.append((replace_attribute(owner, name, routed), lasting))

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.<name> = value`` for this run (``compat.attributes``); undone at the end of the run."""
        self._undo.append((replace_attribute(owner, name, value), False))

    def on_release(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` with the run's other undos (a route a framework needs put back its own way)."""
        self._undo.append((undo, False))

    def route_steps(self, router: Callable[[StabilityEngine], Callable[[], None] | None] | None = None) -> None:
        """Each optimizer's ``step`` through its engine (``router(engine)``: a framework's own route, or None)."""
        for engine in self.engines:
            undo = router(engine) if router is not None else self.routes.route(engine, engine.optimizer)
            if undo is not None:
                self.on_release(undo)

    def add_scheduler(self, scheduler: Any, *, stepped_here: bool) -> None:
        """Track ``scheduler`` for recovery and hold it on skips (``stepped_here``: ``train_step`` steps it)."""
        engine = self.track_scheduler(scheduler)
        if engine is None:
            return
        engine.ledger.has_scheduler = True  # a late skip's event says the scheduler catches up
        if stepped_here:
            self._stepped.setdefault(id(engine), []).append(scheduler)
            self._scheduler_watch.add(scheduler)
        else:
            hold_scheduler(scheduler, engine.holds_scheduler)
            self.on_release(lambda: release_scheduler(scheduler))

    def track_scheduler(self, scheduler: Any) -> StabilityEngine | None:
        """``scheduler`` saved and restored by recovery; returns the engine of the optimizer it drives."""
        engine: StabilityEngine | None = self.engines[0] if self.engines else None
        target = scheduler_target(scheduler) if len(self.engines) > 1 else None
        if target is not None:
            engine = next((e for e in self.engines if e.optimizer is target), None)
        if engine is not None and engine.recovery is not None:
            engine.recovery.track_scheduler(scheduler)
        return engine

    def check_open(self, what: str) -> None:
        """Refuse ``what`` once the run is over: nothing would measure, skip or count its steps."""
        if self.closed:
            name = type(self).__name__
            raise RuntimeError(
                f"stabilitykit: guard.{what}() after guard.close(): the guard no longer measures, skips or counts "
                f"steps, so a non-finite update would be applied. Build a new {name} (and load_state_dict) to go on"
            )

    # ------------------------------------------------------------------ losses, metrics
    def record_loss(self, loss: Tensor, optimizer: Any | None = None) -> None:
        """A backpropagated micro-batch loss (no sync) for the named optimizer's step, or the next to step."""
        if self.closed:
            self.check_open("record_loss")
        if optimizer is None and len(self.engines) == 1:
            self.engines[0].inputs.add_loss(loss)
        elif optimizer is not None:
            self.engine_for(optimizer).inputs.add_loss(loss)
        elif self.engines:
            self._pending_losses.append(loss.detach())

    def claim_losses(self, engine: StabilityEngine) -> None:
        """``engine`` steps now: it takes the losses no optimizer claimed yet."""
        for loss in self._pending_losses:
            engine.inputs.add_loss(loss)
        self._pending_losses = []

    def record(self, name: str, value: Tensor | float, reduce: str = "mean", *, optimizer: Any | None = None) -> None:
        """Record a metric of the coming step (no sync; ``stabilitykit.record``): the named optimizer's, else all."""
        self.check_open("record")
        targets = [self.engine_for(optimizer)] if optimizer is not None else self.engines
        for engine in targets:
            engine.record_metric(name, value, reduce)

    # ------------------------------------------------------------------ the step
    def train_step(
        self,
        engine: StabilityEngine,
        optimizer_step: Callable[[], Any],
        replay: Callable[[], Tensor] | None = None,
        log_step: int | None = None,
        backward: Callable[[Tensor], None] | None = None,
    ) -> StepReport:
        """One optimizer step top to bottom, where the driver owns the whole step (see ``decide``)."""
        if self._pending_losses:
            self.claim_losses(engine)  # 1. the losses of the micro-batches no optimizer claimed yet
        self.decide(engine, replay=replay, log_step=log_step, backward=backward)  # 2. measure ... clip
        optimizer_step()  # 3. the optimizer step: its routed step applies or skips it
        self._scheduler_watch.before()
        if not engine.holds_scheduler():  # 4. the LR schedulers, held on a skipped step
            for scheduler in self._stepped.get(id(engine), ()):
                scheduler.step()
        report = self.end_step(engine)  # 5. events, sinks, the divergence check, recovery
        self._scheduler_watch.after()  # after a rollback's restore of the schedulers
        assert report is not None
        return report

    def decide(
        self,
        engine: StabilityEngine,
        replay: Callable[[], Tensor] | None = None,
        log_step: int | None = None,
        backward: Callable[[Tensor], None] | None = None,
        rerun_replay: Callable[[], Tensor] | None = None,
    ) -> StepDecision:
        """Grads are final: measure, agree, decide and clip this step (one still in flight is finished first).
        ``replay``: the batch's loss again (forward only) to name where a skip went non-finite and, with ``backward``
        (or ``rerun_replay``), to re-run a flagged step. ``log_step``: the step sinks see. A closure run twice keeps
        its first decision."""
        if engine.in_flight is not None:
            if id(engine) in self.routes.in_closure:
                return engine.in_flight
            self.end_step(engine)
        _follow_param_groups(engine, self.model, self._param_counts)
        grad_scale = engine.scaler.grads_scale(engine.optimizer, engine.fused)  # unscaled once, here
        force_skip = engine.inputs.bad_batch  # the data guard's flag over the step's micro-batches
        if engine.rerun is not None:
            recompute = recompute_step(engine, rerun_replay or replay, backward)
            if recompute is None and not self._warned_no_rerun:
                self._warned_no_rerun = True
                warn_no_rerun(backward is not None)
            engine.rerun.arm(recompute)
            if engine.rerun.known_bad(engine.step):  # judged reproducible before: not trained on again
                force_skip = engine.inputs.true if force_skip is None else force_skip | True
        recovery, step = engine.recovery, engine.step  # recovery is asked here, once before the step
        ask = NO_ASK
        if recovery is not None:
            ask = RecoveryAsk(recovery.skips_batch(step), recovery.request(step), recovery.health(step))
        decision = engine.evaluate(
            grad_scale=grad_scale,
            scaler_active=engine.scaler.enabled,
            loss_scale=engine.scaler.loss_scale(),
            force_skip=force_skip,
            ask=ask,
        )
        engine.inputs.bad_batch = None
        decision.log_step = log_step
        engine.in_flight = decision
        assert engine.tracing is not None
        replay = replay if engine.tracing.replays(replay) else None
        creates_state = engine.fused and engine.new_state.creates_state(
            engine.optimizer, engine.params, engine.plan.present
        )  # a fused optimizer's step asks on every step until settled (logging steps too)
        if decision.pending and (self.host_decides or replay is not None or creates_state):
            engine.resolve(decision)  # one sync: the replay, or state a skipped step must not create
        if decision.pending:
            engine.buffers.restore(decision.skip)  # on the device: restored where the skip flag is set
        elif decision.skipped_now:  # the host knows the skip and its reason (no read of a pending code)
            source = engine.tracing.source_of(decision.report, replay, engine.params)
            if source is not None:
                engine.readout.source_hint = source  # named by this step's skip events
            engine.buffers.restore(True)  # after a replay's forward: its running statistics go too
        return decision

    def end_step(self, engine: StabilityEngine) -> StepReport | None:
        """The step is over: events, sinks, divergence, rerun and replica checks, recovery asked once, tracing."""
        decision = engine.in_flight
        if decision is None:
            return None
        engine.in_flight = None
        if self._start_events:
            for event in self._start_events:
                self.hooks.emit(dataclasses.replace(event, step=decision.report.step))
            self._start_events = []
        engine.buffers.save()
        if engine.fused:
            engine.new_state.after_step(decision, engine.optimizer, engine.plan.present)
        assert engine.tracing is not None
        try:
            recovery = engine.recovery
            engine.last_report = engine.book_step(decision, raise_divergence=recovery is None)
            if engine.rerun is not None:
                engine.rerun.end_step()
            if engine.replicas is not None and engine.replicas.due(decision.report.step):
                engine.replicas.check(decision.report.step)
            if recovery is not None:
                recovery.after_step(decision)
        finally:
            engine.tracing.after_step(decision, engine.step)
        return engine.last_report

    # ------------------------------------------------------------------ end of run
    def summary(self) -> RunSummary:
        """The run's totals (one sync): the first optimizer's, with ``optimizers`` one entry each; empty before it."""
        if not self.engines:
            return RunSummary(0, 0, 0, 0.0, 0)
        rows = [engine_summary(engine) for engine in self.engines]
        first = rows[0]
        if len(rows) > 1:
            first = dataclasses.replace(first, optimizers=tuple(rows))
        return first

    def end_run(self, summary: RunSummary | None = None) -> None:
        """The run is over (finished or raised): last step and rows, summary line, patches undone, sinks closed."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.engines:
                try:
                    _close_engine(self, self.engines[0])  # finishes, folds (and logs), removes its tracer
                finally:
                    for engine in self.engines[1:]:
                        _close_engine(self, engine)
                (summary or self.summary()).log()
        finally:
            self.release()
            _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
            self.hooks.close()

    def close(self) -> None:
        """End the run (``end_run``): the last rows and the summary line logged, every patch undone, sinks closed."""
        self.end_run()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the driver however the block ends: patches undone, the last row logged, sinks closed."""
        self.close()

    def release(self, lasting: bool = False) -> None:
        """Undo every patch and hook of the run, newest first (``lasting``: those that outlive a run too)."""
        self.routes.released = True
        kept: list[tuple[Callable[[], None], bool]] = []
        while self._undo:
            undo, outlives = self._undo.pop()
            if outlives and not lasting:
                kept.append((undo, outlives))
            else:
                undo()
        self._undo = kept[::-1]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every engine's state in the one format (before the run: a state loaded and not applied yet)."""
        if not self.engines:
            return dict(self._pending_state or {})
        return driver_state(self.engines)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s state (``state.load_driver_state``), or keep it until the engines exist."""
        if not isinstance(state, Mapping):
            raise TypeError(f"stabilitykit state must be a mapping (from state_dict()), got {type(state).__name__}")
        if not self.engines:
            self._pending_state = dict(state) if state else None
            return
        load_driver_state(self.engines, state)


def _follow_param_groups(engine: StabilityEngine, model: nn.Module | None, counts: dict[int, int]) -> None:
    """A param group added since the last step: the engine measures the optimizer's new set from now on."""
    count = sum([len(group["params"]) for group in engine.optimizer.param_groups])  # no call: every step pays it
    if count != counts.get(id(engine), count):
        params = optimizer_params(engine.optimizer)
        check_supported(model, engine.optimizer, params)
        engine.follow_params(params)
        counts[id(engine)] = count
        if engine.recovery is not None:
            engine.recovery.forget()


def _close_engine(driver: Driver, engine: StabilityEngine) -> None:
    """Finish ``engine``'s step in flight and fold what is left; its tracing hooks go even if that raises."""
    try:
        driver.end_step(engine)
    finally:
        try:
            engine.flush(final_row=driver.final_row)
        finally:
            assert engine.tracing is not None
            engine.tracing.detach()


def guard_batch(engine: StabilityEngine, batch: Any) -> None:
    """The data guard (``config.data``): ``raise`` (one sync) or a device flag that skips the coming step."""
    dcfg = engine.config.data
    if dcfg.mode == "skip":
        bad = batch_is_bad(batch, dcfg.num_classes, dcfg.label_keys)
        if bad is not None:
            engine.inputs.add_bad_batch(bad)
    elif dcfg.mode == "raise":
        check_batch(batch, dcfg.num_classes, step=engine.step, label_keys=dcfg.label_keys)
