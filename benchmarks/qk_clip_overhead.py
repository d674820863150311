"""What QK-clip and soft-capping cost per training step on a small GPT. Prints milliseconds and ratios.

    python benchmarks/qk_clip_overhead.py [--rounds 30] [--layers 4] [--width 256] [--context 64 256]

Arms, run interleaved in one process (round-robin, same data) for each context length, every one a
whole step (forward, backward, fused AdamW) of a GPT whose attention is ``QKNormAttention``:

* ``sdpa``: qk_norm=False, nothing else (the baseline);
* ``qk_clip``: the same model under ``sk.nn.QKClip`` (per-head max logits on every forward: one
  extra ``q @ k^T`` beside SDPA; ``apply()`` after the optimizer step);
* ``qk_clip_apply``: ``QKClip.apply()`` alone (the rescale, after a forward);
* ``softcap``: ``softcap=50`` (explicit attention instead of SDPA);
* ``softcap_qk_clip``: both (the max logits come from the explicit scores: no extra matmul);
* ``qk_norm``: qk_norm=True, for comparison.

This is a script, not a test: timings depend on the machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt


def _model(args: argparse.Namespace, context: int, **attention: object) -> torch.nn.Module:
    model = tiny_gpt(seed=0, n_layer=args.layers, n_embd=args.width, n_head=args.heads, block_size=context)
    for block in model.blocks:  # type: ignore[union-attr]
        block.attn = sk.nn.QKNormAttention(args.width, args.heads, **attention)  # type: ignore[arg-type]
    return model


def _step(
    model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], after: Callable[[], None] | None
) -> Callable[[], None]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        model.loss(*batch).backward()  # type: ignore[operator]
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after is not None:
            after()

    return step


def run(args: argparse.Namespace, context: int) -> dict[str, float]:
    batch = next(char_batches(batch_size=args.batch, block_size=context, vocab_size=64))
    arms: dict[str, Callable[[], None]] = {}
    arms["sdpa"] = _step(_model(args, context, qk_norm=False), batch, None)
    clipped = _model(args, context, qk_norm=False)
    qk = sk.nn.QKClip(clipped, threshold=100.0)
    arms["qk_clip"] = _step(clipped, batch, qk.apply)
    probe = _model(args, context, qk_norm=False)
    probe_qk = sk.nn.QKClip(probe, threshold=1e-3)  # every head clips: the rescale's full cost
    with torch.no_grad():
        probe.loss(*batch)  # type: ignore[operator]

    def apply_only() -> None:
        probe_qk.apply()
        for entry in probe_qk.entries:  # the same maxima again next round, without a forward
            entry.running = torch.full((args.heads,), 1e3)

    arms["qk_clip_apply"] = apply_only
    arms["softcap"] = _step(_model(args, context, qk_norm=False, softcap=50.0), batch, None)
    both = _model(args, context, qk_norm=False, softcap=50.0)
    arms["softcap_qk_clip"] = _step(both, batch, sk.nn.QKClip(both).apply)
    arms["qk_norm"] = _step(_model(args, context, qk_norm=True), batch, None)

    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds + 3):
        for name, fn in arms.items():
            start = time.perf_counter()
            fn()
            if r >= 3:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    for context in args.context:
        ms = run(args, context)
        results[context] = ms
        base = ms["sdpa"]
        print(f"\ncontext {context}, {args.layers} layers x {args.width} wide, batch {args.batch} (median ms per step)")
        for name, value in ms.items():
            ratio = "" if name == "qk_clip_apply" else f"  x{value / base:.3f}"
            print(f"  {name:16s} {value:8.2f}{ratio}")
    return results


if __name__ == "__main__":
    main()
