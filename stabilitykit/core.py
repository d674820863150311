"""The earlier import path of ``stabilitykit.drivers.core``; the driver lives there."""

from stabilitykit.config import coerce_config as coerce_config
from stabilitykit.drivers.core import DriverCore as DriverCore
from stabilitykit.drivers.core import optimizer_params as optimizer_params
from stabilitykit.drivers.core import unwrap_optimizer as unwrap_optimizer
