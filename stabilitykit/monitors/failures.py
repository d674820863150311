"""What the monitors could not measure, and why: a measurement never breaks a step.

A hook whose measurement raises disables its module with one warning naming the module and the
reason; the step goes on. The reasons are kept (``reasons``) for the run summary.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from stabilitykit.caller import user_stacklevel


class Unmeasured:
    """Modules that are not measured, by name, with the reason (``reasons``)."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.reasons

    def failed(self, name: str, reason: str) -> None:
        """A measurement of ``name`` failed: it is left alone from now on, said once."""
        if name in self.reasons:
            return
        self.reasons[name] = reason
        warnings.warn(
            f"stabilitykit monitors: {name} is not measured: {reason}", RuntimeWarning, stacklevel=user_stacklevel()
        )

    def guarded(self, name: str, measure: Callable[[], None]) -> None:
        """Run one measurement; an exception disables ``name`` with one warning, the step goes on."""
        if name in self.reasons:
            return
        try:
            measure()
        except Exception as error:  # a monitor never breaks a step
            message = str(error).splitlines()[0][:200] if str(error) else ""
            self.failed(name, f"measuring it raised {type(error).__name__}: {message}")

    def note(self, name: str, reason: str) -> None:
        """Name a module that was not measured without a warning of its own (listed with the others)."""
        self.reasons.setdefault(name, reason)

    def report(self) -> None:
        """One warning listing every module that was not measured, and why (none: nothing said)."""
        if self.reasons:
            listed = "; ".join(f"{name}: {reason}" for name, reason in self.reasons.items())
            warnings.warn(
                f"stabilitykit monitors: not measured: {listed}", RuntimeWarning, stacklevel=user_stacklevel()
            )
