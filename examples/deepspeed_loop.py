"""A DeepSpeed ZeRO-2 loop under DeepSpeedGuard: a NaN on one rank skipped on every rank, a NaN streak
on one rank rolled back on every rank.

    python examples/deepspeed_loop.py [--steps 30] [--stage 2] [--out runs/deepspeed]

Starts 2 CPU processes (DeepSpeed's CPU accelerator; collectives over gloo on 127.0.0.1) that train
a tiny GPT with ZeRO (stage 2 by default: each rank holds half of every gradient). At step 10 rank 1
alone gets a NaN loss. DeepSpeed alone, at stage 0, would write NaN into every parameter; here
both ranks skip that step (the decision is agreed across ranks), nothing of the step is applied
(parameters, fp32 partitions, Adam moments, LR scheduler, the engine's step counters), and the
run goes on. At steps 12 and 13 rank 1 alone has NaN losses again: two skips in a row is a
divergence (``max_consecutive=2``), and recovery rolls both ranks back together at the next logging
step to the snapshot before the streak, each rank restoring its own partitions. Each rank prints
its summary; the ranks check the global grad norm against DeepSpeed's own
``engine.get_global_grad_norm()``. Needs ``pip install 'stabilitykit[deepspeed]'``. About 15 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: no GPU needed

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt

BAD_STEP = 10
BAD_STREAK = (12, 13)  # two skips in a row: a divergence, rolled back
WORLD = 2


def train(rank: int, port: int, steps: int, stage: int, out: Path) -> None:
    """One rank: ZeRO training under the guard; writes ``rank<r>.json`` with what it saw."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_SIZE": str(WORLD)})
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import logger

    from stabilitykit.drivers.deepspeed import DeepSpeedGuard

    logger.setLevel("ERROR")
    model = tiny_gpt(n_layer=2, n_embd=32)  # the same init on every rank
    ds_config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.1, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,  # stabilitykit clips (DeepSpeed's default is 1.0: one clipper only)
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    cfg = sk.StabilityConfig(
        log_every_n_steps=5,
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        skip=sk.SkipConfig(max_consecutive=2),
        # snapshots of each rank's own partitions every 4 steps; a divergence rolls every rank back
        # together and training goes on at once (the defaults would also skip the next 50 batches and
        # halve the LR for 50 steps, for a burst of bad data or a blow-up)
        recovery=sk.RecoveryConfig(snapshot_every=4, keep=2, trigger=["diverged"], skip_after=0, cooldown_steps=0),
    )
    guard = DeepSpeedGuard(engine, config=cfg, sinks=[sk.sinks.JsonlSink(out / f"rank{rank}.jsonl")])
    rollbacks: list[tuple[int, int]] = []
    guard.hooks.on("rollback", lambda e: rollbacks.append((e.step, e.details["restored_step"])))
    batches = char_batches(batch_size=8, seed=rank)
    norms = []
    for step in range(steps):
        x, y = next(batches)
        logits = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        if (step == BAD_STEP or step in BAD_STREAK) and rank == 1:
            loss = loss * float("nan")  # one rank's bad batch
        engine.backward(loss)  # routed through the guard: the same as guard.backward(loss)
        report = guard.step()
        assert report is not None
        if not bool(report.skipped):
            norms.append((float(report.grad_norm), float(engine.get_global_grad_norm())))
    summary = guard.summary()
    guard.close()
    same_norm = all(math.isclose(a, b, rel_tol=1e-5) for a, b in norms)
    params = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    result = {
        "skipped": summary.skipped,
        "rollbacks": rollbacks,
        "digest": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
        "global_steps": engine.global_steps,
        "finite": all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()),
        "norm_is_deepspeeds": same_norm,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank}: {summary.line()}")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--out", type=Path, default=Path("runs/deepspeed"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(port, args.steps, args.stage, args.out), nprocs=WORLD)
    ranks = [json.loads((args.out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    print(f"ZeRO-{args.stage}: every rank skipped the NaN steps: {all(r['skipped'] == 3 for r in ranks)}")
    together = len(ranks[0]["rollbacks"]) == 1 and all(r["rollbacks"] == ranks[0]["rollbacks"] for r in ranks)
    print(f"every rank rolled back once, at the same step, to the same snapshot: {together} {ranks[0]['rollbacks']}")
    identical = all(r["finite"] and r["digest"] == ranks[0]["digest"] for r in ranks)
    print(f"parameters finite and identical on every rank: {identical}")
    print(f"global norm equal to DeepSpeed's own: {all(r['norm_is_deepspeeds'] for r in ranks)}")
    print(f"engine steps (skipped and rolled-back steps not counted): {[r['global_steps'] for r in ranks]}")
    return ranks


if __name__ == "__main__":
    main(sys.argv[1:])
