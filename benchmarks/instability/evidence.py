"""Final loss against peak learning rate per arm, from the stored traces: a markdown table and a plot.

    python benchmarks/instability/evidence.py [--traces benchmarks/instability/traces.npz]
                                              [--plot docs/guides/img/evidence.png]

Reads only the traces (``train.py`` writes them); prints, per arm and LR, the held-out loss at
the end of the run, and per run the loss spikes and divergences of the loss-based ground truth.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
from spike_suite import TRACES, ground_truth, load_runs

ORDER = ("baseline", "qknorm", "zloss", "both", "clip", "zclip", "adaptive", "skip", "qkclip", "softcap", "agc")
LABELS = {
    "baseline": "baseline",
    "qknorm": "qk-norm",
    "zloss": "z-loss",
    "both": "qk-norm + z-loss",
    "clip": "fixed clip 1.0",
    "zclip": "ZClip",
    "adaptive": "adaptive clipping",
    "skip": "skip-on-spike",
    "qkclip": "QK-clip 100",
    "softcap": "soft-cap 50/30",
    "agc": "per-tensor adaptive clipping",
}


def seed_of(key: str) -> int:
    """The seed of a run key (``arm@lr`` is seed 0, ``arm@lr#s2`` seed 2)."""
    return int(key.split("#s")[1]) if "#s" in key else 0


def print_summary(all_runs: list, lrs: list[float]) -> None:
    """Per arm and LR over every seed stored: mean final loss (runs); loss spikes and divergences per run
    at the LRs every arm ran (0.3 and 1), so the counts compare across arms."""
    print("\nAll seeds: mean final loss (runs); loss spikes and divergences per run at LR 0.3 and 1\n")
    print("| arm | " + " | ".join(f"LR {lr:g}" for lr in lrs) + " | spikes / run | divergences / run |")
    print("|" + " --- |" * (3 + len(lrs)))
    for arm in [a for a in ORDER if any(r.arm == a for r in all_runs)]:
        cells, spikes, divergences, n = [], 0, 0, 0
        for lr in lrs:
            runs = [r for r in all_runs if r.arm == arm and r.lr == lr]
            if not runs:
                cells.append("-")
                continue
            losses = [r.final_loss for r in runs]
            cells.append(f"{sum(losses) / len(losses):.3f} ({len(runs)})")
            for r in runs if lr >= 0.3 else []:
                truth = ground_truth(r.col("loss"))
                spikes += len(truth.spikes)
                divergences += len(truth.divergences)
                n += 1
        rates = f" | {spikes / n:.2f} | {divergences / n:.2f} |" if n else " | - | - |"
        print(f"| {LABELS[arm]} | " + " | ".join(cells) + rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", default=str(TRACES))
    parser.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args(argv)
    all_runs = load_runs(Path(args.traces))
    lrs = sorted({r.lr for r in all_runs})
    for seed in sorted({seed_of(r.key) for r in all_runs}):
        runs = [r for r in all_runs if seed_of(r.key) == seed]
        by = {(r.arm, r.lr): r for r in runs}
        arms = [a for a in ORDER if any(r.arm == a for r in runs)]
        print(f"\nSeed {seed}:\n")
        print("| arm | " + " | ".join(f"LR {lr:g}" for lr in lrs) + " |")
        print("|" + " --- |" * (1 + len(lrs)))
        for arm in arms:
            cells = []
            for lr in lrs:
                run = by.get((arm, lr))
                if run is None:
                    cells.append("-")
                    continue
                truth = ground_truth(run.col("loss"))
                marks = len(truth.spikes) * "s" + len(truth.divergences) * "D"
                skipped = int(np.nansum(run.col("skipped")))
                extra = f" ({marks}{', ' if marks and skipped else ''}{f'{skipped} skipped' if skipped else ''})"
                cells.append(f"{run.final_loss:.3f}" + (extra if marks or skipped else ""))
            print(f"| {LABELS[arm]} | " + " | ".join(cells) + " |")
    print("\ns: a loss spike, D: a divergence (loss-based ground truth); n skipped: steps the arm skipped")
    print_summary(all_runs, lrs)
    runs = [r for r in all_runs if seed_of(r.key) == 0]
    by = {(r.arm, r.lr): r for r in runs}
    arms = [a for a in ORDER if any(r.arm == a for r in runs)]
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for arm in arms:
            points = [(lr, by[(arm, lr)].final_loss) for lr in lrs if (arm, lr) in by]
            points = [(x, y) for x, y in points if math.isfinite(y)]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o", label=LABELS[arm])
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("held-out loss at the end (nats/byte)")
        ax.set_title("0.5M-parameter byte GPT on the stdlib, 400 steps (seed 0)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
