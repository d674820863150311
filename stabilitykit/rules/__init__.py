"""Skip rules: one file per reason to skip a step, and the rule set that orders them.

A custom rule is one class (``SkipRule``) given to any driver with ``rules=[...]``; see
``docs/guides/extending.md``.
"""

from __future__ import annotations

from stabilitykit.rules.base import SkipContext, SkipRule, StepValues
from stabilitykit.rules.registry import RuleSet
from stabilitykit.rules.registry import Verdict as Verdict

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
