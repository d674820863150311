"""Does rollback help? Real instabilities and bad data, recovery against the other remedies.

    python benchmarks/recovery_runs.py [--suite instability,bad_data] [--seeds 0,1] [--steps 300]

Both suites train the instability benchmark's model (``benchmarks/instability/train.py``: a 4-block
byte-level GPT on the standard library's sources, AdamW, 100 warm-up steps and cosine decay as a
``LambdaLR`` the guard holds and a rollback restores) through ``sk.StabilityGuard``, one arm at a
time, on the same data order per seed. Every arm skips non-finite steps and never stops on a
streak (``max_consecutive`` is large) except the recovery arm, whose streak is a trigger.

* **instability**: peak LR 0.3 and 1, where the baseline spikes or diverges (the stored traces:
  3 of 3 seeds diverge at LR 1 near step 60). Per arm and LR over the seeds: runs with no
  divergence by the loss-based ground truth of ``benchmarks/spike_suite.py`` (a run that gave up
  counts as diverged), the mean held-out loss at the end, and rollbacks per run.
* **bad_data**: a healthy run (peak LR 0.1) hit by corrupted batches: ``garbled`` (steps 150-179
  are random bytes) and ``shifted`` (steps 150-209 have every target byte shifted by 17: a wrong
  but learnable mapping that drives the loss up for tens of steps). The steps are those of a
  300-step run, scaled with ``--steps``. Per arm: the held-out loss at
  the end against the clean run's, over the seeds.

Arms: ``none`` (skip non-finite only), ``recovery`` (RecoveryConfig: snapshot every 25 steps,
4 deep, triggers diverged + spike_alert + loss_drift with ``loss_drift_alert=20``, 25 steps of
look-back, LR x0.5 for 50 steps after a rollback, 3 rollbacks per 1000 steps), ``recovery_skip``
(the same, and the 50 batches after each rollback skipped: ``skip_after=50``), ``skip``
(skip-on-spike), ``clip`` (fixed 1.0), ``adaptive`` (adaptive clipping). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "instability")]

from spike_suite import ground_truth  # noqa: E402
from train import ByteGPT, batch, corpus, lr_at  # noqa: E402

import stabilitykit as sk  # noqa: E402

ARMS = ("none", "recovery", "recovery_skip", "skip", "clip", "adaptive")
#: Corrupted steps, as fractions of the run: garbled for 30 of 300 steps, shifted for 60.
CORRUPTIONS = {"garbled": (0.5, 0.6), "shifted": (0.5, 0.7)}


@dataclass
class Outcome:
    arm: str
    lr: float
    seed: int
    corruption: str | None
    losses: list[float]
    final_loss: float
    rollbacks: int
    gave_up: bool
    seconds: float

    @property
    def diverged(self) -> bool:
        return self.gave_up or bool(ground_truth(self.losses).divergences)


def config_for(arm: str) -> sk.StabilityConfig:
    """The guard's configuration per arm (published or default values, not tuned on these runs)."""
    never_stop = sk.SkipConfig(max_consecutive=10**6)
    if arm in ("recovery", "recovery_skip"):
        return sk.StabilityConfig(
            log_every_n_steps=10,
            skip=sk.SkipConfig(max_consecutive=10),
            spikes=sk.SpikeConfig(loss_drift_alert=20.0),
            recovery=sk.RecoveryConfig(
                enabled=True,
                snapshot_every=25,
                keep=4,
                trigger=["diverged", "spike_alert", "loss_drift"],
                min_lookback=25,
                lr_scale=0.5,
                cooldown_steps=50,
                max_rollbacks=3,
                window=1000,
                skip_after=50 if arm == "recovery_skip" else 0,
            ),
        )
    if arm == "skip":
        return sk.StabilityConfig(log_every_n_steps=10, skip=sk.SkipConfig(spike=True, max_consecutive=10**6))
    if arm == "clip":
        return sk.StabilityConfig(log_every_n_steps=10, skip=never_stop, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    if arm == "adaptive":
        return sk.StabilityConfig(log_every_n_steps=10, skip=never_stop, clip=sk.ClipConfig(mode="adaptive"))
    return sk.StabilityConfig(log_every_n_steps=10, skip=never_stop)


def corrupt(x: torch.Tensor, y: torch.Tensor, kind: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "garbled":
        noise = torch.randint(0, 256, (x.shape[0], x.shape[1] + 1), generator=gen)
        return noise[:, :-1], noise[:, 1:]
    return x, (y + 17) % 256  # shifted: a consistent wrong target


def train(
    arm: str, lr: float, seed: int, steps: int, data: np.ndarray, heldout: np.ndarray, corruption: str | None = None
) -> Outcome:
    torch.manual_seed(seed)
    model = ByteGPT(False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, lr) / lr)
    rollbacks: list[Any] = []
    guard = sk.StabilityGuard(model, opt, config_for(arm), scheduler=scheduler)
    guard.hooks.on("rollback", rollbacks.append)
    gen = torch.Generator().manual_seed(1000 + seed)
    noise = torch.Generator().manual_seed(5000 + seed)
    lo, hi = CORRUPTIONS.get(corruption or "", (-1.0, -1.0))
    window = (int(lo * steps), int(hi * steps))
    losses: list[float] = []
    gave_up = False
    start = time.perf_counter()
    for step in range(steps):  # the data position: batches of undone steps are not replayed
        x, y = batch(data, gen)
        if corruption is not None and window[0] <= step < window[1]:
            x, y = corrupt(x, y, corruption, noise)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        losses.append(float(loss.detach()))
        guard.backward(loss)
        try:
            guard.step()
        except sk.TrainingDivergedError:
            gave_up = True
            losses.extend([math.nan] * (steps - step - 1))
            break
        guard.zero_grad()
    guard.close()
    model.eval()
    eval_gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        held = [
            F.cross_entropy(model(xe).flatten(0, 1), ye.flatten())
            for xe, ye in (batch(heldout, eval_gen) for _ in range(16))
        ]
    final = float(torch.stack(held).mean())
    return Outcome(arm, lr, seed, corruption, losses, final, len(rollbacks), gave_up, time.perf_counter() - start)


def _mean(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "-"
    spread = f" ± {statistics.stdev(finite):.3f}" if len(finite) > 1 else ""
    return f"{statistics.mean(finite):.3f}{spread}"


def instability(seeds: list[int], steps: int, data: np.ndarray, heldout: np.ndarray, arms: tuple[str, ...]) -> None:
    print("\n## Real instabilities: runs without divergence, final held-out loss, rollbacks per run\n")
    print("| arm | LR | runs without divergence | final loss (mean ± sd) | rollbacks / run | gave up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for lr in (0.3, 1.0):
        for arm in arms:
            runs = [train(arm, lr, seed, steps, data, heldout) for seed in seeds]
            clean = sum(not r.diverged for r in runs)
            print(
                f"| {arm} | {lr:g} | {clean} of {len(runs)} | {_mean([r.final_loss for r in runs])} | "
                f"{statistics.mean(r.rollbacks for r in runs):.1f} | {sum(r.gave_up for r in runs)} |",
                flush=True,
            )


def bad_data(seeds: list[int], steps: int, data: np.ndarray, heldout: np.ndarray, arms: tuple[str, ...]) -> None:
    print("\n## Bad data (peak LR 0.1): final held-out loss against the clean run's\n")
    clean = {seed: train("none", 0.1, seed, steps, data, heldout) for seed in seeds}
    print(f"clean run, no corruption: {_mean([r.final_loss for r in clean.values()])}\n")
    print("| corruption | arm | final loss | gap to clean (mean) | rollbacks / run | gave up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for corruption in CORRUPTIONS:
        for arm in arms:
            runs = [train(arm, 0.1, seed, steps, data, heldout, corruption) for seed in seeds]
            gap = statistics.mean(r.final_loss - clean[r.seed].final_loss for r in runs)
            print(
                f"| {corruption} | {arm} | {_mean([r.final_loss for r in runs])} | {gap:+.3f} | "
                f"{statistics.mean(r.rollbacks for r in runs):.1f} | {sum(r.gave_up for r in runs)} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="instability,bad_data")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = corpus()
    cut = int(len(data) * 0.95)
    train_data, heldout = data[:cut], data[cut:]
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = tuple(args.arms.split(","))
    for suite in args.suite.split(","):
        {"instability": instability, "bad_data": bad_data}[suite](seeds, args.steps, train_data, heldout, arms)


if __name__ == "__main__":
    main()
