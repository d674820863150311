"""One step's decision: one code, made on the device, agreed across ranks, decoded in one function.

What happened to an optimizer step is a single integer, the *decision code*: 0 when the step was
taken, else ``SKIP`` plus the reason bits below. ``decide`` computes it on the device from the
step's agreed verdict inputs (``distributed.agree_step``), so it costs no host sync; the journal
stores it in its ``code`` column; ``reason_from_code`` is the only decoder.

Whether the host knows a step's code yet is explicit: ``Known(code)`` once the host has read it
(a logging step, a non-fused optimizer that must skip on the host, a driver that asked), or
``PENDING`` while it lives on the device only (a fused optimizer skips through ``found_inf``; the
next journal read tells the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AFTER_ROLLBACK",
    "BAD_BATCH",
    "BAD_GRAD",
    "BAD_LOSS",
    "OVERFLOW",
    "PENDING",
    "REMOTE",
    "SKIP",
    "SPIKE",
    "TAKEN",
    "Known",
    "Outcome",
    "Pending",
    "StepDecision",
    "decide",
    "reason_from_code",
]

#: The bits of a decision code. ``REMOTE``: skipped although everything was finite on this rank.
#: ``AFTER_ROLLBACK``: one of the batches a rollback skips ahead (``RecoveryConfig.skip_after``),
#: decided on the host from the configuration, so the same on every rank.
SKIP, BAD_LOSS, BAD_GRAD, OVERFLOW, REMOTE, BAD_BATCH, SPIKE, AFTER_ROLLBACK = 1, 2, 4, 8, 16, 32, 64, 128


def decide(
    can_skip_nonfinite: bool,
    grads_finite_here: Tensor,
    loss_finite_here: Tensor,
    grads_finite: Tensor,
    loss_finite: Tensor,
    bad_batch: Tensor,
    spike: Tensor,
    scaler_active: bool,
) -> Tensor:
    """The decision code of one step, as a 0-d int32 device tensor (no host sync).

    ``*_here``: this rank's own view (for the reason); the others are agreed across ranks, so the
    skip bit is the same on every rank. Precedence of reasons: a bad batch, then a spike on finite
    values, then what was non-finite here (``OVERFLOW`` with a GradScaler), else ``REMOTE``.
    """
    all_finite = grads_finite & loss_finite
    skip = bad_batch | spike
    if can_skip_nonfinite:
        skip = skip | ~all_finite
    grad_bad, loss_bad = ~grads_finite_here, ~loss_finite_here
    nonfinite = grad_bad.int() * (BAD_GRAD | (OVERFLOW if scaler_active else 0)) + loss_bad.int() * BAD_LOSS
    nonfinite = torch.where(grad_bad | loss_bad, nonfinite, torch.full_like(nonfinite, REMOTE))
    reason = torch.where(
        bad_batch, torch.full_like(nonfinite, BAD_BATCH), torch.where(spike & all_finite, SPIKE, nonfinite)
    )
    return torch.where(skip, SKIP + reason, torch.zeros_like(reason)).to(torch.int32)


def reason_from_code(code: int) -> str | None:
    """Why a step was skipped, from its decision code: None when it was taken."""
    if not code & SKIP:
        return None
    if code & AFTER_ROLLBACK:
        return "after_rollback"
    if code & BAD_BATCH:
        return "bad_batch"
    if code & SPIKE:
        return "spike"
    if code & OVERFLOW:
        return "fp16_overflow"
    if code & BAD_LOSS:
        return "nonfinite_loss"
    if code & REMOTE:
        return "nonfinite_on_other_rank"
    return "nonfinite_grad"


@dataclass(frozen=True)
class Known:
    """The host has read this step's decision code: the skip is applied and reported at once."""

    code: int

    @property
    def skipped(self) -> bool:
        """The step is skipped."""
        return bool(self.code & SKIP)

    @property
    def reason(self) -> str | None:
        """Why it is skipped (None: taken)."""
        return reason_from_code(self.code)


@dataclass(frozen=True)
class Pending:
    """The decision is on the device only: a fused optimizer skips through ``found_inf``."""


#: The one ``Pending`` value.
PENDING = Pending()
#: A step that can never be skipped (skipping off, no data guard, no skip-on-spike): known, taken.
TAKEN = Known(0)

Outcome = Known | Pending


@dataclass
class StepDecision:
    """What ``StabilityEngine.evaluate`` decided for one optimizer step, and what the host knows of it."""

    report: Any  # the step's StepReport
    skip: Tensor  # 0-d bool on the device, identical on every rank
    code: Tensor  # the decision code, 0-d int32 on the device, see ``decide``
    outcome: Outcome = PENDING
    logging: bool = False
    rows: list[Any] = field(default_factory=list)  # journal rows the host read during this step
    loss_scale: float | None = None
    module_metrics: dict[str, float] = field(default_factory=dict)
    signals: dict[str, float] = field(default_factory=dict)  # the module metrics the spike detector watches
    update_metrics: dict[str, float] = field(default_factory=dict)  # update ratio and weight norms (logging steps)
    divergence: Any = None  # a run of skips that reached max_consecutive, when ``finish`` did not raise it

    @property
    def skipped_now(self) -> bool:
        """The host knows this step is skipped: the optimizer step is not called, the scheduler held."""
        return isinstance(self.outcome, Known) and self.outcome.skipped

    @property
    def pending(self) -> bool:
        """The decision is on the device only (a fused optimizer skips through ``found_inf``)."""
        return isinstance(self.outcome, Pending)

    def settle(self, code: int) -> None:
        """The host has read this step's code."""
        self.outcome = Known(code)
        self.report.settle(code)
