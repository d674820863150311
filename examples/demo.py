"""Train a tiny GPT on the CPU with one NaN batch and one gradient spike, guarded by stabilitykit.

    python examples/demo.py [--steps 300] [--out runs/demo]

Step 120 gets a corrupt batch (NaN per-token loss weights, as a broken data shard would give):
the guard skips it and the tracer names where the NaN entered. Step 200 gets a x1000 gradient
spike: the guard clips it and the spike detector warns. Progress is printed every ``--progress``
steps; the guard's own warnings (the skip, the spike) come through Python's ``logging``; the run
ends with a short summary.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt

NAN_STEP, SPIKE_STEP = 120, 200


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--progress", type=int, default=50, help="print a progress line every N steps (0: never)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "stability.jsonl"
    log_path.unlink(missing_ok=True)

    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 30) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    config = sk.StabilityConfig(
        log_every_n_steps=10,
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        skip=sk.SkipConfig(nonfinite=True, max_consecutive=10),
        nan_trace=sk.NaNTraceConfig(mode="always"),
    )
    guard = sk.StabilityGuard(model, optimizer, config, scheduler=scheduler, sinks=[sk.sinks.JsonlSink(log_path)])
    events: list[sk.Event] = []
    guard.hooks.on("*", events.append)

    data = char_batches(batch_size=16, seed=0)
    start = time.perf_counter()
    print(f"stabilitykit demo: training a tiny GPT for {args.steps} steps on the CPU", flush=True)
    first_loss = last_loss = math.nan
    for step in range(args.steps):
        x, y = next(data)
        weights = torch.ones(y.shape)
        if step == NAN_STEP:
            weights[3, 5] = float("nan")  # a corrupt shard: 0/0 in the loss weights
        loss = model.loss(x, y, weights)
        if step == SPIKE_STEP:
            loss = loss * 1000.0  # a sudden x1000 gradient
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if step == 0:
            first_loss = float(report.loss)  # type: ignore[arg-type]
        if args.progress and (step + 1) % args.progress == 0:
            # A host read, once every `progress` steps: the guard itself reads only on logging steps.
            print(
                f"  step {step + 1:>4}/{args.steps}  loss {float(report.loss):7.3f}  "  # type: ignore[arg-type]
                f"{time.perf_counter() - start:5.1f} s",
                flush=True,
            )
    last_loss = float(report.loss)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - start
    guard.close()

    summary = guard.summary().to_dict()
    summary.update(first_loss=first_loss, last_loss=last_loss, elapsed_s=elapsed, log=str(log_path))
    kinds = sorted({e.kind for e in events if e.kind != "precision"})  # training events, not the set-up
    print("stabilitykit demo: tiny GPT, CPU")
    print(f"  steps            {summary['steps']}")
    print(f"  skipped          {summary['skipped']}  (NaN batch injected at step {NAN_STEP})")
    print(f"  clipped          {summary['clipped']}  (x1000 gradient injected at step {SPIKE_STEP})")
    print(f"  max grad norm    {summary['max_grad_norm']:.4g}")
    print(f"  NaN came from    {summary['nonfinite_source']}")
    print(f"  loss             {first_loss:.3f} -> {last_loss:.3f}")
    print(f"  events           {', '.join(kinds)}")
    print(f"  elapsed          {elapsed:.1f} s")
    print(f"  JSONL log        {log_path}")
    return summary


if __name__ == "__main__":
    main()
