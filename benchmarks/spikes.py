"""Spike early warning against the detectors users would otherwise run, on the same series. Prints tables.

The held-out check of the defaults is its successor, ``benchmarks/warning/score.py``: the same peers on
a corpus of runs of five ``transformers`` families (``benchmarks/warning/corpus.py``), split by family.

    python benchmarks/spikes.py [--seeds 3] [--steps 6000] [--traces benchmarks/instability/traces.npz]

Part 1, the synthetic suite (``spike_suite.synthetic_stream``): log-normal AR(1) grad-norm
streams, stationary std sigma 0.05-0.4 and lag-1 correlation phi 0-0.95, on a level with a warmup
ramp, a regime change and a 4x decay; one-step spikes of 1.5x-1000x every 80-120 steps; NaN and
Inf events. Per configuration: recall on spikes >= 3x, false alarms per 10k clean steps, and the
Gaussian bound (the best recall any detector reaches on a 3x spike at 1 false alarm per 10k).

Part 2, real instabilities (``benchmarks/instability/traces.npz``, from ``train.py``; the 8 arms of
the detector study, ``spike_suite.DETECTOR_ARMS``; the technique arms added later are not scored here): loss-based
ground truth (see ``spike_suite``), recall of loss-spike and divergence onsets, the share alerted
before the loss moved, and alerts per 10k healthy steps (all runs; and the runs with no event).
Reported for all runs, the tuning set (seed 0, the runs the rules were designed on) and the
held-out set (seeds 1+, generated afterwards), with the loss-drift alert off and at 4 (the default
since the monitors benchmark, ``instability/monitors_lead.py --drift``), 3 and 2, and the warning
with precursors fed on every 10th step only (as the engine does).

Part 3, each signal alone: thresholded just above its largest value on the healthy steps of the
tuning set's runs with no event, scored on the held-out runs (can any signal warn before the loss
moves without paging on healthy training?).

Detectors, each on the same values:

* stabilitykit: ``SpikeMonitor``'s ``spike_alert`` (the rare alert), and its ``spike_warning``;
* stabilitykit before: the first detector's warning at z >= 4 (what used to page; an EMA baseline of
  log(x) with a robust scale, kept here as ``EmaDetector`` since the library has one detector now);
* OLMo-core: above mean + 6 std of the previous 128 values (grad norm and loss);
* Lightning ``SpikeDetection`` (its defaults, on the loss; on the stream in part 1);
* ZClip as a detector: a step counts when ZClip would clip it (grad norm);
* Megatron: above 10x the largest of the previous 100 values (loss; the stream in part 1).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import numpy as np
from spike_suite import (
    DETECTOR_ARMS,
    PHIS,
    SIGMAS,
    SPIKE_SIZES,
    TRACES,
    Flag,
    Run,
    gaussian_bound,
    ground_truth,
    lightning_rule,
    load_runs,
    megatron_rule,
    olmo_rule,
    synthetic_stream,
    zclip_rule,
)

from stabilitykit.config import SpikeConfig
from stabilitykit.spikes import PredictiveDetector, SpikeMonitor, TrendDetector

Row = dict[str, float]  # one step of a real trace: grad_norm, loss, layer norms, signals
RowFlag = Callable[[Row], bool]


# ----------------------------------------------------------------------------- our detectors
class EmaDetector:
    """The library's first detector (the "before" arm): one-step-ahead robust z-scores of log(x) against an
    EMA baseline, residual scale an EMA of |residual| (x1.2533, floor 1e-3), residuals clamped to 3 scales."""

    def __init__(self, alpha: float = 0.1, warmup_steps: int = 20) -> None:
        self.alpha, self.warmup_steps = alpha, warmup_steps
        self.mean = self.abs_dev = 0.0
        self.count = 0

    def update(self, x: float) -> float:
        """The z-score of ``x`` (0 in warmup and for a non-finite or non-positive value), then fold it in."""
        if not (x > 0 and math.isfinite(x)):
            return 0.0
        log_x = math.log(x)
        if self.count == 0:
            self.mean, self.count = log_x, 1
            return 0.0
        resid = log_x - self.mean
        std = self.abs_dev * 1.2533 + 1e-3
        z = 0.0
        if self.count >= self.warmup_steps:
            z = resid / std
            resid = max(-3 * std, min(3 * std, resid))
        self.mean += self.alpha * resid
        self.abs_dev = (1 - self.alpha) * self.abs_dev + self.alpha * abs(resid)
        self.count += 1
        return z


def ours_alert_stream() -> Flag:
    monitor = SpikeMonitor(SpikeConfig(), [])
    step = [0]

    def flag(x: float) -> bool:
        events = monitor.update(step[0], x, None, None)
        step[0] += 1
        return any(e.kind == "spike_alert" for e in events)

    return flag


def old_stream() -> Flag:
    detector = EmaDetector(alpha=0.1, warmup_steps=20)
    return lambda x: detector.update(x) >= 4.0


def ours_real(kind: str, signal_every: int = 1, **config: Any) -> Callable[[list[str]], RowFlag]:
    """``SpikeMonitor`` on a real trace; ``signal_every``: precursors on every n-th step only (logging steps)."""

    def make(layer_names: list[str]) -> RowFlag:
        monitor = SpikeMonitor(SpikeConfig(per_layer=True, **config), layer_names)
        step = [0]

        def flag(row: Row) -> bool:
            layers = [row[f"layer/{n}"] for n in layer_names]
            signals = None
            if step[0] % signal_every == 0:
                signals = {k: row[k] for k in ("max_attn_logit", "log_z", "update") if k in row}
            events = monitor.update(step[0], row["grad_norm"], row["loss"], layers, signals=signals)
            step[0] += 1
            return any(e.kind == kind for e in events)

        return flag

    return make


def on_series(factory: Callable[[], Flag], series: tuple[str, ...]) -> Callable[[list[str]], RowFlag]:
    """A one-series peer applied to each named series of a real trace; a step counts if any flags."""

    def make(layer_names: list[str]) -> RowFlag:
        flags = {name: factory() for name in series}

        def flag(row: Row) -> bool:
            return any([f(row[name]) for name, f in flags.items()])  # a list: every flag sees every step

        return flag

    return make


STREAM_DETECTORS: dict[str, Callable[[], Flag]] = {
    "stabilitykit alert": ours_alert_stream,
    "stabilitykit before (z>=4)": old_stream,
    "OLMo 6 std / 128": olmo_rule,
    "Lightning SpikeDetection": lightning_rule,
    "ZClip (would clip)": zclip_rule,
    "Megatron 10x": megatron_rule,
}

REAL_DETECTORS: dict[str, Callable[[list[str]], RowFlag]] = {
    "stabilitykit alert (default: loss drift 4, loss level 2)": ours_real("spike_alert"),
    "stabilitykit alert, loss level off (before)": ours_real("spike_alert", loss_level_alert=None),
    "stabilitykit alert, loss level 3": ours_real("spike_alert", loss_level_alert=3.0),
    "stabilitykit alert, loss level 1.5": ours_real("spike_alert", loss_level_alert=1.5),
    "stabilitykit alert, loss drift off": ours_real("spike_alert", loss_drift_alert=None),
    "stabilitykit alert, loss drift off, loss level off": ours_real(
        "spike_alert", loss_drift_alert=None, loss_level_alert=None
    ),
    "stabilitykit alert + loss drift 3": ours_real("spike_alert", loss_drift_alert=3.0),
    "stabilitykit alert + loss drift 2": ours_real("spike_alert", loss_drift_alert=2.0),
    "stabilitykit warning": ours_real("spike_warning"),
    "stabilitykit warning (signals every 10 steps)": ours_real("spike_warning", signal_every=10),
    "stabilitykit before (z>=4)": on_series(old_stream, ("grad_norm",)),
    "OLMo 6 std / 128 (grad norm, loss)": on_series(olmo_rule, ("grad_norm", "loss")),
    "Lightning SpikeDetection (loss)": on_series(lightning_rule, ("loss",)),
    "ZClip (grad norm)": on_series(zclip_rule, ("grad_norm",)),
    "Megatron 10x (loss)": on_series(megatron_rule, ("loss",)),
}


# ----------------------------------------------------------------------------- part 1
def part1(seeds: int, steps: int, detectors: dict[str, Callable[[], Flag]]) -> dict[str, Any]:
    """Per configuration and detector: recall on >= 3x spikes, per-size recall, false alarms, recall after NaN."""
    table: dict[str, Any] = {}
    for sigma in SIGMAS:
        for phi in PHIS:
            key = f"sigma={sigma:g} phi={phi:g}"
            streams = [synthetic_stream(sigma, phi, seed, steps) for seed in range(seeds)]
            innovation = streams[0].innovation
            cell: dict[str, Any] = {"innovation": innovation, "bound_3x": gaussian_bound(innovation, 3.0)}
            for name, factory in detectors.items():
                hits = {s: [0, 0] for s in SPIKE_SIZES}
                after = [0, 0]
                false_alarms = clean = 0
                for stream in streams:
                    flag = factory()
                    first_bad = min(stream.bad)
                    for t, x in enumerate(stream.values):
                        hit = flag(x)
                        if t in stream.spikes:
                            size = stream.spikes[t]
                            hits[size][0] += hit
                            hits[size][1] += 1
                            if t > first_bad and size >= 3:
                                after[0] += hit
                                after[1] += 1
                        elif t >= 100 and t not in stream.bad and t not in stream.ignore:
                            clean += 1
                            false_alarms += hit
                big = [hits[s] for s in SPIKE_SIZES if s >= 3]
                cell[name] = {
                    "recall_3x+": sum(h for h, _ in big) / max(1, sum(n for _, n in big)),
                    "by_size": {f"{s:g}x": hits[s][0] / max(1, hits[s][1]) for s in SPIKE_SIZES},
                    "fa_per_10k": false_alarms / clean * 1e4,
                    "recall_after_nan": after[0] / max(1, after[1]),
                }
            table[key] = cell
    return table


def print_part1(table: dict[str, Any], detectors: list[str]) -> None:
    short = {name: name.split(" (")[0].replace("stabilitykit", "sk") for name in detectors}
    print("\n## Synthetic suite: recall on spikes >= 3x / false alarms per 10k clean steps\n")
    print("| config | innovation | bound 3x | " + " | ".join(short[d] for d in detectors) + " |")
    print("|" + " --- |" * (3 + len(detectors)))
    for key, cell in table.items():
        parts = [f"{cell[d]['recall_3x+']:.2f} / {cell[d]['fa_per_10k']:.1f}" for d in detectors]
        print(f"| {key} | {cell['innovation']:.3f} | {cell['bound_3x']:.2f} | " + " | ".join(parts) + " |")
    ours = detectors[0]
    print(f"\n## Synthetic suite, {ours}: recall by spike size\n")
    print("| config | " + " | ".join(f"{s:g}x" for s in SPIKE_SIZES) + " | bound 3x | FA/10k |")
    print("|" + " --- |" * (3 + len(SPIKE_SIZES)))
    for key, cell in table.items():
        by = cell[ours]["by_size"]
        print(
            f"| {key} | "
            + " | ".join(f"{by[f'{s:g}x']:.2f}" for s in SPIKE_SIZES)
            + f" | {cell['bound_3x']:.2f} | {cell[ours]['fa_per_10k']:.1f} |"
        )
    print("\n## Synthetic suite, summary\n")
    print(
        "| detector | configs (innovation <= 0.16) meeting recall >= 0.95 and FA <= 1 | mean recall 3x+ (<= 0.16) "
        "| worst FA/10k | recall after NaN/Inf |"
    )
    print("| --- | --- | --- | --- | --- |")
    for d in detectors:
        easy = [c for c in table.values() if c["innovation"] <= 0.16]
        ok = sum(1 for c in easy if c[d]["recall_3x+"] >= 0.95 and c[d]["fa_per_10k"] <= 1.0)
        mean = sum(c[d]["recall_3x+"] for c in easy) / len(easy)
        worst = max(c[d]["fa_per_10k"] for c in table.values())
        after = sum(c[d]["recall_after_nan"] for c in table.values()) / len(table)
        print(f"| {d} | {ok}/{len(easy)} | {mean:.2f} | {worst:.1f} | {after:.2f} |")


# ----------------------------------------------------------------------------- part 2
def rows_of(run: Run) -> list[Row]:
    names = run.columns
    return [{n: float(v) for n, v in zip(names, r, strict=True)} for r in run.data.tolist()]


def part2(runs: list[Run], detectors: dict[str, Callable[[list[str]], RowFlag]]) -> dict[str, Any]:
    """Per detector: onset recall, share before the loss moved, lead times, alerts per 10k healthy steps."""
    truths = {run.key: ground_truth(run.col("loss")) for run in runs}
    out: dict[str, Any] = {}
    for name, make in detectors.items():
        spikes_hit = spikes_n = early = div_hit = div_n = 0
        leads: list[int] = []
        fa = healthy = fa_quiet = healthy_quiet = 0
        for run in runs:
            truth = truths[run.key]
            flag = make(run.layer_names())
            alerts = np.array([flag(row) for row in rows_of(run)], dtype=bool)
            steps = np.flatnonzero(alerts)
            for m, t in truth.spikes:
                spikes_n += 1
                inside = steps[(steps >= m - 30) & (steps <= t + 3)]
                if len(inside):
                    spikes_hit += 1
                    leads.append(int(m - inside[0]))
                    early += inside[0] < m
            for d in truth.divergences:
                div_n += 1
                div_hit += bool(((steps >= d - 30) & (steps <= d + 3)).any())
            fa += int(alerts[truth.healthy].sum())
            healthy += int(truth.healthy.sum())
            if not truth.spikes and not truth.divergences:
                fa_quiet += int(alerts[truth.healthy].sum())
                healthy_quiet += int(truth.healthy.sum())
        out[name] = {
            "spike_recall": spikes_hit / max(1, spikes_n),
            "spikes": spikes_n,
            "before_moved": early / max(1, spikes_hit),
            "median_lead": float(np.median(leads)) if leads else math.nan,
            "divergence_recall": div_hit / max(1, div_n),
            "divergences": div_n,
            "fa_per_10k": fa / max(1, healthy) * 1e4,
            "fa_per_10k_quiet_runs": fa_quiet / max(1, healthy_quiet) * 1e4,
            "healthy_steps": healthy,
            "quiet_steps": healthy_quiet,
        }
    return out


def print_part2(table: dict[str, Any], runs: list[Run]) -> None:
    any_row = next(iter(table.values()))
    print(
        f"\n## Real instabilities: {len(runs)} runs, {any_row['spikes']} loss-spike onsets, "
        f"{any_row['divergences']} divergence onsets, {any_row['healthy_steps']} healthy steps "
        f"({any_row['quiet_steps']} in runs with no event)\n"
    )
    print(
        "| detector | loss-spike recall | alerted before the loss moved | median lead (steps) "
        "| divergence recall | alerts / 10k healthy steps | same, runs with no event |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in table.items():
        print(
            f"| {name} | {r['spike_recall']:.2f} | {r['before_moved']:.2f} | {r['median_lead']:.0f} "
            f"| {r['divergence_recall']:.2f} | {r['fa_per_10k']:.1f} | {r['fa_per_10k_quiet_runs']:.1f} |"
        )


# ----------------------------------------------------------------------------- part 2b
#: Injected blow-ups: the step they start, how many times the loss they hold, and over how many steps the loss
#: gets there (1: a jump; 50: a climb).
BLOWUP_STARTS = (8, 15, 30, 60, 150, 250)
BLOWUP_FACTORS = (3.0, 15.0)
BLOWUP_RAMPS = (1, 50)
#: An injected blow-up counts as alerted when an alert comes within this many steps of its start (a climb:
#: of the end of its ramp).
BLOWUP_DEADLINE = 30


def injected(rows: list[Row], start: int, factor: float, ramp: int) -> list[Row]:
    """``rows`` with the loss held ``factor`` times higher from ``start`` on (reached over ``ramp`` steps)."""
    out = []
    for t, row in enumerate(rows):
        if t >= start:
            row = {**row, "loss": row["loss"] * factor ** min(1.0, (t - start + 1) / ramp)}
        out.append(row)
    return out


def part2b(runs: list[Run], detectors: dict[str, Callable[[list[str]], RowFlag]]) -> dict[str, Any]:
    """Sustained blow-ups injected into the runs with no event (a loss held high from a step on, from inside the
    detector's warm-up to late): per detector, the share alerted in time, and the alerts in the first 50 steps
    of the same runs left as they are (healthy: the benchmark's healthy steps start at 50)."""
    quiet = [r for r in runs if not (t := ground_truth(r.col("loss"))).spikes and not t.divergences]
    out: dict[str, Any] = {}
    for name, make in detectors.items():
        hits: dict[tuple[int, float, int], list[int]] = {}
        early_alerts = early_steps = 0
        for run in quiet:
            rows = rows_of(run)
            flag = make(run.layer_names())
            early = [flag(row) for row in rows[:50]]
            early_alerts += sum(early)
            early_steps += 50
            for start in BLOWUP_STARTS:
                for factor in BLOWUP_FACTORS:
                    for ramp in BLOWUP_RAMPS:
                        flag = make(run.layer_names())
                        alerts = [flag(row) for row in injected(rows, start, factor, ramp)]
                        end = start + ramp - 1 + BLOWUP_DEADLINE
                        cell = hits.setdefault((start, factor, ramp), [0, 0])
                        cell[0] += any(alerts[start : end + 1])
                        cell[1] += 1
        out[name] = {
            "cells": {key: h / n for key, (h, n) in hits.items()},
            "recall": sum(h for h, _ in hits.values()) / max(1, sum(n for _, n in hits.values())),
            "early_per_10k": early_alerts / max(1, early_steps) * 1e4,
            "runs": len(quiet),
        }
    return out


def print_part2b(table: dict[str, Any]) -> None:
    runs = next(iter(table.values()))["runs"]
    print(
        f"\n## Injected sustained blow-ups: the loss held 3x or 15x higher from step s on (a jump, or a climb over "
        f"50 steps), in each of the {runs} runs with no event; alerted within {BLOWUP_DEADLINE} steps of the start "
        "(of the climb's end)\n"
    )
    keys = list(next(iter(table.values()))["cells"])
    head = " | ".join(f"s={s} {f:g}x {'jump' if r == 1 else 'climb'}" for s, f, r in keys)
    print(f"| detector | all | alerts / 10k in steps 0-49 of the runs as they are | {head} |")
    print("|" + " --- |" * (3 + len(keys)))
    for name, r in table.items():
        cells = " | ".join(f"{r['cells'][k]:.2f}" for k in keys)
        print(f"| {name} | {r['recall']:.2f} | {r['early_per_10k']:.1f} | {cells} |")


# ----------------------------------------------------------------------------- part 3
def signal_scores(run: Run) -> dict[str, np.ndarray]:
    """Per-step scores of each signal a rule could use, from the library's detectors (no lookahead)."""
    n = len(run.data)
    main, layers, extra = PredictiveDetector(size=2), PredictiveDetector(size=6), PredictiveDetector(size=2)
    trend = TrendDetector(warmup_steps=50)
    grad, loss, update, logit = (run.col(c) for c in ("grad_norm", "loss", "update", "max_attn_logit"))
    layer_values = run.layers()
    names = ("loss z", "grad-norm z", "min(grad z, loss z)", "max layer z", "update-size z", "attention-logit z")
    out = {name: np.zeros(n) for name in (*names, "attention-logit trend", "loss CUSUM (k=1)")}
    cusum = 0.0
    for t in range(n):
        z_grad, z_loss = main.update([grad[t], loss[t]])
        z_update, z_logit = extra.update([update[t], logit[t]])
        cusum = max(0.0, cusum + min(z_loss, 4.0) - 1.0)
        row = (z_loss, z_grad, min(z_grad, z_loss), max(layers.update(list(layer_values[t]))), z_update, z_logit)
        for name, value in zip(names, row, strict=True):
            out[name][t] = value
        out["attention-logit trend"][t] = trend.update(abs(logit[t]))
        out["loss CUSUM (k=1)"][t] = cusum
    return out


def part3(tune: list[Run], held: list[Run]) -> dict[str, Any]:
    """Each signal alone, thresholded just above its maximum on the tuning set's quiet runs, scored on held-out runs."""
    scores = {run.key: signal_scores(run) for run in tune + held}
    truths = {run.key: ground_truth(run.col("loss")) for run in tune + held}
    quiet = [r for r in tune if not truths[r.key].spikes and not truths[r.key].divergences]
    out: dict[str, Any] = {}
    for name in scores[tune[0].key]:
        threshold = max(float(scores[r.key][name][truths[r.key].healthy].max()) for r in quiet)
        hit = early = n = div_hit = div_n = exceed = healthy = exceed_q = healthy_q = 0
        for run in held:
            s, truth = scores[run.key][name], truths[run.key]
            above = s > threshold
            for m, t in truth.spikes:
                n += 1
                hit += bool(above[max(0, m - 30) : t + 4].any())
                early += bool(above[max(0, m - 30) : m].any())
            for d in truth.divergences:
                div_n += 1
                div_hit += bool(above[max(0, d - 30) : d + 4].any())
            exceed += int(above[truth.healthy].sum())
            healthy += int(truth.healthy.sum())
            if not truth.spikes and not truth.divergences:
                exceed_q += int(above[truth.healthy].sum())
                healthy_q += int(truth.healthy.sum())
        out[name] = {
            "threshold": threshold,
            "spike_recall": hit / max(1, n),
            "before": early / max(1, n),
            "divergence_recall": div_hit / max(1, div_n),
            "exceed_per_10k": exceed / max(1, healthy) * 1e4,
            "exceed_quiet_per_10k": exceed_q / max(1, healthy_q) * 1e4,
        }
    return out


def print_part3(table: dict[str, Any], tune: list[Run], held: list[Run]) -> None:
    print(
        f"\n## Each signal alone: threshold just above its largest value on the healthy steps of the "
        f"tuning set's runs with no event ({len(tune)} runs), scored on the {len(held)} held-out runs\n"
    )
    print(
        "| signal | threshold | loss-spike onsets reached | reached before the loss moved "
        "| divergence onsets reached | healthy steps above / 10k | same, runs with no event |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in table.items():
        print(
            f"| {name} | {r['threshold']:.2f} | {r['spike_recall']:.2f} | {r['before']:.2f} "
            f"| {r['divergence_recall']:.2f} | {r['exceed_per_10k']:.1f} | {r['exceed_quiet_per_10k']:.1f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--traces", default=str(TRACES))
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--skip-real", action="store_true")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.skip_real:
        pass
    elif Path(args.traces).exists():
        runs = load_runs(Path(args.traces), DETECTOR_ARMS)
        tune = [r for r in runs if "#s" not in r.key]  # seed 0: the runs the rules were designed on
        held = [r for r in runs if "#s" in r.key]  # seeds 1+: generated after, for scoring only
        for title, subset in (("all runs", runs), ("tuning set (seed 0)", tune), ("held-out (seeds 1+)", held)):
            if subset and (held or subset is runs):
                print(f"\n# Real runs, {title}")
                print_part2(part2(subset, REAL_DETECTORS), subset)
        if tune and held:
            print_part3(part3(tune, held), tune, held)
        alerts = {k: v for k, v in REAL_DETECTORS.items() if "alert" in k and "drift 2" not in k}
        print_part2b(part2b(held or runs, alerts))
    else:
        print(f"(no traces at {args.traces}: run benchmarks/instability/train.py first)")
    if not args.skip_synthetic:
        print_part1(part1(args.seeds, args.steps, STREAM_DETECTORS), list(STREAM_DETECTORS))
    print(f"\n({time.perf_counter() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
