"""A grad-norm look held until the loss follows: one hard batch is a number in the summary, not an event.

A mini-batch whose gradient is 2.5-100x the usual (a hard batch, a top-2 router sending one batch to
a cold expert, Muon's orthogonalised step meeting an odd batch) raises the grad norm's z-score for
one step while the loss does not move. On the early-warning corpus no such look ever came before an
onset, and they were most of the looks on healthy steps of the held-out families. ``PendingLook``
holds a grad-norm look for ``steps`` steps: it is raised (as a ``spike_warning``, at the step the
loss followed, its details saying where the jump was) once the loss's z-score reaches ``z_loss``;
otherwise it is dropped and counted (``unconfirmed``: ``spikes/grad_jumps_unconfirmed``).
"""

from __future__ import annotations

import math
from typing import Any

from stabilitykit.events import Event


class PendingLook:
    """At most one grad-norm look waiting for the loss, and the count of those it never saw followed."""

    def __init__(self, steps: int, z_loss: float) -> None:
        if steps < 0 or not z_loss > 0:
            raise ValueError(f"need steps >= 0 and z_loss > 0, got {steps}, {z_loss}")
        self.steps, self.z_loss = steps, z_loss
        self.held: Event | None = None
        self.unconfirmed = 0

    def offer(self, look: Event) -> None:
        """Hold ``look`` (a newer look replaces one still waiting, which counts as unconfirmed)."""
        if self.held is not None:
            self.unconfirmed += 1
        self.held = look

    def update(self, step: int, z_loss: float) -> Event | None:
        """The held look, raised at ``step`` when the loss's z-score reaches ``z_loss`` within ``steps`` steps of the
        jump; None otherwise (a look past its window is dropped and counted)."""
        look = self.held
        if look is None:
            return None
        if math.isfinite(z_loss) and z_loss >= self.z_loss:
            self.held = None
            followed = f"; the loss followed at step {step} (z {z_loss:.1f})" if step != look.step else ""
            details = {**look.details, "jump_step": look.step, "z_loss": z_loss}
            return Event(look.kind, step, look.message + followed, details)
        if step - look.step >= self.steps:
            self.held = None
            self.unconfirmed += 1
        return None

    def state_dict(self) -> dict[str, Any]:
        """The look held (kind, step, message, details) or None, and the unconfirmed count."""
        held = None if self.held is None else self.held.to_dict()
        return {"held": held, "unconfirmed": self.unconfirmed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        held = state["held"]
        self.unconfirmed = int(state["unconfirmed"])
        if held is None:
            self.held = None
            return
        details = {k: v for k, v in held.items() if k not in ("kind", "step", "message")}
        self.held = Event(str(held["kind"]), int(held["step"]), str(held["message"]), details)
