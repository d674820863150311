"""Huge but finite gradients: re-measure a step whose fp32 norm overflowed, in fp64.

A tensor whose sum of squares passes fp32's range (a norm above ~1.8e19, one element of 1e38)
makes the fp32 total non-finite although every grad is finite. The fp64 norm cannot overflow;
with it the clip brings the grads back into range, as it would for any large norm. This runs only
on a skipped step whose decision the host already read, so ordinary steps pay nothing. Per-tensor
clipping (AdaGC) keeps such a step skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from stabilitykit.engine.clipping import ClipStrategy
from stabilitykit.engine.step_record import StepRecord
from stabilitykit.grads import CLIP_EPS, GradNormPlan, apply_clip_coefficient


@dataclass
class Remeasured:
    """An overflowed step that is finite after all: its true norms and the clip applied."""

    total: Tensor  # fp32 (inf only above fp32's largest value)
    layer_norms: Tensor | None
    coef: Tensor
    threshold: Tensor


def remeasure_overflow(
    plan: GradNormPlan,
    clip: ClipStrategy,
    grouped: list[list[Tensor]],
    grad_scale: Tensor | None,
    loss: Tensor | None,
    force_skip: Tensor | None,
    sync_ranks: bool,
) -> Remeasured | None:
    """Measure in fp64; if every grad and the loss are finite (on every rank), clip and return the
    numbers, else None (the skip stands). Syncs: the finite flags are read on the host (a rare path)."""
    norms, _ = plan.compute(grad_scale, dtype=torch.float64)
    grads_finite = norms.finite if norms.finite is not None else torch.isfinite(norms.total)
    loss_finite = torch.isfinite(loss) if loss is not None else torch.ones_like(grads_finite)
    bad_batch = force_skip if force_skip is not None else torch.zeros_like(grads_finite)
    record = StepRecord()
    record.put("grad_norm", norms.total, "max")
    record.put("grads_finite", grads_finite, "all")
    record.put("loss_finite", loss_finite, "all")
    record.put("bad_batch", bad_batch, "any")
    # every rank is here (the caller's branch was taken from agreed values)
    agreed = record.agree(enabled=sync_ranks)
    total, finite, loss_finite, bad_batch = (
        agreed["grad_norm"].to(norms.total.dtype),
        agreed["grads_finite"],
        agreed["loss_finite"],
        agreed["bad_batch"],
    )
    if bool(~finite | ~loss_finite | bad_batch):
        return None  # a NaN or Inf is really there
    total32 = total.clamp(max=torch.finfo(torch.float32).max).float()
    threshold, active = clip.threshold(total32, finite)
    coef = torch.where(active, torch.clamp(threshold.double() / (total + CLIP_EPS), max=1.0).float(), 1.0)
    apply_clip_coefficient(grouped, coef)
    layers = norms.layer_norms.float() if norms.layer_norms is not None else None
    return Remeasured(total.float(), layers, coef, threshold)
