"""StepReport: what happened in one optimizer step. Fields may be 0-d device tensors.

Reading a tensor field (``float(report.grad_norm)``) is a host sync: the caller chooses when to
pay it. ``reason`` is free on logging steps and on steps where the host already decided; on
other steps it reads the packed reason code (one sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["StepReport", "pack_code", "reason_from_code"]

# Reason codes packed into one integer so a single read tells the host everything.
SKIP, BAD_LOSS, BAD_GRAD, OVERFLOW, REMOTE, BAD_BATCH, SPIKE = 1, 2, 4, 8, 16, 32, 64


def pack_code(
    skipped: bool,
    grad_finite: bool,
    loss_finite: bool,
    scaler_active: bool,
    bad_batch: bool = False,
    spike: bool = False,
) -> int:
    """The packed reason code of one step from what the host read of it (0 when not skipped)."""
    if not skipped:
        return 0
    if bad_batch:
        return SKIP | BAD_BATCH
    if spike and grad_finite and loss_finite:
        return SKIP | SPIKE
    code = SKIP
    if not grad_finite:
        code |= BAD_GRAD | (OVERFLOW if scaler_active else 0)
    if not loss_finite:
        code |= BAD_LOSS
    return code if code != SKIP else code | REMOTE  # skipped, yet finite here: another rank saw it


def reason_from_code(code: int) -> str | None:
    """Why a step was skipped, from its packed code: None when it was not skipped."""
    if not code & SKIP:
        return None
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


@dataclass
class StepReport:
    """One optimizer step as the engine saw it.

    ``step`` is the 0-based index of the optimizer step (skipped steps included). ``grad_norm`` is
    the pre-clip total norm (unscaled), ``clip_coef`` the factor applied to the grads (1 when not
    clipped), ``skipped`` a 0-d bool tensor, ``loss`` the mean recorded loss.
    """

    step: int
    grad_norm: Tensor
    clip_coef: Tensor
    skipped: Tensor
    loss: Tensor | None = None
    layer_norms: Tensor | None = None
    layer_names: list[str] = field(default_factory=list)
    scaler_active: bool = False
    bad_batch: Tensor | None = None  # the data guard's device flag, when it checked this step's batch
    spike: Tensor | None = None  # the skip-on-spike rule's device flag, when it is on
    _code_value: int | None = None

    @property
    def clipped(self) -> Tensor:
        """0-d bool tensor: the grads were scaled down and the step was not skipped."""
        return (self.clip_coef < 1.0) & ~self.skipped

    @property
    def reason(self) -> str | None:
        """Why the step was skipped: "nonfinite_loss", "nonfinite_grad", "fp16_overflow", "bad_batch",
        "spike", "nonfinite_on_other_rank", or None (reads the device once unless the engine already did)."""
        if self._code_value is None:
            self._code_value = self._read_code()
        return reason_from_code(self._code_value)

    def _read_code(self) -> int:
        loss = self.loss if self.loss is not None else self.grad_norm.new_zeros(())
        flags = [self.skipped.float(), torch.isfinite(self.grad_norm).float(), torch.isfinite(loss).float()]
        flags.append(self.bad_batch.float() if self.bad_batch is not None else flags[0].new_zeros(()))
        flags.append(self.spike.float() if self.spike is not None else flags[0].new_zeros(()))
        values = torch.stack(flags).tolist()
        return pack_code(
            values[0] > 0.5, values[1] > 0.5, values[2] > 0.5, self.scaler_active, values[3] > 0.5, values[4] > 0.5
        )

    @property
    def layers(self) -> dict[str, Tensor]:
        """Per-layer pre-clip grad norms as 0-d tensors (empty when per-layer norms are off)."""
        if self.layer_norms is None:
            return {}
        return {name: self.layer_norms[i] for i, name in enumerate(self.layer_names)}

    def to_dict(self) -> dict[str, Any]:
        """Host values of every field (syncs once per tensor field: for logs and tests, not hot loops)."""
        return {
            "step": self.step,
            "grad_norm": float(self.grad_norm),
            "clip_coef": float(self.clip_coef),
            "skipped": bool(self.skipped),
            "clipped": bool(self.clipped),
            "reason": self.reason,
            "loss": float(self.loss) if self.loss is not None else None,
        }
