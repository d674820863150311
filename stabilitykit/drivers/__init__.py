"""Every driver, and the lifecycle they share (``base``; ``build``, ``routing``, ``optimizers`` beside it):
``loop``, ``accelerate``, ``fabric``, ``deepspeed``, ``lightning``, ``deepspeed_lightning``, ``hf``,
``deepspeed_hf`` (``hf_attach``: the Trainer drivers' attach and restore). Frameworks load on first use.
"""

from stabilitykit.drivers.base import Driver as Driver
from stabilitykit.drivers.base import active_drivers as active_drivers
from stabilitykit.drivers.base import record as record
