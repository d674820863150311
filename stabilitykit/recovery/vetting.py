"""Snapshots kept or dropped on every rank alike: each rank's detector verdict rides in a step's all-reduce.

A snapshot of step ``s`` (the state after step ``s - 1``) is a restore point only if the spike
detectors were settled after scoring step ``s - 1`` (``SpikeMonitor.was_settled``): a state inside a
climb or an alert is not one. In one process the monitor decides at once (``RestorePoints._vet``). Under
torch.distributed each rank's monitor scores its own loss, so one rank may be inside a climb the
others do not see; if each rank kept or dropped on its own verdict, ranks would hold different
snapshots and a rollback would restore different steps. So, with several ranks:

1. snapshots are taken on the cadence on every rank (not put off by a rank's own monitor) and held
   *unvetted*: an unvetted snapshot pushes no older one out of the ring;
2. once the host has scored step ``s - 1`` (rows are read at the same steps on every rank, so every
   rank has scored the same steps), each rank queues its verdict on that snapshot; the queue is sent
   one verdict a step, in the step's record (``engine/record.py``): one more ``max`` value in the
   all-reduce that already runs every step (no extra collective, no extra sync; a step with nothing
   to send sends 0, so the record's layout never changes);
3. when the host reads that row (``Row.verdict``), every rank holds the same agreed verdict: the
   snapshot is dropped on every rank if *any* rank's monitor was not settled at ``s - 1``, and kept
   (vetted) on every rank otherwise.

A verdict is ``(lag + 1) * 2 + unsettled``: ``lag`` is the step that carries it minus the snapshot's
step, so the value stays small (exact in float32) however long the run; a MAX keeps "unsettled" when
any rank sent it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def encode_verdict(snapshot_step: int, unsettled: bool, step: int) -> int:
    """The value step ``step`` sends for the snapshot of ``snapshot_step`` (``snapshot_step <= step``)."""
    return (step - snapshot_step + 1) * 2 + int(unsettled)


def decode_verdict(value: int, step: int) -> tuple[int, bool]:
    """``(snapshot step, unsettled on some rank)`` of the agreed verdict ``value`` in the row of step ``step``."""
    lag, unsettled = divmod(value, 2)
    return step - (lag - 1), bool(unsettled)


@dataclass
class Verdicts:
    """This rank's verdicts waiting to be sent, oldest snapshot first, and the snapshots judged so far."""

    queued: list[tuple[int, bool]] = field(default_factory=list)  # (snapshot step, unsettled here)
    judged: set[int] = field(default_factory=set)  # snapshot steps queued or sent

    def judge(self, snapshot_step: int, unsettled: bool) -> None:
        """Queue this rank's verdict on the snapshot of ``snapshot_step`` (once per snapshot)."""
        if snapshot_step not in self.judged:
            self.judged.add(snapshot_step)
            self.queued.append((snapshot_step, unsettled))

    def send(self, step: int) -> int:
        """The value step ``step`` sends: the oldest queued verdict (0: none). What is queued depends only on
        the rows read and the snapshots taken, the same on every rank, so every rank sends about the same
        snapshot at the same step."""
        if not self.queued:
            return 0
        snapshot_step, unsettled = self.queued.pop(0)
        return encode_verdict(snapshot_step, unsettled, step)

    def forget_after(self, step: int) -> None:
        """A rollback restored the snapshot of ``step``: the snapshots after it need no verdict."""
        self.queued = [v for v in self.queued if v[0] <= step]
        self.judged = {s for s in self.judged if s <= step}

    def clear(self) -> None:
        """Every snapshot was dropped (the set of parameters changed, a resume)."""
        self.queued, self.judged = [], set()
