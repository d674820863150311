"""What a recovery snapshot keeps of the guard's engine, and how a rollback puts it back.

Beside the engine (not in ``recovery/``): recovery stores and restores this state through the two
callables the drivers hand it (``drivers/build.py``), so it never imports the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stabilitykit.engine.step import StabilityEngine


def guard_snapshot(engine: StabilityEngine) -> dict[str, Any]:
    """What a recovery snapshot keeps of the guard: the engine's state and the held steps."""
    return {"engine": engine.state_dict(), "held_steps": engine.held_steps}


def restore_guard_snapshot(engine: StabilityEngine, state: dict[str, Any]) -> None:
    """A rollback restored a snapshot whose guard state is ``state``: the engine gets its statistics while
    its step count goes on (``rewind``), ``schedule_step`` becomes the snapshot's (as the restored
    schedulers' counts do), and the restored buffers are what a later skip puts back.
    """
    engine.rewind(state["engine"])
    engine.held_steps = int(state["held_steps"]) + engine.step - int(state["engine"]["step"])
    engine.buffers.save()
