"""``stabilitykit report``: one picture of a run from its JSONL log or a Lightning CSV log.

Panels: loss; total grad norm (log scale) with the clip threshold; the grad-norm z-score with
the warning line; a per-layer grad-norm heatmap (layers x logging steps). Skipped steps, spike
warnings, loss spikes and alerts are marked on every line panel. Needs matplotlib (``plots`` extra).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunLog", "draw_report", "load_run_log"]

_MARKERS = {
    "skipped": ("x", "tab:red", "skipped"),
    "spike_warning": ("^", "tab:orange", "spike warning"),
    "loss_spike": ("v", "tab:purple", "loss spike"),
    "diverged": ("X", "black", "diverged"),
    "fp16_warning": ("s", "tab:brown", "fp16 warning"),
}


@dataclass
class RunLog:
    """Metric rows (one per logging step) and events, whatever file they came from."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    prefix: str = "stability"

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """Steps and values of ``<prefix>/<name>`` where present."""
        key = f"{self.prefix}/{name}" if self.prefix else name
        pairs = [(int(r["step"]), float(r[key])) for r in self.rows if r.get(key) not in (None, "")]
        return [s for s, _ in pairs], [v for _, v in pairs]

    def layer_names(self) -> list[str]:
        """Per-layer grad-norm names, in first-seen order."""
        head = f"{self.prefix}/grad_norm/"
        names: dict[str, None] = {}
        for row in self.rows:
            for key in row:
                if key.startswith(head) and key[len(head) :] not in ("total", "max"):
                    names.setdefault(key[len(head) :], None)
        return list(names)


def _float(value: str) -> float | str:
    try:
        return float(value)
    except ValueError:
        return value


def load_run_log(path: str | Path, prefix: str = "stability") -> RunLog:
    """Read the guard's JSONL log, or a Lightning ``CSVLogger`` ``metrics.csv`` (rows merged by step)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("metrics.csv")) or sorted(path.rglob("*.jsonl"))
        if not found:
            raise FileNotFoundError(f"no metrics.csv or *.jsonl under {path}")
        path = found[-1]
    if path.suffix == ".csv":
        by_step: dict[int, dict[str, Any]] = {}
        with path.open(newline="") as handle:
            for record in csv.DictReader(handle):
                if not record.get("step"):
                    continue
                step = int(float(record["step"]))
                merged = by_step.setdefault(step, {"step": step})
                merged.update({k: _float(v) for k, v in record.items() if v not in ("", None) and k != "step"})
        rows = [by_step[s] for s in sorted(by_step)]
        events = _events_from_counters(rows, prefix)
        return RunLog(rows, events, prefix)
    from stabilitykit.sinks.jsonl import read_jsonl

    rows, events = read_jsonl(path)
    return RunLog(rows, [{"kind": e["event"], **e} for e in events], prefix)


def _events_from_counters(rows: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """Without an event log (CSV), skips are read off the skipped/total counter."""
    events = []
    last = 0.0
    for row in rows:
        total = row.get(f"{prefix}/skipped/total")
        if isinstance(total, float) and total > last:
            events.append({"kind": "skipped", "step": row["step"], "count": int(total - last)})
            last = total
    return events


def draw_report(log: str | Path | RunLog, output: str | Path = "report.png", title: str | None = None) -> Path:
    """Draw the one-page report of a run and save it as a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    run = log if isinstance(log, RunLog) else load_run_log(log)
    if not run.rows:
        raise ValueError(f"{log}: no metric rows to draw")
    layers = run.layer_names()
    fig, axes = plt.subplots(4 if layers else 3, 1, figsize=(12, 13 if layers else 9), sharex=False)
    ax_loss, ax_norm, ax_z = axes[0], axes[1], axes[2]

    steps, loss = run.series("loss")
    ax_loss.plot(steps, loss, color="tab:blue", lw=1.2)
    ax_loss.set_ylabel("loss")
    positive = [v for v in loss if math.isfinite(v) and v > 0]
    if positive and max(positive) / min(positive) > 50:
        ax_loss.set_yscale("log")  # a spike would flatten everything else

    steps, norm = run.series("grad_norm/total")
    finite = [(s, v) for s, v in zip(steps, norm, strict=True) if math.isfinite(v) and v > 0]
    ax_norm.plot([s for s, _ in finite], [v for _, v in finite], color="tab:green", lw=1.2, label="total grad norm")
    m_steps, m_norm = run.series("grad_norm/max")
    if m_steps:
        ax_norm.plot(m_steps, m_norm, color="tab:green", lw=0.8, ls=":", label="max since last log")
    t_steps, threshold = run.series("clip/threshold")
    t_pairs = [(s, v) for s, v in zip(t_steps, threshold, strict=True) if math.isfinite(v)]
    if t_pairs:
        ax_norm.plot(
            [s for s, _ in t_pairs], [v for _, v in t_pairs], color="gray", ls="--", lw=1, label="clip threshold"
        )
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("grad norm")
    ax_norm.legend(loc="upper right", fontsize=8)

    z_steps, z = run.series("spikes/z_grad_norm")
    ax_z.plot(z_steps, z, color="tab:orange", lw=1.2, label="z-score (logging step)")
    mz_steps, mz = run.series("spikes/max_z_grad_norm")
    if mz_steps:
        ax_z.plot(mz_steps, mz, color="tab:red", lw=0.8, ls=":", label="max z since last log")
    ax_z.axhline(4.0, color="tab:red", lw=0.8, ls="--", label="warning (z = 4)")
    ax_z.set_ylabel("grad-norm z-score")
    ax_z.legend(loc="upper right", fontsize=8)

    seen: set[str] = set()
    for event in run.events:
        style = _MARKERS.get(event.get("kind", ""))
        if style is None:
            continue
        marker, color, label = style
        for ax in (ax_loss, ax_norm, ax_z):
            ax.axvline(event["step"], color=color, lw=0.6, alpha=0.5)
        ax_loss.scatter(
            [event["step"]],
            [ax_loss.get_ylim()[1]],
            marker=marker,
            color=color,
            zorder=5,
            label=label if label not in seen else None,
            clip_on=False,
        )
        seen.add(label)
    if seen:
        ax_loss.legend(loc="upper right", fontsize=8)
    for ax in (ax_loss, ax_norm, ax_z):
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("step")

    if layers:
        ax_h = axes[3]
        row_steps = [int(r["step"]) for r in run.rows if f"{run.prefix}/grad_norm/{layers[0]}" in r]
        grid = np.full((len(layers), len(row_steps)), np.nan)
        rows_with = [r for r in run.rows if f"{run.prefix}/grad_norm/{layers[0]}" in r]
        for j, row in enumerate(rows_with):
            for i, name in enumerate(layers):
                value = row.get(f"{run.prefix}/grad_norm/{name}")
                if isinstance(value, float) and math.isfinite(value) and value > 0:
                    grid[i, j] = math.log10(value)
        image = ax_h.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap="viridis",
            extent=(row_steps[0] - 0.5, row_steps[-1] + 0.5, len(layers) - 0.5, -0.5),
        )
        ax_h.set_yticks(range(len(layers)), layers, fontsize=7)
        ax_h.set_xlabel("step")
        ax_h.set_title("per-layer grad norm (log10)")
        fig.colorbar(image, ax=ax_h, fraction=0.025)
    fig.suptitle(title or f"stabilitykit report: {Path(str(log)).name if not isinstance(log, RunLog) else 'run'}")
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
