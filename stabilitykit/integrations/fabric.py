"""The earlier import path of ``stabilitykit.drivers.fabric``; the driver lives there."""

from stabilitykit.drivers.fabric import FabricGuard as FabricGuard

__all__ = ["FabricGuard"]
