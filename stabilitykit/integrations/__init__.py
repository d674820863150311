"""The earlier import paths of the framework drivers, which now live in ``stabilitykit.drivers``.

* ``stabilitykit.drivers.hf``: ``StabilityTrainerCallback`` / ``stabilize(trainer)`` for the Hugging
  Face ``Trainer`` (``pip install 'stabilitykit[transformers]'``).
* ``stabilitykit.drivers.accelerate``: ``AccelerateGuard`` for hand-written Accelerate loops
  (``pip install 'stabilitykit[accelerate]'``).
* ``stabilitykit.drivers.fabric``: ``FabricGuard`` for Lightning Fabric (``pip install 'stabilitykit[lightning]'``).
* ``stabilitykit.drivers.deepspeed``: ``DeepSpeedGuard`` for loops over a DeepSpeed engine, ZeRO
  stages 0-3 (``pip install 'stabilitykit[deepspeed]'``).

``from stabilitykit.integrations import AccelerateGuard`` (and the submodules here) keep working.
Nothing is imported until used: ``import stabilitykit`` never needs these frameworks, and
``from stabilitykit.integrations import AccelerateGuard`` imports only Accelerate.
"""

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
