"""The spike-detection suite: synthetic streams, real-instability traces, ground truth and peer detectors.

Shared by ``benchmarks/spikes.py`` (the comparison tables) and the tests. Nothing here trains a
model: the real traces are replayed from ``benchmarks/instability/traces.npz`` (regenerate them
with ``benchmarks/instability/train.py``).

Ground truth on real runs, from the loss alone (fixed before any detector was scored):

* a **loss spike** starts at step t when loss[t] >= 1.3 x the median loss of steps t-20..t-1 and
  no spike started in the 50 steps before; the loss **moved** at the first step m <= t from which
  every loss up to t is >= 1.1 x that median (m = t when the spike is one step tall);
* a **divergence** starts at the first step of a stretch of 100+ steps whose loss is above 2 x the
  running minimum of the loss so far (a non-finite loss counts as above);
* an onset is **alerted** when an alert falls in [m - 30, t + 3]; **lead time** is m - (first such
  alert step), so > 0 means before the loss moved;
* **healthy steps**: steps from 50 on that lie outside [m - 30, t + 50] of every spike and outside
  every divergence; an alert there is a false alarm.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

TRACES = Path(__file__).with_name("instability") / "traces.npz"
SPIKE_SIZES = (1.5, 2.0, 3.0, 5.0, 10.0, 100.0, 1000.0)
SIGMAS = (0.05, 0.1, 0.2, 0.3, 0.4)
PHIS = (0.0, 0.5, 0.9, 0.95)
#: One-sided standard normal quantile at 1e-4 (1 false alarm per 10k steps).
Z_1E4 = 3.719


# ----------------------------------------------------------------------------- synthetic suite
@dataclass
class Stream:
    """One synthetic grad-norm stream and its truth."""

    name: str
    values: list[float]
    spikes: dict[int, float]  # step -> factor
    bad: set[int]  # NaN / Inf steps
    innovation: float  # one-step-ahead noise std in log space
    ignore: set[int] = field(default_factory=set)  # steps just after a spike or a bad value


def synthetic_stream(sigma: float, phi: float, seed: int, steps: int = 6000) -> Stream:
    """Log-normal AR(1) noise (stationary std ``sigma``, lag-1 correlation ``phi``) on a realistic level.

    Level: a warmup ramp up by 3x over 300 steps, a regime change (x0.6) at a random step in
    [1500, 2500], a decay by 4x over the rest; spikes of 1.5x-1000x every 80-120 steps from step
    200 (one step tall); 3 NaN and 3 Inf events.
    """
    rng = random.Random(hash((sigma, phi, seed)) & 0xFFFFFFFF)
    innovation = sigma * math.sqrt(1 - phi * phi)
    change = rng.randint(1500, 2500)
    noise = rng.gauss(0.0, sigma)
    values: list[float] = []
    for t in range(steps):
        level = math.log(0.5) + math.log(3.0) * min(t, 300) / 300
        if t >= change:
            level += math.log(0.6)
        level -= math.log(4.0) * max(0, t - 300) / (steps - 300)
        noise = phi * noise + innovation * rng.gauss(0.0, 1.0)
        values.append(math.exp(level + noise))
    spikes: dict[int, float] = {}
    t, i = 200, rng.randrange(len(SPIKE_SIZES))
    while t < steps - 5:
        spikes[t] = SPIKE_SIZES[i % len(SPIKE_SIZES)]
        i += 1
        t += rng.randint(80, 120)
    free = [t for t in range(300, steps - 5) if all(abs(t - s) > 5 for s in spikes)]
    bad = set(rng.sample(free, 6))
    for t, factor in spikes.items():
        values[t] *= factor
    for j, t in enumerate(sorted(bad)):
        values[t] = math.nan if j % 2 == 0 else math.inf
    ignore = {t + k for t in list(spikes) + list(bad) for k in (1, 2)}
    return Stream(f"sigma={sigma:g} phi={phi:g} seed={seed}", values, spikes, bad, innovation, ignore)


def gaussian_bound(innovation: float, factor: float, fa_rate: float = 1e-4) -> float:
    """Best recall any detector reaches on a one-step x``factor`` spike at ``fa_rate`` false alarms per step.

    With Gaussian innovations of std ``innovation`` in log space and a known prediction, the
    optimal test thresholds the log residual at innovation * z(1 - fa_rate).
    """
    z = statistics.NormalDist().inv_cdf(1 - fa_rate)
    return statistics.NormalDist().cdf((math.log(factor) - z * innovation) / innovation)


# ----------------------------------------------------------------------------- peer detectors (one series)
Flag = Callable[[float], bool]


def olmo_rule(window: int = 128, sigma: float = 6.0, min_values: int = 20) -> Flag:
    """OLMo-core's rule: the value is above mean + 6 std of the previous 128 finite values."""
    past: deque[float] = deque(maxlen=window)

    def flag(x: float) -> bool:
        hit = False
        if len(past) >= min_values and math.isfinite(x):
            mean = sum(past) / len(past)
            std = math.sqrt(sum((v - mean) ** 2 for v in past) / len(past))
            hit = x > mean + sigma * std
        if math.isfinite(x):
            past.append(x)
        return hit

    return flag


def lightning_rule() -> Flag:
    """Lightning's ``SpikeDetection`` (its defaults: mode min, window 10, rtol 2), its own rule methods."""
    import torch
    from lightning.fabric.utilities.spike import SpikeDetection

    detector = SpikeDetection()
    count = [0]

    def flag(x: float) -> bool:
        value = torch.tensor(x)
        i = count[0]
        count[0] += 1
        spike = i >= detector.warmup and bool(detector._is_spike(value))
        if not spike:
            detector._update_stats(value)
        return spike and math.isfinite(x)

    return flag


def zclip_rule() -> Flag:
    """ZClip as a detector (its defaults: alpha 0.97, z 2.5): a step counts when ZClip would clip it."""
    from zclip import ZClip

    z = ZClip(warmup_steps=25)

    def flag(x: float) -> bool:
        if not z.initialized:
            z.buffer.append(x)
            if len(z.buffer) >= z.warmup_steps:
                z._initialize_ema()
            return False
        clip = z._compute_clip_val(x)
        z._update_ema(clip if clip is not None else x)
        return clip is not None and math.isfinite(x)

    return flag


def megatron_rule(factor: float = 10.0, window: int = 100) -> Flag:
    """Megatron's spiky-value check: the value is more than 10x the largest of the previous 100 finite values."""
    past: deque[float] = deque(maxlen=window)

    def flag(x: float) -> bool:
        hit = bool(past) and math.isfinite(x) and x > factor * max(past)
        if math.isfinite(x):
            past.append(x)
        return hit

    return flag


# ----------------------------------------------------------------------------- real traces
@dataclass
class Run:
    """One recorded training run."""

    key: str
    arm: str
    lr: float
    final_loss: float
    columns: list[str]
    data: np.ndarray  # (steps, columns) float32

    def col(self, name: str) -> np.ndarray:
        return self.data[:, self.columns.index(name)].astype(np.float64)

    def layer_names(self) -> list[str]:
        return [c.split("/", 1)[1] for c in self.columns if c.startswith("layer/")]

    def layers(self) -> np.ndarray:
        idx = [i for i, c in enumerate(self.columns) if c.startswith("layer/")]
        return self.data[:, idx].astype(np.float64)


#: The arms of the detector study (the runs ``spikes.py`` scores); later technique arms are in ``evidence.py``.
DETECTOR_ARMS = ("baseline", "qknorm", "zloss", "both", "clip", "zclip", "adaptive", "skip")


def load_runs(path: Path = TRACES, arms: Sequence[str] | None = None) -> list[Run]:
    """The runs stored in a traces file (only those of ``arms`` when given)."""
    with np.load(path) as npz:
        meta = json.loads(str(npz["meta"]))
        return [
            Run(key, info["arm"], info["lr"], info["final_loss"], meta["columns"], npz[key])
            for key, info in meta["runs"].items()
            if arms is None or info["arm"] in arms
        ]


@dataclass
class Truth:
    """Loss-based ground truth of one run."""

    spikes: list[tuple[int, int]]  # (moved step m, onset step t)
    divergences: list[int]
    healthy: np.ndarray  # bool per step


def long_runs(above: np.ndarray, min_length: int) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive True values of ``above`` at least ``min_length`` long, end
    exclusive: the divergences of both ground truths (``ground_truth`` here, ``warning/truth.py``)."""
    runs: list[tuple[int, int]] = []
    n, t = len(above), 0
    while t < n:
        if above[t]:
            end = t
            while end < n and above[end]:
                end += 1
            if end - t >= min_length:
                runs.append((t, end))
            t = end
        else:
            t += 1
    return runs


def ground_truth(loss: Sequence[float]) -> Truth:
    """Loss spikes, divergence onsets and healthy steps by the rule in the module docstring."""
    loss = np.asarray(loss, dtype=np.float64)
    n = len(loss)
    finite = np.isfinite(loss)
    spikes: list[tuple[int, int]] = []
    last = -(10**9)
    for t in range(20, n):
        ref_vals = loss[t - 20 : t][finite[t - 20 : t]]
        if len(ref_vals) < 10:
            continue
        ref = float(np.median(ref_vals))
        high = (not finite[t]) or loss[t] >= 1.3 * ref
        if high and t - last > 50:
            m = t
            while m - 1 >= t - 20 and finite[m - 1] and loss[m - 1] >= 1.1 * ref:
                m -= 1
            spikes.append((m, t))
            last = t
        elif high:
            last = t
    running_min = np.minimum.accumulate(np.where(finite, loss, np.inf))
    above = ~finite | (loss > 2 * running_min)
    divergences: list[int] = []
    in_div = np.zeros(n, dtype=bool)
    for t, end in long_runs(above, 100):
        divergences.append(t)
        in_div[t:end] = True
    healthy = np.ones(n, dtype=bool)
    healthy[:50] = False
    healthy[in_div] = False
    for m, t in spikes:
        healthy[max(0, m - 30) : t + 51] = False
    return Truth(spikes, divergences, healthy)
