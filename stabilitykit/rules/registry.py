"""The rule set: which rules a step runs, their bits in the decision code, and the one decoder.

The decision code of a step is one integer on the device (``engine/step_record.py`` keeps it in the
``code`` column): bit 0 says skipped; then one bit per rule for "this rank raised it", then one bit
per rule for "some rank raised it" (the flags agreed across ranks). A rule's bits and its precedence
as the reason come from its place in the set: built-in rules first (``RuleSet.builtin``), users'
rules after them. ``decode`` is the only reader of a code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from stabilitykit.rules.base import SkipRule

#: Bit 0 of a decision code: the step was skipped.
SKIP = 1
#: The code travels in a float32 column (exact integers up to 2**24): 1 + 2 bits per rule.
MAX_RULES = 11


@dataclass(frozen=True)
class Verdict:
    """A decoded decision code."""

    skipped: bool
    reason: str | None  # None: taken
    rule: SkipRule | None  # the rule the reason comes from
    here: bool  # this rank raised the rule itself (False: another rank did)


_TAKEN = Verdict(False, None, None, False)


class RuleSet:
    """An ordered set of skip rules (earlier rules win as the reason)."""

    def __init__(self, rules: Sequence[SkipRule]) -> None:
        names = [getattr(r, "name", None) for r in rules]
        for rule in rules:
            if not isinstance(rule, SkipRule):
                raise TypeError(
                    f"a skip rule must subclass stabilitykit.SkipRule, got {type(rule).__name__} ({rule!r})"
                )
            if not rule.name or not isinstance(rule.name, str):
                raise ValueError(f"skip rule {type(rule).__name__} has no name (set the class attribute `name`)")
            if names.count(rule.name) > 1:
                raise ValueError(f"two skip rules are named {rule.name!r}: each rule needs its own name")
        if len(rules) > MAX_RULES:
            raise ValueError(f"at most {MAX_RULES} skip rules fit a decision code, got {len(rules)}: {names}")
        self.rules = list(rules)
        #: Each rule's name in the step record (``rule/<name>``), in rule order.
        self.flag_keys = [f"rule/{r.name}" for r in self.rules]
        #: The names of the step values each rule read when it last decided, one set per rule in rule order
        #: (host names, no device work; filled by the engine as each rule decides).
        self.reads: list[set[str]] = [set() for _ in self.rules]
        self._here_bits: Tensor | None = None
        self._agreed_bits: Tensor | None = None
        self._both_bits: Tensor | None = None
        self._no_bits: Tensor | None = None

    @property
    def inputs(self) -> dict[str, tuple[str, ...]]:
        """The step values each rule read when it last decided, by rule name: what its skip event reports."""
        return {rule.name: tuple(sorted(read)) for rule, read in zip(self.rules, self.reads, strict=True) if read}

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rules)

    def names(self) -> list[str]:
        """The rules' names, in precedence order."""
        return [r.name for r in self.rules]

    def by_name(self, name: str) -> SkipRule | None:
        """The rule named ``name``, or None."""
        return next((r for r in self.rules if r.name == name), None)

    def code(self, here: Tensor, agreed: Tensor) -> tuple[Tensor, Tensor]:
        """The decision code from this rank's flags and the agreed ones (1-d bool tensors, one per rule), as a
        0-d int32 device tensor, and whether the step is skipped (0-d bool): no host sync.

        Each raised flag adds its bit (``2 << i``, all above bit 0), so the bits sum to more than 0
        exactly when some rule fired, and bit 0 (``SKIP``) is that comparison: four small ops per step.
        """
        n = len(self.rules)
        if n == 0:
            code = torch.zeros((), dtype=torch.int32, device=here.device)
            return code, code > 0
        if self._here_bits is None or self._here_bits.device != here.device:
            self._here_bits = torch.tensor([2 << i for i in range(n)], dtype=torch.int32, device=here.device)
            self._agreed_bits = torch.tensor([2 << (n + i) for i in range(n)], dtype=torch.int32, device=here.device)
            self._both_bits = self._here_bits + self._agreed_bits
            self._no_bits = torch.zeros_like(self._here_bits)
        assert self._agreed_bits is not None and self._both_bits is not None and self._no_bits is not None
        if agreed is here:  # one process: this rank's flags are the agreed ones
            bits = torch.where(here, self._both_bits, self._no_bits).sum(dtype=torch.int32)
            skip = bits > 0
            return bits + skip, skip  # SKIP where any rule fired (int32 + bool stays int32)
        skip = agreed.any()
        bits = (here.int() * self._here_bits).sum() + (agreed.int() * self._agreed_bits).sum() + SKIP
        return torch.where(skip, bits, torch.zeros_like(bits)).to(torch.int32), skip

    def constant(self, name: str, here: bool = True) -> int:
        """The code of a step skipped by rule ``name`` alone, known on the host (no device value)."""
        i = self.names().index(name)
        n = len(self.rules)
        return SKIP | (2 << (n + i)) | ((2 << i) if here else 0)

    def raised_anywhere(self, code: int) -> list[str]:
        """The rules some rank raised in a decision code (the same list on every rank: the agreed bits)."""
        n = len(self.rules)
        return [rule.name for i, rule in enumerate(self.rules) if code & (2 << (n + i))]

    def decode(self, code: int) -> Verdict:
        """What a decision code says: skipped or not, and why.

        Rules are read in precedence order: the first one this rank raised, or that some rank raised
        and whose reason is the same on every rank (no ``remote_reason``), names the reason; else the
        first rule another rank raised, by its ``remote_reason``.
        """
        if not code & SKIP:
            return _TAKEN
        n = len(self.rules)
        for i, rule in enumerate(self.rules):
            if code & (2 << i):
                return Verdict(True, rule.name, rule, True)
            if code & (2 << (n + i)) and rule.remote_reason is None:
                return Verdict(True, rule.name, rule, False)
        for i, rule in enumerate(self.rules):
            if code & (2 << (n + i)):
                return Verdict(True, rule.remote_reason or rule.name, rule, False)
        return Verdict(True, "skipped", None, False)
