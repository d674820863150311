"""Every driver, and the lifecycle they share.

* ``base``: ``Driver``, the lifecycle (one engine per optimizer, the step top to bottom, state, the
  end of a run); ``build``: one engine per optimizer, everything attached; ``routing``: each
  optimizer's ``step`` through its engine; ``optimizers``: the optimizer looked up and checked.
* ``loop``: ``StabilityGuard`` for plain PyTorch loops; ``accelerate``: ``AccelerateGuard``;
  ``fabric``: ``FabricGuard``; ``deepspeed``: ``DeepSpeedGuard``.
* ``lightning``: ``StabilityCallback``; ``deepspeed_lightning``: ``DeepSpeedStabilityCallback``.
* ``hf``: ``StabilityTrainerCallback`` / ``stabilize`` for the Hugging Face Trainer;
  ``deepspeed_hf``: the Trainer with ``deepspeed=``; ``hf_attach``: their one attach and restore path.

The framework drivers import their framework, so nothing here imports them until asked.
"""

from stabilitykit.drivers.base import Driver as Driver
from stabilitykit.drivers.base import active_drivers as active_drivers
from stabilitykit.drivers.base import record as record
