"""How a driver's step is computed again for a rerun (``config.rerun``): the batch's forward and the driver's
backward, with the step's running statistics put back and its grads dropped."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from stabilitykit.engine.step import StabilityEngine


def recompute_step(
    engine: StabilityEngine, replay: Callable[[], Tensor] | None, backward: Callable[[Tensor], None] | None
) -> Callable[[], None] | None:
    """How a rerun computes this step again: running statistics put back, grads dropped, the batch's
    forward (``replay``) and the driver's backward (``backward``, which records the loss) again.
    None when the driver gave either not: its flagged steps are not re-run."""
    if replay is None or backward is None:
        return None
    optimizer = engine.optimizer

    def recompute() -> None:
        engine.buffers.restore(True)
        optimizer.zero_grad(set_to_none=True)
        backward(replay())

    return recompute


def warn_no_rerun(has_backward: bool) -> None:
    """Rerun is on, but this driver's step cannot be computed again: said once."""
    how = (
        "pass guard.step(replay=...)"
        if has_backward
        else "this driver cannot re-run a step yet (the plain loop, Accelerate, Fabric, DeepSpeedGuard with "
        "guard.step(replay=...), Lightning's automatic optimization, the HF Trainer without DeepSpeed can)"
    )
    warnings.warn(
        f"stabilitykit: RerunConfig is on but a step's batch cannot be computed again ({how}): "
        "flagged steps are skipped without a rerun",
        RuntimeWarning,
        stacklevel=5,
    )
