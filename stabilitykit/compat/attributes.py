"""Instance attributes replaced for a run and put back exactly: the one place that does it.

The drivers route a framework object's method through stabilitykit (an optimizer's ``step``, an
Accelerator's ``backward`` and ``clip_grad_norm_``, a Trainer's ``log``) by setting an attribute
on that instance, never on its class. Undoing restores what was there before: the instance's own
attribute if it had one (an LR scheduler's patch of ``optimizer.step``), or none. If someone
replaced ours in the meantime, theirs stays: undoing never removes another library's wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def replace_attribute(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``owner.<name> = value`` on the instance; returns the undo (idempotent)."""
    had_own = name in vars(owner)
    previous = vars(owner).get(name)
    setattr(owner, name, value)

    def undo() -> None:
        if vars(owner).get(name) is not value:
            return  # already undone, or someone wrapped it again on top: leave theirs alone
        if had_own:
            setattr(owner, name, previous)
        else:
            delattr(owner, name)

    return undo
