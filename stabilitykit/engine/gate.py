"""The step gate: one optimizer step's skip, applied around the optimizer's own step.

``open`` before the optimizer step, ``close`` after it (or instead of it): a skip the host knows
means the step must not run; a skip still on the device is OR-ed into a fused optimizer's
``found_inf`` (GradScaler's own flag, when it set one, is kept and restored, so its bookkeeping
is untouched); QK-clip rescales after a taken step and drops a skipped step's maxima.

``found_inf`` stops a fused step's update but not the optimizer state the step creates, so the
steps that would create state are decided on the host instead (``NewStateCheck``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from stabilitykit.engine.decision import Known, Pending, StepDecision
from stabilitykit.nn.qk_clip import QKClip
from stabilitykit.rules.registry import SKIP


class StepGate:
    """One optimizer step's skip around the step (opened around each routed step, ``drivers/routing.py``)."""

    def __init__(self, decision: StepDecision, fused_optimizer: Any | None, qk_clip: QKClip | None) -> None:
        self.decision = decision
        outcome = decision.outcome
        #: The host knows the step is skipped: do not run the optimizer step.
        self.skip_now = isinstance(outcome, Known) and bool(outcome.code & SKIP)  # ``decision.skipped_now``
        self._qk_clip = qk_clip
        self._optimizer: Any | None = None
        self._previous: Tensor | None = None
        if isinstance(outcome, Pending) and fused_optimizer is not None:  # ``decision.pending``
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


def gated(
    decision: StepDecision, fused_optimizer: Any | None, qk_clip: QKClip | None, step_fn: Callable[[], Any]
) -> Any:
    """``step_fn()`` (the optimizer step) inside the step's gate; a skip the host knows does not run it."""
    gate = StepGate(decision, fused_optimizer, qk_clip)
    try:
        return None if gate.skip_now else step_fn()
    finally:
        gate.close()


class NewStateCheck:
    """Whether a fused optimizer's step would create optimizer state (a first momentum buffer).

    A skipped step must not leave such state behind, and ``found_inf`` does not stop it, so while
    some parameter with a grad has no state yet the host decides the step (one sync; usually the
    first step only). Checked again only when the state or the set of parameters with grads
    changes. An optimizer that creates no state (SGD without momentum) is settled after one
    applied step left the state as it was.
    """

    def __init__(self) -> None:
        self._settled: tuple[int, tuple[bool, ...]] | None = None  # the key the check last found nothing new at
        self._before: tuple[int, tuple[bool, ...]] | None = None  # the key of a host-decided step

    def creates_state(self, optimizer: Any, params: Sequence[Tensor], present: tuple[bool, ...]) -> bool:
        """The coming step would create state for some parameter in ``params`` (``present``: which have grads)."""
        state = optimizer.state
        key = (len(state), present)
        if key == self._settled:
            return False
        creates = any(p.grad is not None and not state.get(p) for p in params)
        if not creates:
            self._settled = key
        self._before = key if creates else None
        return creates

    def after_step(self, decision: StepDecision, optimizer: Any, present: tuple[bool, ...]) -> None:
        """After a host-decided step: an applied step that created no optimizer state settles the check."""
        before, self._before = self._before, None
        if before is None or decision.pending or decision.skipped_now:
            return
        after = (len(optimizer.state), present)
        if after == before:  # applied and created nothing: it never will, so the check is settled
            self._settled = after
