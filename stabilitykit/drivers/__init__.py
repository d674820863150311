"""Drivers: the lifecycle they share (``base.Driver``); each framework's driver maps its hooks onto it."""

from stabilitykit.drivers.base import Driver as Driver
from stabilitykit.drivers.base import active_drivers as active_drivers
from stabilitykit.drivers.base import record as record
