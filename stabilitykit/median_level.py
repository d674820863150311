"""A rise of the loss that holds: the median of its last few steps against the median before, in its own noise.

The one-step-ahead detector (``spikes.PredictiveDetector``) scores each step against a prediction that
follows the loss: a climb over a few dozen noisy steps (an output head whose LR ramps away) moves that
prediction with it, and a single noisy step never reaches a z-score that pages on a loss whose steps
move 25% apart. What a person calls a spike there is a rise that *holds*: several steps in a row
well above where the loss was. ``MedianLevel`` reads exactly that, from the past only:

* ``rise``: the median of log(loss) over the last ``recent`` steps minus its median over the ``window``
  steps before them (a median of three ignores one noisy step either way);
* ``noise``: the robust standard deviation of the one-step changes of log(loss) inside that window
  (1.4826 x their median absolute value / sqrt(2)), never below ``floor``: the loss's own per-step noise;
* ``score``: ``rise / noise``. The alert rule (``SpikeConfig.loss_median_alert``) pages when the score
  reaches its threshold and the rise is at least ``min_rise`` (log units), once per excursion.

Non-finite and non-positive losses are never ingested. The state is the window itself (at most
``recent + window`` floats).
"""

from __future__ import annotations

import math
from collections import deque
from itertools import pairwise
from typing import Any

#: 1.4826 x the median absolute value estimates a normal standard deviation; a one-step change holds two
#: steps' noise, hence the sqrt(2).
_MAD_TO_STD = 1.4826 / math.sqrt(2.0)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class MedianLevel:
    """The recent median of log(loss) against the median before it, in units of the loss's own noise."""

    def __init__(self, recent: int = 3, window: int = 50, min_window: int = 20, floor: float = 0.02) -> None:
        if recent < 1 or window < 2 or not 2 <= min_window <= window or not floor >= 0:
            raise ValueError(
                f"need recent >= 1, 2 <= min_window <= window and floor >= 0, got {recent}, {min_window}, "
                f"{window}, {floor}"
            )
        self.recent, self.window, self.min_window, self.floor = recent, window, min_window, floor
        self.values: deque[float] = deque(maxlen=recent + window)
        self.rise = 0.0
        self.noise = floor

    def update(self, loss: float) -> float:
        """Fold in one loss; the score (``rise / noise``; 0 until ``min_window`` steps precede the recent ones)."""
        if loss > 0 and math.isfinite(loss):
            self.values.append(math.log(loss))
        return self.score()

    def score(self) -> float:
        """``rise / noise`` over the values held (0 while too few)."""
        values = list(self.values)
        before = values[: -self.recent]
        if len(before) < self.min_window:
            self.rise, self.noise = 0.0, self.floor
            return 0.0
        steps = [abs(b - a) for a, b in pairwise(before)]
        self.noise = max(_MAD_TO_STD * _median(steps), self.floor)
        self.rise = _median(values[-self.recent :]) - _median(before)
        return self.rise / self.noise

    def state_dict(self) -> dict[str, Any]:
        """The log losses held, oldest first."""
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (more values than the window keeps only the newest)."""
        self.values = deque((float(v) for v in state["values"]), maxlen=self.recent + self.window)
        self.score()
