"""Holding an LR scheduler on skipped steps without touching what it saves.

A wrapper stored on the scheduler instance lands in ``scheduler.state_dict()`` (it returns the
instance ``__dict__``) and breaks every checkpoint. Instead the scheduler's class is swapped for
a subclass whose ``step`` asks a predicate first; the predicate lives in a weak registry, not on
the instance. The instance's ``__dict__`` and ``state_dict()`` stay exactly as they were, the
scheduler still pickles as its own class, and ``release`` restores the class.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

_PREDICATES: weakref.WeakKeyDictionary[Any, Callable[[], bool]] = weakref.WeakKeyDictionary()
_HELD_CLASSES: dict[type, type] = {}


def _held_class(cls: type) -> type:
    held = _HELD_CLASSES.get(cls)
    if held is not None:
        return held

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        predicate = _PREDICATES.get(self)
        if predicate is not None and predicate():
            return None
        return cls.step(self, *args, **kwargs)  # type: ignore[attr-defined]

    def __reduce_ex__(self: Any, protocol: Any) -> Any:  # a held scheduler pickles as the user's own class
        reduced = super(held, self).__reduce_ex__(protocol)  # type: ignore[arg-type]
        if isinstance(reduced, tuple) and len(reduced) > 1 and reduced[1] and reduced[1][0] is held:
            reduced = (reduced[0], (cls, *reduced[1][1:]), *reduced[2:])
        return reduced

    held = type(cls.__name__, (cls,), {"step": step, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__})
    held.__qualname__ = cls.__qualname__
    _HELD_CLASSES[cls] = held
    return held


def hold_scheduler(scheduler: Any, should_hold: Callable[[], bool]) -> None:
    """From now on ``scheduler.step()`` does nothing while ``should_hold()`` is true."""
    _PREDICATES[scheduler] = should_hold
    if type(scheduler) not in _HELD_CLASSES.values():
        scheduler.__class__ = _held_class(type(scheduler))


def release_scheduler(scheduler: Any) -> None:
    """Undo ``hold_scheduler`` (idempotent): the original class is back."""
    _PREDICATES.pop(scheduler, None)
    cls = type(scheduler)
    for original, held in _HELD_CLASSES.items():
        if cls is held:
            scheduler.__class__ = original
            return
