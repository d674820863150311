"""Each guarded optimizer's ``step`` routed through its engine (``Driver.route_steps``): inside the engine's
gate (``engine/gate.py``) a skip the host knows never reaches the optimizer and one still on the device
goes to a fused optimizer's ``found_inf``; around it, the LR a rollback lowered and the LR noted for ``lr/``."""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from stabilitykit.compat.attributes import replace_attribute
from stabilitykit.drivers.optimizers import unwrap_optimizer
from stabilitykit.engine.gate import StepGate, gated
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
        """Route ``optimizer.step`` through ``engine`` (once; a second call returns the same undo). The wrapper is a
        bound method on the instance, so LR schedulers built later and wrappers put on top keep working and it
        never reaches ``state_dict()``; the undo restores exactly what was there before."""
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
        decision = engine.in_flight
        if decision is None:
            if not self.released:
                _unguarded_step(engine)
            return step_fn()
        gate = (decision, engine.optimizer if engine.fused else None, engine.sources.qk_clip, step_fn)
        if engine.recovery is None and not decision.logging:  # no LR to scale or to note: the gate alone
            return gated(*gate)
        with _step_lr(engine):  # the gate: a skip the host knows is not run, a fused optimizer's goes to found_inf
            return gated(*gate)

    def run_closure(self, engine: StabilityEngine, step_fn: Callable[[Callable[[], Any]], Any], closure: Any) -> Any:
        """Run ``step_fn(guarded_closure)``; the optimizer calls the closure itself. The grads are final when it
        returns (Lightning decides inside it), so its first return decides: a skip the host knows stops the
        optimizer before its update, one on the device goes to ``found_inf``; a second evaluation (SAM) gets its
        real result and decides nothing; an optimizer that never calls it is left to notice (Lightning raises)."""
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
