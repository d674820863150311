"""How far ahead of the loss any detector can be on the corpus: the honest bound behind "warned before".

    python benchmarks/warning/score.py --split tune|held --bound

Two numbers bound the share of onsets a detector can warn of before the loss moves:

* **data events**: an onset whose loss moved as a burst of junk or the data shift arrived (the
  ``burst`` and ``adam_beta2`` arms of ``corpus.py``: moved within ``DATA_SLACK`` steps of the
  arrival, or while the burst lasts). Nothing inside the model can precede data that has not
  arrived yet: an event before one is luck, not a warning. The share of the other onsets is the
  most any detector can reach.
* **the single-precursor frontier** (tuning families only): each precursor the corpus holds, as its
  growth over its long-run level (``TrendDetector``'s fast EMA of log|x| against its slow one, the
  defaults' time constants and warm-up, *ungated*: no stalled-loss rule, no cooldown), the largest over
  its modules; a threshold's looks are its up-crossings on healthy steps (re-armed under half the
  threshold, as ``trend_rearm`` does), and an onset counts as warned when the growth stands at the
  threshold at any step of the 30 before the loss moved. Both are generous to the precursor: it is
  the best that threshold could do, not what a detector built on it gets. The grad norm's own
  one-step-ahead z-score (``PredictiveDetector``, no floor) is scored the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from corpus import BURSTS, SHIFT_AT
from truth import Onsets

from stabilitykit.spikes import PredictiveDetector, TrendDetector

#: An onset is a data event when its loss moved between ``DATA_SLACK`` steps before the data arrived and
#: ``DATA_SLACK`` steps after the burst ended (the shift counts as ``SHIFT_SPAN`` steps long).
DATA_SLACK, SHIFT_SPAN = 3, 10
BEFORE = 30
#: Looks allowed per 1,000 healthy steps (the target).
LOOK_BUDGET = 1.0
#: Corpus column prefixes scored as precursors, by the name the frontier prints.
PRECURSORS = {
    "attention-logit max": ("attn_logit_max/",),
    "log Z": ("log_z/",),
    "output max |logit|": ("logits_max/",),
    "residual norm": ("resid_norm/",),
    "a layer's update ratio": ("update/",),
    "update ratio": ("update_ratio",),
    "a layer's grad norm": ("layer/",),
}


class Run(Protocol):
    """What the bound reads of a corpus run (``score.CorpusRun``)."""

    key: str
    meta: dict[str, Any]
    columns: list[str]
    data: np.ndarray


def arrivals(meta: Mapping[str, Any]) -> list[tuple[int, int]]:
    """(first step, last step) of each burst of junk or data shift of a run (none for other arms)."""
    steps, arm = int(meta["steps"]), str(meta["arm"])
    if arm == "burst":
        return [(int(steps * at), int(steps * at) + length - 1) for at, length in BURSTS]
    if arm == "adam_beta2":
        start = int(steps * SHIFT_AT)
        return [(start, start + SHIFT_SPAN - 1)]
    return []


def is_data_event(moved: int, spans: Sequence[tuple[int, int]]) -> bool:
    """Whether an onset whose loss moved at ``moved`` came with a burst or the shift (``spans``)."""
    return any(first - DATA_SLACK <= moved <= last + DATA_SLACK for first, last in spans)


def growth_series(data: np.ndarray, columns: Sequence[str], prefixes: Sequence[str], warmup: int) -> np.ndarray:
    """Per step, the largest growth over its long-run level of the columns starting with ``prefixes`` (0 where
    none is warm), each column's own ``TrendDetector`` (ungated)."""
    out = np.zeros(len(data))
    for j, name in enumerate(columns):
        if not name.startswith(tuple(prefixes)):
            continue
        trend = TrendDetector(warmup_steps=warmup)
        for t, value in enumerate(data[:, j].tolist()):
            out[t] = max(out[t], trend.update(abs(value), t))
    return out


def jump_series(values: np.ndarray) -> np.ndarray:
    """The one-step-ahead robust z-score of a series (``PredictiveDetector`` at its defaults, no floor)."""
    detector = PredictiveDetector()
    return np.array([detector.update([v])[0] for v in values.tolist()])


@dataclass
class Case:
    """One run's statistic for one precursor, with its truth and which onsets are data events."""

    values: np.ndarray
    truth: Onsets
    data: list[bool]


def operating_point(cases: Sequence[Case], threshold: float, rearm: float = 0.5) -> tuple[float, int, int]:
    """Looks per 1k healthy steps, onsets warned before the loss moved, and of them those not data events."""
    looks = healthy = warned = warned_model = 0
    for case in cases:
        armed = True
        healthy += int(case.truth.healthy.sum())
        for t, v in enumerate(case.values.tolist()):
            if armed and v >= threshold:
                armed = False
                looks += int(case.truth.healthy[t])
            elif v < threshold * rearm:
                armed = True
        for (m, _), data in zip(case.truth.onsets, case.data, strict=True):
            if float(case.values[max(0, m - BEFORE) : max(0, m)].max(initial=-math.inf)) >= threshold:
                warned += 1
                warned_model += not data
    return looks / max(1, healthy) * 1e3, warned, warned_model


def frontier(cases: Sequence[Case], points: int = 40) -> list[tuple[float, float, int, int]]:
    """(threshold, looks per 1k, warned, warned not data) over thresholds from the largest value before any onset
    downward; the points where a lower threshold warns of more onsets."""
    before = [
        float(c.values[max(0, m - BEFORE) : max(0, m)].max(initial=0.0)) for c in cases for m, _ in c.truth.onsets
    ]
    candidates = sorted({v for v in before if v > 0}, reverse=True)[:points]
    out: list[tuple[float, float, int, int]] = []
    for threshold in candidates:
        looks, warned, model = operating_point(cases, threshold)
        if not out or warned > out[-1][2]:
            out.append((threshold, looks, warned, model))
    return out


def report(runs: Sequence[Run], truths: dict[str, Onsets], split: str, tune: bool, warmup: int = 100) -> None:
    """Print the data events of the split and, on the tuning families, each precursor's frontier."""
    onsets = data_events = 0
    cases_by: dict[str, list[Case]] = {name: [] for name in PRECURSORS}
    cases_by["grad-norm jump (z-score)"] = []
    for run in runs:
        truth = truths[run.key]
        spans = arrivals(run.meta)
        data = [is_data_event(m, spans) for m, _ in truth.onsets]
        onsets += len(data)
        data_events += sum(data)
        if not tune:
            continue
        for name, prefixes in PRECURSORS.items():
            values = growth_series(run.data, run.columns, prefixes, warmup)
            cases_by[name].append(Case(values, truth, data))
        grad = run.data[:, run.columns.index("grad_norm")].astype(np.float64)
        cases_by["grad-norm jump (z-score)"].append(Case(jump_series(grad), truth, data))
    model = onsets - data_events
    print(f"\n## The bound on warning before the loss moved ({split} families)\n")
    print(
        f"{onsets} onsets, {data_events} of them data events (a burst or the shift arriving: nothing inside the model "
        f"precedes them); the other {model} are the most any detector can warn of: "
        f"{model / max(1, onsets):.2f} of all onsets at best (the target is 0.30)."
    )
    if not tune:
        return
    print(
        "\nEach precursor alone (ungated, generous: warned if it stands at the threshold anywhere in the 30 steps "
        f"before the loss moved); the best at <= {LOOK_BUDGET:g} look per 1,000 healthy steps, and the thresholds "
        "that warn of more:\n"
    )
    print("| precursor | best warned before at <= 1 look / 1k | threshold | looks / 1k | warned (not data) |")
    print("| --- | --- | --- | --- | --- |")
    for name, cases in cases_by.items():
        points = frontier(cases)
        within = [p for p in points if p[1] <= LOOK_BUDGET]
        best = max(within, key=lambda p: p[2]) if within else None
        best_text = (
            f"{best[2] / max(1, onsets):.2f} ({best[2]} of {onsets}; {best[3]} not data events)"
            if best
            else f"0.00 (0 of {onsets})"
        )
        rows = "; ".join(f"{p[0]:.2f}" for p in points) or "-"
        looks = "; ".join(f"{p[1]:.1f}" for p in points) or "-"
        warned = "; ".join(f"{p[2]} ({p[3]})" for p in points) or "-"
        print(f"| {name} | {best_text} | {rows} | {looks} | {warned} |")
