"""The random generators a snapshot saves: torch (CPU), CUDA (every device), ``random``, numpy.

Reading them costs no host sync: torch keeps the CUDA generators' seed and offset on the host.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def _numpy() -> Any | None:
    try:
        import numpy
    except ImportError:  # numpy is optional
        return None
    return numpy


def capture_rng(host: bool = True) -> dict[str, Any]:
    """The state of every generator present now (numpy only when importable, CUDA only when initialized).

    ``host=False``: torch's generators only (CPU and CUDA: a few microseconds), not Python's ``random`` and
    numpy's (about 0.2 ms together, most of it numpy building its state array)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if host:
        state["random"] = random.getstate()
        np = _numpy()
        if np is not None:
            state["numpy"] = np.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (generators it did not save are left alone)."""
    torch.set_rng_state(state["torch"])
    if "random" in state:
        random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np = _numpy()
    if "numpy" in state and np is not None:
        np.random.set_state(state["numpy"])
