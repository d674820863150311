"""Snapshots kept or dropped on every rank alike: each rank's view of a snapshot's health rides in a step's all-reduce.

A snapshot's **health** says whether the state it holds is a restore point: *healthy* when the spike
detectors were settled after scoring the step before it (``SpikeMonitor.was_settled``), *climbing* when
not (a state inside a climb or an alert is not one). A snapshot of step ``s`` holds the state after step
``s - 1``. In one process the monitor decides at once (``RestorePoints._vet``). Under torch.distributed
each rank's monitor scores its own loss, so one rank may be inside a climb the others do not see; if
each rank kept or dropped by its own monitor, ranks would hold different snapshots and a rollback would
restore different steps. So, with several ranks:

1. snapshots are taken on the cadence on every rank (not put off by a rank's own monitor) and held
   *unvetted*: an unvetted snapshot pushes no older one out of the ring;
2. once the host has scored step ``s - 1`` (rows are read at the same steps on every rank, so every
   rank has scored the same steps), each rank queues the health it sees for that snapshot; the queue
   is sent one snapshot a step, in the step's record (``engine/step_record.py``): the ``health`` value, one
   more ``max`` in the all-reduce that already runs every step (no extra collective, no extra sync; a
   step with nothing to send sends 0, so the record's layout never changes);
3. when the host reads that row (``Row.health``), every rank holds the same agreed health: the
   snapshot is dropped on every rank if *any* rank saw it climbing, and kept (vetted) on every rank
   otherwise.

An encoded health is ``(lag + 1) * 2 + unsettled``: ``lag`` is the step that carries it minus the
snapshot's step, so the value stays small (exact in float32) however long the run; a MAX keeps
"unsettled" (climbing) when any rank sent it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def encode_health(snapshot_step: int, unsettled: bool, step: int) -> int:
    """The value step ``step`` sends for the snapshot of ``snapshot_step`` (``snapshot_step <= step``)."""
    return (step - snapshot_step + 1) * 2 + int(unsettled)


def decode_health(value: int, step: int) -> tuple[int, bool]:
    """``(snapshot step, unsettled on some rank)`` of the agreed health ``value`` in the row of step ``step``."""
    lag, unsettled = divmod(value, 2)
    return step - (lag - 1), bool(unsettled)


@dataclass
class HealthQueue:
    """The health this rank saw for snapshots, waiting to be sent oldest first, and the snapshots judged so far."""

    queued: list[tuple[int, bool]] = field(default_factory=list)  # (snapshot step, unsettled here)
    judged: set[int] = field(default_factory=set)  # snapshot steps queued or sent

    def judge(self, snapshot_step: int, unsettled: bool) -> None:
        """Queue the health this rank sees for the snapshot of ``snapshot_step`` (once per snapshot)."""
        if snapshot_step not in self.judged:
            self.judged.add(snapshot_step)
            self.queued.append((snapshot_step, unsettled))

    def send(self, step: int) -> int:
        """The value step ``step`` sends: the oldest queued health (0: none). What is queued depends only on
        the rows read and the snapshots taken, the same on every rank, so every rank sends about the same
        snapshot at the same step."""
        if not self.queued:
            return 0
        snapshot_step, unsettled = self.queued.pop(0)
        return encode_health(snapshot_step, unsettled, step)

    def forget_after(self, step: int) -> None:
        """A rollback restored the snapshot of ``step``: the snapshots after it need no health sent."""
        self.queued = [v for v in self.queued if v[0] <= step]
        self.judged = {s for s in self.judged if s <= step}

    def clear(self) -> None:
        """Every snapshot was dropped (the set of parameters changed, a resume)."""
        self.queued, self.judged = [], set()
