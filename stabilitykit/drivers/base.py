"""The driver base: the lifecycle every driver shares, so each driver only maps its framework's hooks.

A driver (the plain-loop guard and its Accelerate, Fabric and DeepSpeed forms, Lightning, the
Hugging Face Trainer) is or owns one ``Driver``. The base alone:

* builds one ``DriverCore`` per optimizer and carries the user's skip rules and recorded metrics
  into every core;
* routes micro-batch losses to the optimizer that steps next, and each optimizer's ``step``
  through its core;
* tracks every LR scheduler for recovery, and holds it on skipped steps: stepped by the driver
  (``step_schedulers``) or held by a class swap where the framework steps it;
* keeps the one undo list of every patch it or a driver made (each through ``compat/``) and the
  one flag that says the run is over;
* runs a step top to bottom (``run_step``);
* saves and loads one state format, deferring a state loaded before the cores exist;
* writes ``summary()``, is a context manager, and ends a run the same way everywhere (the
  in-flight step finished, the steps since the last logging step folded and logged, the summary
  line, every patch undone, the user's sinks closed), whether the run finished or raised.

State format, every driver: ``{"version": STATE_VERSION, "optimizers": [core state, ...]}``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Self

from torch import Tensor, nn

from stabilitykit.compat.attributes import replace_attribute, route_attribute
from stabilitykit.compat.schedulers import hold_scheduler, release_scheduler
from stabilitykit.config import StabilityConfig, coerce_config
from stabilitykit.drivers.core import DriverCore, unwrap_optimizer
from stabilitykit.engine.step import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.recovery import refuse_several_optimizers
from stabilitykit.report import StepReport
from stabilitykit.rules import RuleSet, SkipRule
from stabilitykit.run_log import RunSummary
from stabilitykit.schedulers import StepWatch
from stabilitykit.sinks.base import Sink
from stabilitykit.state import STATE_VERSION, check_version, validate_state

_ACTIVE: list[weakref.ReferenceType[Driver]] = []


def active_drivers() -> list[Driver]:
    """The drivers of runs in progress (started and not closed), oldest first."""
    _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None]
    return [d for d in (ref() for ref in _ACTIVE) if d is not None]


def record(name: str, value: Tensor | float, reduce: str = "mean") -> None:
    """Record a metric for the step in flight in the running driver (no host sync).

    For code that has no handle on its driver: a loss function, a model's forward (an MoE router's
    load-balance loss or entropy), a Lightning ``training_step``, a Trainer's ``compute_loss``.
    ``reduce``: how ranks agree on it ("mean", "sum", "max", "min"; "any"/"all" for flags). The value
    is logged as ``<prefix>/metrics/<name>`` at logging steps, seen by skip rules as
    ``values[name]`` (this rank's) and watched by the spike detector. Without a running driver it
    does nothing. With several drivers open at once (two guards in one process), it goes to the one
    started last; record into another with its own ``record``.
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

    def __init__(
        self,
        config: StabilityConfig | Mapping[str, Any] | str | None = None,
        sinks: Iterable[Sink] | None = None,
        hooks: HookManager | None = None,
        rules: Sequence[SkipRule] = (),
        final_row: bool = True,
    ) -> None:
        """``final_row``: a run's last steps since its last logging step get a row of their own at the
        end (the plain loop); False where the framework has its own logging rows (Lightning, HF)."""
        self.final_row = final_row
        self.config = coerce_config(config)
        self.hooks = hooks or HookManager()
        for sink in sinks or []:
            self.hooks.add_sink(sink)
        RuleSet(list(rules))  # refuse bad rules now, by name
        self.rules = list(rules)
        self.cores: list[DriverCore] = []
        #: The run is over (``end_run``); a driver that refuses calls afterwards asks ``check_open``.
        self.closed = False
        self._pending_losses: list[Tensor] = []  # several optimizers: losses not yet claimed by a step
        self._pending_state: dict[str, Any] | None = None  # loaded before the cores exist
        #: The one undo list: every patch of a framework object made for this run, with whether it
        #: outlives the run (undone only by ``release(lasting=True)``).
        self._undo: list[tuple[Callable[[], None], bool]] = []
        self._stepped: dict[int, list[Any]] = {}  # core index -> the schedulers ``step_schedulers`` steps
        self._scheduler_watch = StepWatch()  # a scheduler stepped here and by hand too is named

    # ------------------------------------------------------------------ cores
    def build_cores(
        self,
        model: nn.Module | None,
        optimizers: Sequence[Any],
        config: StabilityConfig | None = None,
        scaler: Any | None = None,
        extra_group: Any | None = None,
        engine_cls: type[StabilityEngine] = StabilityEngine,
    ) -> list[DriverCore]:
        """One core per optimizer (metrics under ``<prefix>/opt<i>`` when there are several; the model's
        monitor hooks and the tracer with the first); a state loaded earlier is restored into them; the
        run is then active for ``record``."""
        base = config or self.config
        refuse_several_optimizers(base.recovery, len(optimizers))
        many = len(optimizers) > 1
        self.cores = []
        self._stepped = {}
        for i, opt in enumerate(optimizers):
            cfg = base
            if many:  # one set of monitor hooks on the model: the first optimizer's core reads it
                prefix = f"{base.metric_prefix}/opt{i}".strip("/")
                cfg = base.model_copy(update={"metric_prefix": prefix, "monitors": base.monitors if i == 0 else None})
            self.cores.append(
                DriverCore(
                    model,
                    opt,
                    cfg,
                    hooks=self.hooks,
                    scaler=scaler,
                    tracing=i == 0,
                    apply_precision=i == 0,
                    extra_group=extra_group,
                    engine_cls=engine_cls,
                    rules=self.rules,
                )
            )
        self.closed = False
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
        _ACTIVE.append(weakref.ref(self))  # the newest started run is the one ``record`` feeds
        return self.cores

    def find_core(self, optimizer: Any) -> DriverCore | None:
        """The core guarding ``optimizer`` (a wrapper is looked through), or None."""
        target = unwrap_optimizer(optimizer)
        return next((core for core in self.cores if core.optimizer is target), None)

    def core_for(self, optimizer: Any | None = None) -> DriverCore:
        """The core guarding ``optimizer``; None: the only one (several: refused, naming the fix)."""
        if optimizer is None:
            if len(self.cores) > 1:
                raise ValueError(
                    f"this run has {len(self.cores)} optimizers: name the one that steps, "
                    "e.g. guard.step(optimizer=opt_d) / guard.backward(loss, optimizer=opt_d)"
                )
            if not self.cores:
                raise RuntimeError("stabilitykit: no optimizer is guarded yet (the run has not started)")
            return self.cores[0]
        core = self.find_core(optimizer)
        if core is None:
            raise ValueError(f"{type(optimizer).__name__} is not one of the optimizers this run guards")
        return core

    # ------------------------------------------------------------------ patches, routes, schedulers
    def patch(self, owner: Any, name: str, route: Callable[[Any], Any], lasting: bool = False) -> None:
        """Route ``owner.<name>`` through ``route(current)`` for this run (``compat.attributes``); undone at
        the end of the run, or only by ``release(lasting=True)`` when ``lasting``."""
        self._undo.append((route_attribute(owner, name, route), lasting))

    def replace(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.<name> = value`` for this run (``compat.attributes``); undone at the end of the run."""
        self._undo.append((replace_attribute(owner, name, value), False))

    def on_release(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` with the run's other undos (a route a framework needs put back its own way)."""
        self._undo.append((undo, False))

    def route_steps(self, router: Callable[[DriverCore], Callable[[], None]] | None = None) -> None:
        """Each core's optimizer ``step`` routed through it for the run (``router(core)`` installs a
        framework's own route and returns its undo; default ``DriverCore.wrap_optimizer_step``)."""
        for core in self.cores:
            undo = router(core) if router is not None else core.wrap_optimizer_step(core.optimizer)
            self.on_release(undo)

    def add_scheduler(self, scheduler: Any, *, stepped_here: bool) -> None:
        """``scheduler`` drives one of the guarded optimizers: recovery saves and restores it with each
        snapshot, and it is held on skipped steps. ``stepped_here``: this driver steps it
        (``step_schedulers``); else the framework does, and a class swap holds it (its saved state
        untouched; undone at the end of the run)."""
        core = self._core_of_scheduler(scheduler)
        if core is None:
            return
        core.track_scheduler(scheduler)
        core.engine.note_scheduler_held()
        if stepped_here:
            self._stepped.setdefault(self.cores.index(core), []).append(scheduler)
            self._scheduler_watch.add(scheduler)
        else:
            hold_scheduler(scheduler, core.should_hold_scheduler)
            self.on_release(lambda: release_scheduler(scheduler))

    def track_scheduler(self, scheduler: Any) -> None:
        """``scheduler`` is saved and restored by recovery only (a framework that holds it itself)."""
        core = self._core_of_scheduler(scheduler)
        if core is not None:
            core.track_scheduler(scheduler)

    def _core_of_scheduler(self, scheduler: Any) -> DriverCore | None:
        """The core of the optimizer ``scheduler`` drives: the only one, the matching one, or (a
        scheduler that names none) the first."""
        if len(self.cores) <= 1:
            return self.cores[0] if self.cores else None
        target = scheduler_target(scheduler)
        if target is None:
            return self.cores[0]
        return next((core for core in self.cores if core.optimizer is target), None)

    def step_schedulers(self, core: DriverCore) -> None:
        """Step the schedulers this driver steps for ``core``, unless the step holds them (a skip)."""
        if not core.should_hold_scheduler():
            for scheduler in self._stepped.get(self.cores.index(core), ()):
                scheduler.step()

    def check_open(self, what: str) -> None:
        """Refuse ``what`` once the run is over: nothing would measure, skip or count its steps (callers on
        the step's path test ``closed`` first, so an open run pays no call)."""
        if self.closed:
            name = type(self).__name__
            raise RuntimeError(
                f"stabilitykit: guard.{what}() after guard.close(): the guard no longer measures, skips or counts "
                f"steps, so a non-finite update would be applied. Build a new {name} (and load_state_dict) to go on"
            )

    # ------------------------------------------------------------------ losses, metrics, the step
    def record_loss(self, loss: Tensor, optimizer: Any | None = None) -> None:
        """A backpropagated micro-batch loss (device tensor, no sync) for the step it feeds: the named
        optimizer's, the only one's, or (several, none named) the next to step."""
        if self.closed:
            self.check_open("record_loss")
        if optimizer is None and len(self.cores) == 1:
            self.cores[0].record_loss(loss)
        elif optimizer is not None:
            self.core_for(optimizer).record_loss(loss)
        elif self.cores:
            self._pending_losses.append(loss.detach())

    def claim_losses(self, core: DriverCore) -> None:
        """``core`` steps now: it takes the losses no optimizer claimed yet."""
        for loss in self._pending_losses:
            core.record_loss(loss)
        self._pending_losses = []

    def record(self, name: str, value: Tensor | float, reduce: str = "mean", *, optimizer: Any | None = None) -> None:
        """Record a metric of the coming step (a 0-d device tensor; no sync): logged as
        ``<prefix>/metrics/<name>`` at logging steps, agreed across ranks with ``reduce`` ("mean",
        "sum", "max", "min", "any", "all"), seen by your skip rules (``values[name]``) and the spike
        detector. Record every name from the first step on. With several optimizers it goes to the
        named one, else to every one (see ``stabilitykit.record``)."""
        self.check_open("record")
        targets = [self.core_for(optimizer)] if optimizer is not None else self.cores
        for core in targets:
            core.engine.record_metric(name, value, reduce)

    def run_step(
        self,
        core: DriverCore,
        optimizer_step: Callable[[], Any],
        replay: Callable[[], Tensor] | None = None,
        log_step: int | None = None,
        backward: Callable[[Tensor], None] | None = None,
    ) -> StepReport:
        """One optimizer step, top to bottom, where the driver owns the whole step (the plain loop):
        the losses claimed, measure / agree / decide / clip (``evaluate``), the optimizer step (its
        routed step applies or skips), the schedulers (held on a skip), then events, sinks, the
        divergence check and recovery (``finish``). ``backward``: backpropagates a loss the way the
        driver does, for a rerun of a flagged step (``config.rerun``)."""
        if self._pending_losses:
            self.claim_losses(core)
        core.evaluate(replay=replay, log_step=log_step, backward=backward)
        optimizer_step()
        self._scheduler_watch.before()
        self.step_schedulers(core)
        report = core.finish()
        self._scheduler_watch.after()  # after a rollback's restore of the schedulers
        assert report is not None
        return report

    # ------------------------------------------------------------------ end of run
    def summary(self) -> RunSummary:
        """The run's totals (reads the steps since the last logging step first: one sync).

        With several optimizers the first optimizer's totals, with ``optimizers``: one entry each.
        Readable by key too (``guard.summary()["skipped"]``); ``.line()`` is the end-of-run line.
        Reading it changes nothing ``close()`` writes. Empty before the run started.
        """
        if not self.cores:
            return RunSummary(0, 0, 0, 0.0, 0)
        rows = [core.summary() for core in self.cores]
        first = rows[0]
        if len(rows) > 1:
            first = dataclasses.replace(first, optimizers=tuple(rows))
        return first

    def end_run(self, summary: RunSummary | None = None) -> None:
        """The run is over (finished or raised): finish the step in flight, give the steps since the last
        logging step their row, write the summary line (once), undo every patch and hook, close the
        user's sinks. Idempotent. ``summary``: the line to write, when the driver counts more than its
        cores do (the HF Trainer's own clipping)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.cores:
                try:
                    self.cores[0].close(self.final_row)  # finishes, folds (and logs), undoes its hooks
                finally:
                    for core in self.cores[1:]:
                        core.close(self.final_row)
                (summary or self.summary()).log()
        finally:
            self.release()
            _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
            self.hooks.close()

    def close(self) -> None:
        """Process the steps since the last logging step, remove tracing hooks and every patch, log the
        summary line and close the sinks. Idempotent; ``with`` a driver calls it."""
        self.end_run()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the driver however the block ends: patches undone, the last row logged, sinks closed."""
        self.close()

    def release(self, lasting: bool = False) -> None:
        """Undo every patch of the run, newest first, and what the cores installed (idempotent; the run
        may go on elsewhere; nothing is closed). ``lasting``: the patches that outlive a run too."""
        kept: list[tuple[Callable[[], None], bool]] = []
        while self._undo:
            undo, outlives = self._undo.pop()
            if outlives and not lasting:
                kept.append((undo, outlives))
            else:
                undo()
        self._undo = kept[::-1]
        for core in self.cores:
            core.release()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every core's state in the one format all drivers save (before the run: a state loaded
        and not applied yet, else empty)."""
        if not self.cores:
            return dict(self._pending_state or {})
        return {"version": STATE_VERSION, "optimizers": [core.state_dict() for core in self.cores]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s state: every optimizer's state is validated before any is loaded.
        Before the cores exist (a framework restores callbacks first) it is kept and loaded into them
        when the run starts; an empty state loads nothing."""
        if not isinstance(state, Mapping):
            raise TypeError(f"stabilitykit state must be a mapping (from state_dict()), got {type(state).__name__}")
        if not self.cores:
            self._pending_state = dict(state) if state else None
            return
        check_version(state)
        states = state.get("optimizers")
        if not isinstance(states, list):
            got = "missing" if states is None else f"got {type(states).__name__}"
            raise ValueError(
                f"invalid stabilitykit state at 'optimizers': a list with one state per optimizer expected ({got}; "
                "not saved by a stabilitykit driver's state_dict()?). Nothing was loaded."
            )
        if len(states) != len(self.cores):
            raise ValueError(
                f"invalid stabilitykit state at 'optimizers': it holds {len(states)} optimizer state(s), this run "
                f"has {len(self.cores)} optimizer(s). Nothing was loaded."
            )
        for i, (core, core_state) in enumerate(zip(self.cores, states, strict=True)):
            try:
                validate_state(core_state, reference=core.state_dict())
            except (TypeError, ValueError) as exc:
                raise ValueError(_within(f"optimizers.{i}", str(exc))) from None
        for core, core_state in zip(self.cores, states, strict=True):
            core.load_state_dict(core_state)


def _within(prefix: str, message: str) -> str:
    """A core state's error message with the path from the driver's state (``optimizers.<i>.``)."""
    head = "invalid stabilitykit state at '"
    if message.startswith(head):
        return head + prefix + "." + message[len(head) :]
    return f"invalid stabilitykit state at '{prefix}': {message}"
