"""The earlier import path of ``stabilitykit.drivers.deepspeed_hf``; the driver lives there."""

from stabilitykit.drivers.deepspeed_hf import DeepSpeedTrainerCallback as DeepSpeedTrainerCallback
