"""The data, the model or the machine: a transient fault, a bad batch and a corrupted replica under DDP.

    python examples/rerun_and_replicas.py [--out runs/rerun]

Starts 2 CPU processes (torch.distributed with gloo) that train a small MLP under
``DistributedDataParallel`` with ``RerunConfig`` and ``ReplicaCheckConfig(every_n_steps=10)`` on,
and injects faults on rank 1 only with ``stabilitykit.testing.inject_fault``:

* step 5: a NaN in rank 1's logits, once (a machine's fault): re-run, judged ``transient``, rank 1
  named, the recomputed step taken;
* step 12: a batch of huge inputs on rank 1 (the data's fault): re-run, judged ``reproducible``,
  skipped on both ranks and written to ``<out>/rerun.jsonl``;
* before step 15: one flipped mantissa bit in rank 1's copy of a weight: the replica check after
  step 19 names rank 1 and the tensor.

Rank 0 prints each event. A few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import stabilitykit as sk
from stabilitykit.testing import inject_fault

WORLD, STEPS = 2, 25


def train(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the events below say what the warnings would
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = sk.StabilityConfig(
        rerun=sk.RerunConfig(record_path=os.path.join(out, "rerun.jsonl")),
        replicas=sk.ReplicaCheckConfig(every_n_steps=10),
    )
    guard = sk.StabilityGuard(model, opt, cfg)
    if rank == 0:
        guard.hooks.on(
            "rerun", lambda e: print(f"rerun @ step {e.step}: {e.details['verdict']}, rank {e.details['rank']}")
        )
        guard.hooks.on(
            "replica_mismatch",
            lambda e: print(f"replica_mismatch @ step {e.step}: rank {e.details['rank']}, {e.details['tensor']}"),
        )
    inject_fault(model, "activation", "2", step=5, rank=1, kind="nan")  # the logits, once
    inject_fault(model, "param", "0.weight", step=15, rank=1, bit=12, index=3)  # a finite corruption
    skipped = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        if step == 12 and rank == 1:
            x = x * 3e38  # overflows in the first layer however often it is computed

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.cross_entropy(model(x), y)

        guard.backward(loss_of())
        if guard.step(replay=loss_of).skipped:
            skipped.append(step)
        guard.zero_grad()
    guard.close()
    if rank == 0:
        print(f"skipped steps: {skipped}")
        print(f"record: {Path(out, 'rerun.jsonl').read_text().strip()}")
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/rerun")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "rerun.jsonl").unlink(missing_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(port, args.out), nprocs=WORLD)


if __name__ == "__main__":
    sys.exit(main())
