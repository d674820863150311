"""The NaN tracing policy: when the tracer's hooks are on, and what names the source of a skipped step.

``NaNTraceConfig.mode`` decides which steps run with the tracer's hooks (``nan.NaNTracer``):
every step, every n-th, or the steps after a non-finite one. A compiled model is never hooked
between steps in mode ``"on_nonfinite"`` (hooks would break and recompile its graph): the bad
batch is replayed eagerly instead (``nan.replay_nonfinite``). A driver core asks this policy, once
per step, for the record that names where a skipped step went non-finite.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import Field
from torch import Tensor, nn

from stabilitykit.engine.decision import StepDecision
from stabilitykit.nan import NaNTracer, NonFiniteRecord, eager_if, is_compiled, replay_nonfinite
from stabilitykit.report import StepReport
from stabilitykit.section import Section


class NaNTraceConfig(Section):
    """Locating the first module whose forward output or input gradient went non-finite."""

    mode: Literal["off", "always", "every_n", "on_nonfinite"] = Field(
        "off",
        description=(
            "'always': hooks on every step (a Python call per module per step; on a compiled model "
            "one graph break per module); 'every_n': on every n-th step; 'on_nonfinite': no hooks "
            "until a step goes non-finite (the guard records the next steps; a compiled model is "
            "never hooked: the bad batch is replayed eagerly)."
        ),
    )
    every_n_steps: int = Field(100, ge=1, description="Cadence of mode 'every_n'.")
    replay: bool = Field(
        True,
        description=(
            "Mode 'on_nonfinite': replay a non-finite batch once with hooks and "
            "torch.autograd.detect_anomaly to name the module and the forward source line "
            "(the guard needs step(replay=...); costs one sync per step to learn of the skip)."
        ),
    )


#: Steps traced after a non-finite step in mode "on_nonfinite".
TRACE_AFTER_NONFINITE = 10


class NaNTracing:
    """One core's tracing: the tracer's hooks step by step, the replay, the newest source found."""

    def __init__(self, model: nn.Module | None, config: NaNTraceConfig, enabled: bool = True) -> None:
        self.model = model
        self.config = config
        self.enabled = enabled and model is not None and config.mode != "off"
        #: A compiled model is never hooked between steps in mode "on_nonfinite" (see the module docstring).
        self.compiled = model is not None and is_compiled(model)
        self._warned_no_replay = False
        self.tracer: NaNTracer | None = None
        #: Steps still traced after a non-finite one (mode "on_nonfinite"; saved with the core's state).
        self.left = 0
        #: Where the newest skipped step went non-finite, as far as the tracer or the replay saw.
        self.last_nonfinite: NonFiniteRecord | None = None

    def replays(self, replay: Callable[[], Tensor] | None) -> bool:
        """A skipped step will be replayed (the host must learn of the skip at once: one sync)."""
        return self.config.mode == "on_nonfinite" and self.config.replay and replay is not None

    def source_of(
        self, report: StepReport, replay: Callable[[], Tensor] | None, params: Sequence[Tensor]
    ) -> NonFiniteRecord | None:
        """Where a step the host knows was skipped went non-finite, or None.

        ``replay`` (given when ``replays`` said so) runs the batch again with hooks and anomaly mode,
        unless the step was a bad batch; then the tracer's hooks, when they were on for this step,
        name the first non-finite module.
        """
        found: NonFiniteRecord | None = None
        if replay is not None and report.reason != "bad_batch":
            found = self._replay(replay, params, report.step)
        elif self.compiled and self.config.mode == "on_nonfinite" and not self._warned_no_replay:
            self._warned_no_replay = True
            warnings.warn(
                "stabilitykit: a compiled model is not hooked between steps (hooks would break and recompile "
                "its graph), so nan_trace 'on_nonfinite' names the source of a non-finite step by replaying "
                "the batch eagerly: pass step(replay=...) and keep NaNTraceConfig(replay=True)",
                RuntimeWarning,
                stacklevel=4,
            )
        if self.tracer is not None and self.tracer.attached and self.tracer.first is not None:
            found = self.tracer.first
        if found is not None:
            self.last_nonfinite = found
        return found

    def _replay(self, replay: Callable[[], Tensor], params: Sequence[Tensor], step: int) -> NonFiniteRecord | None:
        """Re-run the bad batch with hooks and anomaly mode; a failing replay only warns.

        Diagnostics never stop training: the step is skipped either way.
        """
        assert self.model is not None
        try:
            with eager_if(self.compiled):  # the compiled model runs as plain eager code: no recompile
                return replay_nonfinite(self.model, replay, list(params), step=step)
        except Exception as exc:
            warnings.warn(
                f"stabilitykit: replaying the non-finite batch of step {step} failed: {exc!r}",
                RuntimeWarning,
                stacklevel=5,
            )
            return None

    def after_step(self, decision: StepDecision, next_step: int) -> None:
        """The step is over: hooks on or off for ``next_step``."""
        if self.config.mode == "on_nonfinite":
            self.left = TRACE_AFTER_NONFINITE if decision.skipped_now else max(0, self.left - 1)
        self.attach_for(next_step)

    def attach_for(self, step: int) -> None:
        """Attach or detach the tracer's hooks for the coming ``step`` (the tracing policy)."""
        if not self.enabled:
            return
        mode = self.config.mode
        if mode == "always":
            wanted = True
        elif mode == "every_n":
            wanted = step % self.config.every_n_steps == 0
        else:  # on_nonfinite: hooks for the next steps; never on a compiled model (the replay names it)
            wanted = self.left > 0 and not self.compiled
        if wanted:
            if self.tracer is None:
                assert self.model is not None
                self.tracer = NaNTracer(self.model)
            self.tracer.clear()
            self.tracer.attach()
            self.tracer.step = step
        elif self.tracer is not None:
            self.tracer.clear()
            self.tracer.detach()

    def detach(self) -> None:
        """Remove the tracer's hooks (training ended)."""
        if self.tracer is not None:
            self.tracer.detach()
