"""The earlier import paths of the framework drivers, which live in ``stabilitykit.drivers``: each name is
imported on first use, so ``import stabilitykit`` never needs a framework."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AccelerateGuard", "DeepSpeedGuard", "FabricGuard", "StabilityTrainerCallback", "stabilize"]

_WHERE = {
    "AccelerateGuard": "accelerate",
    "DeepSpeedGuard": "deepspeed",
    "FabricGuard": "fabric",
    "StabilityTrainerCallback": "hf",
    "stabilize": "hf",
}


def __getattr__(name: str) -> Any:
    """Import the driver that defines ``name`` on first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'stabilitykit.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(f"stabilitykit.drivers.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
