"""The earlier import path of ``stabilitykit.drivers.loop``; the driver lives there."""

from stabilitykit.drivers.base import scheduler_target as scheduler_target
from stabilitykit.drivers.loop import StabilityGuard as StabilityGuard
