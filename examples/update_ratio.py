"""The update-to-weight ratio ||Δw|| / ||w||: one tiny GPT, a sane and a too-high learning rate.

    python examples/update_ratio.py [--steps 60] [--out runs/update_ratio]

Two AdamW runs, lr 3e-4 and lr 3e-2, with ``GradNormConfig(update_ratio=True)``, logging every 5
steps: each logging step logs the update of the step just before it (steps 4, 9, ...), per layer
and in total. A NaN batch at step 34 is skipped, so the ratio logged at step 35 is exactly 0.
Prints each run's median total ratio and its fastest-moving layer, and draws the offline report
(with its update-ratio panel) of the too-high run.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.report_plot import draw_report
from stabilitykit.testing import char_batches, tiny_gpt

LEARNING_RATES = (3e-4, 3e-2)
NAN_STEP = 34


def train(lr: float, steps: int, log: Path) -> list[dict[str, Any]]:
    """One guarded run; the metric rows of its JSONL log."""
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=5, grad_norm=sk.GradNormConfig(update_ratio=True))
    log.unlink(missing_ok=True)
    guard = sk.StabilityGuard(model, optimizer, cfg, sinks=[sk.sinks.JsonlSink(log)])
    data = char_batches(batch_size=8, seed=3)
    for step in range(steps):
        x, y = next(data)
        loss = model.loss(x, y)
        guard.backward(loss * float("nan") if step == NAN_STEP else loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    rows, _ = sk.sinks.read_jsonl(log)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="runs/update_ratio")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"runs": {}}
    for lr in LEARNING_RATES:
        log = out / f"lr{lr:g}.jsonl"
        rows = train(lr, args.steps, log)
        ratios = {r["step"]: r["stability/update_ratio"] for r in rows if "stability/update_ratio" in r}
        moving = [v for v in ratios.values() if v > 0]  # the skipped step's update is 0
        last = [r for r in rows if "stability/update_ratio" in r][-1]  # close()'s final row has no ratio
        layers = {k.rsplit("/", 1)[1]: v for k, v in last.items() if k.startswith("stability/update_ratio/")}
        top = max(layers, key=layers.__getitem__)
        median = statistics.median(moving)
        print(f"lr {lr:g}: median update/weight ratio {median:.1e} (rule of thumb ~1e-3), fastest layer {top} "
              f"({layers[top]:.1e} at step {last['step']}); ratio logged at step {NAN_STEP + 1}: "
              f"{ratios.get(NAN_STEP + 1)}")  # fmt: skip
        result["runs"][lr] = {"ratios": ratios, "median": median, "top_layer": top, "log": log}
    high = result["runs"][LEARNING_RATES[-1]]["log"]
    result["report"] = draw_report(high, out / "report.png", title=f"lr {LEARNING_RATES[-1]:g}: update ratio")
    print("report:", result["report"])
    return result


if __name__ == "__main__":
    main()
