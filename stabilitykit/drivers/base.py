"""The driver base: the lifecycle every driver shares, so each driver only maps its framework's hooks.

A driver (the plain-loop guard, Lightning, the Hugging Face Trainer, Accelerate, Fabric) owns one
``Driver``: it builds one ``DriverCore`` per optimizer, routes micro-batch losses to the optimizer
that steps next, carries the user's skip rules and recorded metrics into every core, saves and
loads one state format, and ends a run the same way everywhere (the in-flight step finished, the
steps since the last logging step folded and logged, the summary line, wrappers undone, the
user's sinks closed), whether the run finished or raised.

State format, every driver: ``{"version": STATE_VERSION, "optimizers": [core state, ...]}``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from stabilitykit.config import StabilityConfig
from stabilitykit.drivers.core import DriverCore, coerce_config, unwrap_optimizer
from stabilitykit.engine import StabilityEngine
from stabilitykit.hooks import HookManager
from stabilitykit.recovery import refuse_several_optimizers
from stabilitykit.rules import RuleSet, SkipRule
from stabilitykit.run_log import RunSummary
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


class Driver:
    """What every driver does around its cores; the framework adapters only call into it."""

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
        self._pending_losses: list[Tensor] = []  # several optimizers: losses not yet claimed by a step
        self._ended = False

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
        monitor hooks and the tracer with the first); the run is then active for ``record``."""
        base = config or self.config
        refuse_several_optimizers(base.recovery, len(optimizers))
        many = len(optimizers) > 1
        self.cores = []
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
        self._ended = False
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

    # ------------------------------------------------------------------ losses and metrics
    def record_loss(self, loss: Tensor, optimizer: Any | None = None) -> None:
        """A backpropagated micro-batch loss (device tensor, no sync) for the step it feeds: the named
        optimizer's, the only one's, or (several, none named) the next to step."""
        if optimizer is not None or len(self.cores) == 1:
            self.core_for(optimizer).record_loss(loss)
        elif self.cores:
            self._pending_losses.append(loss.detach())

    def claim_losses(self, core: DriverCore) -> None:
        """``core`` steps now: it takes the losses no optimizer claimed yet."""
        for loss in self._pending_losses:
            core.record_loss(loss)
        self._pending_losses = []

    def record(self, name: str, value: Tensor | float, reduce: str = "mean", optimizer: Any | None = None) -> None:
        """Record a metric for the step in flight (see ``stabilitykit.record``); with several
        optimizers it goes to the named one, else to every one."""
        targets = [self.core_for(optimizer)] if optimizer is not None else self.cores
        for core in targets:
            core.engine.record_metric(name, value, reduce)

    # ------------------------------------------------------------------ end of run
    def summary(self) -> RunSummary:
        """The run's totals (reads the steps since the last logging step first: one sync). With several
        optimizers the first one's, and ``optimizers``: one entry each. Empty before the run started."""
        if not self.cores:
            return RunSummary(0, 0, 0, 0.0, 0)
        rows = [core.summary() for core in self.cores]
        first = rows[0]
        if len(rows) > 1:
            first = dataclasses.replace(first, optimizers=tuple(rows))
        return first

    def end_run(self, summary: RunSummary | None = None) -> None:
        """The run is over (finished or raised): finish the step in flight, give the steps since the last
        logging step their row, write the summary line (once), undo every wrapper and hook, close the
        user's sinks. Idempotent. ``summary``: the line to write, when the driver counts more than its
        cores do (the HF Trainer's own clipping)."""
        if self._ended:
            return
        self._ended = True
        try:
            if self.cores:
                try:
                    self.cores[0].close(self.final_row)  # finishes, folds (and logs), undoes wrappers and hooks
                finally:
                    for core in self.cores[1:]:
                        core.close(self.final_row)
                (summary or self.summary()).log()
        finally:
            _ACTIVE[:] = [ref for ref in _ACTIVE if ref() is not None and ref() is not self]
            self.hooks.close()

    def release(self) -> None:
        """Undo every wrapper the cores installed (the run may go on elsewhere; nothing is closed)."""
        for core in self.cores:
            core.release()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Every core's state in the one format all drivers save."""
        return {"version": STATE_VERSION, "optimizers": [core.state_dict() for core in self.cores]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s state: every optimizer's state is validated before any is loaded."""
        if not isinstance(state, Mapping):
            raise TypeError(f"stabilitykit state must be a mapping (from state_dict()), got {type(state).__name__}")
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
