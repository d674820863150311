"""Per-tensor adaptive clipping (AdaGC) vs global clipping when one tensor's grad goes bad.

    python examples/per_tensor_clipping.py [--steps 60] [--spike-at 40] [--factor 1000]

The same tiny GPT trains twice with AdamW: once under ``ClipConfig(mode="fixed", max_norm=1.0)``,
once under ``ClipConfig(mode="per_tensor_adaptive", warmup_max_norm=1.0)``. At ``--spike-at`` one
tensor's grad is multiplied by ``--factor`` (a data outlier or a hardware fault hitting one layer).
Global clipping scales every grad by the same coefficient, so the healthy tensors lose almost all
of that step's signal and the bad tensor still arrives at the optimizer at the full max_norm.
Per-tensor clipping scales the bad tensor back to 1.05x its own running norm and leaves the
others as their own history says.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt

SPIKED = "blocks.1.mlp.fc.weight"


def train(clip: sk.ClipConfig, steps: int, spike_at: int, factor: float) -> dict[str, Any]:
    """Train with ``clip``; at ``spike_at`` one tensor's grad is multiplied by ``factor``. What the clip did then."""
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    guard = sk.StabilityGuard(model, optimizer, sk.StabilityConfig(clip=clip, log_every_n_steps=20))
    params = dict(model.named_parameters())
    data = char_batches(batch_size=8, seed=1)
    usual: dict[str, float] = {}
    result: dict[str, Any] = {}
    for step in range(steps):
        x, y = next(data)
        guard.backward(model.loss(x, y))
        if step == spike_at - 1:  # the step before: each tensor's usual grad norm
            usual = {n: p.grad.norm().item() for n, p in params.items()}  # type: ignore[union-attr]
        if step == spike_at:
            params[SPIKED].grad.mul_(factor)  # type: ignore[union-attr]
            before = {n: p.grad.norm().item() for n, p in params.items()}  # type: ignore[union-attr]
        report = guard.step()
        if step == spike_at:
            after = {n: p.grad.norm().item() for n, p in params.items()}  # type: ignore[union-attr]
            others = [n for n in params if n != SPIKED]
            kept = sum(after[n] ** 2 for n in others) ** 0.5 / sum(before[n] ** 2 for n in others) ** 0.5
            result = {
                "others_kept": kept,  # post-clip / pre-clip norm of the healthy tensors together
                "spiked_vs_usual": after[SPIKED] / usual[SPIKED],  # what the optimizer got vs the usual size
                "coef": float(report.clip_coef),
            }
        guard.zero_grad()
        last = float(report.loss)  # type: ignore[arg-type]
    guard.close()
    result["final_loss"] = last
    result["clipped_steps"] = guard.summary().clipped
    return result


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--spike-at", type=int, default=40)
    parser.add_argument("--factor", type=float, default=1000.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    arms = {
        "global (fixed)": sk.ClipConfig(mode="fixed", max_norm=1.0),
        "per-tensor (AdaGC)": sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=10, warmup_max_norm=1.0),
    }
    results = {name: train(clip, args.steps, args.spike_at, args.factor) for name, clip in arms.items()}
    print(f"{args.factor:g}x spike in {SPIKED} at step {args.spike_at}:")
    print(f"{'clipping':<22}{'healthy grads kept':>20}{'bad grad vs usual':>20}{'clipped steps':>15}{'final loss':>12}")
    for name, r in results.items():
        print(
            f"{name:<22}{r['others_kept']:>20.4f}{r['spiked_vs_usual']:>19.2f}x"
            f"{r['clipped_steps']:>15d}{r['final_loss']:>12.3f}"
        )
    return results


if __name__ == "__main__":
    main()
