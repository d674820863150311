"""What one optimizer step collects before it is decided, and the step record built from it.

Between two optimizer steps a driver hands in the losses backpropagated into the grads (one per
micro-batch) and users record metrics (``sk.record``). At ``evaluate`` they are taken, and with the
step's norms they make the step record (``engine/step_record.py``): the norm, finiteness, each rule's
flag on this rank, the rollback request, a snapshot's health and the recorded metrics, each with its cross-rank
reduction. Everything stays on the device: nothing here syncs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from stabilitykit.engine.decision import NO_ASK, RecoveryAsk
from stabilitykit.engine.step_record import RecordLayout, StepRecord, check_reduce
from stabilitykit.grads import NormResult
from stabilitykit.rules import RuleSet, SkipRule, StepValues


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

    def add_loss(self, loss: Tensor) -> None:
        """Add one micro-batch's loss (detached, on the device) to this optimizer step's loss.

        The step's loss is the sum of the losses backpropagated into its grads: with the usual
        ``loss / accumulate`` per micro-batch (Lightning, Accelerate and the HF Trainer divide for
        you) that is the mean loss of the whole batch.
        """
        value = loss.detach().float().mean()
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
        fixed_now = not self.layout.fixed
        if fixed_now:
            self.layout.fix()
        loss, self._loss_sum = self._loss_sum, None
        self.micro_batches, self._losses = self._losses, 0
        recorded, self._metrics = self._metrics, {}
        return loss, {name: recorded.get(name, self.nan) for name in self.layout.names}, fixed_now

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
        values = {
            "grad_norm": norms.total,
            "grads_finite": grads_finite,
            "loss_finite": loss_finite,
            "loss": self.or_nan(loss),
            "bad_batch": force_skip if force_skip is not None else self.false,
            "after_rollback": self.true if ask.skip_ahead else self.false,
            "never": self.false,  # a constant False for a rule that does not apply this step
            **(observed or {}),
            **metrics,
        }
        view = StepValues(values, scaler_active=scaler_active, step=step, has_loss=loss is not None)
        record = StepRecord()
        record.put("grad_norm", norms.total, "max")
        record.put("grads_finite", grads_finite, "all")
        record.put("loss_finite", loss_finite, "all")
        for rule in rules:
            view.read.clear()
            record.put(f"rule/{rule.name}", rule_flag(rule, view), "any")
            rules.inputs[rule.name] = tuple(sorted(view.read))
        asked = self._no_request if ask.request == 0 else torch.full((), float(ask.request), device=self.device)
        record.put("request", asked, "max")
        judged = self._no_request if ask.health == 0 else torch.full((), float(ask.health), device=self.device)
        record.put("health", judged, "max")
        for name, value in metrics.items():
            record.put(f"metric/{name}", value, self.layout.columns[name])
        return record

    def rule_flags(self, record: StepRecord, agreed: dict[str, Tensor], rules: RuleSet) -> tuple[Tensor, Tensor]:
        """(each rule's flag on this rank, each rule's flag agreed across ranks), stacked in rule order."""
        if not len(rules):
            return self.false[None], self.false[None]
        here = torch.stack([record[f"rule/{r.name}"] for r in rules])
        if agreed is record.values:  # one process (or sync_ranks off): nothing was agreed
            return here, here
        return here, torch.stack([agreed[f"rule/{r.name}"] for r in rules])


def rule_flag(rule: SkipRule, view: StepValues) -> Tensor:
    """A rule's flag as a 0-d bool; a rule that fails or returns no 0-d tensor is named."""
    flag = rule.flag(view)
    if not isinstance(flag, Tensor) or flag.numel() != 1:
        raise TypeError(
            f"skip rule {rule.name!r} ({type(rule).__name__}.flag) must return a 0-d bool tensor on the device, "
            f"got {type(flag).__name__}"
        )
    if flag.dim() != 0:
        flag = flag.reshape(())
    return flag if flag.dtype == torch.bool else flag.bool()
