"""One rollback decision on every rank: a rank's trigger rides in the next step's all-reduce.

Under torch.distributed each rank finds its own triggers: a ``spike_alert`` scores this rank's
loss (and its monitors), so ranks see different alerts; a divergence is found when the journal is
read. If each rank rolled back on its own, replicas would drift apart (DDP) or shards would come
from different steps (FSDP). So, with several ranks:

1. a rank that finds a trigger *queues* it: ``(trigger, onset)``, the earliest one if several;
2. the next step sends it as one number in the step's record (``engine/step_record.py``, a
   MAX that already runs on every rank every step: no extra collective, no extra sync); every
   rank's row of that step then holds the same agreed request (``Row.request``), which the engine hands
   back to recovery with the step (``RecoveryAnswer.requests``);
3. the rollback happens at the end of the next **logging step**, the first step at which every
   rank is certain to have read that row (a logging step reads every unread row): every rank
   restores the same snapshot at the same step.

The cost is latency: a trigger found at step t rolls back at the first logging step after
t + 1 (at most ``log_every_n_steps`` steps later); the steps in between are undone with the rest.

A request is ``(lag + 1) * 4 + kind``: ``lag`` is the step that carries it minus the onset, so a
MAX keeps the earliest onset any rank saw (ties: the larger kind). It stays an exact integer in
float32 for lags below four million steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: The triggers a request can carry, by code (1, 2, 3).
KINDS = ("diverged", "spike_alert", "loss_drift")


def encode_request(trigger: str, onset: int, step: int) -> int:
    """The request that step ``step`` sends for ``trigger`` with onset ``onset`` (``onset <= step``)."""
    return (step - onset + 1) * 4 + KINDS.index(trigger) + 1


def decode_request(value: int, step: int) -> tuple[str, int]:
    """``(trigger, onset)`` of the agreed request ``value`` in the row of step ``step``."""
    lag, kind = divmod(value, 4)
    return KINDS[kind - 1], step - (lag - 1)


@dataclass
class Agreement:
    """This rank's queued trigger and the earliest agreed request read so far."""

    queued: tuple[str, int] | None = None  # (trigger, onset) found here, not sent yet
    agreed: tuple[str, int] | None = None  # (trigger, onset) agreed by every rank, not acted on yet

    def queue(self, trigger: str, onset: int) -> None:
        """Send ``trigger`` (onset ``onset``) with the next step; the earliest onset wins."""
        if self.queued is None or onset < self.queued[1]:
            self.queued = (trigger, onset)

    def request(self, step: int) -> int:
        """The number step ``step`` sends (0: nothing queued); a queued trigger is sent once."""
        if self.queued is None:
            return 0
        (trigger, onset), self.queued = self.queued, None
        return encode_request(trigger, min(onset, step), step)

    def read(self, requests: Iterable[tuple[int, int]]) -> None:
        """Agreed requests the host has read, as (step, request) pairs: keep the earliest onset among them."""
        for step, request in requests:
            if request > 0:
                found = decode_request(request, step)
                if self.agreed is None or found[1] < self.agreed[1]:
                    self.agreed = found

    def take(self) -> tuple[str, int] | None:
        """The agreed request to act on now (every rank has read it), or None; it is acted on once."""
        agreed, self.agreed = self.agreed, None
        return agreed

    def clear(self) -> None:
        """A rollback happened: what was queued or agreed before it belonged to the undone steps."""
        self.queued = self.agreed = None
