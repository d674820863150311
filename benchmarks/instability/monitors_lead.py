"""Do the model monitors warn before the loss moves, on a model we did not write?

    python benchmarks/instability/monitors_lead.py [--lrs 0.3,1] [--seeds 0,1] [--steps 600]

Trains a tiny random-init Hugging Face ``LlamaForCausalLM`` (4 layers, width 96, 4 heads, no
qk-norm of ours) on the instability benchmark's bytes (``train.py``: the standard library's
sources, AdamW, 100 warm-up steps, cosine decay) through ``sk.StabilityGuard`` with
``MonitorConfig`` on, logging (and sampling) every step, so every warning and alert lands on its
own step. Nothing here changes training: the guard only measures (clipping and skipping of
finite steps are off).

Ground truth is the loss-only rule of ``benchmarks/spike_suite.py``: a loss spike's onset t and
the step m where the loss first moved; healthy steps lie outside every spike and divergence.
Per source of ``spike_warning`` (the monitors' precursor signals, the grad norm and layers) and
for ``spike_alert``: onsets warned in [m - 30, m) (before the loss moved) with the mean lead
m - (first warning), onsets warned in [m - 30, t + 3] at all, and the rate of warnings on
healthy steps. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT.parent)]

from spike_suite import ground_truth  # noqa: E402
from train import CONTEXT, batch, corpus, lr_at  # noqa: E402

import stabilitykit as sk  # noqa: E402


@dataclass
class Run:
    lr: float
    seed: int
    losses: list[float]
    warnings: list[tuple[int, str]] = field(default_factory=list)  # (step, source)
    alerts: list[int] = field(default_factory=list)
    seconds: float = 0.0


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


def train(lr: float, seed: int, steps: int, data: Any) -> Run:
    model = llama(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, lr) / lr)
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        skip=sk.SkipConfig(max_consecutive=10**6),
        spikes=sk.SpikeConfig(per_layer=True),
        monitors=sk.MonitorConfig(),
    )
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=scheduler)
    run = Run(lr, seed, [])
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
    return run


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", default="0.3,1")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = corpus()
    train_data = data[: int(len(data) * 0.95)]
    runs = []
    for lr in (float(v) for v in args.lrs.split(",")):
        for seed in (int(s) for s in args.seeds.split(",")):
            run = train(lr, seed, args.steps, train_data)
            truth = ground_truth(run.losses)
            finite = [v for v in run.losses[-20:] if math.isfinite(v)]
            print(
                f"LR {lr:g} seed {seed}: {len(truth.spikes)} loss spikes, {len(truth.divergences)} divergences, "
                f"{len(run.warnings)} warnings, {len(run.alerts)} alerts, last loss "
                f"{statistics.mean(finite) if finite else math.nan:.3f} ({run.seconds:.0f} s)",
                flush=True,
            )
            runs.append(run)
    sources = sorted({s for r in runs for _, s in r.warnings})
    steps_of = {s: [[step for step, src in r.warnings if src == s] for r in runs] for s in sources}
    steps_of["any spike_warning"] = [[step for step, _ in r.warnings] for r in runs]
    steps_of["spike_alert"] = [r.alerts for r in runs]
    score(runs, steps_of)


if __name__ == "__main__":
    main()
