"""Re-run a suspect step: the data's fault or the model's (it comes out the same), or the machine's.

``config`` (``RerunConfig``), ``compare`` (first pass against the recomputation, agreed across ranks),
``judged_steps`` (the rerun record: the verdicts in a small JSON lines file a resumed run reads),
``policy`` (when a step is re-run, the random state it started with, the verdict, the event).
``stabilitykit.drivers.base.Driver`` arms it per step with the driver's way to recompute the batch; the
engine consults it once per step.
"""

from stabilitykit.rerun.config import RerunConfig as RerunConfig
from stabilitykit.rerun.judged_steps import RerunRecord as RerunRecord
from stabilitykit.rerun.policy import Rerun as Rerun
