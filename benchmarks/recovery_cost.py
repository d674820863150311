"""What recovery costs: one snapshot's time and host memory, a restore, and the step overhead.

    python benchmarks/recovery_cost.py [--layers 4] [--width 128] [--rounds 3] [--every 100] [--threads 1]

On a small GPT with fused AdamW (the model and optimizer of ``overhead.py``, smaller by default):

1. Snapshot: the time to take one (parameters, buffers, optimizer state, scheduler, guard state,
   random generators) the first time (host buffers allocated) and later (buffers of a dropped
   snapshot reused), and the host memory one holds, against the parameters' own size.
2. Restore: the time to put one back in place (a rollback, without the engine's journal read).
3. Step overhead: whole guarded training steps with ``RecoveryConfig(enabled=True,
   snapshot_every=--every)`` against the same guard without recovery, run interleaved in blocks
   of ``--every`` steps (so each block holds one snapshot), medians over ``--rounds`` blocks.

On the CPU a snapshot is a memory copy on the step's own thread; on CUDA it runs on a side stream
into pinned host memory and the host does not wait (run this on a GPU machine to see that).
This is a script, not a test: timings depend on the machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.recovery import restore_snapshot, take_snapshot
from stabilitykit.recovery.host_copy import HostCopier
from stabilitykit.testing import char_batches, tiny_gpt


def _build(args: argparse.Namespace, recovery: bool) -> tuple[Any, sk.StabilityGuard, Iterator[Any]]:
    model = tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256, block_size=64).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.001 * s))
    cfg = sk.StabilityConfig(
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        recovery=sk.RecoveryConfig(enabled=recovery, snapshot_every=args.every),
    )
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched)
    data = char_batches(batch_size=8, block_size=64, vocab_size=256)
    return model, guard, data


def _steps(model: Any, guard: sk.StabilityGuard, data: Iterator[Any], n: int, device: str) -> float:
    """Seconds for ``n`` guarded steps."""
    start = time.perf_counter()
    for _ in range(n):
        x, y = next(data)
        guard.backward(model.loss(x.to(device), y.to(device)))
        guard.step()
        guard.zero_grad()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def snapshot_cost(args: argparse.Namespace) -> None:
    """Table 1 and 2: one snapshot's time and memory, one restore's time."""
    model, guard, data = _build(args, recovery=True)
    _steps(model, guard, data, 3, args.device)  # optimizer state exists
    recovery = guard.engine.recovery
    assert recovery is not None
    objects, copier = recovery.objects, recovery.store.copier
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def timed_snapshot(into: HostCopier) -> tuple[float, Any]:
        start = time.perf_counter()
        snap = take_snapshot(objects, into, guard.step_count, confirmed=True)
        assert snap.tree is not None
        snap.tree.wait()  # the copy has landed (on CUDA the step itself would not wait)
        return time.perf_counter() - start, snap

    first = statistics.median(timed_snapshot(HostCopier())[0] for _ in range(args.repeats))  # fresh pools
    seconds, snap = timed_snapshot(copier)
    copier.release(snap.tree)
    reused = []
    for _ in range(args.repeats):
        seconds, snap = timed_snapshot(copier)
        reused.append(seconds)
        copier.release(snap.tree)
    seconds, snap = timed_snapshot(copier)
    restores = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        restore_snapshot(objects, snap.tree.tree, rng=False)
        restores.append(time.perf_counter() - start)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: GPT {args.layers}x{args.width}, {n_params / 1e6:.2f}M parameters ({param_bytes / 2**20:.1f} MiB)")
    print(f"  snapshot, new host buffers (median of {args.repeats}):    {first * 1e3:8.2f} ms")
    print(f"  snapshot, buffers reused (median of {args.repeats}):      {statistics.median(reused) * 1e3:8.2f} ms")
    print(f"  restore in place (median of {args.repeats}):              {statistics.median(restores) * 1e3:8.2f} ms")
    print(
        f"  host memory per snapshot: {snap.nbytes / 2**20:.1f} MiB ({snap.nbytes / param_bytes:.2f}x the parameters; "
        f"keep={guard.config.recovery.keep} holds {guard.config.recovery.keep * snap.nbytes / 2**20:.1f} MiB)"
    )
    guard.close()


def step_overhead(args: argparse.Namespace) -> None:
    """Table 3: blocks of ``--every`` whole steps, recovery off and on, interleaved."""
    arms = {"recovery off": _build(args, recovery=False), "recovery on": _build(args, recovery=True)}
    for model, guard, data in arms.values():
        _steps(model, guard, data, 5, args.device)  # warm-up
    blocks: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (model, guard, data) in arms.items():
            blocks[name].append(_steps(model, guard, data, args.every, args.device) / args.every)
    off = statistics.median(blocks["recovery off"])
    on = statistics.median(blocks["recovery on"])
    print(f"step time at snapshot_every={args.every} (median over {args.rounds} blocks of {args.every} steps):")
    print(f"  recovery off: {off * 1e3:8.2f} ms/step")
    print(f"  recovery on:  {on * 1e3:8.2f} ms/step  ({(on / off - 1) * 100:+.1f}%)")
    for _, guard, _ in arms.values():
        guard.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--every", type=int, default=sk.RecoveryConfig().snapshot_every)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    snapshot_cost(args)
    step_overhead(args)


if __name__ == "__main__":
    main()
