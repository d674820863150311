"""What one optimizer step collects before it is decided, and the step record built from it.

Between two optimizer steps a driver hands in the losses backpropagated into the grads (one per
micro-batch) and users record metrics (``sk.record``). At ``evaluate`` they are taken, and with the
step's norms they make the step record (``engine/step_record.py``): the norm, finiteness, each rule's
flag on this rank, the rollback request, a snapshot's health and the recorded metrics, each with its cross-rank
reduction. Everything stays on the device: nothing here syncs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from stabilitykit.engine.decision import NO_ASK, RecoveryAsk
from stabilitykit.engine.step_record import RecordLayout, StepRecord, check_reduce
from stabilitykit.grads import NormResult
from stabilitykit.rules import RuleSet, SkipRule, StepValues

_BOOL = torch.bool


class StepInputs:
    """The step in flight's losses and recorded metrics; builds its record (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: The recorded metrics' names and reductions: fixed at the first step (``take``).
        self.layout = RecordLayout()
        self._metrics: dict[str, Tensor] = {}
        self._loss_sum: Tensor | None = None
        self._losses = 0
        #: Losses (micro-batches) the step taken last had (``take``): more than one is gradient accumulation.
        self.micro_batches = 0
        self.false = torch.zeros((), dtype=torch.bool, device=device)
        self.true = ~self.false
        self.nan = torch.full((), math.nan, dtype=torch.float32, device=device)
        self._no_request = torch.zeros((), dtype=torch.float32, device=device)
        #: The data guard's flag over this step's micro-batches (``config.data.mode="skip"``), or None.
        self.bad_batch: Tensor | None = None
        #: The record's reductions (``_reductions``), and the rule keys and metric names they were built for.
        self._reductions_for: tuple[list[str], tuple[str, ...]] | None = None
        self._kept_reductions: dict[str, str] = {}

    def add_loss(self, loss: Tensor) -> None:
        """Add one micro-batch's loss (detached, on the device) to this optimizer step's loss.

        The step's loss is the sum of the losses backpropagated into its grads: with the usual
        ``loss / accumulate`` per micro-batch (Lightning, Accelerate and the HF Trainer divide for
        you) that is the mean loss of the whole batch.
        """
        value = loss.detach()
        if value.dtype != torch.float32 or value.dim() != 0:
            value = value.float().mean()  # a 0-d float32 loss is its own mean: kept as it is (detached)
        self._losses += 1
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value

    def add_bad_batch(self, bad: Tensor) -> None:
        """One micro-batch's data-guard flag (0-d device bool), OR-ed into the step's: any bad one skips it."""
        self.bad_batch = bad if self.bad_batch is None else self.bad_batch | bad

    def add_metric(self, name: str, value: Tensor | float, reduce: str, step: int) -> None:
        """Record a user metric for the step in flight (a 0-d device tensor; no sync). The same name
        twice in a step keeps the last value; a name first recorded after the first step is refused."""
        check_reduce(name, reduce)
        if not isinstance(value, Tensor):
            value = torch.as_tensor(value, dtype=torch.float32, device=self.device)
        if value.numel() != 1:
            raise ValueError(
                f"record({name!r}, ...): a metric is one number, got a tensor of shape {tuple(value.shape)}"
            )
        self.layout.declare(name, reduce, step)
        self._metrics[name] = value.detach().reshape(()).float().to(self.device)

    def take(self) -> tuple[Tensor | None, dict[str, Tensor], bool]:
        """(the step's loss or None, its metrics by name in layout order (NaN where a name was not
        recorded), whether the layout was fixed just now), and start the next step empty."""
        layout = self.layout
        fixed_now = not layout.fixed
        if fixed_now:
            layout.fix()
        loss, self._loss_sum = self._loss_sum, None
        self.micro_batches, self._losses = self._losses, 0
        if not layout.columns:  # no metric recorded in this run
            return loss, {}, fixed_now
        recorded, self._metrics = self._metrics, {}
        return loss, {name: recorded.get(name, self.nan) for name in layout.names}, fixed_now

    def or_nan(self, value: Tensor | None) -> Tensor:
        """``value``, or a NaN for a step with no loss."""
        return value if value is not None else self.nan

    def build_record(
        self,
        norms: NormResult,
        loss: Tensor | None,
        metrics: dict[str, Tensor],
        rules: RuleSet,
        step: int,
        force_skip: Tensor | None = None,
        ask: RecoveryAsk = NO_ASK,
        scaler_active: bool = False,
        observed: dict[str, Tensor] | None = None,
    ) -> StepRecord:
        """The step record, each value with its cross-rank reduction (agreed in one collective).

        A rule decides on this rank's values (skip-on-spike may see another loss than its peers);
        its flag is OR-ed across ranks with the rest. ``observed``: values the monitors measured for
        this step (router load...), which rules read by name but the record does not carry. ``ask``:
        what recovery asks of this step (``RecoveryAsk``).
        """
        grads_finite = norms.finite if norms.finite is not None else torch.isfinite(norms.total)
        loss_finite = torch.isfinite(loss) if loss is not None else self.true
        nan = self.nan
        values = {
            "grad_norm": norms.total,
            "grads_finite": grads_finite,
            "loss_finite": loss_finite,
            "loss": nan if loss is None else loss,
            "bad_batch": force_skip if force_skip is not None else self.false,
            "after_rollback": self.true if ask.skip_ahead else self.false,
            "never": self.false,  # a constant False for a rule that does not apply this step
        }
        if observed:
            values.update(observed)
        if metrics:
            values.update(metrics)
        view = StepValues(values, scaler_active=scaler_active, step=step, has_loss=loss is not None)
        put: dict[str, Tensor] = {
            "grad_norm": norms.total if norms.total.dim() == 0 else norms.total.reshape(()),
            "grads_finite": grads_finite,
            "loss_finite": loss_finite,
        }
        flags = []
        for rule, key, read in zip(rules.rules, rules.flag_keys, rules.reads, strict=True):
            read.clear()
            view.read = read  # the names this rule reads (its skip event reports their values)
            flag = rule.flag(view)
            if flag.__class__ is not Tensor or flag.dtype is not _BOOL or flag.ndim:
                flag = _checked_flag(rule, flag)  # what the built-in rules return needs no more checking
            put[key] = flag
            flags.append(flag)
        no = self._no_request
        put["request"] = no if ask.request == 0 else torch.full((), float(ask.request), device=self.device)
        put["health"] = no if ask.health == 0 else torch.full((), float(ask.health), device=self.device)
        for name, value in metrics.items():
            put[f"metric/{name}"] = value
        return StepRecord(put, self._reductions(rules, metrics), flags)

    def _reductions(self, rules: RuleSet, metrics: dict[str, Tensor]) -> dict[str, str]:
        """Each record value's cross-rank reduction, in record order: the same every step once the layout is
        fixed, so it is built once per rule set and metric names and kept."""
        names = tuple(metrics)
        kept = self._reductions_for
        if kept is None or kept[0] is not rules.flag_keys or kept[1] != names:
            reductions = {"grad_norm": "max", "grads_finite": "all", "loss_finite": "all"}
            reductions.update(dict.fromkeys(rules.flag_keys, "any"))
            reductions.update(request="max", health="max")
            reductions.update({f"metric/{name}": self.layout.columns[name] for name in names})
            self._reductions_for, self._kept_reductions = (rules.flag_keys, names), reductions
        return self._kept_reductions

    def rule_flags(self, record: StepRecord, agreed: dict[str, Tensor], rules: RuleSet) -> tuple[Tensor, Tensor]:
        """(each rule's flag on this rank, each rule's flag agreed across ranks), stacked in rule order."""
        if not record.flags:
            return self.false[None], self.false[None]
        here = torch.stack(record.flags)
        if agreed is record.values:  # one process (or sync_ranks off): nothing was agreed
            return here, here
        return here, torch.stack([agreed[key] for key in rules.flag_keys])


def _checked_flag(rule: SkipRule, flag: Any) -> Tensor:
    """``flag`` (what ``rule.flag`` returned) as a 0-d bool, or a TypeError naming the rule."""
    if not isinstance(flag, Tensor) or flag.numel() != 1:
        raise TypeError(
            f"skip rule {rule.name!r} ({type(rule).__name__}.flag) must return a 0-d bool tensor on the device, "
            f"got {type(flag).__name__}"
        )
    if flag.dim() != 0:
        flag = flag.reshape(())
    return flag if flag.dtype == torch.bool else flag.bool()
