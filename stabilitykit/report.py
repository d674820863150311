"""StepReport: what happened in one optimizer step. Fields may be 0-d device tensors.

Reading a tensor field (``float(report.grad_norm)``) is a host sync: the caller chooses when to
pay it. ``reason`` is free on logging steps and on steps where the host already decided; on
other steps it reads the packed reason code (one sync).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from stabilitykit.engine.decision import PENDING, Known, Outcome


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
    code: Tensor | None = None  # the decision code (0-d int32 on the device; see rules/registry.py)
    outcome: Outcome = PENDING  # Known(code, reason) once the host has read it
    decode: Callable[[int], str | None] | None = field(default=None, repr=False)  # the rule set's decoder
    values: dict[str, Tensor] = field(default_factory=dict)  # the step's recorded metrics, agreed (device)

    @property
    def clipped(self) -> Tensor:
        """0-d bool tensor: the grads were scaled down and the step was not skipped."""
        return (self.clip_coef < 1.0) & ~self.skipped

    def settle(self, code: int, reason: str | None) -> None:
        """The host has read this step's decision code (the engine calls it when it reads the journal)."""
        self.outcome = Known(code, reason)

    @property
    def reason(self) -> str | None:
        """Why the step was skipped: "nonfinite_loss", "nonfinite_grad", "fp16_overflow", "bad_batch",
        "spike", "after_rollback", "nonfinite_on_other_rank", a custom rule's name, or None (reads the
        device once unless the host already did)."""
        if not isinstance(self.outcome, Known):
            code = int(self.code) if self.code is not None else int(bool(self.skipped))
            self.settle(code, self.decode(code) if self.decode is not None else ("skipped" if code else None))
        assert isinstance(self.outcome, Known)
        return self.outcome.reason

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
