"""Skip rules: one file per reason to skip a step, and the rule set that orders them.

A custom rule is one class (``SkipRule``) given to any driver with ``rules=[...]``; see
``docs/guides/extending.md``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues
from stabilitykit.rules.registry import RuleSet
from stabilitykit.rules.registry import Verdict as Verdict
from stabilitykit.section import Section


class SkipConfig(Section):
    """Skip-the-batch: which steps are skipped and when training is declared diverged."""

    nonfinite: bool = Field(True, description="Skip the step when the grad norm or loss is NaN/Inf.")
    max_consecutive: int | None = Field(
        10,
        ge=1,
        description="Raise TrainingDivergedError after this many skipped steps in a row (None: never).",
    )
    sync_ranks: bool = Field(
        True,
        description="Under torch.distributed, all-reduce the skip flag so every rank decides alike.",
    )
    restore_buffers: Literal["auto", "all", "none"] = Field(
        "auto",
        description=(
            "Buffers a skipped step puts back as they were before its forward passes: 'auto' the running "
            "statistics of modules with track_running_stats (BatchNorm, InstanceNorm), 'all' every buffer, "
            "'none' nothing."
        ),
    )
    spike: bool = Field(
        False,
        description=(
            "Skip-on-spike: also skip a finite step whose grad norm (or loss) is an outlier, decided on "
            "the device with no host sync (stabilitykit.spike_skip.SpikeSkipRule)."
        ),
    )
    spike_z: float = Field(6.0, gt=0, description="Skip-on-spike: log-space z-score above which a step is skipped.")
    spike_rate: float = Field(0.05, gt=0, lt=1, description="Skip-on-spike: EMA rate of the log-space statistics.")
    spike_warmup_steps: int = Field(50, ge=1, description="Skip-on-spike: finite steps before any step is skipped.")
    spike_on_loss: bool = Field(True, description="Skip-on-spike: test the loss as well as the grad norm.")


__all__ = ["RuleSet", "SkipContext", "SkipRule", "StepValues"]


def builtin_rules(config, device) -> list[SkipRule]:  # type: ignore[no-untyped-def]
    """The built-in rules a configuration turns on, in precedence order (``config``: a ``StabilityConfig``)."""
    from stabilitykit.rules.after_rollback import AfterRollback
    from stabilitykit.rules.bad_batch import BadBatch
    from stabilitykit.rules.fp16_overflow import Fp16Overflow
    from stabilitykit.rules.nonfinite_grad import NonFiniteGrad
    from stabilitykit.rules.nonfinite_loss import NonFiniteLoss
    from stabilitykit.rules.spike import Spike

    rules: list[SkipRule] = [AfterRollback(), BadBatch()]
    scfg = config.skip
    if scfg.nonfinite:
        rules += [NonFiniteLoss(), Fp16Overflow(), NonFiniteGrad()]
    if scfg.spike:
        rules.append(Spike(scfg.spike_z, scfg.spike_rate, scfg.spike_warmup_steps, device, scfg.spike_on_loss))
    return rules
