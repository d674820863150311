"""Do recovery's defaults act on a wrecked run, and stay quiet on a healthy one?

    python benchmarks/recovery_defaults.py [--seeds 0,1,2] [--steps 300] [--skip-after 50]

A plain loop (``sk.StabilityGuard``) trains the instability benchmark's model (a 4-block byte-level
GPT, AdamW, 100 warm-up steps then cosine decay to a peak LR of 0.1, as a ``LambdaLR`` given to the
guard) in three scenarios, on the same data order per seed:

* ``clean``: nothing goes wrong (a rollback here is a false alarm);
* ``lr_x1000``: the learning rate is 1000 times the schedule's for two steps at half the run (a
  finite blow-up: no non-finite step, so no streak of skips);
* ``garbled``: 30 steps of random tokens from half the run (bad data).

Arms, each a ``RecoveryConfig`` given with defaults for everything but the trigger and ``skip_after``:
``none`` (no recovery), ``diverged`` (today's defaults: ``trigger=["diverged"]``, ``skip_after=0``),
``alert`` (``trigger=["diverged", "spike_alert"]``, ``skip_after=0``) and ``alert_skip`` (the same with
``skip_after`` batches skipped after a rollback). Per scenario and arm over the seeds: the final
held-out loss, its gap to the clean run without recovery, rollbacks per run and runs that gave up.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "instability")]

from train import ByteGPT, batch, corpus, lr_at  # noqa: E402

import stabilitykit as sk  # noqa: E402

SCENARIOS = ("clean", "lr_x1000", "garbled")
ARMS = ("none", "diverged", "alert", "alert_skip")
PEAK_LR = 0.1


def config_for(arm: str, skip_after: int) -> sk.StabilityConfig:
    """The arm's configuration: library defaults except the recovery trigger and ``skip_after``."""
    if arm == "none":
        return sk.StabilityConfig()
    trigger: list[Any] = ["diverged"] if arm == "diverged" else ["diverged", "spike_alert"]
    after = skip_after if arm == "alert_skip" else 0
    return sk.StabilityConfig(recovery=sk.RecoveryConfig(trigger=trigger, skip_after=after))


def train(
    arm: str, scenario: str, seed: int, steps: int, skip_after: int, data: np.ndarray, heldout: np.ndarray
) -> tuple[float, int, bool]:
    """(final held-out loss, rollbacks, gave up) of one run."""
    torch.manual_seed(seed)
    model = ByteGPT(False)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, PEAK_LR) / PEAK_LR)
    guard = sk.StabilityGuard(model, opt, config_for(arm, skip_after), scheduler=scheduler)
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    gen = torch.Generator().manual_seed(1000 + seed)
    noise = torch.Generator().manual_seed(5000 + seed)
    middle = steps // 2
    gave_up = False
    for step in range(steps):  # the data position: batches of undone steps are not replayed
        x, y = batch(data, gen)
        if scenario == "garbled" and middle <= step < middle + 30:
            tokens = torch.randint(0, 256, (x.shape[0], x.shape[1] + 1), generator=noise)
            x, y = tokens[:, :-1], tokens[:, 1:]
        blow_up = scenario == "lr_x1000" and middle <= step < middle + 2
        if blow_up:
            for group in opt.param_groups:
                group["lr"] *= 1000.0
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        guard.backward(loss)
        try:
            guard.step()
        except sk.TrainingDivergedError:
            gave_up = True
            break
        if blow_up:  # the schedule's value again (a held scheduler did not set it)
            for group, lr in zip(opt.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
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
    return (final if not gave_up else math.nan), len(rollbacks), gave_up


def _mean(values: list[float]) -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "-"
    spread = f" ± {statistics.stdev(finite):.3f}" if len(finite) > 1 else ""
    return f"{statistics.mean(finite):.3f}{spread}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip-after", type=int, default=50)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = corpus()
    cut = int(len(data) * 0.95)
    train_data, heldout = data[:cut], data[cut:]
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[tuple[str, str, int], tuple[float, int, bool]] = {}
    for seed in seeds:
        for scenario in args.scenarios.split(","):
            for arm in args.arms.split(","):
                runs[scenario, arm, seed] = run = train(
                    arm, scenario, seed, args.steps, args.skip_after, train_data, heldout
                )
                print(f"run {scenario} {arm} seed {seed}: final {run[0]:.3f}, rollbacks {run[1]}, gave up {run[2]}")
    clean = {seed: runs["clean", "none", seed][0] for seed in seeds if ("clean", "none", seed) in runs}
    print(f"\nclean run without recovery: {_mean(list(clean.values()))} (seeds {args.seeds})\n")
    print("| scenario | arm | final held-out loss | gap to clean | rollbacks / run | gave up |")
    print("| --- | --- | --- | --- | --- | --- |")
    for scenario in args.scenarios.split(","):
        for arm in args.arms.split(","):
            rows = {seed: runs[scenario, arm, seed] for seed in seeds}
            gaps = [r[0] - clean[s] for s, r in rows.items() if math.isfinite(r[0]) and s in clean]
            gap = f"{statistics.mean(gaps):+.3f}" if gaps else "-"
            print(
                f"| {scenario} | {arm} | {_mean([r[0] for r in rows.values()])} | {gap} | "
                f"{statistics.mean(r[1] for r in rows.values()):.1f} | {sum(r[2] for r in rows.values())} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
