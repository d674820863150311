"""Overhead of DeepSpeedGuard over a DeepSpeed step without it, in one process, per ZeRO stage.

    python benchmarks/deepspeed_overhead.py [--steps 40] [--repeats 3]

One CPU process (DeepSpeed's CPU accelerator, gloo), a tiny GPT, fp32, ZeRO stages 0-3. For each
stage it times the same training step three ways, interleaved in rounds so a noisy machine hits
each alike: DeepSpeed alone (``engine.backward``/``engine.step``), under the guard with per-layer
norms, under the guard with the total norm only. It prints the median step time of each and the
ratios to DeepSpeed alone. Times are this process's CPU time (one thread; gloo on one rank adds no
waiting), so other work on a shared machine does not count.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt


def _engine(stage: int):  # type: ignore[no-untyped-def]
    import deepspeed

    model = tiny_gpt(n_layer=4, n_embd=64)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _time(stage: int, mode: str, steps: int) -> float:
    """Median seconds per step over ``steps`` steps (after 5 warm-up steps)."""
    from stabilitykit.integrations.deepspeed import DeepSpeedGuard

    engine = _engine(stage)
    guard = None
    if mode != "deepspeed":
        cfg = sk.StabilityConfig(log_every_n_steps=50, grad_norm=sk.GradNormConfig(per_layer=mode == "per_layer"))
        guard = DeepSpeedGuard(engine, config=cfg)
    batches = char_batches(batch_size=8, seed=0)
    times = []
    for i in range(steps + 5):
        x, y = next(batches)
        start = time.process_time()
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        if guard is None:
            engine.backward(loss)
            engine.step()
        else:
            guard.backward(loss)
            guard.step()
        if i >= 5:
            times.append(time.process_time() - start)
    if guard is not None:
        guard.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", default="0,1,2,3")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    from deepspeed.utils import logger

    logger.setLevel("ERROR")
    modes = ("deepspeed", "per_layer", "total")
    print("| ZeRO stage | DeepSpeed alone (ms/step) | guard, per-layer norms | guard, total norm only |")
    print("| --- | --- | --- | --- |")
    for stage in (int(s) for s in args.stages.split(",")):
        results: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for mode in modes:
                with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # DeepSpeed prints its config
                    results[mode].append(_time(stage, mode, args.steps))
        base = statistics.median(results["deepspeed"])
        cells = [
            f"{statistics.median(results[m]) * 1e3:.2f} ms (x{statistics.median(results[m]) / base:.3f})"
            for m in modes[1:]
        ]
        print(f"| {stage} | {base * 1e3:.2f} | {cells[0]} | {cells[1]} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
