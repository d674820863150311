"""Recovery: snapshots of healthy training state, restored past a divergence so training goes on.

Split by job: ``host_copy`` (tensors to host memory and back, no sync on the step path), ``rng``
(the random generators), ``snapshot`` (what a snapshot holds, taken and restored in place),
``store`` (the ring of pending and confirmed snapshots, memory or disk), ``record`` (the skipped
step ranges, ``skipped_batches.json``) and ``controller`` (triggers, the rollback, the learning
rate after it). ``stabilitykit.core.DriverCore`` drives it; configure it with ``RecoveryConfig``.
"""

from stabilitykit.recovery.controller import Recovery, refuse_several_optimizers
from stabilitykit.recovery.record import SKIPPED_FILE, RollbackLog, RollbackRecord
from stabilitykit.recovery.snapshot import Snapshot, TrainingObjects, restore_snapshot, take_snapshot
from stabilitykit.recovery.store import SnapshotStore

__all__ = [
    "SKIPPED_FILE",
    "Recovery",
    "RollbackLog",
    "RollbackRecord",
    "Snapshot",
    "SnapshotStore",
    "TrainingObjects",
    "refuse_several_optimizers",
    "restore_snapshot",
    "take_snapshot",
]
