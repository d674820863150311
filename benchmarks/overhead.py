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
3. The update-to-weight ratio (``GradNormConfig(update_ratio=True)``): whole guarded steps with it
   off and on, logging every 10 steps and every step; by position in the logging interval (the
   measured step before a logging step, the logging step, the others) and on average.
   ``--update-ratio-only`` runs just this table.
4. The guard's host time per ordinary step: ``guard.backward`` + ``guard.step`` against
   ``loss.backward()`` + ``optimizer.step()`` on a model so small that the step's own work is
   almost nothing, logging every 1000 steps (logging steps are not counted), in microseconds.
   ``--host-only`` runs just this one, in the stepping thread's CPU time (median and IQR of paired
   differences); ``--ab PATH...`` times the package trees at PATH... beside the imported one, step by step.
5. Rerun and replica checks: whole guarded steps with ``RerunConfig`` off, on (no step flagged:
   what every step pays) and on with every step re-run (a NaN in the logits on every pass: what a
   rerun step costs); and one replica check (fingerprints of every parameter and AdamW state
   tensor, the all-gather on a one-process gloo group, the read) amortized over
   ``every_n_steps=100``. ``--rerun-only`` runs just this table.

This is a script, not a test: timings depend on the machine; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

import stabilitykit as sk
from stabilitykit.engine import StabilityEngine
from stabilitykit.testing import char_batches, tiny_gpt


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _interleave(
    arms: dict[str, Callable[[], None]], rounds: int, warmup: int = 3, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Median seconds per call of each arm, run round-robin (``clock``: wall time, or CPU time)."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds + warmup):
        for name, fn in arms.items():
            start = clock()
            fn()
            elapsed = clock() - start
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
        engine.book_step(decision)

    def ours_per_tensor() -> None:
        decision = per_tensor_engine.evaluate()
        per_tensor_engine.book_step(decision)

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


def update_ratio_cost(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Table 3: guarded whole steps with the update ratio off and on, by position in the logging interval."""
    tmp = tempfile.mkdtemp(prefix="sk-bench-")
    data = char_batches(batch_size=8, block_size=64, vocab_size=256)
    batches = [next(data) for _ in range(8)]
    arms: dict[str, Callable[[int], None]] = {}
    for every in (10, 1):
        for on in (False, True):
            model = tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256, block_size=64)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            cfg = sk.StabilityConfig(
                clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
                log_every_n_steps=every,
                grad_norm=sk.GradNormConfig(update_ratio=on),
            )
            name = f"every {every}, update ratio {'on' if on else 'off'}"
            sink = sk.sinks.JsonlSink(os.path.join(tmp, f"{every}-{on}.jsonl"))
            guard = sk.StabilityGuard(model, opt, cfg, sinks=[sink])

            def step(i: int, model: torch.nn.Module = model, guard: sk.StabilityGuard = guard) -> None:
                x, y = batches[i % len(batches)]
                guard.backward(model.loss(x, y))
                guard.step()
                guard.zero_grad()

            arms[name] = step
    window, warmup = 10, 1
    times: dict[str, list[float]] = {name: [] for name in arms}
    for i in range((args.rounds + warmup) * window):
        for name, fn in arms.items():  # round-robin, one step each: every arm is at the same position
            start = time.perf_counter()
            fn(i)
            times[name].append(time.perf_counter() - start)
    out: dict[str, dict[str, float]] = {}
    for name, samples in times.items():
        kept = samples[warmup * window :]
        at = {pos: [t for j, t in enumerate(kept) if j % window == pos] for pos in range(window)}
        rest = [t for pos in range(1, window - 1) for t in at[pos]]
        out[name] = {
            "mean": statistics.fmean(kept) * 1e3,
            "measured (pos 9)": _median_ms(at[window - 1]),
            "logging (pos 0)": _median_ms(at[0]),
            "other (median)": _median_ms(rest),
        }
    return out


@dataclass
class HostTime:
    """Table 4's reading: the guard's host time per ordinary step, microseconds of this thread's CPU time."""

    median: float
    q1: float
    q3: float
    bare: float  # the bare step's own median, for scale
    ratio: float  # median of each round's guarded step over its bare step (a machine slowed down alike cancels)
    samples: list[float]  # each round's difference (guard - bare)
    bares: list[float]  # each round's bare step

    def line(self) -> str:
        return (
            f"{self.median:.0f} us (IQR {self.q1:.0f}-{self.q3:.0f}, {len(self.samples)} paired steps; "
            f"bare step {self.bare:.0f} us, guarded/bare {self.ratio:.2f}x), CPU time of the stepping thread"
        )


def _host_time(diffs: list[float], bares: list[float]) -> HostTime:
    q1, median, q3 = statistics.quantiles(diffs, n=4)
    ratio = statistics.median((d + b) / b for d, b in zip(diffs, bares, strict=True))
    return HostTime(median, q1, q3, statistics.median(bares), ratio, diffs, bares)


def _package_modules() -> dict[str, ModuleType]:
    """The ``stabilitykit`` modules imported now."""
    return {k: m for k, m in sys.modules.items() if k == "stabilitykit" or k.startswith("stabilitykit.")}


def _use(modules: dict[str, ModuleType]) -> None:
    """Make ``modules`` the ``stabilitykit`` every import finds (a lazy import inside a step too)."""
    for name in _package_modules():
        del sys.modules[name]
    sys.modules.update(modules)


def load_tree(path: str) -> dict[str, ModuleType]:
    """``stabilitykit`` imported from the tree at ``path`` beside the one imported already: its modules,
    set aside (``_use`` switches to them); the imported one stays current."""
    current = _package_modules()
    _use({})
    sys.path.insert(0, os.path.abspath(path))
    try:
        importlib.import_module("stabilitykit")
        loaded = _package_modules()
    finally:
        sys.path.remove(os.path.abspath(path))
        _use(current)
    return loaded


def guard_host_us(
    rounds: int = 3000, trees: dict[str, dict[str, ModuleType]] | None = None, warmup: int = 20
) -> dict[str, HostTime]:
    """Table 4: the guard's own host time per ordinary step (microseconds), per package tree.

    Each round runs one bare step and one guarded step per tree (``trees``: label -> its modules, from
    ``load_tree``; default: the imported package as "guard"), in an order that rotates, and keeps each
    guarded step's difference from the round's bare step; timed in the thread's CPU time
    (``time.thread_time_ns``), so time spent preempted on a shared machine is not counted (the tensors
    are so small that torch runs every op on this thread). Logging steps (every 1000th) are left out:
    an ordinary step is what is measured.
    """
    trees = trees or {"guard": _package_modules()}
    current = _package_modules()
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4, 8)

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1)  # every arm the same model
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    model, opt = make()

    def bare() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    every = 1000
    arms: dict[str, Callable[[], None]] = {"bare": bare}
    guards = []
    for label, modules in trees.items():
        _use(modules)
        pkg = modules["stabilitykit"]
        guarded_model, guarded_opt = make()
        cfg = pkg.StabilityConfig(clip=pkg.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=every)
        guard = pkg.StabilityGuard(guarded_model, guarded_opt, cfg)
        guards.append((modules, guard))

        def guarded(guard: Any = guard, guarded_model: torch.nn.Module = guarded_model) -> None:
            guard.backward(torch.nn.functional.mse_loss(guarded_model(x), y))
            guard.step()
            guard.zero_grad()

        arms[label] = guarded
    _use(current)
    names = list(arms)
    clock = time.thread_time_ns
    spent: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + warmup):
        order = names[r % len(names) :] + names[: r % len(names)]
        took: dict[str, int] = {}
        for name in order:
            if name != "bare":
                _use(trees[name])
            start = clock()
            arms[name]()
            took[name] = clock() - start
        if r >= warmup and r % every != 0:  # r: the guarded steps' number; every 1000th is a logging step
            for name in names:
                spent[name].append(took[name] / 1e3)
    for modules, guard in guards:
        _use(modules)
        guard.close()
    _use(current)
    bares = spent.pop("bare")
    return {
        name: _host_time([t - b for t, b in zip(times, bares, strict=True)], bares) for name, times in spent.items()
    }


def host_ab(others: list[str], rounds: int) -> None:
    """Table 4 for several package trees in one process: each tree at ``others`` and the one imported (B),
    interleaved step by step with the same bare step; every reading, and B minus each, paired by round."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(sk.__file__)))
    paths = {f"A{i + 1}" if len(others) > 1 else "A": os.path.abspath(p) for i, p in enumerate(others)}
    trees = {label: load_tree(path) for label, path in paths.items()}
    trees["B"] = _package_modules()
    paths["B"] = here
    result = guard_host_us(rounds, trees)
    print("\n4. the guard's host time per ordinary step, trees interleaved in one process")
    for label, path in paths.items():
        print(f"{label} {path}: {result[label].line()}")
    b = result["B"]
    for label in paths:
        if label == "B":
            continue
        a = result[label]
        gap = [sb - sa for sa, sb in zip(a.samples, b.samples, strict=True)]
        q1, median, q3 = statistics.quantiles(gap, n=4)
        print(
            f"B - {label}: {median:+.0f} us per ordinary step (IQR {q1:+.0f} to {q3:+.0f}, paired by round), "
            f"{100 * median / a.median:+.1f}% of {label}'s"
        )


def update_monitor_cost(args: argparse.Namespace, rounds: int = 200) -> float:
    """Median ms of the update ratio's own device work on one measured step: the parameter copy,
    the norms after the optimizer step (not timed) and the per-layer ratios; what table 3's whole
    steps add, without their noise."""
    model = tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256, block_size=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    cfg = sk.StabilityConfig(grad_norm=sk.GradNormConfig(update_ratio=True))
    engine = StabilityEngine(list(model.parameters()), cfg, model=model, fused=True)
    monitor = engine.updates
    assert monitor is not None
    x, y = next(char_batches(batch_size=8, block_size=64, vocab_size=256))
    model.loss(x, y).backward()
    samples = []
    for i in range(rounds + 5):
        start = time.perf_counter()
        monitor.snapshot(i)
        middle = time.perf_counter()
        opt.step()
        resume = time.perf_counter()
        monitor.measure()
        values = monitor.values(i + 1)
        assert values is not None
        values.tolist()  # rides in the logging step's journal read: the copy itself is that read's
        if i >= 5:
            samples.append(middle - start + time.perf_counter() - resume)
    return _median_ms(samples)


def rerun_cost(args: argparse.Namespace) -> dict[str, float]:
    """Table 4: the rerun's cost per step and per rerun step; one replica check, amortized."""
    import torch.distributed as dist

    from stabilitykit.replicas import ReplicaCheck
    from stabilitykit.testing import inject_fault

    data = char_batches(batch_size=8, block_size=64, vocab_size=256)
    batches = [next(data) for _ in range(8)]
    arms: dict[str, Callable[[], None]] = {}
    guards = []
    for name, rerun, faulty, host_rng in (
        ("rerun off", False, False, False),
        ("rerun on", True, False, False),
        ("rerun on, host_rng", True, False, True),  # Python's random and numpy's states taken too
        ("every step re-run", True, True, False),
    ):
        torch.manual_seed(0)
        model = tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256, block_size=64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        cfg = sk.StabilityConfig(
            clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
            log_every_n_steps=10,
            skip=sk.SkipConfig(max_consecutive=None),
            # the faulty arm reads every step's decision so that every step is re-run (fused AdamW otherwise
            # re-runs only a flagged logging step: rerun adds no read of its own)
            rerun=sk.RerunConfig(read_every_step=faulty, host_rng=host_rng) if rerun else None,
        )
        guard = sk.StabilityGuard(model, opt, cfg)
        guards.append((model, opt, guard))
        if faulty:  # a NaN in the logits every time any step is computed: every step is re-run (reproducible)
            inject_fault(model, "activation", "lm_head", step=0, kind="nan", repeat=True, step_of=lambda: 0)
        counter = {"i": 0}

        def step(model: torch.nn.Module = model, guard: sk.StabilityGuard = guard, counter: dict = counter) -> None:
            counter["i"] += 1
            x, y = batches[counter["i"] % len(batches)]

            def loss_of() -> torch.Tensor:
                return model.loss(x, y)

            guard.backward(loss_of())
            guard.step(replay=loss_of)
            guard.zero_grad()

        arms[name] = step
    clock = time.process_time if args.cpu_time else time.perf_counter
    times = _interleave(arms, args.rounds * 5, clock=clock)
    model, opt, _ = guards[0]
    if not dist.is_initialized():
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    names = [n for n, _ in model.named_parameters()]
    check = ReplicaCheck(sk.ReplicaCheckConfig(), list(model.parameters()), names, opt, model, sk.HookManager())
    samples = []
    for i in range(args.rounds + 3):
        start = clock()
        check.check(i)  # fingerprints, the all-gather, the one read (world of one: the collective's floor)
        if i >= 3:
            samples.append(clock() - start)
    times["replica check (one)"] = _median_ms(samples)
    return times


def _rerun_table(result: dict[str, float]) -> None:
    print("\n5. rerun and replica checks (interleaved whole guarded steps, median ms; --cpu-time: CPU ms)")
    for name, ms in result.items():
        print(f"{name:<28}{ms:>10.3f}")
    off = result["rerun off"]
    print(f"rerun on, no step flagged vs off: {100 * (result['rerun on'] / off - 1):+.1f}% per step")
    host = result["rerun on, host_rng"]
    print(f"rerun on with host_rng vs off: {100 * (host / off - 1):+.1f}% per step")
    print(f"a re-run step vs an ordinary step: {result['every step re-run'] / off:.2f}x")
    check = result["replica check (one)"]
    print(
        f"replica check at every_n_steps=100: {check:.3f} ms per check, "
        f"{100 * check / 100 / off:.3f}% of a step averaged"
    )


def _update_table(result: dict[str, dict[str, float]]) -> None:
    print("\n3. update ratio: whole guarded step, ms (interleaved; position in a 10-step window)")
    columns = list(next(iter(result.values())))
    print(f"{'arm':<32}" + "".join(f"{c:>18}" for c in columns))
    for name, row in result.items():
        print(f"{name:<32}" + "".join(f"{row[c]:>18.3f}" for c in columns))
    for every in (10, 1):
        off, on = result[f"every {every}, update ratio off"], result[f"every {every}, update ratio on"]
        parts = [f"mean {100 * (on['mean'] / off['mean'] - 1):+.1f}%"]
        if every > 1:
            for c in ("measured (pos 9)", "logging (pos 0)", "other (median)"):
                parts.append(f"{c} {on[c] - off[c]:+.3f} ms ({100 * (on[c] / off[c] - 1):+.1f}%)")
        print(f"every {every}: update ratio on vs off: " + ", ".join(parts))


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
    parser.add_argument("--update-ratio-only", action="store_true", help="only table 3 (the update ratio's cost)")
    parser.add_argument(
        "--ratios-only", action="store_true", help="only tables 1 and 2 and their ratios (grad pass, per-tensor, step)"
    )
    parser.add_argument("--host-only", action="store_true", help="only table 4 (the guard's host time per step)")
    parser.add_argument("--host-rounds", type=int, default=3000, help="table 4: paired steps measured")
    parser.add_argument(
        "--ab",
        metavar="PATH",
        nargs="+",
        help="table 4 for the package trees at PATH... (A) and the imported one (B), interleaved in one process",
    )
    parser.add_argument("--rerun-only", action="store_true", help="only table 5 (rerun and replica checks)")
    parser.add_argument(
        "--cpu-time", action="store_true", help="table 5 in this process's CPU time (a shared machine; use --threads 1)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in tiny_gpt(n_layer=args.layers, n_embd=args.width, vocab_size=256).parameters())
    size = f"GPT {args.layers}x{args.width} ({n_params / 1e6:.1f}M params)"
    print(f"torch {torch.__version__}, {args.threads} threads, {size}")
    if args.ab is not None:
        host_ab(args.ab, args.host_rounds)
        return
    if args.host_only:
        print(f"4. the guard's host time per ordinary step: {guard_host_us(args.host_rounds)['guard'].line()}")
        return
    if args.rerun_only:
        _rerun_table(rerun_cost(args))
        return
    if args.update_ratio_only:
        _update_table(update_ratio_cost(args))
        print(f"update ratio's own work on a measured step (copy + norms + ratios): {update_monitor_cost(args):.3f} ms")
        return
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
    if args.ratios_only:
        return
    _update_table(update_ratio_cost(args))
    print(f"update ratio's own work on a measured step (copy + norms + ratios): {update_monitor_cost(args):.3f} ms")
    print(f"\n4. the guard's host time per ordinary step: {guard_host_us(args.host_rounds)['guard'].line()}")
    _rerun_table(rerun_cost(args))


if __name__ == "__main__":
    main()
