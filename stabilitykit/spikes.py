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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

from stabilitykit.events import Event
from stabilitykit.look_confirm import PendingLook
from stabilitykit.median_level import MedianLevel
from stabilitykit.precursors import GRAD_NORM, LAYER, LOSS, SignalKind, lead_text, module_of
from stabilitykit.precursors import kind_of as precursor_kind
from stabilitykit.section import Section


class SpikeConfig(Section):
    """Early warning on the loss and the total grad norm (robust one-step-ahead baseline)."""

    enabled: bool = Field(True, description="Run the spike detectors.")
    warmup_steps: int = Field(20, ge=1, description="Steps that only collect statistics.")
    baseline_rate: float = Field(0.1, gt=0, lt=1, description="EMA rate of the log-space baseline.")
    scale_rate: float = Field(
        0.1,
        gt=0,
        lt=1,
        description=(
            "EMA rate of the residual scale (debiased). Slower (0.03) gives less noisy z-scores on "
            "stationary noise; 0.1 follows noise that changes during training (better on real runs)."
        ),
    )
    scale_floor: float = Field(
        0.02,
        ge=0,
        description=(
            "Smallest residual scale of the loss and the grad norm, in log units (0.02: a 2% change). The "
            "scale follows the series' own noise; on a flat loss that noise shrinks to almost nothing and a 3% "
            "bump would score as a many-sigma jump. Chosen on the tuning families of the early-warning corpus."
        ),
    )
    warning_scale_floor: float = Field(
        0.15,
        ge=0,
        description=(
            "Smallest residual scale of the total grad norm when it is scored for a look (spike_warning), in "
            "log units: a grad-norm look (z_warning 6) needs a jump of at least exp(6 x 0.15) = 2.5x its "
            "prediction. One hard batch doubles a mini-batch's grad norm while the loss does not follow; on "
            "the tuning families of the early-warning corpus the loss's floor (0.02) looked 9 times on healthy "
            "steps for such jumps (1.9-3x), 0.15 four times, and no grad-norm look came before an onset at "
            "either. Alerts score the grad norm on scale_floor."
        ),
    )
    z_warning: float = Field(
        6.0,
        gt=0,
        description=(
            "Grad-norm (or layer) z-score that raises a spike_warning (a look, not a page). 6: at 4 the grad "
            "norm looked 51 times in 7,848 healthy steps of the early-warning corpus's tuning families (6.5 "
            "per 1,000) and warned before 2 of 13 onsets; at 6 it looks 4 times (with warning_scale_floor) and "
            "warned before none: the grad norm moves with the loss, not ahead of it."
        ),
    )
    z_spike: float = Field(6.0, gt=0, description="Robust z-score of the loss that is a loss spike.")
    z_alert: float = Field(
        5.0,
        gt=0,
        description="With no loss given: the grad-norm z-score that raises a spike_alert (the rare event that pages).",
    )
    z_joint: float = Field(
        3.0, gt=0, description="With a loss: grad norm and loss both at this z-score raise a spike_alert."
    )
    joint_confirm: bool = Field(
        True,
        description=(
            "A joint jump (grad norm and loss both at z_joint) pages one step later, and only if the loss is "
            "still at z_joint then: a hard batch raises both for one step and the loss falls back at the next "
            "(all five joint pages on healthy steps of the early-warning corpus's tuning families did, each "
            "to 0.73-0.83 of its value), while a spike that matters holds. A loss jump of z_loss_alert pages "
            "at once either way. What it gives up: a one-step spike that falls back at once (on the byte-GPT "
            "instability runs, whose truth counts those, loss-spike recall 0.66 -> 0.54, and 0.69 with "
            "loss_median_alert); False pages at the jump."
        ),
    )
    z_loss_alert: float = Field(6.0, gt=0, description="Loss z-score that raises a spike_alert.")
    alert_cooldown: int = Field(
        20,
        ge=1,
        description=(
            "Steps after a spike_alert during which no other is raised (after a loss-drift alert, a jump of "
            "the loss or grad norm still alerts)."
        ),
    )
    loss_drift_alert: float | None = Field(
        4.0,
        gt=0,
        description=(
            "Sequential test (CUSUM) on the loss: a spike_alert when the running sum of (loss z-score - 1), "
            "each term clamped to 4, reaches this; catches a loss that climbs over several steps. None: off. "
            "4 was chosen on the tuning runs of the monitors benchmark; lower is more recall for more "
            "alerts: see the spike guide's operating points."
        ),
    )
    loss_level_alert: float | None = Field(
        2.0,
        gt=1,
        description=(
            "A spike_alert when the loss's recent level (an EMA over about ten steps) reaches this many times "
            "the best level the run has held; it scores from the fifth step on (inside warmup_steps too) and its "
            "reference never follows a climb, so a blow-up that starts early or lasts is alerted once per "
            "excursion (re-armed when the level falls back under the square root of this). None: off."
        ),
    )
    loss_median_alert: float | None = Field(
        3.0,
        gt=0,
        description=(
            "A spike_alert when the median of the loss's last 3 steps stands this many of its own per-step noise "
            "units above its median over the 50 steps before (the noise: the robust std of the one-step changes "
            "of log(loss) there), by at least loss_median_rise: a rise that holds, which a noisy loss's one-step "
            "z-scores and the CUSUM (whose prediction follows a slow climb) miss. Once per excursion (re-armed "
            "when the recent median is back under the median before). None: off. On the early-warning corpus's "
            "tuning families 3.0-3.25 alert 12 of 13 onsets at no page (10 with it off); 2.75 pages once, 3.5 "
            "alerts 10: see the spike guide."
        ),
    )
    loss_median_rise: float = Field(
        0.262,
        gt=0,
        description=(
            "Smallest rise (log units: 0.262 is 1.3x, the line both ground truths draw) of the recent median over "
            "the median before for loss_median_alert to page: a flat loss has almost no noise, and a few percent "
            "are not a spike. At 0.2 (1.22x) the byte-GPT runs with no event paged 6 times in 6,300 healthy steps "
            "(warm restarts, 1.22-1.3x for a few steps); at 0.262 once; the corpus's tuning families alert 12 of "
            "13 onsets at 0.15-0.3 alike."
        ),
    )
    trend_warning: float = Field(
        1.4,
        gt=0,
        description=(
            "Precursor signals (max attention logit, log Z, update size): warn when the recent level "
            "exceeds the long-run level by this much in log units (1.4: about 4x). On the early-warning "
            "corpus's tuning families, 0.7 (about 2x, ungated) looked 38 times in 7,848 healthy steps and "
            "warned before 3 of 13 onsets; 1.4 with trend_while_stalled looks 8 times (with warning_cooldown) "
            "and warned before 1. A signal warns again only after its growth fell under half of this."
        ),
    )
    trend_warmup: int = Field(
        100,
        ge=1,
        description=(
            "Steps a precursor signal is watched before its trend scores (at least warmup_steps): early in "
            "training every signal grows as the model learns."
        ),
    )
    trend_while_stalled: float | None = Field(
        0.01,
        description=(
            "Precursor trends warn only while the loss has stopped falling: its recent level (EMA over about 10 "
            "steps) no more than this far (log units) below its level over about 30 steps. Early training "
            "grows every signal while the loss falls fast; before an instability they grow while it stalls "
            "(0.01 lets a loss that falls slowly, as late in training, through). None: no gate."
        ),
    )
    trend_rearm: float = Field(
        0.5,
        gt=0,
        le=1,
        description=(
            "A precursor that warned warns again only after its growth fell under this share of trend_warning "
            "(hysteresis; 1: as soon as it is under trend_warning). A signal hovering at the threshold crossed "
            "it again and again: BERT's attention logits on the early-warning corpus looked twice two steps apart."
        ),
    )
    warning_cooldown: int = Field(
        100,
        ge=1,
        description=(
            "Steps after a spike_warning during which no other is raised: a look asks a person to open the "
            "run's charts, and a second signal crossing a few steps later (another layer's attention logits) "
            "tells them nothing new. On the tuning families of the early-warning corpus, 1.9 looks per 1,000 "
            "healthy steps without it, 1.15 with 100; no onset warned before or alerted was lost."
        ),
    )
    look_confirm_steps: int | None = Field(
        3,
        ge=0,
        description=(
            "With a loss: a grad-norm look (spike_warning on the total grad norm) is raised only once the loss's "
            "z-score reaches z_joint within this many steps of the jump (at the step it does, naming the jump's "
            "step); a jump the loss never follows is a hard batch, counted in spikes/grad_jumps_unconfirmed and "
            "not raised. No grad-norm look came before an onset on the early-warning corpus, tuning or held out. "
            "None: every grad-norm look is raised at its jump."
        ),
    )
    per_layer: bool = Field(
        False, description="Also score each layer's grad norm (names the layer that leads a spike)."
    )
    layer_share_trend: bool = Field(
        False,
        description=(
            "Also watch each layer's share of the total grad norm as a precursor (``grad_share/<layer>``, every "
            "step, from the per-layer grad norms the engine already measures): a spike_warning when one layer's "
            "share grows trend_warning over its long-run level. Off: on the tuning families of the early-warning "
            "corpus it added 2 looks on healthy steps and warned before no onset (see the spike guide)."
        ),
    )
    score_window: int = Field(128, ge=2, description="Window of the OLMo-style spike score (steps).")
    score_sigma: float = Field(6.0, gt=0, description="Std multiple beyond which the spike score counts a step.")

    @model_validator(mode="after")
    def _ordered(self) -> SpikeConfig:
        if self.z_spike < self.z_warning:
            raise ValueError("z_spike must be >= z_warning")
        return self


#: |residual| EMA * 1.2533 estimates the standard deviation of a normal residual.
_ABS_TO_STD = 1.2533
#: Residuals are clamped to this many scales before they update the baseline (outlier rejection).
_CLAMP_SCALES = 3.0
#: Floor of the residual scale in log space (0.1% relative change), so a flat series cannot alarm.
_MIN_STD = 1e-3
#: Loss-drift CUSUM: the reference z-score subtracted per step and the clamp of each step's term.
_DRIFT_REFERENCE = 1.0
_DRIFT_CLAMP = 4.0
#: The ``rule`` of a spike_alert raised by the loss-drift test (``SpikeConfig.loss_drift_alert``).
DRIFT_RULE = "loss (climbing over several steps)"
#: The ``rule`` of a spike_alert raised by the loss-level test (``SpikeConfig.loss_level_alert``).
LEVEL_RULE = "loss (far above its best level)"
#: The ``rule`` of a spike_alert raised by the median test (``SpikeConfig.loss_median_alert``).
MEDIAN_RULE = "loss (its recent median far above the median before)"
#: Loss-level test: losses seen before it scores (the EMA needs a few values), and the rate at which
#: the best level relaxes upward while the loss is near it (a run whose loss settles higher for good).
#: The loss trend behind ``trend_while_stalled``: an EMA over about 10 steps against one over about 30. On
#: the corpus's tuning families, against 100 steps: 1.9 looks per 1k healthy steps instead of 1.2, and 3 of
#: 11 onsets warned before the loss moved instead of none; against 10 steps: 4.3 looks per 1k, 4 of 11.
_LOSS_TREND_FAST = 0.1
_LOSS_TREND_SLOW = 0.03
_LEVEL_MIN_STEPS = 5
_LEVEL_RELAX = 0.002


def _check_series(state: Mapping[str, Any], keys: Sequence[str], size: int) -> None:
    """A detector state holds every key, each a list of one value per scored series (``size``)."""
    for key in keys:
        values = state.get(key)
        if not isinstance(values, list | tuple):
            raise ValueError(f"detector state needs {key!r} as a list of {size} values, got {type(values).__name__}")
        if len(values) != size:
            raise ValueError(f"detector state {key!r} has {len(values)} series, this detector scores {size}")


class PredictiveDetector:
    """One-step-ahead robust z-scores of log(x) that model autocorrelation, for ``size`` series.

    Grad-norm series are autocorrelated (AR(1)-like in log space, phi up to 0.95): a plain EMA
    baseline mistakes slow wander for noise, so its residual scale widens and 3x jumps drown.
    This detector predicts ``level + phi * (last - level)``, with ``level`` an EMA of log(x) and
    ``phi`` the lag-1 autocorrelation of the deviations from it (estimated online, in [0, 0.98]).
    The residual scale is a debiased EMA of |residual| (x1.2533, rate ``scale_rate``, by default
    ``rate``), never below ``floor`` (per series, log units: a relative change); once warm, residuals are clamped to
    ``clamp`` scales before they update anything, and a clamped value is what ``last`` keeps, so
    one spike moves neither the baseline nor the scale nor the next prediction. NaN, Inf and
    non-positive values are never ingested: the detector is never blind after one.
    """

    def __init__(
        self,
        rate: float = 0.1,
        warmup_steps: int = 20,
        size: int = 1,
        slow_rate: float = 0.02,
        clamp: float = 3.0,
        scale_rate: float | None = None,
        floor: Sequence[float] | float = 0.0,
    ) -> None:
        scale_rate = rate if scale_rate is None else scale_rate
        if not 0 < rate < 1 or not 0 < slow_rate < 1 or not 0 < scale_rate < 1:
            raise ValueError(
                f"rate, slow_rate and scale_rate must be in (0, 1), got {rate!r}, {slow_rate!r}, {scale_rate!r}"
            )
        self.rate = rate
        self.slow_rate = slow_rate
        self.scale_rate = scale_rate
        self.clamp = clamp
        self.warmup_steps = warmup_steps
        self.level = [0.0] * size
        self.last = [0.0] * size
        self.abs_dev = [0.0] * size
        self.cov = [0.0] * size  # EMA of d_t * d_{t-1}, d = clean log value - level
        self.var = [0.0] * size  # EMA of d_t ** 2
        self.count = [0] * size
        floors = [float(floor)] * size if isinstance(floor, int | float) else [float(f) for f in floor]
        if len(floors) != size or any(f < 0 or not math.isfinite(f) for f in floors):
            raise ValueError(f"floor must be one finite value >= 0 or {size} of them, got {floor!r}")
        #: Smallest residual scale per series (log units, so relative to the level): a series whose noise
        #: shrinks to nothing (a flat loss) would otherwise score a 3% bump as a many-sigma jump.
        self.floor = floors

    @property
    def size(self) -> int:
        """How many series this detector scores."""
        return len(self.level)

    def phi(self, i: int = 0) -> float:
        """The current lag-1 autocorrelation estimate of series ``i``."""
        return min(0.98, max(0.0, self.cov[i] / self.var[i])) if self.var[i] > 0 else 0.0

    def scale(self, i: int = 0) -> float:
        """The current one-step-ahead residual scale of series ``i`` (log space, std units).

        The EMA of |residual| starts at 0, so it is divided by ``1 - (1 - scale_rate) ** n`` (n residuals
        seen), as Adam debiases its moments: the scale is unbiased from the first steps on.
        """
        seen = self.count[i] - 1
        debias = 1.0 - (1.0 - self.scale_rate) ** seen if seen > 0 else 1.0
        return max(self.abs_dev[i] / debias * _ABS_TO_STD, self.floor[i]) + _MIN_STD

    def update(self, values: Sequence[float]) -> list[float]:
        """Score each value against its prediction, then fold it in; z is 0 in warmup and for bad values."""
        scores: list[float] = []
        for i, x in enumerate(values):
            if not (x > 0 and math.isfinite(x)):
                scores.append(0.0)
                continue
            y = math.log(x)
            count = self.count[i]
            if count == 0:
                self.level[i] = self.last[i] = y
                self.count[i] = 1
                scores.append(0.0)
                continue
            level, last = self.level[i], self.last[i]
            phi = self.phi(i)
            pred = level + phi * (last - level)
            resid = y - pred
            std = self.scale(i)
            if count >= self.warmup_steps:
                scores.append(resid / std)
                bound = self.clamp * std
                resid = max(-bound, min(bound, resid))
            else:
                scores.append(0.0)
            clean = pred + resid
            a = self.rate
            b = self.scale_rate
            self.abs_dev[i] = (1 - b) * self.abs_dev[i] + b * abs(resid)
            d_prev, d_now = last - level, clean - level
            s = self.slow_rate
            self.cov[i] = (1 - s) * self.cov[i] + s * d_now * d_prev
            self.var[i] = (1 - s) * self.var[i] + s * d_now * d_now
            self.level[i] = level + a * (clean - level)
            self.last[i] = clean
            self.count[i] = count + 1
        return scores

    def state_dict(self) -> dict[str, Any]:
        """Levels, last clean values, scales, autocorrelation moments and counts (plain lists)."""
        return {
            "level": list(self.level),
            "last": list(self.last),
            "abs_dev": list(self.abs_dev),
            "cov": list(self.cov),
            "var": list(self.var),
            "count": list(self.count),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the sizes must match."""
        _check_series(state, ("level", "last", "abs_dev", "cov", "var", "count"), self.size)
        for key in ("level", "last", "abs_dev", "cov", "var"):
            setattr(self, key, [float(v) for v in state[key]])
        self.count = [int(v) for v in state["count"]]


class LevelReference:
    """The loss's recent level against the best level the run has held, in log units.

    A z-score (``PredictiveDetector``) measures a value against its own recent past: a blow-up that
    starts before the detector is warm is never scored, and one that lasts becomes the baseline it is
    measured against. This reference does neither. ``level`` is an EMA of log(loss) (rate ``rate``,
    about ten steps: one bad batch barely moves it); ``best`` is the lowest level held so far, so it
    never follows a climb. While the level sits within ``freeze_above`` of the best, the best relaxes
    upward at rate ``relax`` (a run whose loss settles higher for good, e.g. a new data mixture, is
    not alarmed for ever); above it, the best is frozen. ``update`` returns ``level - best`` (0 for
    the first ``min_steps`` values and for a non-finite or non-positive value, never ingested).
    """

    def __init__(
        self, rate: float = 0.1, relax: float = _LEVEL_RELAX, freeze_above: float = 0.35, min_steps: int = 5
    ) -> None:
        if not 0 < rate < 1 or not 0 <= relax < 1:
            raise ValueError(f"rate must be in (0, 1) and relax in [0, 1), got {rate!r}, {relax!r}")
        self.rate, self.relax, self.freeze_above, self.min_steps = rate, relax, freeze_above, min_steps
        self.level = 0.0
        self.best = math.inf
        self.count = 0

    def update(self, x: float) -> float:
        """Fold in one loss; how far (log units) the recent level sits above the best level held."""
        if not (x > 0 and math.isfinite(x)):
            return self.excess()
        y = math.log(x)
        self.level = y if self.count == 0 else self.level + self.rate * (y - self.level)
        self.count += 1
        if self.level < self.best:
            self.best = self.level
        elif self.level - self.best < self.freeze_above:
            self.best += self.relax * (self.level - self.best)
        return self.excess()

    def excess(self) -> float:
        """``level - best`` in log units (0 before ``min_steps`` values)."""
        return self.level - self.best if self.count >= self.min_steps else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The level, the best level and the count."""
        return {"level": self.level, "best": self.best if math.isfinite(self.best) else None, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        best = state["best"]
        self.level, self.count = float(state["level"]), int(state["count"])
        self.best = math.inf if best is None else float(best)


class TrendDetector:
    """Slow growth of a positive signal: the fast EMA of log(x) against a slow one, in log units.

    For precursors that drift rather than jump (max attention logit, |log Z|, update size): the
    score is ``fast - slow`` (log of the ratio of the recent level to the long-run level).
    Non-finite and non-positive values are never ingested. With ``step`` given, the rates and the
    warmup are per optimizer step, so a signal measured on logging steps only (every n steps)
    keeps the same time constants as one measured every step.
    """

    def __init__(self, fast: float = 0.1, slow: float = 0.01, warmup_steps: int = 50) -> None:
        self.fast_rate, self.slow_rate, self.warmup_steps = fast, slow, warmup_steps
        self.fast = self.slow = 0.0
        self.count = 0
        self.first_step: int | None = None
        self.last_step: int | None = None

    def update(self, x: float, step: int | None = None) -> float:
        """Fold in one value; the log growth of the recent level over the long-run level (0 in warmup)."""
        if not (x > 0 and math.isfinite(x)):
            return 0.0
        y = math.log(x)
        gap = 1 if step is None or self.last_step is None else max(1, step - self.last_step)
        if self.count == 0:
            self.fast = self.slow = y
            self.first_step = step
        self.fast += (1.0 - (1.0 - self.fast_rate) ** gap) * (y - self.fast)
        self.slow += (1.0 - (1.0 - self.slow_rate) ** gap) * (y - self.slow)
        self.count += 1
        self.last_step = step
        age = self.count if step is None or self.first_step is None else step - self.first_step + 1
        return self.fast - self.slow if age >= self.warmup_steps else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Both levels, the count and the first and last steps seen."""
        return {
            "fast": self.fast,
            "slow": self.slow,
            "count": self.count,
            "first_step": self.first_step,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.fast, self.slow, self.count = float(state["fast"]), float(state["slow"]), int(state["count"])
        self.first_step, self.last_step = state["first_step"], state["last_step"]


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
        """The window's values and its length (which tells a window cut short from one still filling)."""
        return {"values": list(self.values), "window": self.window}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self.values = deque((float(v) for v in state["values"]), maxlen=self.window)


@dataclass(frozen=True)
class StepScores:
    """What the rules of one step read: the step's values and their scores."""

    step: int
    grad_norm: float
    loss: float | None
    z_grad: float
    z_loss: float
    leading: str | None  # the layer whose z-score reached z_warning (per_layer), else None
    trend_name: str | None  # the precursor that crossed trend_warning at this step (the largest), else None
    trend_growth: float  # its growth in log units (0 without one)
    #: The grad norm's z-score on a scale of at least ``warning_scale_floor``, the look's (None: ``z_grad``).
    z_look: float | None = None


def warning_rule(s: StepScores, cfg: SpikeConfig) -> Event | None:
    """``spike_warning``: the grad norm's z-score, else a layer's, else a precursor's trend crossing.

    Its details name the signal (``signal``: the name it was scored under; ``source``: its kind), the module
    when one measured it, the usual lead over the loss (``lead``, steps; None when not measured) and what to do
    (``advice``); the message says the same in words."""
    details: dict[str, Any] = {"z": s.z_grad, "grad_norm": s.grad_norm, "layer": s.leading}
    z_look = s.z_grad if s.z_look is None else s.z_look
    if z_look >= cfg.z_warning or s.leading is not None:
        on_total = z_look >= cfg.z_warning
        kind = GRAD_NORM if on_total else LAYER
        signal = "grad_norm" if on_total else f"layer {s.leading}"
        where = f"; largest layer z-score: {s.leading}" if s.leading else ""
        message = (
            f"grad-norm z-score {z_look:.1f} at step {s.step} (warning at {cfg.z_warning}){where}: "
            f"{kind.advice} ({lead_text(kind)})"
        )
        return Event("spike_warning", s.step, message, {**details, **_signal_details(signal, kind)})
    if s.trend_name is not None and s.trend_growth >= cfg.trend_warning:
        kind = precursor_kind(s.trend_name)
        module = module_of(s.trend_name)
        on = f" ({module})" if module else ""
        message = (
            f"{s.trend_name} grew {math.exp(s.trend_growth):.1f}x over its long-run level at step {s.step}{on}: "
            f"{kind.advice} ({lead_text(kind)})"
        )
        extra = {"growth": math.exp(s.trend_growth), "module": module}
        return Event("spike_warning", s.step, message, {**details, **_signal_details(s.trend_name, kind), **extra})
    return None


def _signal_details(signal: str, kind: SignalKind) -> dict[str, Any]:
    """The details every early-warning event carries: the signal, its kind, its usual lead and the advice."""
    return {"signal": signal, "source": kind.name, "lead": kind.lead, "advice": kind.advice}


def loss_spike_rule(s: StepScores, cfg: SpikeConfig) -> Event | None:
    """``loss_spike``: the loss's z-score reaches ``z_spike`` (kept for existing hooks)."""
    if s.z_loss < cfg.z_spike:
        return None
    message = f"loss z-score {s.z_loss:.1f} at step {s.step} (spike at {cfg.z_spike})"
    return Event("loss_spike", s.step, message, {"z": s.z_loss, "loss": s.loss})


@dataclass(frozen=True)
class AlertReason:
    """Why a step alerts: ``rule`` (the event's ``details["rule"]``), the words that open its message,
    whether the loss climbed over several steps (rather than jumped), and which z-score it reports."""

    rule: str
    subject: str
    climbing: bool = False
    on_grad_norm: bool = False
    above_best: bool = False  # the loss-level test: the loss's level far above its best
    holds: bool = False  # the median test: a rise that holds (inside a climb's cooldown it is that climb)


GRAD_NORM_ALERT = AlertReason("grad norm", "grad norm", on_grad_norm=True)
LOSS_ALERT = AlertReason("loss", "loss")
JOINT_ALERT = AlertReason("grad norm and loss", "grad norm and loss")
LEVEL_ALERT = AlertReason(LEVEL_RULE, "loss", above_best=True)
DRIFT_ALERT = AlertReason(DRIFT_RULE, "loss", climbing=True)
MEDIAN_ALERT = AlertReason(MEDIAN_RULE, "loss", holds=True)


def alert_reason(
    s: StepScores,
    cfg: SpikeConfig,
    loss_drift: float,
    level_excess: float = 0.0,
    joint_before: bool = False,
    median_high: bool = False,
) -> AlertReason | None:
    """The alert rule: without a loss, the grad norm alone; with one, the loss alone, then both
    together (under ``joint_confirm``: both at the step before, ``joint_before``, and the loss still
    up now), then the loss's level far above its best (``loss_level_alert``), then the loss's
    CUSUM (``loss_drift_alert``), then its recent median far above the median before (``median_high``,
    ``loss_median_alert``). None: no alert at this step."""
    if s.loss is None:
        return GRAD_NORM_ALERT if s.z_grad >= cfg.z_alert else None
    if s.z_loss >= cfg.z_loss_alert:
        return LOSS_ALERT
    joint = joint_before and s.z_loss >= cfg.z_joint if cfg.joint_confirm else min(s.z_grad, s.z_loss) >= cfg.z_joint
    if joint:
        return JOINT_ALERT
    if cfg.loss_level_alert is not None and level_excess >= math.log(cfg.loss_level_alert):
        return LEVEL_ALERT
    if cfg.loss_drift_alert is not None and loss_drift >= cfg.loss_drift_alert:
        return DRIFT_ALERT
    return MEDIAN_ALERT if median_high else None


def alert_event(s: StepScores, reason: AlertReason, loss_drift: float, level_excess: float = 0.0) -> Event:
    """The ``spike_alert`` event of ``reason`` at this step."""
    if reason.holds:
        verb = "holds well above where it was (the median of its last steps)"
    elif reason.above_best:
        verb = f"stays {math.exp(level_excess):.1f}x above its best level"
    elif reason.climbing:
        verb = f"climbed (cumulative excess {loss_drift:.1f})"
    else:
        verb = "jumped"
    loss_text = "n/a" if s.loss is None else f"{s.loss:.4g}"
    message = (
        f"{reason.subject} {verb} at step {s.step}: z-scores {s.z_grad:.1f} (grad norm {s.grad_norm:.3g}) "
        f"and {s.z_loss:.1f} (loss {loss_text}); a loss spike or divergence may follow"
    )
    z = s.z_grad if reason.on_grad_norm else s.z_loss
    details: dict[str, Any] = {"z": z, "z_grad": s.z_grad, "z_loss": s.z_loss, "grad_norm": s.grad_norm}
    details.update(loss=s.loss, loss_drift=loss_drift, rule=reason.rule, layer=s.leading)
    details.update(
        _signal_details("grad_norm" if reason.on_grad_norm else "loss", GRAD_NORM if reason.on_grad_norm else LOSS)
    )
    if reason.above_best:
        details["level_ratio"] = math.exp(level_excess)
    return Event("spike_alert", s.step, message, details)


class SpikeMonitor:
    """Early warning over journal rows: a *warning* for the dashboard, an *alert* to page a person.

    The engine's ledger calls ``update`` exactly once per optimizer step (in step order, skipped
    steps included) with host floats, and ``metrics()`` on logging steps. Everything it keeps
    round-trips through ``state_dict``.

    * ``spike_warning`` (frequent, cheap to ignore; ``warning_rule``): the total grad norm's
      one-step-ahead z-score reaches ``z_warning``, a layer's reaches it (``per_layer``), or a
      precursor signal passed in ``signals`` (max attention logit, log Z, update size) crosses
      ``trend_warning`` (log units of growth over its long-run level; once per crossing).
    * ``spike_alert`` (rare; ``alert_reason``): with a loss, the grad norm and the loss jump together
      (both z-scores reach ``z_joint``) or the loss alone reaches ``z_loss_alert``; a grad-norm jump
      the loss does not share is a one-batch outlier and only warns. Without a loss (``loss=None``),
      the grad norm's z-score reaching ``z_alert`` alerts. Opt-in (``loss_drift_alert``): a CUSUM of
      the loss z-score (``max(0, S + min(z, 4) - 1)``) reaching the threshold alerts on a loss that
      climbs over several steps. At most one per ``alert_cooldown`` steps. Only alerts are meant
      for ``run.alert``.
    * ``loss_spike`` (``loss_spike_rule``): the loss's z-score reaches ``z_spike`` (kept for existing hooks).

    Both z-scores come from ``PredictiveDetector`` (log space, autocorrelation-aware, robust
    scale). Non-finite values are never ingested, so the monitor is never blind after a NaN.
    """

    def __init__(self, config: SpikeConfig, layer_names: Sequence[str]) -> None:
        self.config = config
        self.layer_names = list(layer_names)
        rate, warmup, scale_rate = config.baseline_rate, config.warmup_steps, config.scale_rate
        floor = config.scale_floor
        self.detector = PredictiveDetector(rate, warmup, size=2, scale_rate=scale_rate, floor=floor)  # [grad, loss]
        per_layer = config.per_layer and bool(self.layer_names)
        self.layer_detector = (
            PredictiveDetector(rate, warmup, size=len(self.layer_names), scale_rate=scale_rate) if per_layer else None
        )
        self.trends: dict[str, TrendDetector] = {}
        #: Steps that brought precursor signals (each made or fed a trend): a saved state that counts some
        #: and holds no trend is damaged, not a run without precursors.
        self.trend_steps = 0
        self.trend_high: set[str] = set()  # signals that warned, until their growth falls under half of trend_warning
        #: The loss's recent level over its long-run level (log units; < 0 while it falls): the gate of
        #: ``trend_while_stalled``.
        self.loss_trend = TrendDetector(fast=_LOSS_TREND_FAST, slow=_LOSS_TREND_SLOW, warmup_steps=1)
        self.loss_trend_value = 0.0
        self.spike_score = SpikeScore(config.score_window, config.score_sigma)
        self.last_z: tuple[float, float] = (0.0, 0.0)
        self.max_z_grad_recent = 0.0
        self.max_z_loss_recent = 0.0
        self.max_trend_recent = 0.0
        self.last_alert_step: int | None = None
        self.last_warning_step: int | None = None  # the last spike_warning raised (warning_cooldown)
        self.last_alert_drift = False  # the last alert was the loss-drift rule's (a jump may still page)
        self.alerts = 0
        self.loss_drift = 0.0  # CUSUM of the loss z-score (loss_drift_alert)
        level_factor = config.loss_level_alert
        self._level_alert_at = math.log(level_factor) if level_factor is not None else math.inf
        self.level = LevelReference(freeze_above=self._level_alert_at / 2 if level_factor is not None else 0.35)
        self.level_excess = 0.0  # log(recent loss level / best level held) (loss_level_alert)
        self.level_alerted = False  # this excursion above the best level has paged (re-armed below half way)
        self.median = MedianLevel(floor=config.scale_floor)  # loss_median_alert
        self.median_score = 0.0
        self.median_alerted = False  # this rise of the median has paged (re-armed under half the threshold)
        self.pending_look = PendingLook(config.look_confirm_steps or 0, config.z_joint)  # look_confirm_steps
        self.last_step: int | None = None  # the last step scored
        #: Steps scored while not ``settled()``, as (first, last) ranges, newest last (the last 64 kept):
        #: recovery drops a snapshot of such a step (``unsettled_since``). Not saved with the state.
        self.unsettled: deque[tuple[int, int]] = deque(maxlen=64)

    def update(
        self,
        step: int,
        grad_norm: float,
        loss: float | None,
        layer_norms: Sequence[float] | None,
        *,
        signals: Mapping[str, float] | None = None,
    ) -> list[Event]:
        """Score one step; the events it raises (``spike_warning``, ``spike_alert``, ``loss_spike``).

        ``signals``: optional precursors measured at this step, by name (e.g.
        ``{"attention/max_logit": 31.0, "log_z": 6.2, "update_rms": 1e-3}``); a missing or
        non-finite one is simply not scored.
        """
        cfg = self.config
        joint_before = self.last_step == step - 1 and min(self.last_z) >= cfg.z_joint  # last step's joint jump
        self.last_step = step
        grad_scale = self.detector.scale(0)  # the scale this step's grad norm is scored on
        z_grad, z_loss = self.detector.update([grad_norm, math.nan if loss is None else loss])
        z_look = z_grad * grad_scale / max(grad_scale, cfg.warning_scale_floor)
        self.last_z = (z_grad, z_loss)
        self.max_z_grad_recent = max(self.max_z_grad_recent, z_grad)
        self.max_z_loss_recent = max(self.max_z_loss_recent, z_loss)
        self.spike_score.update(grad_norm)
        leading = self._leading_layer(layer_norms)
        if loss is not None:
            self.loss_trend_value = self.loss_trend.update(loss, step)
        if self.config.layer_share_trend and layer_norms is not None:
            signals = {**(signals or {}), **self._layer_shares(grad_norm, layer_norms)}
        trend_name, trend_growth = self._trend_crossing(step, signals)
        self.max_trend_recent = max(self.max_trend_recent, trend_growth)
        scores = StepScores(step, grad_norm, loss, z_grad, z_loss, leading, trend_name, trend_growth, z_look)
        warning = self._confirmed(warning_rule(scores, cfg), step, loss, z_loss)
        if warning is not None:
            last = self.last_warning_step
            if last is not None and step - last < cfg.warning_cooldown:
                warning = None  # a look within the cooldown of the last one tells nothing new
            else:
                self.last_warning_step = step
        events = [e for e in (warning, loss_spike_rule(scores, cfg)) if e is not None]
        if loss is not None:
            self.loss_drift = max(0.0, self.loss_drift + min(z_loss, _DRIFT_CLAMP) - _DRIFT_REFERENCE)
            self.level_excess = self.level.update(loss)
            self.median_score = self.median.update(loss)
        if self.level_excess < self._level_alert_at / 2:
            self.level_alerted = False  # back near the best level: the next excursion pages again
        elif self.level_excess >= self._level_alert_at and not self.level_alerted and self._jump_paged(step):
            self.level_alerted = True  # the jump that began this excursion has paged already
        excess = 0.0 if self.level_alerted else self.level_excess
        reason = alert_reason(scores, cfg, self.loss_drift, excess, joint_before, self._median_high())
        if reason is not None:
            if self._may_alert(step, reason):
                events.append(alert_event(scores, reason, self.loss_drift, self.level_excess))
                self.last_alert_step, self.last_alert_drift = step, reason.climbing
                self.alerts += 1
                if self.level_excess >= self._level_alert_at:
                    self.level_alerted = True  # this excursion has paged, whichever rule raised it
                self.median_alerted = True  # a rise of the median inside this excursion is the same trouble
            self.loss_drift = 0.0  # this excursion is alerted (or inside the cooldown of its alert)
        if not self.settled():
            if self.unsettled and self.unsettled[-1][1] == step - 1:
                self.unsettled[-1] = (self.unsettled[-1][0], step)
            else:
                self.unsettled.append((step, step))
        return events

    def was_settled(self, step: int) -> bool:
        """Whether the detectors were settled after scoring ``step`` (True for a step not scored yet or
        older than the ranges kept)."""
        return not any(first <= step <= last for first, last in self.unsettled)

    def settled(self) -> bool:
        """The detectors see nothing going on: no ``spike_alert`` within ``alert_cooldown`` steps, the loss's
        level within half the loss-level threshold of its best (log scale), its recent median not half way to
        ``loss_median_alert`` (in noise units and in rise), and no loss-drift excursion half way to its alert.
        Recovery keeps snapshots only from settled steps (a state inside a climb is not a restore point)."""
        cfg = self.config
        last = self.last_alert_step
        if last is not None and self.last_step is not None and self.last_step - last < cfg.alert_cooldown:
            return False
        if self.level_excess >= self._level_alert_at / 2:
            return False
        median = cfg.loss_median_alert
        if median is not None and self.median_score >= median / 2 and self.median.rise >= cfg.loss_median_rise / 2:
            return False
        return cfg.loss_drift_alert is None or self.loss_drift < cfg.loss_drift_alert / 2

    def _confirmed(self, warning: Event | None, step: int, loss: float | None, z_loss: float) -> Event | None:
        """Under ``look_confirm_steps`` (with a loss): a grad-norm look is held until the loss follows; the look to
        raise at this step (a held one the loss now follows, or any other look)."""
        if self.config.look_confirm_steps is None or loss is None:
            return warning
        if warning is not None and warning.details.get("source") == GRAD_NORM.name:
            self.pending_look.offer(warning)
            warning = None
        followed = self.pending_look.update(step, z_loss)
        return warning if warning is not None else followed

    def _median_high(self) -> bool:
        """The loss's recent median stands ``loss_median_alert`` noise units and ``loss_median_rise`` above the median
        before, and this rise has not paged yet. Re-armed only once the recent median is back at or under the median
        before: the median before follows a climb, and re-arming half way paged again inside one excursion (BERT's
        LR edge on the corpus, 57 steps after its onset)."""
        threshold = self.config.loss_median_alert
        if threshold is None:
            return False
        if self.median_score <= 0:
            self.median_alerted = False  # the median is back where it was: the next rise pages again
        high = self.median_score >= threshold and self.median.rise >= self.config.loss_median_rise
        return high and not self.median_alerted

    def _jump_paged(self, step: int) -> bool:
        """A jump (not a loss-drift alert) paged within ``alert_cooldown`` steps before ``step``."""
        last = self.last_alert_step
        return last is not None and step - last < self.config.alert_cooldown and not self.last_alert_drift

    def _may_alert(self, step: int, reason: AlertReason) -> bool:
        """Outside the cooldown of the last alert, or a jump inside the cooldown of a drift alert: a climb
        that turns into a jump is news (and the alert a ``spike_alert`` recovery trigger acts on)."""
        if self.last_alert_step is None or step - self.last_alert_step >= self.config.alert_cooldown:
            return True
        return self.last_alert_drift and not reason.climbing and not reason.holds

    def _leading_layer(self, layer_norms: Sequence[float] | None) -> str | None:
        """The layer with the largest z-score when it reaches ``z_warning`` (``per_layer``), else None."""
        if self.layer_detector is None or layer_norms is None:
            return None
        layer_z = self.layer_detector.update(layer_norms)
        if not layer_z:
            return None
        top = max(range(len(layer_z)), key=layer_z.__getitem__)
        return self.layer_names[top] if layer_z[top] >= self.config.z_warning else None

    def _layer_shares(self, grad_norm: float, layer_norms: Sequence[float]) -> dict[str, float]:
        """Each layer's share of the total grad norm, by ``grad_share/<layer>`` (none when the total is not a
        finite positive value)."""
        if not (grad_norm > 0 and math.isfinite(grad_norm)):
            return {}
        return {
            f"grad_share/{name}": norm / grad_norm
            for name, norm in zip(self.layer_names, layer_norms, strict=False)
            if norm > 0 and math.isfinite(norm)
        }

    def _trend_crossing(self, step: int, signals: Mapping[str, float] | None) -> tuple[str | None, float]:
        """Fold each precursor into its trend; the one that crossed ``trend_warning`` now with the
        largest growth, and that growth ((None, 0.0) when none crossed). Under ``trend_while_stalled``, a
        signal above the threshold while the loss still falls has not crossed yet: it warns when the loss
        stalls, if it is still above then."""
        cfg = self.config
        gate = cfg.trend_while_stalled
        stalled = gate is None or self.loss_trend_value >= -gate
        name_top, growth_top = None, 0.0
        if signals:
            self.trend_steps += 1
        for name, value in (signals or {}).items():
            detector = self.trends.get(name)
            if detector is None:
                detector = self.trends[name] = TrendDetector(warmup_steps=max(cfg.warmup_steps, cfg.trend_warmup))
            growth = detector.update(abs(value), step)
            if growth < cfg.trend_warning * cfg.trend_rearm:
                self.trend_high.discard(name)  # fell back: the next crossing warns again
            elif growth >= cfg.trend_warning and name not in self.trend_high and stalled:
                self.trend_high.add(name)
                if growth > growth_top:
                    name_top, growth_top = name, growth
        return name_top, growth_top

    def metrics(self) -> dict[str, float]:
        """The logging step's spike metrics (names without the metric prefix); starts a new interval."""
        out = {
            "spikes/z_grad_norm": self.last_z[0],
            "spikes/z_loss": self.last_z[1],
            "spikes/max_z_grad_norm": self.max_z_grad_recent,
            "spikes/max_z_loss": self.max_z_loss_recent,
            "spikes/score": self.spike_score.score(),
            "spikes/alerts": float(self.alerts),
            "spikes/z_warning": self.config.z_warning,  # the threshold, so a report draws the run's own line
        }
        if self.trends:
            out["spikes/max_trend"] = self.max_trend_recent
        if self.config.loss_drift_alert is not None:
            out["spikes/loss_drift"] = self.loss_drift
        if self.config.loss_level_alert is not None:
            out["spikes/loss_level"] = math.exp(self.level_excess)  # recent loss level / best level held
        if self.config.look_confirm_steps is not None:
            out["spikes/grad_jumps_unconfirmed"] = float(self.pending_look.unconfirmed)
        self.max_z_grad_recent = self.max_z_loss_recent = self.max_trend_recent = 0.0
        return out

    def state_dict(self) -> dict[str, Any]:
        """Detector baselines, trends, the score window, interval maxima and the alert clock (plain values)."""
        return {
            "detector": self.detector.state_dict(),
            "layer_detector": self.layer_detector.state_dict() if self.layer_detector is not None else None,
            "trends": {name: d.state_dict() for name, d in self.trends.items()},
            "trend_steps": self.trend_steps,
            "trend_high": sorted(self.trend_high),
            "loss_trend": self.loss_trend.state_dict(),
            "spike_score": self.spike_score.state_dict(),
            "last_z": list(self.last_z),
            "recent": [self.max_z_grad_recent, self.max_z_loss_recent, self.max_trend_recent],
            "last_alert_step": self.last_alert_step,
            "last_warning_step": self.last_warning_step,
            "last_alert_drift": self.last_alert_drift,
            "alerts": self.alerts,
            "loss_drift": self.loss_drift,
            "level": self.level.state_dict(),
            "level_alerted": self.level_alerted,
            "median": self.median.state_dict(),
            "median_alerted": self.median_alerted,
            "pending_look": self.pending_look.state_dict(),
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (validated by ``state.py`` first)."""
        self.detector.load_state_dict(state["detector"])
        if self.layer_detector is not None and state["layer_detector"] is not None:
            self.layer_detector.load_state_dict(state["layer_detector"])
        self.trends = {}
        self.trend_steps = int(state["trend_steps"])
        self.trend_high = set(state["trend_high"])
        self.loss_trend.load_state_dict(state["loss_trend"])
        self.loss_trend_value = self.loss_trend.fast - self.loss_trend.slow
        for name, sub in state["trends"].items():
            self.trends[name] = TrendDetector(warmup_steps=max(self.config.warmup_steps, self.config.trend_warmup))
            self.trends[name].load_state_dict(sub)
        self.last_alert_step = state["last_alert_step"]
        self.last_warning_step = state["last_warning_step"]
        self.last_alert_drift = bool(state["last_alert_drift"])
        self.alerts = int(state["alerts"])
        self.loss_drift = float(state["loss_drift"])
        self.level.load_state_dict(state["level"])
        self.level_excess = self.level.excess()
        self.level_alerted = bool(state["level_alerted"])
        self.median.load_state_dict(state["median"])
        self.median_score = self.median.score()
        self.median_alerted = bool(state["median_alerted"])
        self.pending_look.load_state_dict(state["pending_look"])
        self.last_step = state["last_step"]
        self.spike_score.load_state_dict(state["spike_score"])
        z = state["last_z"]
        self.last_z = (float(z[0]), float(z[1]))
        self.max_z_grad_recent, self.max_z_loss_recent, self.max_trend_recent = (float(v) for v in state["recent"])
