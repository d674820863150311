"""Robust spike detectors and an OLMo-comparable spike score, in host floats.

The engine keeps each step's grad norm and loss on the device in a small journal and copies it
to the host once per logging step (the copy it makes anyway). The detectors run over those
rows there, in plain Python floats: a one-step-ahead baseline of log(x) (an exponential moving
average) and a robust scale of its residuals (an EMA of absolute residuals, with residuals
clamped to a few scales so one spike cannot inflate it). The score of a step is its residual
divided by that scale: a robust z-score. Non-finite and non-positive values are never ingested.
This costs nothing on the step path and scores every step, not only logging steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stabilitykit.events import Event

if TYPE_CHECKING:
    from stabilitykit.config import SpikeConfig

__all__ = ["RobustDetector", "SpikeMonitor", "SpikeScore"]

#: |residual| EMA * 1.2533 estimates the standard deviation of a normal residual.
_ABS_TO_STD = 1.2533
#: Residuals are clamped to this many scales before they update the baseline (outlier rejection).
_CLAMP_SCALES = 3.0
#: Floor of the residual scale in log space (0.1% relative change), so a flat series cannot alarm.
_MIN_STD = 1e-3


class RobustDetector:
    """One-step-ahead robust z-scores of log(x) for ``size`` positive series scored side by side."""

    def __init__(self, alpha: float = 0.1, warmup_steps: int = 20, size: int = 1) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
        self.alpha = alpha
        self.warmup_steps = warmup_steps
        self.mean = [0.0] * size
        self.abs_dev = [0.0] * size
        self.count = [0] * size

    @property
    def size(self) -> int:
        """How many series this detector scores."""
        return len(self.mean)

    def update(self, values: Sequence[float]) -> list[float]:
        """Score each value against its baseline, then fold it in; z is 0 in warmup and for bad values."""
        scores: list[float] = []
        alpha = self.alpha
        for i, x in enumerate(values):
            if not (x > 0 and math.isfinite(x)):
                scores.append(0.0)
                continue
            log_x = math.log(x)
            count = self.count[i]
            if count == 0:
                self.mean[i] = log_x
                self.count[i] = 1
                scores.append(0.0)
                continue
            resid = log_x - self.mean[i]
            std = self.abs_dev[i] * _ABS_TO_STD + _MIN_STD
            if count >= self.warmup_steps:
                scores.append(resid / std)
                bound = _CLAMP_SCALES * std
                resid = max(-bound, min(bound, resid))
            else:
                scores.append(0.0)
            self.mean[i] += alpha * resid
            self.abs_dev[i] = (1 - alpha) * self.abs_dev[i] + alpha * abs(resid)
            self.count[i] = count + 1
        return scores

    def state_dict(self) -> dict[str, Any]:
        """Baselines, scales and counts (plain lists)."""
        return {"mean": list(self.mean), "abs_dev": list(self.abs_dev), "count": list(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the sizes must match."""
        if len(state["mean"]) != self.size:
            raise ValueError(f"detector state has {len(state['mean'])} series, this detector scores {self.size}")
        self.mean = [float(v) for v in state["mean"]]
        self.abs_dev = [float(v) for v in state["abs_dev"]]
        self.count = [int(v) for v in state["count"]]


class SpikeScore:
    """OLMo's spike score: the share of the last ``window`` values beyond ``sigma`` std of the window mean."""

    def __init__(self, window: int = 128, sigma: float = 6.0) -> None:
        self.window = window
        self.sigma = sigma
        self.values: deque[float] = deque(maxlen=window)

    def update(self, value: float) -> None:
        """Add one finite value (non-finite ones are left out)."""
        if math.isfinite(value):
            self.values.append(value)

    def is_spike(self, value: float) -> bool:
        """True when ``value`` lies beyond ``sigma`` std of the current window (before it is added)."""
        n = len(self.values)
        if n < 2 or not math.isfinite(value):
            return False
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)
        return abs(value - mean) > self.sigma * std

    def score(self) -> float:
        """Share of the window's values that are spikes against the window itself (0 when empty)."""
        n = len(self.values)
        if n < 2:
            return 0.0
        mean = sum(self.values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)
        if std == 0:
            return 0.0
        return sum(1 for v in self.values if abs(v - mean) > self.sigma * std) / n

    def state_dict(self) -> dict[str, Any]:
        """The window's values."""
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.values = deque((float(v) for v in state["values"]), maxlen=self.window)


class SpikeMonitor:
    """Early warning over journal rows: scores each step on the host and returns its events.

    The engine's ledger calls ``update`` exactly once per optimizer step (in step order, skipped
    steps included) with host floats, and ``metrics()`` on logging steps. Everything it keeps
    round-trips through ``state_dict``.
    """

    def __init__(self, config: SpikeConfig, layer_names: Sequence[str]) -> None:
        self.config = config
        self.layer_names = list(layer_names)
        self.detector = RobustDetector(config.alpha, config.warmup_steps, size=2)  # [grad norm, loss]
        per_layer = config.per_layer and bool(self.layer_names)
        self.layer_detector = (
            RobustDetector(config.alpha, config.warmup_steps, size=len(self.layer_names)) if per_layer else None
        )
        self.spike_score = SpikeScore(config.score_window, config.score_sigma)
        self.last_z: tuple[float, float] = (0.0, 0.0)
        self.max_z_grad_recent = 0.0
        self.max_z_loss_recent = 0.0

    def update(
        self, step: int, grad_norm: float, loss: float | None, layer_norms: Sequence[float] | None, skipped: bool
    ) -> list[Event]:
        """Score one step; the events it raises (``spike_warning``, ``loss_spike``)."""
        cfg = self.config
        z_grad, z_loss = self.detector.update([grad_norm, math.nan if loss is None else loss])
        self.last_z = (z_grad, z_loss)
        self.max_z_grad_recent = max(self.max_z_grad_recent, z_grad)
        self.max_z_loss_recent = max(self.max_z_loss_recent, z_loss)
        self.spike_score.update(grad_norm)
        leading: str | None = None
        if self.layer_detector is not None and layer_norms is not None:
            layer_z = self.layer_detector.update(layer_norms)
            if layer_z and max(layer_z) >= cfg.z_warning:
                leading = self.layer_names[max(range(len(layer_z)), key=layer_z.__getitem__)]
        events: list[Event] = []
        if z_grad >= cfg.z_warning:
            where = f"; largest layer z-score: {leading}" if leading else ""
            message = f"grad-norm z-score {z_grad:.1f} at step {step} (warning at {cfg.z_warning}){where}"
            events.append(
                Event("spike_warning", step, message, {"z": z_grad, "grad_norm": grad_norm, "layer": leading})
            )
        if z_loss >= cfg.z_spike:
            message = f"loss z-score {z_loss:.1f} at step {step} (spike at {cfg.z_spike})"
            events.append(Event("loss_spike", step, message, {"z": z_loss, "loss": loss}))
        return events

    def metrics(self) -> dict[str, float]:
        """The logging step's spike metrics (names without the metric prefix); starts a new interval."""
        out = {
            "spikes/z_grad_norm": self.last_z[0],
            "spikes/z_loss": self.last_z[1],
            "spikes/max_z_grad_norm": self.max_z_grad_recent,
            "spikes/score": self.spike_score.score(),
        }
        self.max_z_grad_recent = self.max_z_loss_recent = 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        """Detector baselines, the score window and the interval maxima (plain values)."""
        return {
            "detector": self.detector.state_dict(),
            "layer_detector": self.layer_detector.state_dict() if self.layer_detector is not None else None,
            "spike_score": self.spike_score.state_dict(),
            "last_z": list(self.last_z),
            "recent": [self.max_z_grad_recent, self.max_z_loss_recent],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.detector.load_state_dict(state["detector"])
        if self.layer_detector is not None and state.get("layer_detector") is not None:
            self.layer_detector.load_state_dict(state["layer_detector"])
        self.spike_score.load_state_dict(state["spike_score"])
        z = state.get("last_z", (0.0, 0.0))
        self.last_z = (float(z[0]), float(z[1]))
        recent = state.get("recent", (0.0, 0.0))
        self.max_z_grad_recent, self.max_z_loss_recent = float(recent[0]), float(recent[1])
