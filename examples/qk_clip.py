"""QK-clip on a tiny GPT whose attention logits run away at a high learning rate.

    python examples/qk_clip.py [--steps 40] [--tau 8]

The GPT's attention is a user-written module (fused ``qkv``, explicit scores, no qk-norm) that
implements ``sk.nn.QKClipTarget`` in a few lines. The same run twice with AdamW at lr 2e-2: without
QK-clip the largest attention logit climbs to about 30; with ``StabilityConfig(qk_clip=...)`` the
guard rescales the offending heads' query and key rows after every step and the logit levels off
just above tau (each forward sees one more update's growth before the next clip).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import Tensor, nn

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt


class Attention(nn.Module):
    """Causal self-attention with explicit scores, implementing ``sk.nn.QKClipTarget``."""

    qk_clip_tracking = False  # QKClip sets it: compute per-head max logits on every training forward

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.head_max: Tensor | None = None
        self.max_logit = torch.zeros(())

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(), -math.inf)
        self.max_logit = scores.detach().amax()
        if self.qk_clip_tracking and self.training:
            self.head_max = scores.detach().amax(dim=(0, 2, 3))  # (heads,), pre-softmax
        y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]

    def qk_clip_layout(self) -> sk.nn.QKLayout:
        return sk.nn.QKLayout.fused(self.qkv, self.heads, self.head_dim)  # rows: q heads, k heads, v heads

    def qk_clip_max_logits(self) -> Tensor | None:
        return self.head_max


def train(steps: int, tau: float | None) -> dict[str, Any]:
    """One run; ``tau=None``: no QK-clip. Returns the max logit after every step and the logged rows."""
    model = tiny_gpt(seed=0)
    torch.manual_seed(1)
    for block in model.blocks:  # type: ignore[union-attr]
        block.attn = Attention(64, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, fused=True)
    qk_clip = sk.QKClipConfig(enabled=tau is not None, threshold=tau or 100.0)
    rows: list[dict[str, float]] = []

    class Rows:
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            rows.append({"step": step, **metrics})

    guard = sk.StabilityGuard(
        model, optimizer, sk.StabilityConfig(log_every_n_steps=10, qk_clip=qk_clip), sinks=[Rows()]
    )
    data = char_batches(seed=0)
    maxima = []
    for _ in range(steps):
        x, y = next(data)
        guard.backward(model.loss(x, y))  # type: ignore[operator]
        guard.step()  # optimizer step, then QK-clip
        guard.zero_grad()
        maxima.append(max(float(block.attn.max_logit) for block in model.blocks))  # type: ignore[union-attr]
    return {"max_logit": maxima, "rows": rows, "loss": rows[-1]["stability/loss"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tau", type=float, default=8.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    free = train(args.steps, None)
    clipped = train(args.steps, args.tau)
    print(f"max attention logit per step (lr 2e-2), tau = {args.tau}")
    print("  without QK-clip:", " ".join(f"{v:.0f}" for v in free["max_logit"]))
    print("  with QK-clip:   ", " ".join(f"{v:.0f}" for v in clipped["max_logit"]))
    heads = [int(r.get("stability/qk_clip/heads_clipped", 0)) for r in clipped["rows"]]
    print(f"  heads clipped on the logging steps: {heads}")
    print(f"  last logged loss: {free['loss']:.3f} without, {clipped['loss']:.3f} with")
    return {"free": free, "clipped": clipped}


if __name__ == "__main__":
    main()
