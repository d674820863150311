"""``RerunConfig``: which flagged steps are computed again, what counts as the same, where verdicts go."""

from __future__ import annotations

from pydantic import Field

from stabilitykit.section import Section

#: Skip reasons that say the data is bad or the step was never to be trained on: never re-run.
NOT_RERUN = ("bad_batch", "after_rollback", "fp16_overflow")


class RerunConfig(Section):
    """Re-run a flagged step to tell the data or the model (reproducible) from the machine (transient).

    Given, it is on (``StabilityConfig(rerun=RerunConfig())``). It needs the driver to be able to
    compute the step's batch again: ``guard.step(replay=...)`` in a plain loop.
    """

    on: list[str] = Field(
        default_factory=lambda: ["nonfinite_loss", "nonfinite_grad", "spike"],
        min_length=1,
        description=(
            "Skip reasons (rule names; your own rules' names too) whose steps are re-run. A step skipped "
            "because of the data guard, a rollback or a GradScaler overflow is never re-run."
        ),
    )
    rtol: float | None = Field(
        None,
        ge=0,
        description=(
            "How far the recomputed loss and grad norm may be from the first pass's and still be the same. "
            "None: 0 on the CPU (bitwise; two NaNs are the same), 1e-4 on GPUs, where reductions may "
            "not be deterministic (see the rerun guide for the determinism settings)."
        ),
    )
    max_transient: int | None = Field(
        3,
        ge=1,
        description=(
            "Raise TransientFaultError when one rank has had this many transient faults (None: never; each one warns)."
        ),
    )
    read_every_step: bool = Field(
        False,
        description=(
            "Read every step's decision so that every flagged step is re-run. Off: rerun adds no host sync, and "
            "a step is re-run where the host reads its decision anyway: every step of a non-fused optimizer "
            "(which reads to skip), logging steps of a fused one (a fused optimizer's step flagged between "
            "logging steps is skipped on the device without a rerun). On: one host read per step with a fused "
            "optimizer."
        ),
    )
    host_rng: bool = Field(
        False,
        description=(
            "Also take and put back Python's random and numpy's global generators for a rerun (about 0.2 ms per "
            "step). Off: torch's generators only (CPU and CUDA, a few microseconds per step), what a model's "
            "forward draws from (dropout, sampling); turn it on if your forward draws from random or numpy."
        ),
    )
    record_path: str | None = Field(
        None,
        description=(
            "A JSON lines file of verdicts (step, batch, verdict, rank, host); a run started with the same "
            "path skips the steps judged reproducible in it (a resume does not train on a known-bad batch "
            "again). None: kept in memory only."
        ),
    )
