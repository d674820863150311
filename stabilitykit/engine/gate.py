"""The step gate: one optimizer step's skip, applied around the optimizer's own step.

``open`` before the optimizer step, ``close`` after it (or instead of it): a skip the host knows
means the step must not run; a skip still on the device is OR-ed into a fused optimizer's
``found_inf`` (GradScaler's own flag, when it set one, is kept and restored, so its bookkeeping
is untouched); QK-clip rescales after a taken step and drops a skipped step's maxima.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from stabilitykit.engine.decision import StepDecision
from stabilitykit.nn.qk_clip import QKClip


class StepGate:
    """One optimizer step's skip around the step (see ``StabilityEngine.open_step``)."""

    def __init__(self, decision: StepDecision, fused_optimizer: Any | None, qk_clip: QKClip | None) -> None:
        self.decision = decision
        #: The host knows the step is skipped: do not run the optimizer step.
        self.skip_now = decision.skipped_now
        self._qk_clip = qk_clip
        self._optimizer: Any | None = None
        self._previous: Tensor | None = None
        if decision.pending and fused_optimizer is not None:
            self._optimizer = fused_optimizer
            self._previous = previous = getattr(fused_optimizer, "found_inf", None)
            flag = decision.skip.to(torch.float32)
            fused_optimizer.found_inf = flag if previous is None else torch.maximum(previous, flag.to(previous))

    def close(self) -> None:
        """The step ran (or was skipped): restore ``found_inf``, then QK-clip (idempotent)."""
        optimizer, self._optimizer = self._optimizer, None
        if optimizer is not None:
            if self._previous is None:
                del optimizer.found_inf
            else:
                optimizer.found_inf = self._previous
        qk_clip, self._qk_clip = self._qk_clip, None
        if qk_clip is not None:
            skip = self.decision.skip
            qk_clip.apply(skip=torch.ones_like(skip) if self.skip_now else skip)
