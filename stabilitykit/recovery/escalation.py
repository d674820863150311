"""What recovery does to the learning rate, and whether trouble was the learning rate's or the data's.

A rollback cannot tell at once why a run blew up. The first one in a while (``cause`` "undetermined")
does what fixes either: it skips the next ``skip_after`` batches and runs ``cooldown_steps`` steps at
``lr_scale`` times the learning rate. The skipped batches then say which it was: they are measured
(never trained on) on the restored, healthy weights, so a loss far above the one the run had at the
restored step means the data itself is bad (``_judge``; with nothing skipped, the first batch after
the rollback is judged: its loss, too, is measured before any update). When trouble comes back within ``window``
steps of that action:

* the skipped batches were bad: the cause is the **data** (a long burst): roll back and skip again;
* they were not (the trouble recurred on data the healthy model reads fine): the cause is the
  **learning rate**: roll back without skipping and lower the LR one level further
  (``lr_backoff``, 0.5 then 0.25 times the schedule's), held for ``backoff_steps``;
* nothing was measured (the last action lowered the LR where the run was, with no restore point to
  measure batches on): when the trouble came back only after that lowered LR ended, it held off while
  the LR was low and returned with the full LR, so the cause is the **learning rate**; when it came back
  while the LR was still lowered there is no evidence either way, so the cause is **undetermined** again
  and both are handled. Blaming the LR without evidence would stop the skipping that a burst of bad data
  needs.

Under torch.distributed each rank measures its own batches' loss, so ranks could judge differently;
there a recurrence is always the learning rate's (a choice every rank makes alike).

Everything here is host bookkeeping over host values the driver already read; the factor in force
at a step is ``factor(step)``, applied around the optimizer step by the controller.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

Cause = Literal["undetermined", "data", "lr"]

#: The skipped batches' median loss at least this many times the restored state's: the data was bad.
BAD_DATA_RATIO = 1.5
#: Taken steps before the restored step whose losses make the reference loss when the restored step's is unknown.
REFERENCE_STEPS = 20
#: Taken steps at the end of an LR change whose median loss says whether the trouble passed (``unrecovered``).
END_STEPS = 5


@dataclass(frozen=True)
class LrChange:
    """One lowering of the learning rate: from ``step`` on, times ``factor`` until (before) ``until``."""

    step: int
    factor: float
    until: int
    cause: str  # "undetermined", "data" or "lr"
    rolled_back: bool  # False: lowered where the run was (no restore point within the bound)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON-ready)."""
        return asdict(self)


class Escalation:
    """The learning-rate factor in force, the backoff level reached, and what the skipped data showed."""

    def __init__(
        self,
        lr_scale: float,
        cooldown_steps: int,
        lr_backoff: Sequence[float],
        backoff_steps: int,
        window: int,
        judge_data: bool,
    ) -> None:
        self.lr_scale, self.cooldown_steps = lr_scale, cooldown_steps
        self.lr_backoff, self.backoff_steps, self.window = list(lr_backoff), backoff_steps, window
        self.judge_data = judge_data
        self.level = 0  # backoff levels used so far (0: none; len(lr_backoff): the deepest)
        self.changes: list[LrChange] = []
        self.last_action: int | None = None  # the step of the last rollback or LR change
        self.last_onset: int | None = None  # where the trouble last acted on began
        self._reviewed: LrChange | None = None  # the last change whose end was reviewed (``unrecovered``)
        #: ``(first, end)`` of the batches the last rollback skips ahead, the reference loss, their losses.
        self._skipped: tuple[int, int] | None = None
        self._reference: float | None = None
        self._skipped_losses: list[float] = []
        self._while_bad = False  # the skip ahead ends once the batches measure fine again (the data's cause)
        self._passed: int | None = None  # the first step that trains again, when that skip ended early
        self.data_bad: bool | None = None  # the last batches skipped ahead were bad (None: not measured yet)
        self._losses: deque[tuple[int, float]] = deque(maxlen=256)  # (step, loss) of recent taken steps
        self._onsets: deque[int] = deque(maxlen=16)  # where recent trouble began: never a reference
        #: The loss of the run's first step (step 0: the model before any update), when taken and finite. A run
        #: that never got below it has not recovered, however low the best it held inside its blow-up.
        self.initial_loss: float | None = None

    # ------------------------------------------------------------------ reading rows
    def observe(self, rows: Iterable[Any]) -> None:
        """Journal rows the host read: losses of taken steps (the reference), and of batches skipped ahead."""
        for row in rows:
            loss = row.loss
            window = self._skipped
            if window is not None and window[0] <= row.step < window[1]:
                if loss is not None:
                    self._skipped_losses.append(loss if math.isfinite(loss) else math.inf)
                    if self._fine_again():
                        self._passed = row.step + 1
                        self._judge()
                        continue
            elif loss is not None and not row.skipped and math.isfinite(loss):
                self._losses.append((row.step, loss))
                if row.step == 0:
                    self.initial_loss = loss
            if window is not None and row.step >= window[1] - 1:
                self._judge()  # the window's last row, or a later one (a row may reach the host outside a step)

    def _fine_again(self) -> bool:
        """Batches skipped ahead for bad data (``while_bad``) measure fine again: the median loss of the last
        ``END_STEPS`` of them is under ``BAD_DATA_RATIO`` times the reference (the burst is over)."""
        last = self._skipped_losses[-END_STEPS:]
        if not self._while_bad or self._reference is None or len(last) < END_STEPS:
            return False
        return statistics.median(last) < BAD_DATA_RATIO * self._reference

    def passed(self) -> int | None:
        """Once: the step from which training goes on, when batches skipped for bad data measured fine again
        before the skip ahead ran out (None: not now)."""
        passed, self._passed = self._passed, None
        return passed

    def _judge(self) -> None:
        """Every batch skipped ahead is measured: were they bad (far above the restored state's loss)?"""
        if self._reference is not None and self._skipped_losses:
            self.data_bad = statistics.median(self._skipped_losses) >= BAD_DATA_RATIO * self._reference
        self._skipped, self._skipped_losses = None, []

    # ------------------------------------------------------------------ deciding
    def cause(self, onset: int) -> Cause:
        """Why trouble at ``onset`` came: "undetermined" when nothing was done within ``window`` steps before;
        "data" when the batches skipped after the last rollback were bad, "lr" when they were fine (under
        torch.distributed, where the data is not judged: always "lr"). When nothing was measured since (the last
        action lowered the LR where the run was): "lr" if the trouble came back only once that lowered LR had
        ended (it held off while the LR was low and returned with the full LR: it follows the LR), else
        "undetermined" (it came back at the lowered LR: nothing tells the LR from the data)."""
        if self.last_action is None or onset - self.last_action > self.window:
            return "undetermined"
        if not self.judge_data:  # several ranks: the data is not judged, every rank blames the LR alike
            return "lr"
        if self.data_bad is None:  # nothing measured since the last action (an LR lowered in place)
            last = self.changes[-1] if self.changes else None
            returned_with_the_lr = last is not None and last.step == self.last_action and onset >= last.until
            return "lr" if returned_with_the_lr else "undetermined"
        return "data" if self.data_bad else "lr"

    @property
    def exhausted(self) -> bool:
        """Every backoff level has been used (or there are none)."""
        return self.level >= len(self.lr_backoff)

    def deepest_in_force(self, step: int) -> bool:
        """The lowest backoff level holds at ``step`` (or there is no backoff): lowering did not help."""
        return not self.lr_backoff or (self.exhausted and self.factor(step) <= self.lr_backoff[-1])

    def act(
        self, cause: Cause, step: int, restart: int, rolled_back: bool, onset: int | None = None
    ) -> LrChange | None:
        """Note an action at ``step`` for ``cause`` on trouble that began at ``onset`` (default: ``step``);
        training goes on at ``restart`` (after the batches skipped ahead). Returns the LR change it makes
        (None: none)."""
        self.last_action = step
        self.last_onset = step if onset is None else onset
        self.data_bad = None
        if cause == "lr" and self.lr_backoff:
            self.level = min(self.level + 1, len(self.lr_backoff))
            change = LrChange(step, self.lr_backoff[self.level - 1], restart + self.backoff_steps, cause, rolled_back)
        elif self.lr_scale != 1.0 and self.cooldown_steps:
            change = LrChange(step, self.lr_scale, restart + self.cooldown_steps, cause, rolled_back)
        else:
            change = None
        if change is not None:
            self.changes.append(change)
        return change

    def skipping(self, first: int, end: int, restored_step: int, onset: int, while_bad: bool = False) -> None:
        """A rollback to the snapshot of ``restored_step`` skips the batches of steps ``first .. end - 1``
        (``while_bad``: only while they measure bad; the skip ends at the first ``END_STEPS`` in a row that do not):
        judge them against the loss of step ``restored_step`` (the same weights on the batch it trained on)
        unless trouble began at that step (``onset`` now, or an earlier one), else against the losses of the
        taken steps just before it. None skipped: judge the batch of step ``first``,
        whose loss is also measured on the restored weights, before any update."""
        # the loss step ``restored_step`` had (the restored weights on that step's batch, before its update),
        # unless trouble began at that batch (now or at an earlier rollback): it may be the bad data itself
        self._onsets.append(onset)
        same = [loss for step, loss in self._losses if step == restored_step and step not in self._onsets]
        before = [loss for step, loss in self._losses if restored_step - REFERENCE_STEPS <= step < restored_step]
        self._reference = same[0] if same else statistics.median(before) if before else None
        self._skipped, self._skipped_losses = (first, max(end, first + 1)), []
        self._while_bad, self._passed = while_bad and self.judge_data, None

    def factor(self, step: int) -> float:
        """The factor on the learning rate at ``step`` (1.0: the schedule's): the lowest change in force."""
        return min((c.factor for c in self.changes if c.step < step < c.until), default=1.0)

    def lowered(self, step: int) -> bool:
        """A change made by recovery lowers the learning rate at ``step`` (recovery has acted and it holds)."""
        return self.factor(step) < 1.0

    def unrecovered(self, step: int) -> tuple[float, str] | None:
        """At the end of the last LR change (once the losses of its last steps are read, at ``step``): how many
        times the best loss the run held the loss still is (the median of the ``END_STEPS`` taken steps up to
        the change's last step), when that is ``BAD_DATA_RATIO`` or more, with what it was measured against:
        the trouble did not pass while the LR was lowered. The best loss is the lowest median of ``END_STEPS``
        taken steps in a row (one lucky batch is no level), or the first step's loss (``initial_loss``) when
        that is lower: a run that blows up from its first steps has no healthy level before the trouble, and
        one that never got below its untrained model's loss is still wrecked, however far its loss fell from
        the top of the blow-up while the LR was lowered. None otherwise, for a change whose cause was the data
        (a lower LR cannot fix it), and under torch.distributed (each rank reads its own loss: ranks would
        lower their LRs apart). Each change is reviewed once, within ``REFERENCE_STEPS`` of its end."""
        change = self.changes[-1] if self.changes else None
        if not self.judge_data or change is None or change is self._reviewed:
            return None
        end = change.until - 1
        if not end <= step < end + REFERENCE_STEPS or change.cause == "data":
            return None
        last = [loss for s, loss in self._losses if end - END_STEPS < s <= end]
        held = [loss for s, loss in self._losses if s <= end]
        runs_of_steps = (held[i : i + END_STEPS] for i in range(len(held) - END_STEPS + 1))
        levels = [(statistics.median(losses), "the best the run held") for losses in runs_of_steps]
        if self.initial_loss is not None:
            levels.append((self.initial_loss, "the loss of its first step (the model before any update)"))
        best, against = min(levels, default=(None, ""))
        if not last or best is None or best <= 0:
            return None
        self._reviewed = change
        ratio = statistics.median(last) / best
        return (ratio, against) if ratio >= BAD_DATA_RATIO else None

    def recovered(self, step: int) -> bool:
        """The loss of taken step ``step`` is back near its level from before the trouble last acted on: under
        ``BAD_DATA_RATIO`` times the median loss of the ``REFERENCE_STEPS`` taken steps before it began (the
        ratio that calls a loss far above; False when either is unknown). Not "under the median": a run at
        the top of its warm-up is noisy, and a state a little above its earlier median is still one a
        rollback can go back to, where a state inside a blow-up is many times above it."""
        onset = self.last_onset
        if onset is None or step < onset:
            return False
        now = [loss for s, loss in self._losses if s == step]
        before = [loss for s, loss in self._losses if onset - REFERENCE_STEPS <= s < onset]
        return bool(now and before) and now[-1] < BAD_DATA_RATIO * statistics.median(before)

    def tried(self) -> str:
        """What was tried to lower the learning rate, for a message ("" when nothing)."""
        return "; ".join(f"the LR times {c.factor:g} from step {c.step + 1} to {c.until - 1}" for c in self.changes)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything the next decision reads, so a resumed run decides as the run would have: the level, the
        LR changes (which one's end was reviewed), the last action and onset, what the skipped data showed and
        the measure in progress (the batches skipped ahead, their reference and losses so far), the recent
        losses of taken steps (the references), the recent onsets and the first step's loss. Host values only
        (no sync)."""
        window = self._skipped
        reviewed = next((i for i, c in enumerate(self.changes) if c is self._reviewed), None)
        return {
            "level": self.level,
            "changes": [c.to_dict() for c in self.changes],
            "last_action": self.last_action,
            "last_onset": self.last_onset,
            "reviewed": reviewed,
            "data_bad": self.data_bad,
            "skipped": list(window) if window is not None else None,
            "reference": self._reference,
            "skipped_losses": list(self._skipped_losses),
            "while_bad": self._while_bad,
            "loss_steps": [step for step, _ in self._losses],
            "losses": [loss for _, loss in self._losses],
            "onsets": list(self._onsets),
            "initial_loss": self.initial_loss,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (validated by ``stabilitykit.state`` before; empty: nothing saved)."""
        if not state:
            return
        self.level = int(state["level"])
        self.changes = [LrChange(**c) for c in state["changes"]]
        last, onset, reviewed = state["last_action"], state["last_onset"], state["reviewed"]
        self.last_action = int(last) if last is not None else None
        self.last_onset = int(onset) if onset is not None else None
        self._reviewed = self.changes[reviewed] if reviewed is not None and reviewed < len(self.changes) else None
        self.data_bad = state["data_bad"]
        window = state["skipped"]
        self._skipped = (int(window[0]), int(window[1])) if window is not None else None
        self._reference = state["reference"]
        self._skipped_losses = [float(x) for x in state["skipped_losses"]]
        self._while_bad = bool(state["while_bad"])
        pairs = zip(state["loss_steps"], state["losses"], strict=True)
        self._losses = deque(((int(s), float(x)) for s, x in pairs), maxlen=self._losses.maxlen)
        self._onsets = deque((int(s) for s in state["onsets"]), maxlen=self._onsets.maxlen)
        initial = state["initial_loss"]
        self.initial_loss = float(initial) if initial is not None else None
