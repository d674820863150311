"""Do the model monitors warn before the loss moves, on a model we did not write?

    python benchmarks/instability/monitors_lead.py [--lrs 0.3,1] [--seeds 0,1] [--steps 600]
        [--drift 4,3,2] [--record runs.json.gz] [--replay runs.json.gz[,more.json.gz]]

Trains a tiny random-init Hugging Face ``LlamaForCausalLM`` (4 layers, width 96, 4 heads, no
qk-norm of ours) on the instability benchmark's bytes (``train.py``: the standard library's
sources, AdamW, 100 warm-up steps, cosine decay) through ``sk.StabilityGuard`` with
``MonitorConfig`` on, logging (and sampling) every step, so every warning and alert lands on its
own step. Nothing here changes training: the guard only measures (clipping and skipping of
finite steps are off).

Ground truth is the loss-only rule of ``benchmarks/spike_suite.py``: a loss spike's onset t and
the step m where the loss first moved; healthy steps lie outside every spike and divergence.
Per source of ``spike_warning`` (the monitors' precursor signals, the grad norm and layers) and
for ``spike_alert`` (of ``SPIKES``, replayed, so a recorded run is scored at today's defaults):
onsets warned in [m - 30, m) (before the loss moved) with the mean lead m - (first warning),
onsets warned in [m - 30, t + 3] at all, and the rate of warnings on healthy steps. Prints
markdown tables.

``--drift``: the operating points of ``SpikeConfig.loss_drift_alert`` with the monitors' signals
in, by the protocol of ``benchmarks/spikes.py`` (seed 0 is the tuning set, other seeds held out):
loss-spike onsets alerted in [m - 30, t + 3], divergence onsets in [d - 30, d + 3], alerted
onsets whose first alert came before the loss moved (before m), and alerts per 10k healthy steps
(all runs; runs with no event). Training does not depend on the setting (the guard only
measures), so each run trains once: every call the guard's own ``SpikeMonitor`` gets (step, grad
norm, loss, layer norms, signals) is recorded and replayed through a fresh ``SpikeMonitor`` per
setting. Replaying the guard's own configuration must give the guard's own alerts (checked).
``--record`` writes the runs (losses, warnings, alerts, detector inputs) to a file; ``--replay``
scores recorded runs without training.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]

from spike_suite import ground_truth  # noqa: E402
from train import CONTEXT, batch, corpus, lr_at  # noqa: E402

import stabilitykit as sk  # noqa: E402
from stabilitykit.spikes import SpikeMonitor  # noqa: E402

#: One call of ``SpikeMonitor.update``: step, grad norm, loss, layer norms, signals.
DetectorInput = tuple[int, float, float | None, list[float] | None, dict[str, float] | None]

#: The guard's spike detector (every other field at its default); the replay varies ``loss_drift_alert``.
SPIKES = sk.SpikeConfig(per_layer=True)


@dataclass
class Run:
    lr: float
    seed: int
    losses: list[float]
    warnings: list[tuple[int, str]] = field(default_factory=list)  # (step, source)
    alerts: list[int] = field(default_factory=list)
    seconds: float = 0.0
    layer_names: list[str] = field(default_factory=list)  # the guard's spike monitor's layers
    inputs: list[DetectorInput] = field(default_factory=list)  # what that monitor was fed, per step


def llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def source_of(event: sk.Event) -> str:
    """Which signal a warning came from: a monitor precursor by its kind, else grad norm or a layer."""
    signal = str(event.details.get("signal", ""))
    if signal.startswith("monitors/"):
        return "monitor: " + signal.split("/")[1]
    if signal.startswith("layer"):
        return "layer grad norm"
    return signal or "other"


def record_inputs(monitor: SpikeMonitor, run: Run) -> None:
    """Record every call ``monitor`` gets (it still scores them): the replay feeds the same to other settings."""
    update = monitor.update
    run.layer_names = list(monitor.layer_names)

    def recording(
        step: int,
        grad_norm: float,
        loss: float | None,
        layer_norms: Any,
        *legacy: Any,
        signals: Any = None,
    ) -> list[sk.Event]:
        layers = None if layer_norms is None else [float(v) for v in layer_norms]
        run.inputs.append((step, float(grad_norm), loss, layers, None if signals is None else dict(signals)))
        return update(step, grad_norm, loss, layer_norms, *legacy, signals=signals)

    monitor.update = recording  # type: ignore[method-assign]


def replay_alerts(run: Run, config: sk.SpikeConfig) -> list[int]:
    """The steps where a fresh ``SpikeMonitor`` with ``config``, fed the run's recorded inputs, alerts."""
    monitor = SpikeMonitor(config, run.layer_names)
    alerts = []
    for step, grad_norm, loss, layers, signals in run.inputs:
        if any(e.kind == "spike_alert" for e in monitor.update(step, grad_norm, loss, layers, signals=signals)):
            alerts.append(step)
    return alerts


def train(lr: float, seed: int, steps: int, data: Any) -> Run:
    model = llama(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, lr) / lr)
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        skip=sk.SkipConfig(max_consecutive=10**6),
        spikes=SPIKES,
        monitors=sk.MonitorConfig(),
    )
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=scheduler)
    run = Run(lr, seed, [])
    assert guard.engine.ledger.spikes is not None
    record_inputs(guard.engine.ledger.spikes, run)
    guard.hooks.on("spike_warning", lambda e: run.warnings.append((e.step, source_of(e))))
    guard.hooks.on("spike_alert", lambda e: run.alerts.append(e.step))
    gen = torch.Generator().manual_seed(1000 + seed)
    start = time.perf_counter()
    for _ in range(steps):
        x, y = batch(data, gen)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        run.losses.append(float(loss.detach()))
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    run.seconds = time.perf_counter() - start
    if replay_alerts(run, cfg.spikes) != run.alerts:
        raise RuntimeError(f"LR {lr:g} seed {seed}: the replay does not reproduce the guard's own alerts")
    return run


def save_runs(runs: list[Run], path: str) -> None:
    """Write the runs (losses, warnings, alerts, detector inputs) as gzipped JSON."""
    with gzip.open(path, "wt") as f:
        json.dump([vars(r) for r in runs], f)


def load_runs(paths: str) -> list[Run]:
    """The runs ``save_runs`` wrote, from comma-separated paths."""
    runs = []
    for path in paths.split(","):
        with gzip.open(path, "rt") as f:
            for raw in json.load(f):
                raw["warnings"] = [tuple(w) for w in raw["warnings"]]
                raw["inputs"] = [tuple(i) for i in raw["inputs"]]
                runs.append(Run(**raw))
    return runs


def score(runs: list[Run], steps_of: dict[str, list[list[int]]]) -> None:
    """One row per source: onsets warned before the loss moved (lead), warned at all, healthy rate."""
    truths = [ground_truth(r.losses) for r in runs]
    onsets = sum(len(t.spikes) for t in truths)
    healthy = sum(int(t.healthy.sum()) for t in truths)
    print(f"\n{len(runs)} runs, {onsets} loss-spike onsets, {healthy} healthy steps\n")
    head = ("source", "onsets warned before the loss moved", "mean lead (steps)", "warned in [m-30, t+3]")
    print("| " + " | ".join(head) + " | per 1k healthy steps |")
    print("| --- | --- | --- | --- | --- |")
    for source, per_run in steps_of.items():
        early, leads, caught, false = 0, [], 0, 0
        for truth, marks in zip(truths, per_run, strict=True):
            for m, t in truth.spikes:
                before = [s for s in marks if m - 30 <= s < m]
                if before:
                    early += 1
                    leads.append(m - min(before))
                caught += any(m - 30 <= s <= t + 3 for s in marks)
            false += sum(1 for s in marks if 0 <= s < len(truth.healthy) and truth.healthy[s])
        lead = f"{statistics.mean(leads):.1f}" if leads else "-"
        rate = 1000 * false / max(1, healthy)
        print(f"| {source} | {early} of {onsets} | {lead} | {caught} of {onsets} | {rate:.1f} |")


@dataclass
class OperatingPoint:
    """Alerts of one setting scored on a set of runs (the columns of ``benchmarks/spikes.py``'s table)."""

    spikes: int = 0
    spikes_hit: int = 0
    early: int = 0  # alerted loss-spike onsets whose first alert came before the loss moved
    divergences: int = 0
    divergences_hit: int = 0
    false: int = 0
    healthy: int = 0
    false_quiet: int = 0  # the same two, on runs with no loss spike and no divergence
    healthy_quiet: int = 0

    def add(self, losses: list[float], alerts: list[int]) -> None:
        """Score one run's alert steps against the ground truth of its losses."""
        truth = ground_truth(losses)
        for m, t in truth.spikes:
            inside = [s for s in alerts if m - 30 <= s <= t + 3]
            self.spikes += 1
            if inside:
                self.spikes_hit += 1
                self.early += min(inside) < m
        for d in truth.divergences:
            self.divergences += 1
            self.divergences_hit += any(d - 30 <= s <= d + 3 for s in alerts)
        false = sum(1 for s in alerts if 0 <= s < len(truth.healthy) and truth.healthy[s])
        healthy = int(truth.healthy.sum())
        self.false += false
        self.healthy += healthy
        if not truth.spikes and not truth.divergences:
            self.false_quiet += false
            self.healthy_quiet += healthy

    def cells(self) -> list[str]:
        """Onsets alerted (all, loss spikes, divergences), before the loss moved, alerts per 10k healthy steps."""

        def share(hit: int, n: int) -> str:
            return f"{100 * hit / n:.0f}% ({hit}/{n})" if n else "- (0/0)"

        def rate(false: int, n: int) -> str:
            return f"{1e4 * false / n:.1f} ({false} in {n:,})" if n else "- (no steps)"

        onsets = self.spikes + self.divergences
        return [
            share(self.spikes_hit + self.divergences_hit, onsets),
            share(self.spikes_hit, self.spikes),
            share(self.divergences_hit, self.divergences),
            share(self.early, self.spikes_hit),
            rate(self.false, self.healthy),
            rate(self.false_quiet, self.healthy_quiet),
        ]


def drift_table(runs: list[Run], settings: list[float | None]) -> None:
    """``loss_drift_alert`` operating points on the tuning set (seed 0) and the held-out set (other seeds)."""
    alerts = {h: [replay_alerts(r, SPIKES.model_copy(update={"loss_drift_alert": h})) for r in runs] for h in settings}
    sets: dict[str, Callable[[Run], bool]] = {
        "tuning (seed 0)": lambda r: r.seed == 0,
        "held-out (seeds 1+)": lambda r: r.seed != 0,
        "all": lambda r: True,
    }
    print("\n`loss_drift_alert` with the monitors' signals in (`spike_alert` replayed per setting)\n")
    head = (
        "`loss_drift_alert`",
        "runs",
        "onsets alerted",
        "loss-spike onsets",
        "divergence onsets",
        "alerted before the loss moved",
        "alerts / 10k healthy steps, all runs",
        "same, runs with no event",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for h in settings:
        for name, keep in sets.items():
            chosen = [i for i, r in enumerate(runs) if keep(r)]
            point = OperatingPoint()
            for i in chosen:
                point.add(runs[i].losses, alerts[h][i])
            label = "None (off)" if h is None else f"{h:g}"
            print(f"| {label} | {name}, {len(chosen)} | " + " | ".join(point.cells()) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default="0.3,1")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--drift", default="", help="loss_drift_alert values to score besides None, e.g. 4,3,2")
    parser.add_argument("--record", help="write the runs here (gzipped JSON)")
    parser.add_argument("--replay", help="score the runs recorded in these files (comma-separated); no training")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs = load_runs(args.replay) if args.replay else train_all(args.lrs, args.seeds, args.steps)
    if args.record:
        save_runs(runs, args.record)
    sources = sorted({s for r in runs for _, s in r.warnings})
    steps_of = {s: [[step for step, src in r.warnings if src == s] for r in runs] for s in sources}
    steps_of["any spike_warning"] = [[step for step, _ in r.warnings] for r in runs]
    steps_of["spike_alert"] = [replay_alerts(r, SPIKES) for r in runs]  # the library's current default
    score(runs, steps_of)
    if args.drift:
        drift_table(runs, [None, *(float(v) for v in args.drift.split(","))])


def train_all(lrs: str, seeds: str, steps: int) -> list[Run]:
    """Train one run per LR and seed; print a line for each."""
    data = corpus()
    train_data = data[: int(len(data) * 0.95)]
    runs = []
    for lr in (float(v) for v in lrs.split(",")):
        for seed in (int(s) for s in seeds.split(",")):
            run = train(lr, seed, steps, train_data)
            truth = ground_truth(run.losses)
            finite = [v for v in run.losses[-20:] if math.isfinite(v)]
            print(
                f"LR {lr:g} seed {seed}: {len(truth.spikes)} loss spikes, {len(truth.divergences)} divergences, "
                f"{len(run.warnings)} warnings, {len(run.alerts)} alerts, last loss "
                f"{statistics.mean(finite) if finite else math.nan:.3f} ({run.seconds:.0f} s)",
                flush=True,
            )
            runs.append(run)
    return runs


if __name__ == "__main__":
    main()
