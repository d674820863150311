"""The stack level of the user's code, for warnings raised deep inside the library.

A warning raised on a training step travels up through the driver, the engine and the monitors (and,
from a forward hook, through ``torch.nn.Module``'s call machinery) before it reaches the line the user
wrote. A fixed ``stacklevel`` points at whichever of those frames happens to sit at that depth, and
changes with every driver; ``user_stacklevel()`` counts the frames instead, so the warning names the
user's ``guard.step()`` or ``model(...)`` line (or the framework's loop that called it).
"""

from __future__ import annotations

import inspect
import os

import torch

#: Files in these folders are not the user's code: this package (this module's folder: importing the
#: package itself here would make every module that warns part of an import circle), and torch.
_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f or "")) + os.sep for f in (__file__, torch.__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by the caller of this function that points at the
    first frame outside stabilitykit and torch (the outermost frame when every frame is inside them)."""
    here = inspect.currentframe()
    frame = here.f_back if here is not None else None  # the function that will call warnings.warn: stacklevel 1
    level = 1
    if frame is None:  # an interpreter without frame objects
        return 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame = frame.f_back
        level += 1
    return level
