"""Drivers: the lifecycle they share (``base.Driver``); each framework's driver maps its hooks onto it."""

from stabilitykit.drivers.base import Driver, active_drivers, record

__all__ = ["Driver", "active_drivers", "record"]
