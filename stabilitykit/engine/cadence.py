"""A framework's logging cadence: log when the optimizer step *ends* on one of its logging steps.

The HF Trainer logs after global steps ``n, 2n, ...`` and Lightning when ``(global_step + 1) % n == 0``
(0-based), so both log after the engine's 0-based steps ``n - 1, 2n - 1, ...``; the default engine
logs at ``0, n, 2n, ...``. Drivers of those frameworks build this engine so our metrics share rows
with the framework's own.
"""

from __future__ import annotations

from stabilitykit.engine.step import StabilityEngine


class TrainerAlignedEngine(StabilityEngine):
    """The engine, logging at the framework's logging steps (``log_first_step``: also the first step)."""

    log_first_step = False

    def is_logging_step(self, step: int | None = None) -> bool:
        """True when the step ending with global step ``step + 1`` is one the framework logs."""
        s = self.step if step is None else step
        every = self.config.log_every_n_steps or 1
        return (s + 1) % every == 0 or (self.log_first_step and s == 0)
