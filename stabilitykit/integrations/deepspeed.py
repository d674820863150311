"""The earlier import path of ``stabilitykit.drivers.deepspeed``; the driver lives there."""

from stabilitykit.drivers.deepspeed import DeepSpeedGuard as DeepSpeedGuard

__all__ = ["DeepSpeedGuard"]
