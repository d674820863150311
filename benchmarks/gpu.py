"""What stabilitykit costs on a GPU: a GPT-2-small step (124M, random init, bf16 autocast, fused AdamW, 8 x 1024).

    python benchmarks/gpu.py [--rounds 20]            # on a GPU machine (scripts/gpu_check.sh runs it)
    python benchmarks/gpu.py --tiny --device cpu      # the same code path, tiny, on the CPU

Arms, interleaved round-robin in one process on the same model and data:

* ``clip``: a hand-written loop: ``torch.nn.utils.clip_grad_norm_`` + ``optimizer.step()``;
* ``guard``: ``sk.StabilityGuard`` with per-layer norms, skipping and fixed clipping (logging every 10);
* ``lightning grad_norm``: Lightning's ``grad_norm`` (per-parameter norms) + clip + step;
* ``per-param logger``: a ``wandb.watch``-style logger reading every grad's norm to the host + clip + step.

Printed, one markdown table: median step time, overhead against ``clip`` in percent, host syncs per
step off logging steps (CUDA sync debug mode; "n/a" on the CPU) and CUDA kernels launched by the
guard's own work in one non-logging step (torch.profiler; "n/a" on the CPU). Without a GPU and
without ``--device cpu`` it says so and exits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stabilitykit as sk


def build(tiny: bool, device: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if tiny:
        config = GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=256)
        batch, seq = 2, 64
    else:
        config = GPT2Config()  # 124M
        batch, seq = 8, 1024
    model = GPT2LMHeadModel(config).to(device)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2 (the code path, not the numbers)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no GPU here (torch.cuda.is_available() is False); run it on a GPU machine")
        return
    device = args.device
    cuda = device == "cuda"
    model, tokens = build(args.tiny, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    cfg = sk.StabilityConfig(log_every_n_steps=10, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    guard = sk.StabilityGuard(model, optimizer, cfg, hooks=sk.HookManager(log_events=False))

    def forward_backward() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(tokens, labels=tokens).loss
        return loss

    def arm_clip() -> None:
        forward_backward().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def arm_guard() -> None:
        guard.backward(forward_backward())
        guard.step()
        guard.zero_grad()

    def arm_lightning() -> None:
        from lightning.pytorch.utilities import grad_norm

        forward_backward().backward()
        grad_norm(model, norm_type=2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    def arm_per_param() -> None:
        forward_backward().backward()
        _ = {n: p.grad.norm().item() for n, p in model.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    arms: dict[str, Callable[[], None]] = {
        "clip": arm_clip,
        "guard": arm_guard,
        "lightning grad_norm": arm_lightning,
        "per-param logger": arm_per_param,
    }
    times: dict[str, list[float]] = {name: [] for name in arms}
    for fn in arms.values():  # warm-up: optimizer state, kernels, allocator
        fn()
        fn()
    for _ in range(args.rounds):
        for name, fn in arms.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    syncs = _syncs_off_logging(guard, arm_guard) if cuda else None
    kernels = _guard_kernels(guard, forward_backward) if cuda else None
    base = statistics.median(times["clip"])
    name = torch.cuda.get_device_name() if cuda else "CPU"
    size = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{name}, torch {torch.__version__}, GPT-2 {size:.1f}M params, tokens {tuple(tokens.shape)}, bf16 autocast")
    print()
    print("| arm | ms/step | overhead vs clip | syncs per non-logging step | kernels of the guard's pass |")
    print("| --- | --- | --- | --- | --- |")
    for arm, samples in times.items():
        ms = statistics.median(samples) * 1e3
        extra = "n/a" if arm != "guard" or syncs is None else str(syncs)
        kern = "n/a" if arm != "guard" or kernels is None else str(kernels)
        print(f"| {arm} | {ms:.2f} | {100 * (ms / 1e3 / base - 1):+.2f}% | {extra} | {kern} |")


def _syncs_off_logging(guard: sk.StabilityGuard, step: Callable[[], None]) -> float:
    """Mean device-to-host syncs over 9 non-logging steps (CUDA sync debug mode, warn)."""
    while guard.engine.is_logging_step():
        step()
    total, steps = 0, 0
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while not guard.engine.is_logging_step():
                step()
                steps += 1
        total = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return total / max(steps, 1)


def _guard_kernels(guard: sk.StabilityGuard, forward_backward: Callable[[], torch.Tensor]) -> int:
    """CUDA kernels launched between the end of backward and the optimizer step, on a non-logging step."""
    from torch.profiler import ProfilerActivity, profile

    while guard.engine.is_logging_step():
        guard.backward(forward_backward())
        guard.step()
        guard.zero_grad()
    guard.backward(forward_backward())
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        guard.decide(guard.engine)
        torch.cuda.synchronize()
    guard.optimizer.step()  # routed: applies or skips the step in flight
    guard.end_step(guard.engine)
    guard.zero_grad()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


if __name__ == "__main__":
    main()
