"""Every driver (``loop``, ``accelerate``, ``fabric``, ``deepspeed``, ``lightning``, ``deepspeed_lightning``, ``hf``,
``deepspeed_hf``) and the lifecycle they share (``base``); frameworks are imported on first use."""

from stabilitykit.drivers.base import Driver as Driver
from stabilitykit.drivers.base import active_drivers as active_drivers
from stabilitykit.drivers.base import record as record


def missing(module: str, extra: str, package: str) -> ImportError:
    """The ImportError a framework driver raises without its framework: which extra (and package) it needs."""
    return ImportError(f"{module} needs {package}: pip install 'stabilitykit[{extra}]' (or pip install {package})")
