"""Rollback under DDP: a fault on one rank rolls every rank back, at the same step, to the same snapshot.

    python examples/recovery_ddp.py [--steps 90] [--out runs/recovery_ddp]

Starts 2 CPU processes (torch.distributed with gloo on 127.0.0.1) that train a tiny GPT under
``DistributedDataParallel`` with recovery on. From step 50 rank 1 alone gets bad batches (its
loss is NaN, and DDP averages the NaN into every rank's grads); every rank skips those steps (the
skip decision is agreed), the run of skips is a divergence, and both ranks restore the snapshot
taken before it at the next logging step. Rank 0
then checks that both replicas hold the same weights and prints each rank's rollback. With
several ranks a trigger one rank finds is agreed in the next step's all-reduce and acted on at the
next logging step (the recovery guide explains why). A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt

BAD = range(50, 56)  # rank 1's bad batches
WORLD = 2


def train(rank: int, port: int, steps: int, out: Path) -> None:
    """One rank: DDP training with recovery; writes ``rank<r>.json`` with its rollbacks and a weight checksum."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(tiny_gpt(n_layer=2, n_embd=32))  # same init everywhere
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    cfg = sk.StabilityConfig(
        log_every_n_steps=5,
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        skip=sk.SkipConfig(max_consecutive=4),
        recovery=sk.RecoveryConfig(enabled=True, snapshot_every=10, keep=3, record_dir=str(out / f"rank{rank}")),
    )
    guard = sk.StabilityGuard(model, optimizer, cfg)
    rollbacks: list[dict[str, Any]] = []
    guard.hooks.on("rollback", lambda e: rollbacks.append(dict(e.details)))
    data = char_batches(seed=rank)  # each rank its own data
    for step in range(steps):
        x, y = next(data)
        logits = model(x)  # through DDP's forward, so its backward averages the grads across ranks
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        if rank == 1 and step in BAD:
            loss = loss * float("nan")  # a corrupt batch on this rank only
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    keys = ("at_step", "trigger", "onset", "restored_step")
    result = {"rollbacks": [{k: r[k] for k in keys} for r in rollbacks], "checksum": checksum}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--out", type=Path, default=Path("runs/recovery_ddp"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(train, args=(_free_port(), args.steps, args.out), nprocs=WORLD)
    ranks = [json.loads((args.out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, result in enumerate(ranks):
        for rollback in result["rollbacks"]:
            print(
                f"rank {r}: rolled back after {rollback['trigger']} (onset step {rollback['onset']}) at step "
                f"{rollback['at_step']} to the state before step {rollback['restored_step']}"
            )
    same = len({r["checksum"] for r in ranks}) == 1
    print(f"every rank rolled back together: {all(r['rollbacks'] == ranks[0]['rollbacks'] for r in ranks)}")
    print(f"replicas identical: {same}")
    return ranks


if __name__ == "__main__":
    main(sys.argv[1:])
