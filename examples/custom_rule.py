"""A skip rule and a metric of your own: skip the step when an MoE router collapses.

A tiny mixture-of-experts model records its router's entropy and load-balance loss from inside its
forward (``sk.record``), and ``RouterCollapse`` skips a step whose entropy falls below a floor, in
every driver, on the device, with no host sync. The run forces a collapse at step 12 (the router's
logits are scaled up by 1000 for one batch): that step is skipped, bitwise, and named by the rule;
both metrics are logged at every logging step.

    python examples/custom_rule.py [--steps 30] [--out runs/custom_rule]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import stabilitykit as sk

COLLAPSE_AT = 12


class RouterCollapse(sk.SkipRule):
    """Skip a step whose router entropy (averaged over tokens) is below ``floor`` nats."""

    name = "router_collapse"

    def __init__(self, floor: float = 0.1) -> None:
        self.floor = floor

    def flag(self, values: sk.StepValues) -> Tensor:
        return values["router_entropy"] < self.floor  # a 0-d bool on the device: no sync


class TinyMoE(nn.Module):
    """Two experts and a softmax router over a tiny regression problem."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(experts))
        self.head = nn.Linear(dim, 1)
        self.router_scale = 1.0

    def forward(self, x: Tensor) -> Tensor:
        probs = torch.softmax(self.router(x) * self.router_scale, dim=-1)
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean()
        load = probs.mean(0)
        balance = load.numel() * (load * load).sum()  # 1 when perfectly balanced
        sk.record("router_entropy", entropy)  # agreed across ranks by mean
        sk.record("load_balance", balance, reduce="max")
        mixed = sum(probs[:, i : i + 1] * expert(x) for i, expert in enumerate(self.experts))
        return self.head(mixed)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("runs/custom_rule"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = TinyMoE()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = sk.StabilityConfig(log_every_n_steps=5)
    jsonl = args.out / "stability.jsonl"
    jsonl.unlink(missing_ok=True)  # a fresh log for this run
    with sk.StabilityGuard(
        model, optimizer, config, sinks=[sk.sinks.JsonlSink(jsonl)], rules=[RouterCollapse()]
    ) as guard:
        for step in range(args.steps):
            x = torch.randn(32, 16)
            y = x.sum(-1, keepdim=True)
            model.router_scale = 1000.0 if step == COLLAPSE_AT else 1.0
            before = [p.detach().clone() for p in model.parameters()] if step == COLLAPSE_AT else None
            guard.backward(nn.functional.mse_loss(model(x), y))
            report = guard.step()
            guard.zero_grad()
            if before is not None:
                same = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
                print(f"step {step}: skipped={bool(report.skipped)} reason={report.reason} weights unchanged={same}")
        summary = guard.summary()
    rows, events = sk.sinks.read_jsonl(jsonl)
    entropy = [r["stability/metrics/router_entropy"] for r in rows if "stability/metrics/router_entropy" in r]
    skipped = [(e["step"], e["reason"]) for e in events if e["event"] == "skipped"]
    result = {"steps": summary.steps, "skipped": skipped, "logged_entropy": entropy}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
