"""The earlier import path of ``stabilitykit.drivers.accelerate``; the driver lives there."""

from stabilitykit.drivers.accelerate import AccelerateGuard as AccelerateGuard

__all__ = ["AccelerateGuard"]
