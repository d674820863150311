"""What stabilitykit costs per step, against what users would otherwise run. Prints ratios.

    python benchmarks/overhead.py [--rounds 40] [--layers 6] [--width 256]

All arms run interleaved in one process (round-robin, same grads, same model), so machine noise
hits every arm alike. Two tables:

1. Grad processing only (after backward, before the optimizer): stabilitykit's engine (fused
   norms + per-layer norms + finite check + clip + counters, logging every 10 steps; fixed and
   per-tensor adaptive (AdaGC) clipping) vs ``torch.nn.utils.clip_grad_norm_`` alone, vs
   Lightning's ``grad_norm`` + ``clip_grad_norm_``, vs ZClip (``zclip`` package).
2. A whole training step of a small GPT (forward, backward, grad processing, fused AdamW step):
   bare, ``clip_grad_norm_``, StabilityGuard (JSONL logging every 10 steps), Lightning's
   ``grad_norm`` + clip, ZClip, and ``wandb.watch(log="gradients", log_freq=1)`` (offline) + clip.

This is a script, not a test: timings depend on the machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import stabilitykit as sk
from stabilitykit.engine import StabilityEngine
from stabilitykit.testing import char_batches, tiny_gpt


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _interleave(arms: dict[str, Callable[[], None]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each arm, run round-robin."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds + warmup):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
    return {name: _median_ms(t) for name, t in times.items()}


def grad_processing(args: argparse.Namespace) -> dict[str, float]:
    """Table 1: cost of the grad processing alone, on the same grads."""
    from lightning.pytorch.utilities import grad_norm
    from zclip import ZClip

    model = tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256, block_size=64)
    x, y = next(char_batches(batch_size=8, block_size=64, vocab_size=256))
    model.loss(x, y).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    saved = [p.grad.clone() for p in params]

    def restore() -> None:
        torch._foreach_copy_([p.grad for p in params], saved)  # type: ignore[misc]

    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=10)
    engine = StabilityEngine(params, cfg, model=model, fused=True)
    per_tensor_cfg = sk.StabilityConfig(
        clip=sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=1), log_every_n_steps=10
    )
    per_tensor_engine = StabilityEngine(params, per_tensor_cfg, model=model, fused=True)
    zclip = ZClip(warmup_steps=5)

    def ours() -> None:
        decision = engine.evaluate()
        engine.finish(decision)

    def ours_per_tensor() -> None:
        decision = per_tensor_engine.evaluate()
        per_tensor_engine.finish(decision)

    def torch_clip() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    def lightning() -> None:
        grad_norm(model, 2)
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    def zclip_step() -> None:
        zclip.step(model)

    arms = {
        "stabilitykit": ours,
        "stabilitykit per-tensor": ours_per_tensor,
        "clip_grad_norm_": torch_clip,
        "lightning grad_norm+clip": lightning,
        "zclip": zclip_step,
    }
    timed = {name: (lambda fn=fn: (restore(), fn())[1]) for name, fn in arms.items()}
    restore_only = _interleave({"restore": restore}, args.rounds)["restore"]
    result = _interleave(timed, args.rounds * 5)
    return {name: ms - restore_only for name, ms in result.items()}


def training_steps(args: argparse.Namespace) -> dict[str, float]:
    """Table 2: a whole training step with each tool."""
    import wandb
    from lightning.pytorch.utilities import grad_norm
    from zclip import ZClip

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    tmp = tempfile.mkdtemp(prefix="sk-bench-")
    data = char_batches(batch_size=8, block_size=64, vocab_size=256)
    batches = [next(data) for _ in range(8)]
    counter = {"i": 0}

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        counter["i"] += 1
        return batches[counter["i"] % len(batches)]

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256, block_size=64)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    arms: dict[str, Callable[[], None]] = {}

    def plain(extra: Callable[[torch.nn.Module], None] | None) -> Callable[[], None]:
        model, opt = make()

        def step() -> None:
            x, y = batch()
            model.loss(x, y).backward()
            if extra is not None:
                extra(model)
            opt.step()
            opt.zero_grad()

        return step

    arms["bare"] = plain(None)
    arms["clip_grad_norm_"] = plain(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))

    model, opt = make()
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=10)
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(os.path.join(tmp, "run.jsonl"))])

    def guarded() -> None:
        x, y = batch()
        guard.backward(model.loss(x, y))
        guard.step()
        guard.zero_grad()

    arms["stabilitykit guard"] = guarded

    def lightning_extra(m: torch.nn.Module) -> None:
        grad_norm(m, 2)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)

    arms["lightning grad_norm+clip"] = plain(lightning_extra)
    zclip = ZClip(warmup_steps=5)
    arms["zclip"] = plain(zclip.step)

    run = wandb.init(project="stabilitykit-bench", dir=tmp, mode="offline")
    watched, wopt = make()
    run.watch(watched, log="gradients", log_freq=1)

    def wandb_step() -> None:
        x, y = batch()
        loss = watched.loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(watched.parameters(), 1.0)
        wopt.step()
        wopt.zero_grad()
        run.log({"loss": loss.item()})  # watch() publishes its histograms with the next log call

    arms["wandb.watch gradients"] = wandb_step
    try:
        return _interleave(arms, args.rounds)
    finally:
        run.finish()


def _table(title: str, result: dict[str, float], bases: list[str]) -> None:
    print(f"\n{title}")
    header = f"{'arm':<28}{'ms/step':>10}" + "".join(f"{'x ' + b:>24}" for b in bases)
    print(header)
    print("-" * len(header))
    for name, ms in result.items():
        print(f"{name:<28}{ms:>10.3f}" + "".join(f"{ms / result[b]:>24.3f}" for b in bases))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="stabilitykit overhead vs the alternatives (ratios)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256).parameters())
    size = f"GPT {args.layers}x{args.width} ({n_params / 1e6:.1f}M params)"
    print(f"torch {torch.__version__}, {args.threads} threads, {size}")
    g = grad_processing(args)
    _table("1. grad processing per step (median)", g, ["clip_grad_norm_"])
    t = training_steps(args)
    _table("2. whole training step (median)", t, ["bare", "clip_grad_norm_"])
    overhead = (t["stabilitykit guard"] / t["clip_grad_norm_"] - 1) * 100
    print(f"\nstabilitykit vs clip_grad_norm_ alone (grad processing): {g['stabilitykit'] / g['clip_grad_norm_']:.3f}x")
    per_tensor = g["stabilitykit per-tensor"] / g["clip_grad_norm_"]
    print(f"stabilitykit per-tensor (AdaGC) vs clip_grad_norm_ alone (grad processing): {per_tensor:.3f}x")
    print(f"end-to-end step overhead vs a clip_grad_norm_ loop: {overhead:+.1f}%")
    print(f"wandb.watch(log='gradients', log_freq=1) step vs bare: {t['wandb.watch gradients'] / t['bare']:.2f}x")


if __name__ == "__main__":
    main()
