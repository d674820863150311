"""The earlier import path of ``stabilitykit.drivers.loop``; the driver lives there."""

from stabilitykit.drivers.loop import StabilityGuard as StabilityGuard
from stabilitykit.drivers.loop import scheduler_target as scheduler_target
