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
from bisect import bisect_left, insort
from collections import deque
from typing import Any

#: 1.4826 x the median absolute value estimates a normal standard deviation; a one-step change holds two
#: steps' noise, hence the sqrt(2).
_MAD_TO_STD = 1.4826 / math.sqrt(2.0)


def _median_of_sorted(ordered: list[float]) -> float:
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


class MedianLevel:
    """The recent median of log(loss) against the median before it, in units of the loss's own noise.

    The window before and its one-step changes are kept sorted as they slide (one insertion and one removal
    a step), so a step costs a few list operations, not two sorts of the window."""

    def __init__(self, recent: int = 3, window: int = 50, min_window: int = 20, floor: float = 0.02) -> None:
        if recent < 1 or window < 2 or not 2 <= min_window <= window or not floor >= 0:
            raise ValueError(
                f"need recent >= 1, 2 <= min_window <= window and floor >= 0, got {recent}, {min_window}, "
                f"{window}, {floor}"
            )
        self.recent, self.window, self.min_window, self.floor = recent, window, min_window, floor
        self._recent: deque[float] = deque()
        self._before: deque[float] = deque()
        self._before_sorted: list[float] = []
        self._steps_sorted: list[float] = []  # |one-step change| inside the window before, sorted
        self.rise = 0.0
        self.noise = floor

    def update(self, loss: float) -> float:
        """Fold in one loss; the score (``rise / noise``; 0 until ``min_window`` steps precede the recent ones)."""
        if loss > 0 and math.isfinite(loss):
            self._push(math.log(loss))
        return self.score()

    def _push(self, y: float) -> None:
        if len(self._recent) == self.recent:
            moved = self._recent.popleft()
            if len(self._before) == self.window:
                old = self._before.popleft()
                del self._before_sorted[bisect_left(self._before_sorted, old)]
                gone = abs(self._before[0] - old)
                del self._steps_sorted[bisect_left(self._steps_sorted, gone)]
            if self._before:
                insort(self._steps_sorted, abs(moved - self._before[-1]))
            self._before.append(moved)
            insort(self._before_sorted, moved)
        self._recent.append(y)

    def score(self) -> float:
        """``rise / noise`` over the values held (0 while too few)."""
        if len(self._before) < self.min_window:
            self.rise, self.noise = 0.0, self.floor
            return 0.0
        self.noise = max(_MAD_TO_STD * _median_of_sorted(self._steps_sorted), self.floor)
        self.rise = _median_of_sorted(sorted(self._recent)) - _median_of_sorted(self._before_sorted)
        return self.rise / self.noise

    def state_dict(self) -> dict[str, Any]:
        """The log losses held, oldest first."""
        return {"values": [*self._before, *self._recent]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (more values than the window keeps only the newest)."""
        self._recent, self._before = deque(), deque()
        self._before_sorted, self._steps_sorted = [], []
        for y in list(state["values"])[-(self.recent + self.window) :]:
            self._push(float(y))
        self.score()
