"""Early warning scored on the corpus (``corpus.py``): ours and every peer, on held-out families.

    python benchmarks/warning/score.py [--corpus benchmarks/warning/corpus.npz] [--split tune|held|all]
                                       [--signals-every 1] [--skip-synthetic] [--onsets] [--candidates] [--bound]

Ground truth comes from the loss alone, by the rule of ``truth.py`` (the same for every detector,
fixed before any detector was scored on it): ``spike_suite.ground_truth``'s 1.3x rule with each
run's own noise taken into account (a one-step rise must clear 5 of the noise; a rise that holds for
five steps counts whatever the noise). An **onset** is a spike (moved step m, peak t) or a divergence
d (m = t = d) not within 50 steps after a spike. Scoring:

* **pages / 10k healthy steps**: ``spike_alert``s on healthy steps (ground truth's: from step 50,
  outside every onset's [m - 30, t + 50] and every divergence);
* **looks / 1k healthy steps**: ``spike_warning``s on healthy steps;
* **recall**: onsets with a ``spike_alert`` in [m - 30, t + 3];
* **warned before the loss moved**: onsets with any event (warning or alert) in [m - 30, m - 1];
* **median lead**: m minus the first event's step in [m - 30, t + 3], over onsets with one
  (> 0: ahead of the loss).

Split by family (a held-out family is also a held-out optimizer and schedule, see ``corpus.py``):
the detectors' defaults were chosen on ``gpt2`` and ``bert`` only; ``llama``, ``mixtral`` and
``resnet`` are reported and were not read while choosing. Peers have one level: each flag counts
as a page (and their looks column is empty). Signals reach the detector as the engine hands them
over: the model monitors' precursors (``monitors/<signal>/<module>``: max attention logit, max |logit|,
log Z) on logging steps (``--signals-every``, default every step: the corpus logs every step). The
update-to-weight ratio and the LR are in the corpus but not handed to the detector, as the engine
does not: ``--candidates`` (tuning families only) scores them as a precursor (``extra_signals``),
and each layer's share of the grad norm (``SpikeConfig.layer_share_trend``), against the defaults.

``--bound`` (``bound.py``) prints what bounds "warned before the loss moved" on the split: how many
onsets are data events (a burst or the shift arriving: nothing inside the model precedes them) and,
on the tuning families, the best any single precursor threshold does at <= 1 look per 1,000 healthy steps.

The synthetic hard stream (``spike_suite.synthetic_stream``, sigma 0.35, phi 0.9: grad norms that
wander) is scored on five seeds: recall on spikes of 3x and more, false alarms per 10k clean steps.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bound
from spike_suite import (
    lightning_rule,
    megatron_rule,
    olmo_rule,
    synthetic_stream,
    zclip_rule,
)
from truth import Onsets, onsets_of

from stabilitykit.precursors import kind_of as precursor_kind
from stabilitykit.spikes import SpikeConfig, SpikeMonitor

CORPUS = Path(__file__).with_name("corpus.npz")
TUNE = ("gpt2", "bert")
HELD = ("llama", "mixtral", "resnet")
#: Corpus columns handed to the detector as precursor signals, and the name the engine gives them.
SIGNAL_PREFIXES = {
    "attn_logit_max/": "monitors/attn_logit_max/",
    "log_z/": "monitors/log_z/",
    "logits_max/": "monitors/logits_max/",
}
WINDOW_BEFORE, WINDOW_AFTER = 30, 3


@dataclass
class CorpusRun:
    key: str
    family: str
    arm: str
    meta: dict[str, Any]
    columns: list[str]
    data: np.ndarray

    def col(self, name: str) -> np.ndarray:
        return self.data[:, self.columns.index(name)].astype(np.float64)

    def layer_names(self) -> list[str]:
        return [c.split("/", 1)[1] for c in self.columns if c.startswith("layer/")]


def load(path: Path = CORPUS, families: Iterable[str] | None = None) -> list[CorpusRun]:
    keep = set(families) if families is not None else None
    with np.load(path) as npz:
        meta = json.loads(str(npz["meta"]))
        return [
            CorpusRun(key, m["family"], m["arm"], m, list(m["columns"]), npz[key])
            for key, m in meta["runs"].items()
            if keep is None or m["family"] in keep
        ]


# ----------------------------------------------------------------------------- detectors under test
Event = tuple[int, str, str]  # (step, "page" | "look", signal)
Replay = Callable[[CorpusRun, int], list[Event]]


def extra_signals(run: CorpusRun, kinds: Sequence[str]) -> list[dict[str, float]]:
    """Per step, the candidate precursors ``kinds`` computed from the run's columns, by the name a detector
    would score them under:

    * ``update_per_lr``: the update-to-weight ratio over the LR (``update_ratio``, the update of the step
      before, as the engine measures it, over ``lr/0`` of the logging step, the LR the engine holds then;
      a schedule moves it by a fraction of a percent per step): Adam's update
      size per unit of LR, so a warm-up, a decay or a restart does not move it, a ramped LR does not either,
      and what grows is the optimizer's own step (a beta2 near 1, a tiny eps, gradients that outgrow the
      second moment).
    """
    out: list[dict[str, float]] = [{} for _ in range(len(run.data))]
    if "update_per_lr" in kinds and "update_ratio" in run.columns and "lr/0" in run.columns:
        ratio, lr = run.col("update_ratio"), run.col("lr/0")
        for t in range(len(out)):
            if lr[t] > 0 and math.isfinite(ratio[t]) and ratio[t] > 0:
                out[t]["update_ratio_per_lr"] = float(ratio[t] / lr[t])
    return out


def ours(signals_every: int = 1, extra: Sequence[str] = (), monitors: bool = True, **config: Any) -> Replay:
    """``SpikeMonitor`` with ``SpikeConfig(**config)``, fed as the engine feeds it (``extra``: candidate
    precursors of ``extra_signals`` handed over too; ``monitors=False``: the monitors' signals not)."""

    def replay(run: CorpusRun, every: int) -> list[Event]:
        step_every = max(signals_every, every)
        layers = run.layer_names()
        monitor = SpikeMonitor(SpikeConfig(**config), layers)
        idx_layers = [run.columns.index(f"layer/{n}") for n in layers]
        sig_cols = []
        for i, c in enumerate(run.columns):
            for prefix, name in SIGNAL_PREFIXES.items():
                if monitors and c.startswith(prefix):
                    sig_cols.append((i, name + c[len(prefix) :]))
        more = extra_signals(run, extra) if extra else None
        gi, li = run.columns.index("grad_norm"), run.columns.index("loss")
        out: list[Event] = []
        for t, row in enumerate(run.data.tolist()):
            signals = None
            if t % step_every == 0:
                signals = {name: row[i] for i, name in sig_cols if math.isfinite(row[i])}
                if more is not None:
                    signals.update(more[t])
            layer_norms = [row[i] for i in idx_layers]
            for e in monitor.update(t, row[gi], row[li], layer_norms, signals=signals):
                if e.kind == "spike_alert":
                    out.append((t, "page", str(e.details.get("rule"))))
                elif e.kind == "spike_warning":
                    out.append((t, "look", str(e.details.get("signal"))))
        return out

    return replay


def peer(factory: Callable[[], Callable[[float], bool]], series: Sequence[str]) -> Replay:
    """A one-series peer rule on each named series; a step counts once if any flags (a page)."""

    def replay(run: CorpusRun, every: int) -> list[Event]:
        flags = {name: factory() for name in series}
        cols = {name: run.col(name) for name in series}
        out: list[Event] = []
        for t in range(len(run.data)):
            hit = [name for name, f in flags.items() if f(float(cols[name][t]))]
            if hit:
                out.append((t, "page", hit[0]))
        return out

    return replay


#: The defaults before the median rule and the look confirmation; before the joint-page confirmation, the grad
#: norm's own scale floor, the look cooldown and the trend hysteresis; and before the corpus existed.
LAST: dict[str, Any] = {"loss_median_alert": None, "look_confirm_steps": None}
PREVIOUS: dict[str, Any] = {
    **LAST,
    "joint_confirm": False,
    "warning_scale_floor": 0.02,
    "warning_cooldown": 1,
    "trend_rearm": 1.0,
}
BEFORE: dict[str, Any] = {
    **PREVIOUS,
    "scale_floor": 0.0,
    "warning_scale_floor": 0.0,
    "z_warning": 4.0,
    "trend_warning": 0.7,
    "trend_warmup": 50,
    "trend_while_stalled": None,
}
DETECTORS: dict[str, Replay] = {
    "stabilitykit (defaults)": ours(),
    "stabilitykit, no median rule": ours(loss_median_alert=None),
    "stabilitykit, grad-norm looks unconfirmed": ours(look_confirm_steps=None),
    "stabilitykit last defaults (no median rule, grad-norm looks unconfirmed)": ours(**LAST),
    "stabilitykit older defaults (also joint pages unconfirmed, grad floor 0.02, no look cooldown)": ours(**PREVIOUS),
    "stabilitykit before (no scale floor, z_warning 4, trends 2x ungated)": ours(**BEFORE),
    "OLMo 6 std / 128 (grad norm, loss)": peer(olmo_rule, ("grad_norm", "loss")),
    "Lightning SpikeDetection (loss)": peer(lightning_rule, ("loss",)),
    "ZClip would clip (grad norm)": peer(zclip_rule, ("grad_norm",)),
    "Megatron 10x (loss)": peer(megatron_rule, ("loss",)),
}
#: Candidate precursors, scored on the tuning families only (``--candidates``): kept only if they help there.
CANDIDATES: dict[str, Replay] = {
    "stabilitykit (defaults)": ours(),
    "defaults without the monitors' signals": ours(monitors=False),
    "+ update ratio / LR": ours(extra=("update_per_lr",)),
    "+ per-layer grad-norm share": ours(layer_share_trend=True),
    "+ both": ours(extra=("update_per_lr",), layer_share_trend=True),
}


# ----------------------------------------------------------------------------- scoring
@dataclass
class Tally:
    healthy: int = 0
    pages: int = 0
    looks: int = 0
    onsets: int = 0
    recalled: int = 0
    before: int = 0
    leads: list[int] = field(default_factory=list)
    signals: dict[str, int] = field(default_factory=dict)
    early: dict[str, list[int]] = field(default_factory=dict)  # signal kind -> leads of onsets it warned before

    def add(self, other: Tally) -> None:
        self.healthy += other.healthy
        self.pages += other.pages
        self.looks += other.looks
        self.onsets += other.onsets
        self.recalled += other.recalled
        self.before += other.before
        self.leads += other.leads
        for k, v in other.signals.items():
            self.signals[k] = self.signals.get(k, 0) + v
        for k, leads in other.early.items():
            self.early.setdefault(k, []).extend(leads)

    def row(self) -> dict[str, float]:
        return {
            "pages_per_10k": self.pages / max(1, self.healthy) * 1e4,
            "looks_per_1k": self.looks / max(1, self.healthy) * 1e3,
            "recall": self.recalled / max(1, self.onsets),
            "before": self.before / max(1, self.onsets),
            "median_lead": float(np.median(self.leads)) if self.leads else math.nan,
            "onsets": self.onsets,
            "healthy": self.healthy,
        }


def tally(run: CorpusRun, events: list[Event], truth: Onsets) -> Tally:
    out = Tally()
    out.healthy = int(truth.healthy.sum())
    for step, level, signal in events:
        if truth.healthy[step]:
            if level == "page":
                out.pages += 1
            else:
                out.looks += 1
                out.signals[signal] = out.signals.get(signal, 0) + 1
    for m, t in truth.onsets:
        out.onsets += 1
        inside = [(s, lv) for s, lv, _ in events if m - WINDOW_BEFORE <= s <= t + WINDOW_AFTER]
        if any(lv == "page" for _, lv in inside):
            out.recalled += 1
        if any(s < m for s, _ in inside):
            out.before += 1
            first: dict[str, int] = {}
            for s, _, signal in events:
                if m - WINDOW_BEFORE <= s < m:
                    first.setdefault(signal_kind(signal), m - s)
            for kind, lead in first.items():
                out.early.setdefault(kind, []).append(lead)
        if inside:
            out.leads.append(m - min(s for s, _ in inside))
    return out


def signal_kind(signal: str) -> str:
    """A short kind for an event's signal or rule (the precursor kinds of ``stabilitykit.precursors``)."""
    if "/" in signal or "_per_" in signal or signal.startswith("update"):
        return precursor_kind(signal).name
    return signal


def score(runs: list[CorpusRun], detectors: dict[str, Replay], every: int = 1) -> dict[str, dict[str, Tally]]:
    """Per detector, per family (and "all"): the tally."""
    truths = {r.key: onsets_of(r.col("loss")) for r in runs}
    out: dict[str, dict[str, Tally]] = {}
    for name, replay in detectors.items():
        per: dict[str, Tally] = {"all": Tally()}
        for run in runs:
            t = tally(run, replay(run, every), truths[run.key])
            per.setdefault(run.family, Tally()).add(t)
            per["all"].add(t)
        out[name] = per
    return out


def print_table(title: str, table: dict[str, dict[str, Tally]]) -> None:
    print(f"\n## {title}\n")
    print(
        "| detector | family | pages / 10k healthy | looks / 1k healthy | onset recall | warned before the loss "
        "moved | median lead (steps) | onsets | healthy steps |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, per in table.items():
        peer_row = not name.startswith(("stabilitykit", "+", "defaults"))
        for family, t in per.items():
            r = t.row()
            looks = "-" if peer_row else f"{r['looks_per_1k']:.2f}"
            print(
                f"| {name} | {family} | {r['pages_per_10k']:.1f} | {looks} | {r['recall']:.2f} | {r['before']:.2f} "
                f"| {r['median_lead']:.0f} | {r['onsets']} | {r['healthy']} |"
            )


def print_early(table: dict[str, dict[str, Tally]]) -> None:
    """Per detector of ours: which signals warned before the loss moved, on how many onsets, and their median lead;
    and the signals of the looks on healthy steps."""
    print("\n## What warned before the loss moved, and what looked on healthy steps (ours)\n")
    for name, per in table.items():
        if not name.startswith("stabilitykit") and not name.startswith(("+", "defaults")):
            continue
        t = per["all"]
        early = ", ".join(f"{k}: {len(v)} (median lead {float(np.median(v)):.0f})" for k, v in sorted(t.early.items()))
        looks: dict[str, int] = {}
        for signal, count in t.signals.items():
            kind = signal_kind(signal)
            looks[kind] = looks.get(kind, 0) + count
        print(f"- {name}: before the loss: {early or 'none'}; looks: {looks or 'none'}")


def print_onsets(runs: list[CorpusRun]) -> None:
    print("\n## Runs and their onsets (ground truth from the loss)\n")
    print("| run | optimizer | schedule | mechanism | onsets (moved step, peak step) | healthy steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        o = onsets_of(r.col("loss"))
        print(
            f"| {r.key} | {r.meta['optimizer']} | {r.meta['schedule']} | {r.meta['mechanism']} "
            f"| {', '.join(f'{m}-{t}' for m, t in o.onsets) or '-'} | {int(o.healthy.sum())} |"
        )


# ----------------------------------------------------------------------------- synthetic
def hard_stream(seeds: int = 5, sigma: float = 0.35, phi: float = 0.9, **config: Any) -> dict[str, float]:
    """Recall on >= 3x spikes and false alarms / 10k clean steps of ``spike_alert`` (grad norm, no loss)."""
    hit = n = fa = clean = 0
    for seed in range(seeds):
        stream = synthetic_stream(sigma, phi, seed, 6000)
        monitor = SpikeMonitor(SpikeConfig(**config), [])
        for t, x in enumerate(stream.values):
            alert = any(e.kind == "spike_alert" for e in monitor.update(t, x, None, None))
            if t in stream.spikes:
                if stream.spikes[t] >= 3:
                    n += 1
                    hit += alert
            elif t >= 100 and t not in stream.bad and t not in stream.ignore:
                clean += 1
                fa += alert
    return {"recall": hit / max(1, n), "spikes": n, "fa_per_10k": fa / max(1, clean) * 1e4}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=str(CORPUS))
    parser.add_argument("--split", choices=("tune", "held", "all"), default="held")
    parser.add_argument("--signals-every", type=int, default=1)
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--onsets", action="store_true", help="also list each run's onsets")
    parser.add_argument("--bound", action="store_true", help="also print the bound on warning before the loss moved")
    parser.add_argument(
        "--candidates", action="store_true", help="score the candidate precursors instead (tuning families only)"
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    families = {"tune": TUNE, "held": HELD, "all": TUNE + HELD}[args.split]
    runs = load(Path(args.corpus), families)
    if args.onsets:
        print_onsets(runs)
    if args.candidates and args.split != "tune":
        parser.error("--candidates scores the tuning families only (--split tune): never choose on held-out ones")
    table = score(runs, CANDIDATES if args.candidates else DETECTORS, args.signals_every)
    print_table(f"{args.split} families ({', '.join(families)}): {len(runs)} runs", table)
    print_early(table)
    if args.bound:
        truths = {r.key: onsets_of(r.col("loss")) for r in runs}
        bound.report(runs, truths, args.split, tune=args.split == "tune")
    if not args.skip_synthetic:
        r = hard_stream()
        print(
            f"\n## Synthetic hard stream (sigma 0.35, phi 0.9, 5 seeds x 6000 steps)\n\n"
            f"spike_alert recall on {r['spikes']} spikes >= 3x: {r['recall']:.3f}; "
            f"false alarms: {r['fa_per_10k']:.2f} per 10k clean steps"
        )
    print(f"\n({time.perf_counter() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
