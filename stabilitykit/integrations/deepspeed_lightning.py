"""The earlier import path of ``stabilitykit.drivers.deepspeed_lightning``; the driver lives there."""

from stabilitykit.drivers.deepspeed_lightning import DeepSpeedStabilityCallback as DeepSpeedStabilityCallback
