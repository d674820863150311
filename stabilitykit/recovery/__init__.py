"""Recovery: snapshots of healthy training state, restored past a divergence so training goes on.

Split by job: ``config`` (``RecoveryConfig``), ``host_copy`` (tensors to host memory and back, no
sync on the step path), ``rng`` (the random generators), ``snapshot`` (what a snapshot holds, taken
and restored in place), ``store`` (the ring of pending and confirmed snapshots, memory or disk),
``restore_points`` (the cadence, and which snapshots are healthy), ``triggers`` (what sets a
rollback off), ``rollback`` (the rollback itself, or the LR lowered in place, or the limit),
``escalation`` (the learning rate after it, the LR's fault or the data's), ``record`` (the skipped
step ranges, ``skipped_batches.json``) and ``controller`` (``Recovery``: wires them together for the
driver base, ``stabilitykit.drivers.base``). Configure it with ``RecoveryConfig``.

``Recovery`` is imported on first use: the controller needs the engine, and this package is also
imported by ``stabilitykit.config`` (for ``RecoveryConfig``), which the engine's types name.
"""

import importlib
from typing import Any

from stabilitykit.recovery.config import RecoveryConfig as RecoveryConfig
from stabilitykit.recovery.config import refuse_several_optimizers as refuse_several_optimizers
from stabilitykit.recovery.rollback_log import SKIPPED_FILE as SKIPPED_FILE
from stabilitykit.recovery.rollback_log import RollbackLog as RollbackLog
from stabilitykit.recovery.rollback_log import RollbackRecord as RollbackRecord
from stabilitykit.recovery.snapshot import Snapshot as Snapshot
from stabilitykit.recovery.snapshot import TrainingObjects as TrainingObjects
from stabilitykit.recovery.snapshot import restore_snapshot as restore_snapshot
from stabilitykit.recovery.snapshot import take_snapshot as take_snapshot
from stabilitykit.recovery.store import SnapshotStore as SnapshotStore


def __getattr__(name: str) -> Any:
    """``Recovery`` from ``controller.py``, imported when first asked for (the package's code imports it from
    ``stabilitykit.recovery.controller``; this keeps the old path ``stabilitykit.recovery.Recovery``)."""
    if name == "Recovery":
        return importlib.import_module("stabilitykit.recovery.controller").Recovery
    raise AttributeError(f"module 'stabilitykit.recovery' has no attribute {name!r}")
