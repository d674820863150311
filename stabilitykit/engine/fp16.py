"""fp16 diagnosis: warn when GradScaler skips too often or the loss scale collapses (host floats)."""

from __future__ import annotations

from collections import deque
from typing import Any

from pydantic import Field

from stabilitykit.events import Event
from stabilitykit.section import Section


class Fp16Config(Section):
    """fp16 overflow diagnosis: warn when GradScaler skips too often or the loss scale collapses."""

    window: int = Field(200, ge=10, description="Steps over which the share of overflow-skipped steps is measured.")
    max_overflow_share: float = Field(
        0.05, gt=0, le=1, description="Share of overflow-skipped steps in the window that triggers the warning."
    )
    scale_floor: float = Field(1.0, gt=0, description="A loss scale below this triggers the warning.")


class Fp16Monitor:
    """Tracks overflow-skipped steps over a window and turns a bad rate or scale into one event."""

    def __init__(self, config: Fp16Config) -> None:
        self.config = config
        self.overflow_steps: deque[int] = deque()
        self.warned_at = -(10**9)

    def overflow(self, step: int) -> None:
        """GradScaler skipped ``step`` for an fp16 overflow."""
        self.overflow_steps.append(step)

    def rate(self, step: int) -> float:
        """Share of the last ``window`` steps that GradScaler skipped for overflow."""
        window = self.config.window
        while self.overflow_steps and self.overflow_steps[0] <= step - window:
            self.overflow_steps.popleft()
        return len(self.overflow_steps) / max(1, min(window, step + 1))

    def check(self, step: int, scale: float, where: str = "") -> list[Event]:
        """An ``fp16_warning`` (at most once per window) when overflows are frequent or the scale is tiny."""
        cfg = self.config
        rate = self.rate(step)
        if step - self.warned_at < cfg.window:
            return []
        problems = []
        if rate > cfg.max_overflow_share and len(self.overflow_steps) >= 2:
            problems.append(f"GradScaler skipped {rate:.0%} of the last {min(cfg.window, step + 1)} steps")
        if scale < cfg.scale_floor:
            problems.append(f"the loss scale fell to {scale:g} (floor {cfg.scale_floor:g})")
        if not problems:
            return []
        self.warned_at = step
        message = (
            f"fp16 is unstable here: {' and '.join(problems)}{where}. Train in bf16 where the device supports it "
            "(sk.select_precision()), or lower the learning rate."
        )
        return [
            Event("fp16_warning", step, message, {"overflow_rate": rate, "loss_scale": scale, "recommendation": "bf16"})
        ]

    def state_dict(self) -> dict[str, Any]:
        """The overflow steps in the window and when it last warned."""
        return {"overflow_steps": list(self.overflow_steps), "warned_at": self.warned_at}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.overflow_steps = deque(int(s) for s in state["overflow_steps"])
        self.warned_at = int(state["warned_at"])
