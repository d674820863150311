"""What a skip rule is: a name, a device flag computed from the step's values, and its event text.

A rule never reads the host: ``flag`` returns a 0-d device bool from this rank's values of the step
(``StepValues``), and the engine agrees the flags of every rule across ranks in the step's one
collective, so a step any rank flags is skipped on every rank. Where a rule sits in the rule set
decides its bit in the decision code and its precedence as the reason (earlier wins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


class StepValues(Mapping[str, Tensor]):
    """This rank's named device values of one step, read-only, as a rule sees them.

    Always present: ``grad_norm`` (pre-clip total, unscaled), ``grads_finite``, ``loss_finite``
    (0-d bools) and ``loss`` (NaN when no loss was recorded); plus every value recorded with
    ``driver.record(name, tensor)`` this step. Host facts: ``step``, ``has_loss`` (a loss was recorded)
    and ``scaler_active`` (a GradScaler scales this step's loss, so a non-finite grad is an overflow).
    """

    def __init__(
        self, values: Mapping[str, Tensor], scaler_active: bool = False, step: int = 0, has_loss: bool = True
    ) -> None:
        self._values = dict(values)
        self.scaler_active = scaler_active
        self.step = step
        self.has_loss = has_loss
        #: The names read so far (a rule's inputs: its skip event's details carry their values).
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Tensor:
        try:
            value = self._values[name]
        except KeyError:
            known = ", ".join(sorted(self._values))
            raise KeyError(f"no step value named {name!r} (this step has: {known})") from None
        self.read.add(name)
        return value

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


@dataclass
class SkipContext:
    """What the host knows of a skipped step when it writes the rule's event."""

    step: int
    where: str = ""  # " (first non-finite layer in backward order: ...)" or ""
    total: float = float("nan")  # the step's pre-clip grad norm
    details: dict[str, Any] = field(default_factory=dict)


class SkipRule:
    """One reason to skip a step. Subclass it and give an instance to any driver (``rules=[...]``).

    ``name`` is the reason (in ``StepReport.reason``, the ``skipped`` event and the JSONL row);
    ``flag(values)`` returns a 0-d device bool: True skips the step on every rank, exactly as a NaN
    step is skipped (weights, optimizer state, buffers and LR schedulers untouched). It must not read
    the host (no ``.item()``, ``bool()``, ``float()``): the step would sync every time.

    ``remote_reason``: the reason on a rank that did not raise the flag itself (default: ``name``).
    ``event_kind``: the kind of the event emitted with the ``skipped`` event. ``counts_toward_divergence``:
    a run of such skips reaching ``SkipConfig.max_consecutive`` is a divergence.
    """

    name: str = ""
    remote_reason: str | None = None
    event_kind: str = "rule_skip"
    counts_toward_divergence: bool = True

    def flag(self, values: StepValues) -> Tensor:
        """True (a 0-d device bool) when this step must be skipped."""
        raise NotImplementedError

    def message(self, ctx: SkipContext) -> str:
        """The text of this rule's event for a step it skipped."""
        return f"{type(self).__name__} flagged it{ctx.where}"

    def state_dict(self) -> dict[str, Any]:
        """State that must survive a resume (none by default)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict``'s state."""
        del state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
