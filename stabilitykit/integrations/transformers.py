"""The earlier import path of ``stabilitykit.drivers.hf``; the driver lives there."""

from stabilitykit.drivers.hf import StabilityTrainerCallback as StabilityTrainerCallback
from stabilitykit.drivers.hf import stabilize as stabilize

__all__ = ["StabilityTrainerCallback", "stabilize"]
