"""Wrappers over ``torch.nn.functional`` calls, installed once however many users ask for them.

The attention monitors read the tensors a model passes to its own attention call
(``F.scaled_dot_product_attention``, or ``F.softmax`` in eager attention), so the call itself is
wrapped in the module every model calls through. The wrappers are installed when the first user
asks and removed when the last one is done; a wrapper someone installed on top of ours stays.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.nn.functional as F


class FunctionalWrappers:
    """Reference-counted wrappers for named ``torch.nn.functional`` functions.

    ``wrappers`` maps a function's name to a factory that takes the original and returns the
    wrapper. ``acquire()`` installs them on the first call; ``release()`` removes them on the last.
    """

    def __init__(self, wrappers: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> None:
        self._factories = dict(wrappers)
        self._installed: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}
        self._users = 0

    def acquire(self) -> None:
        """One more user: install the wrappers if this is the first."""
        if self._users == 0:
            for name, factory in self._factories.items():
                original = getattr(F, name)
                wrapper = factory(original)
                self._installed[name] = (original, wrapper)
                setattr(F, name, wrapper)
        self._users += 1

    def release(self) -> None:
        """One user fewer: put the originals back after the last (unless wrapped again on top of ours)."""
        if self._users == 0:
            return
        self._users -= 1
        if self._users == 0:
            for name, (original, wrapper) in self._installed.items():
                if getattr(F, name) is wrapper:
                    setattr(F, name, original)
            self._installed.clear()
