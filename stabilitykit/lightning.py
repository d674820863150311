"""The earlier import path of ``stabilitykit.drivers.lightning``; the driver lives there."""

from stabilitykit.drivers.lightning import StabilityCallback as StabilityCallback

__all__ = ["StabilityCallback"]
