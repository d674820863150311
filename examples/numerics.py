"""The numerics toolkit on a tiny GPT: qk-norm attention, z-loss, precision choice, the data guard,
and a NaN replay that names the module and source line.

    python examples/numerics.py [--steps 40]

At step 15 one MLP's output is poisoned with NaN: the guard skips the step, replays the batch with
hooks and anomaly mode, and reports where the NaN was made. At step 25 a batch with an
out-of-range label arrives: the data guard skips that step on the device.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt


class LatestMetrics:
    """A sink keeping the newest value of each metric (any object with ``log_metrics`` is a sink)."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.values.update(metrics)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)

    choice = sk.select_precision("cpu")
    print(f"precision: {choice.lightning_precision} ({choice.reason})")
    model = tiny_gpt(qk_norm=True, z_loss=1e-4)  # QKNormAttention blocks, ZLoss on the logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(
        log_every_n_steps=10,
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        nan_trace=sk.NaNTraceConfig(mode="on_nonfinite"),
        data=sk.DataGuardConfig(mode="skip", num_classes=model.cfg.vocab_size, label_keys=[1]),
    )
    latest = LatestMetrics()
    guard = sk.StabilityGuard(model, optimizer, cfg, sinks=[sk.sinks.ConsoleSink(), latest])
    events: list[sk.Event] = []
    guard.hooks.on("*", events.append)

    poison = {"on": False}
    model.blocks[2].mlp.register_forward_hook(lambda m, i, out: out * float("nan") if poison["on"] else out)
    data = char_batches(batch_size=8, seed=3)
    for step in range(args.steps):
        x, y = next(data)
        if step == 25:
            y = y.clone()
            y[0, 0] = model.cfg.vocab_size + 5  # a corrupt label
        poison["on"] = step == 15
        guard.check_batch((x, y))
        with choice.autocast():
            loss = model.loss(x, y.clamp(max=model.cfg.vocab_size - 1))
        guard.backward(loss)
        guard.step(replay=lambda x=x, y=y: model.loss(x, y.clamp(max=model.cfg.vocab_size - 1)))
        guard.zero_grad()
    summary = guard.summary()
    guard.close()
    print(f"skipped {summary['skipped']} steps; NaN source: {guard.last_nonfinite}")
    for kind in ("nonfinite", "bad_batch"):
        for event in events:
            if event.kind == kind:
                print(" ", event)
    metrics = latest.values
    print(
        f"log Z max {metrics['stability/logits/log_z_max']:.2f}, "
        f"max attention logit {metrics['stability/attention/max_logit']:.2f}"
    )
    return {"summary": summary, "events": events, "record": guard.last_nonfinite, "metrics": metrics}


if __name__ == "__main__":
    main()
