"""A learning rate set by hand every iteration (as nanoGPT does), held through a skipped step.

    python examples/hand_set_lr.py [--steps 60] [--fused]

nanoGPT computes ``lr = get_lr(iter_num)`` and writes it into every ``param_group["lr"]``. The
iteration counter moves on through a skipped step, so the schedule would run one step ahead of
the weights after each skip. ``guard.schedule_step`` is the step a held schedule is at (steps
less the skipped ones): feed it to ``get_lr`` instead, and the LR stays where a scheduler passed
as ``scheduler=`` would have stayed. The script trains twice, once with the hand-set LR and once
with the same schedule as a ``LambdaLR``, with NaN batches at steps 23 and 44, and prints that
the LRs and weights are identical.
"""

from __future__ import annotations

import argparse
import math

import torch

import stabilitykit as sk

BASE_LR, WARMUP = 1e-2, 10
NAN_STEPS = (23, 44)


def get_lr(step: int, total: int) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine decay."""
    if step < WARMUP:
        return BASE_LR * (step + 1) / WARMUP
    return BASE_LR * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / max(1, total - WARMUP))))


def train(steps: int, fused: bool, by_hand: bool) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=BASE_LR, fused=fused)
    scheduler = None
    if not by_hand:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: get_lr(s, steps) / BASE_LR)
    config = sk.StabilityConfig(log_every_n_steps=10, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    guard = sk.StabilityGuard(model, optimizer, config, scheduler=scheduler)
    data = torch.Generator().manual_seed(1)
    lrs = []
    for step in range(steps):
        if by_hand:
            lr = get_lr(guard.schedule_step, steps)  # not get_lr(step): a skipped step holds the schedule
            for group in optimizer.param_groups:
                group["lr"] = lr
        lrs.append(optimizer.param_groups[0]["lr"])
        x = torch.randn(16, 8, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        guard.backward(loss * float("nan") if step in NAN_STEPS else loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    return lrs, model


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fused", action="store_true", help="fused AdamW (a skip is held at the next logging step)")
    args = parser.parse_args(argv)
    hand_lrs, hand_model = train(args.steps, args.fused, by_hand=True)
    sched_lrs, sched_model = train(args.steps, args.fused, by_hand=False)
    pairs = zip(hand_model.parameters(), sched_model.parameters(), strict=True)
    same_weights = all(torch.equal(a, b) for a, b in pairs)
    print(f"hand-set LR at steps 22-26: {[f'{lr:.5f}' for lr in hand_lrs[22:27]]}")
    print(f"LambdaLR     at steps 22-26: {[f'{lr:.5f}' for lr in sched_lrs[22:27]]}")
    print(f"identical LRs: {hand_lrs == sched_lrs}, identical weights: {same_weights}")
    return {"hand": hand_lrs, "scheduler": sched_lrs, "same_weights": same_weights}


if __name__ == "__main__":
    main()
