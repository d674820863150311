"""Recovery: snapshots of healthy training state, restored past a divergence so training goes on.

Split by job: ``host_copy`` (tensors to host memory and back, no sync on the step path), ``rng``
(the random generators), ``snapshot`` (what a snapshot holds, taken and restored in place),
``store`` (the ring of pending and confirmed snapshots, memory or disk), ``record`` (the skipped
step ranges, ``skipped_batches.json``) and ``controller`` (triggers, the rollback, the learning
rate after it). ``stabilitykit.drivers.core.DriverCore`` drives it; configure it with ``RecoveryConfig``.
"""

from stabilitykit.recovery.controller import Recovery as Recovery
from stabilitykit.recovery.controller import refuse_several_optimizers as refuse_several_optimizers
from stabilitykit.recovery.record import SKIPPED_FILE as SKIPPED_FILE
from stabilitykit.recovery.record import RollbackLog as RollbackLog
from stabilitykit.recovery.record import RollbackRecord as RollbackRecord
from stabilitykit.recovery.snapshot import Snapshot as Snapshot
from stabilitykit.recovery.snapshot import TrainingObjects as TrainingObjects
from stabilitykit.recovery.snapshot import restore_snapshot as restore_snapshot
from stabilitykit.recovery.snapshot import take_snapshot as take_snapshot
from stabilitykit.recovery.store import SnapshotStore as SnapshotStore
