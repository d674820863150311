"""Do recovery's defaults and presets act on a wrecked run, and stay quiet on a healthy one?

    python benchmarks/recovery_defaults.py [--models byte_gpt,gpt2] [--seeds 0,1,2] [--steps 200]

A plain loop (``sk.StabilityGuard``) trains one of two model families on the instability benchmark's
byte corpus (AdamW, warm-up then cosine decay to a peak LR of 0.1, as a ``LambdaLR`` given to the
guard), in three scenarios, on the same data order per seed:

* ``byte_gpt``: the instability benchmark's 4-block byte-level GPT (``instability/train.py``);
* ``gpt2``: Hugging Face ``GPT2LMHeadModel``, random init, 2 blocks of width 64 over the 256 byte values
  (a model this project did not write);

* ``clean``: nothing goes wrong (a rollback here is a false alarm);
* ``lr_x1000``: the learning rate is 1000 times the schedule's for two steps at half the run (a
  finite blow-up: no non-finite step, so no streak of skips);
* ``garbled``: 30 steps of random tokens from half the run (bad data).

Arms: ``none`` (the library's defaults without recovery: non-finite steps skipped), ``clip`` (the same
with ``ClipConfig(mode="fixed", max_norm=1.0)``), ``defaults`` (``RecoveryConfig()`` given: trigger
``["diverged"]``, ``skip_after=0``), and the presets ``blow_up`` and ``bad_data``
(``RecoveryConfig.preset``). Per model, scenario and arm over the seeds: the final held-out loss, its
gap to the clean run without recovery, rollbacks per run, runs that gave up, and runs that end healthy
(within 0.15 nats of the clean run of the same seed). Seeds listed in ``--held-out`` are marked in the
per-seed lines. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(ROOT / "instability")]

from train import CONTEXT, ByteGPT, batch, corpus, lr_at  # noqa: E402

import stabilitykit as sk  # noqa: E402

SCENARIOS = ("clean", "lr_x1000", "garbled")
ARMS = ("none", "clip", "defaults", "blow_up", "bad_data")
MODELS = ("byte_gpt", "gpt2")
PEAK_LR = 0.1
HEALTHY_GAP = 0.15  # nats above the clean run of the same seed that still count as ending healthy


def config_for(arm: str) -> sk.StabilityConfig:
    """The arm's configuration, as a user writes it."""
    if arm == "none":
        return sk.StabilityConfig()
    if arm == "clip":
        return sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    if arm == "defaults":
        return sk.StabilityConfig(recovery=sk.RecoveryConfig())
    return sk.StabilityConfig(recovery=sk.RecoveryConfig.preset(arm))  # type: ignore[arg-type]


def build_model(name: str) -> torch.nn.Module:
    """A fresh model of family ``name`` (seeded by the caller)."""
    if name == "byte_gpt":
        return ByteGPT(False)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4)
    hf = GPT2LMHeadModel(config)

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = hf

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.hf(input_ids=x).logits

    return Logits()


def train(
    model_name: str, arm: str, scenario: str, seed: int, steps: int, data: np.ndarray, heldout: np.ndarray
) -> tuple[float, int, bool]:
    """(final held-out loss, rollbacks, gave up) of one run."""
    torch.manual_seed(seed)
    model = build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.99), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_at(s, steps, PEAK_LR) / PEAK_LR)
    guard = sk.StabilityGuard(model, opt, config_for(arm), scheduler=scheduler)
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
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--held-out", default="2", help="seeds not looked at when the presets were chosen")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = corpus()
    cut = int(len(data) * 0.95)
    train_data, heldout = data[:cut], data[cut:]
    seeds = [int(s) for s in args.seeds.split(",")]
    held = {int(s) for s in args.held_out.split(",") if s}
    models, scenarios, arms = args.models.split(","), args.scenarios.split(","), args.arms.split(",")
    runs: dict[tuple[str, str, str, int], tuple[float, int, bool]] = {}
    for model in models:
        for seed in seeds:
            for scenario in scenarios:
                for arm in arms:
                    runs[model, scenario, arm, seed] = run = train(
                        model, arm, scenario, seed, args.steps, train_data, heldout
                    )
                    tag = " (held out)" if seed in held else ""
                    print(
                        f"run {model} {scenario} {arm} seed {seed}{tag}: final {run[0]:.3f}, rollbacks {run[1]}, "
                        f"gave up {run[2]}",
                        flush=True,
                    )
    print(
        f"\n| model | scenario | arm | final held-out loss | gap to clean | ends healthy (<= +{HEALTHY_GAP}) "
        "| rollbacks per seed | gave up |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in models:
        clean = {s: runs[model, "clean", "none", s][0] for s in seeds if (model, "clean", "none", s) in runs}
        for scenario in scenarios:
            for arm in arms:
                rows = {seed: runs[model, scenario, arm, seed] for seed in seeds}
                gaps = {s: r[0] - clean[s] for s, r in rows.items() if math.isfinite(r[0]) and s in clean}
                gap = f"{statistics.mean(gaps.values()):+.3f}" if gaps else "-"
                healthy = sum(1 for g in gaps.values() if g <= HEALTHY_GAP)
                per_seed = ", ".join(str(r[1]) for r in rows.values())
                print(
                    f"| {model} | {scenario} | {arm} | {_mean([r[0] for r in rows.values()])} | {gap} | "
                    f"{healthy}/{len(rows)} | {per_seed} | {sum(r[2] for r in rows.values())} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
