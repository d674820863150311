"""Each guarded optimizer's ``step`` routed through its engine: applied, or skipped before its update.

The driver base owns one ``StepRoutes``; a driver only says where the framework's optimizer step
is (``Driver.route_steps``). A routed step with a step in flight runs inside the engine's gate
(``engine/gate.py``): a skip the host knows never reaches the optimizer, a skip still on the device
goes to a fused optimizer's ``found_inf``; around it, the LR a rollback lowered and the LR the step
used (noted for the logging step's ``lr/<group>`` metrics, ``engine/lr.py``).
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from stabilitykit.compat.attributes import replace_attribute
from stabilitykit.drivers.optimizers import unwrap_optimizer
from stabilitykit.engine.gate import StepGate
from stabilitykit.engine.lr import noting_lr
from stabilitykit.engine.step import StabilityEngine


class _StepSkipped(Exception):
    """Raised from a guarded closure to stop the optimizer before its update (a skip the host knows)."""


class StepRoutes:
    """The routed ``optimizer.step`` of every engine of a run, and what a routed step does."""

    def __init__(self) -> None:
        self._undo: dict[int, Callable[[], None]] = {}  # optimizer id -> undo of its routed step
        #: The run's routes were released: a wrapper of ours still reached (under someone else's) just runs.
        self.released = False
        #: Engines whose optimizer is running a closure step now (a closure evaluated twice keeps its decision).
        self.in_closure: set[int] = set()

    def route(self, engine: StabilityEngine, optimizer: Any) -> Callable[[], None]:
        """Route ``optimizer.step`` through ``engine`` (once: a second call returns the same undo).

        The wrapper is a bound method on the instance, so torch's LR schedulers built later (they
        need ``optimizer.step.__func__``) and anyone who wraps it after us keep working; it never
        reaches ``optimizer.state_dict()``. Undoing restores exactly what was there before (an
        instance attribute such as an LR scheduler's patch, or none).
        """
        target = unwrap_optimizer(optimizer)
        self.released = False
        installed = self._undo.get(id(target))
        if installed is not None:
            return installed
        original = target.step
        routes = self

        @functools.wraps(getattr(original, "__func__", original))
        def step(_optimizer: Any, *args: Any, closure: Any = None, **kwargs: Any) -> Any:
            if closure is None:
                return routes.run(engine, lambda: original(*args, **kwargs))
            return routes.run_closure(engine, lambda guarded: original(*args, closure=guarded, **kwargs), closure)

        restore = replace_attribute(target, "step", types.MethodType(step, target))

        def undo() -> None:
            self._undo.pop(id(target), None)
            restore()  # someone who wrapped it again on top keeps theirs (ours then just runs the step)

        self._undo[id(target)] = undo
        return undo

    def run(self, engine: StabilityEngine, step_fn: Callable[[], Any]) -> Any:
        """Run the optimizer step of the step in flight, or skip it (none in flight: just run it, and say so)."""
        if engine.in_flight is None:
            if not self.released:
                _unguarded_step(engine)
            return step_fn()
        with _step_lr(engine):  # the gate: a skip the host knows is not run, a fused optimizer's goes to found_inf
            gate = StepGate(engine.in_flight, engine.optimizer if engine.fused else None, engine.sources.qk_clip)
            try:
                return None if gate.skip_now else step_fn()
            finally:
                gate.close()

    def run_closure(self, engine: StabilityEngine, step_fn: Callable[[Callable[[], Any]], Any], closure: Any) -> Any:
        """Run ``step_fn(guarded_closure)``: the optimizer calls the closure itself, as it would without us.

        The grads are final when the closure returns (Lightning measures them in its
        ``on_before_optimizer_step``, inside the closure). The first return of the closure decides
        the step: a skip the host knows stops the optimizer right there (before its update), a skip
        still on the device goes to a fused optimizer's ``found_inf``. An optimizer that evaluates
        its closure again in the same step (a SAM-style two-pass step) gets each evaluation's real
        result; only the first is measured, clipped and decides. An optimizer that never calls its
        closure is left to notice that itself (Lightning raises).
        """
        gate: StepGate | None = None
        result: Any = None

        def guarded() -> Any:
            nonlocal gate, result
            result = closure()
            if gate is None and engine.in_flight is not None:
                gate = StepGate(engine.in_flight, engine.optimizer if engine.fused else None, engine.sources.qk_clip)
                if gate.skip_now:
                    raise _StepSkipped
            return result

        self.in_closure.add(id(engine))
        try:
            with _step_lr(engine):
                return step_fn(guarded)
        except _StepSkipped:
            return result
        finally:
            self.in_closure.discard(id(engine))
            if gate is not None:
                gate.close()


def _unguarded_step(engine: StabilityEngine) -> None:
    """``optimizer.step()`` called directly, not through the driver: counted, and named once."""
    engine.unguarded_steps += 1
    if engine.unguarded_steps == 1:
        warnings.warn(
            f"stabilitykit: {type(engine.optimizer).__name__}.step() was called directly, behind the guard's back "
            f"(after step {engine.step}): that step was not measured, clipped, skipped or counted, and "
            "recovery cannot undo it. Call guard.step() instead (it steps the optimizer)",
            RuntimeWarning,
            stacklevel=4,
        )


@contextlib.contextmanager
def _step_lr(engine: StabilityEngine) -> Iterator[None]:
    """Around the optimizer step: the LR lowered after a rollback (nothing without recovery), and the LR
    the step used noted for the logging step's ``lr/<group>`` metrics (``engine/lr.py``)."""
    scaled = engine.recovery.scaled_lr() if engine.recovery is not None else contextlib.nullcontext()
    with scaled, noting_lr(engine.lr_optimizer, lambda: engine.in_flight):
        yield
