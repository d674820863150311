"""W&B without an account: an offline run with WandbSink, read back from its run file, the
dashboard spec, and the offline report picture.

    python examples/wandb_offline.py [--steps 120] [--out runs/wandb]

A NaN batch at step 40 and a x1000 gradient at step 80 produce a skip, alerts and spike markers.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.sinks import WandbRunFile, WandbSink
from stabilitykit.testing import char_batches, tiny_gpt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default="runs/wandb")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project="stabilitykit-example", dir=str(out), mode="offline", reinit="create_new")
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=10, clip=sk.ClipConfig(mode="adaptive", warmup_steps=20))
    jsonl = out / "stability.jsonl"
    jsonl.unlink(missing_ok=True)
    guard = sk.StabilityGuard(model, optimizer, cfg, sinks=[WandbSink(run), sk.sinks.JsonlSink(jsonl)])
    data = char_batches(batch_size=8, seed=2)
    for step in range(args.steps):
        x, y = next(data)
        loss = model.loss(x, y)
        if step == 40:
            loss = loss * float("nan")
        if step == 80:
            loss = loss * 1000.0
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    run_dir = Path(run.dir).parent
    run.finish()

    logged = WandbRunFile.read(run_dir)
    rows = [r for r in logged.history if "stability/grad_norm/total" in r]
    print(f"offline run {run_dir.name}: {len(rows)} logging steps, alerts:")
    for alert in logged.alerts:
        print(f"  [{alert['level']}] {alert['title']}: {alert['text']}")
    workspace = sk.wandb_dashboard("my-team", "stabilitykit-example", layers=guard.engine.layer_names[:3])
    print("dashboard sections:", [s.name for s in workspace.sections], "(workspace.save() publishes it)")
    picture = __import__("stabilitykit.report_plot", fromlist=["draw_report"]).draw_report(jsonl, out / "report.png")
    print("report:", picture)
    return {"logged": logged, "workspace": workspace, "report": picture}


if __name__ == "__main__":
    main()
