"""The fault matrix, generated: run by tests/test_fault_matrix.py on 2 or 4 gloo processes.

    STABILITYKIT_RECORD_COLLECTIVES=1 python tests/fault_matrix_script.py WORLD OUT PORT ci|all

Axes (``CELLS``): layout (2 processes: DDP, FSDP1 FULL_SHARD / SHARD_GRAD_OP / NO_SHARD, FSDP2;
4 processes: FSDP1 HYBRID_SHARD, FSDP2 HSDP 2x2, tensor parallel over 4, FSDP2 + tensor parallel
2x2) x fault (NaN, Inf, a huge finite 3e19; in the loss or in one grad element) x where (rank 0,
the last rank, every rank) x optimizer (AdamW fused, foreach, for-loop; SGD with momentum) x the
step it hits (a logging or a non-logging step) x clipping (off, fixed, adaptive, per-tensor).
Each cell builds its layout fresh and runs ``StabilityGuard`` up to the faulty step. Checked in
every cell, on every rank:

* no crash and no hang (collectives time out; the test bounds the whole run);
* the same decision and the same reported norm on every rank at every step;
* the same sequence of stabilitykit collectives on every rank (``STABILITYKIT_RECORD_COLLECTIVES``);
* a skipped step leaves parameters, optimizer state and buffers bitwise unchanged;
* the decision the skip guide documents (a NaN/Inf is skipped; a huge finite grad is clipped and
  taken where the host reads the decision and clipping is fixed or adaptive, else skipped);
* without a fault: every step's norm equal to one process training the same model on all the data.

``ci`` runs a covering subset (every value of every axis on every layout, and the DDP scenario of a
non-finite grad on the last rank under fixed clipping for every optimizer and step kind); ``all``
runs every cell.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __name__ == "__main__":  # record before stabilitykit is imported (spawned ranks inherit it)
    os.environ.setdefault("STABILITYKIT_RECORD_COLLECTIVES", "1")

import stabilitykit as sk
from stabilitykit.distributed import clear_recorded_collectives, recorded_collectives, to_local
from tests.distributed_models import ResidualNet
from tests.distributed_script_runner import launch

WIDTH, HIDDEN, DEPTH, CLASSES, BATCH = 8, 16, 2, 4, 4
LAYOUTS = {
    2: ("ddp", "fsdp1-full-shard", "fsdp1-shard-grad-op", "fsdp1-no-shard", "fsdp2"),
    4: ("fsdp1-hybrid-shard", "fsdp2-hsdp", "tp", "fsdp2-tp"),
}
FAULTS = ("nan-loss", "inf-loss", "huge-loss", "nan-grad", "inf-grad", "huge-grad")
WHERE = ("rank0", "last", "every")
OPTIMIZERS = ("adamw-fused", "adamw-foreach", "adamw-forloop", "sgd-momentum")
STEPS = ("logging", "nonlogging")
CLIPS = ("off", "fixed", "adaptive", "per_tensor_adaptive")
VALUES = {"nan": math.nan, "inf": math.inf, "huge": 3e19}
LOG_EVERY = 2  # steps 0 and 2 are logging steps, 1 is not


@dataclass(frozen=True)
class Cell:
    layout: str
    fault: str  # "none" or one of FAULTS
    where: str
    optimizer: str
    step: str
    clip: str

    @property
    def name(self) -> str:
        return "/".join((self.layout, self.fault, self.where, self.optimizer, self.step, self.clip))


def cells(world: int, which: str) -> list[Cell]:
    """Every cell of the matrix on ``world`` processes, or the CI subset; ``all:<text>``: every cell
    whose name contains ``<text>``."""
    if which.startswith("all:"):
        return [cell for cell in cells(world, "all") if which[4:] in cell.name]
    layouts = LAYOUTS[world]
    clean = [
        Cell(lay, "none", "every", opt, "logging", clip) for lay in layouts for opt in OPTIMIZERS for clip in CLIPS
    ]
    if which == "all":
        faulty = [Cell(*axes) for axes in itertools.product(layouts, FAULTS, WHERE, OPTIMIZERS, STEPS, CLIPS)]
        return clean + faulty
    subset: list[Cell] = []
    for li, lay in enumerate(layouts):
        subset.append(Cell(lay, "none", "every", OPTIMIZERS[li % 4], "logging", CLIPS[(li + 1) % 4]))
        for i in range(12):  # a covering design: each value of each axis appears on each layout
            k = i + li
            subset.append(
                Cell(lay, FAULTS[k % 6], WHERE[k % 3], OPTIMIZERS[k % 4], STEPS[(k // 2) % 2], CLIPS[(k // 3) % 4])
            )
    if world == 2:  # the reported DDP scenario: inf in one grad on the last rank, fixed clipping
        for opt, step in itertools.product(OPTIMIZERS, STEPS):
            subset.append(Cell("ddp", "inf-grad", "last", opt, step, "fixed"))
    return list(dict.fromkeys(subset))


# --------------------------------------------------------------------------- layouts


_MESHES: dict[tuple[Any, ...], Any] = {}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """One mesh per shape for the whole run: each new mesh makes process groups (and their threads)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def _tp(net: ResidualNet, mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in net.blocks:
        parallelize_module(block, mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


def _replicate(module: nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def inputs(_m: nn.Module, args: Any, device_mesh: Any) -> Any:
        return tuple(DTensor.from_local(t, device_mesh, [Replicate()]) for t in args)

    distribute_module(module, mesh, input_fn=inputs, output_fn=lambda _m, out, _mesh: out.to_local())


def build(layout: str) -> tuple[nn.Module, int, int]:
    """The layout's module, this rank's data rank and the number of data ranks."""
    net = ResidualNet(WIDTH, HIDDEN, DEPTH, CLASSES)
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(net), rank, world
    if layout.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        strategy = {
            "fsdp1-full-shard": ShardingStrategy.FULL_SHARD,
            "fsdp1-shard-grad-op": ShardingStrategy.SHARD_GRAD_OP,
            "fsdp1-no-shard": ShardingStrategy.NO_SHARD,
            "fsdp1-hybrid-shard": ShardingStrategy.HYBRID_SHARD,
        }[layout]
        kw: dict[str, Any] = {"sharding_strategy": strategy, "use_orig_params": True, "device_id": cpu}
        if strategy == ShardingStrategy.HYBRID_SHARD:
            kw["device_mesh"] = _mesh((2, 2), ("replicate", "shard"))
        for i, block in enumerate(net.blocks):
            net.blocks[i] = FSDP(block, **kw)
        return FSDP(net, **kw), rank, world
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp2":
        for block in net.blocks:
            fully_shard(block)
        fully_shard(net)
        return net, rank, world
    if layout == "fsdp2-hsdp":
        mesh = _mesh((2, 2), ("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, rank, world
    if layout == "tp":
        mesh = _mesh((world,), ("tp",))
        _tp(net, mesh)
        _replicate(net.head, mesh)  # every parameter a DTensor: torch's optimizers refuse a mix
        return net, 0, 1  # every rank sees the same data
    if layout == "fsdp2-tp":
        mesh = _mesh((2, 2), ("dp", "tp"))
        _tp(net, mesh["tp"])
        for block in net.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"])
        return net, int(mesh.get_coordinate()[0]), 2
    raise ValueError(layout)


def batch(data_rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + data_rank)
    return torch.randn(BATCH, WIDTH, generator=g) * 2, torch.randint(0, CLASSES, (BATCH,), generator=g)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    flags = {"adamw-fused": {"fused": True}, "adamw-foreach": {"foreach": True}, "adamw-forloop": {"foreach": False}}
    return torch.optim.AdamW(params, lr=0.01, **flags[kind])


def config(clip: str) -> sk.StabilityConfig:
    clip_cfg = sk.ClipConfig(mode="off") if clip == "off" else sk.ClipConfig(mode=clip, max_norm=1.0)
    return sk.StabilityConfig(log_every_n_steps=LOG_EVERY, clip=clip_cfg, nan_trace=sk.NaNTraceConfig(mode="off"))


# --------------------------------------------------------------------------- one cell


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha1()
    for t in tensors:
        local = to_local(t).detach().contiguous()
        h.update(local.reshape(-1).view(torch.uint8).numpy().tobytes() if local.numel() else b"")
    return h.hexdigest()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    tensors = [p for p in model.parameters()] + [b for b in model.buffers()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return f"{len(optimizer.state)}:{_digest(tensors)}"


def _poison_one_grad(model: nn.Module, value: float) -> None:
    for p in model.parameters():
        if p.grad is not None and to_local(p.grad).numel():
            to_local(p.grad).view(-1)[0] = value
            return


def _hits_here(where: str) -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    return where == "every" or (where == "rank0" and rank == 0) or (where == "last" and rank == world - 1)


def expected_skip(cell: Cell, norm: float) -> bool:
    """What the skip guide documents for this cell's faulty step, given the norm every rank reported.

    NaN/Inf: skipped. A huge finite value: taken when its fp32 norm stays finite (after the
    reductions a 3e19 loss on one data-parallel rank may be averaged down below fp32's range);
    when the fp32 norm overflows, re-measured in fp64 and taken where the host reads the decision
    with fixed or adaptive clipping, else skipped.
    """
    if cell.fault == "none":
        return False
    if not cell.fault.startswith("huge"):
        return True
    host_reads = cell.step == "logging" or cell.optimizer != "adamw-fused"
    if cell.clip in ("fixed", "adaptive") and host_reads:
        return False
    return not math.isfinite(norm)


def reference_norms(cell: Cell, data_ranks: int, steps: int) -> list[float]:
    """One process, the same model and config, every data rank's batch at once."""
    net = ResidualNet(WIDTH, HIDDEN, DEPTH, CLASSES)
    optimizer = make_optimizer(cell.optimizer, net.parameters())
    guard = sk.StabilityGuard(net, optimizer, config(cell.clip))
    norms = []
    for it in range(steps):
        losses = [nn.functional.cross_entropy(net(x), y) for x, y in (batch(r, it) for r in range(data_ranks))]
        guard.backward(torch.stack(losses).mean())
        norms.append(float(guard.step().grad_norm))
        guard.zero_grad()
    return norms


def run_cell(cell: Cell) -> list[str]:
    """The cell's failures on this rank (empty: every invariant held here)."""
    model, data_rank, data_ranks = build(cell.layout)
    optimizer = make_optimizer(cell.optimizer, model.parameters())
    guard = sk.StabilityGuard(model, optimizer, config(cell.clip))
    fault_step = 2 if cell.step == "logging" else 1
    failures: list[str] = []
    decisions: list[tuple[bool, str]] = []
    for it in range(fault_step + 1):
        faulty = it == fault_step and cell.fault != "none" and _hits_here(cell.where)
        kind, _, place = cell.fault.partition("-")
        x, y = batch(data_rank, it)
        loss = nn.functional.cross_entropy(model(x), y)
        if faulty and place == "loss":
            loss = loss * VALUES[kind]
        guard.backward(loss)
        if faulty and place == "grad":
            _poison_one_grad(model, VALUES[kind])
        before = _state(model, optimizer)
        report = guard.step()
        skipped = bool(report.skipped)
        if skipped and _state(model, optimizer) != before:
            failures.append(f"step {it} skipped but the state changed")
        decisions.append((skipped, repr(float(report.grad_norm))))
        guard.zero_grad()
    guard.close()
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (decisions, recorded_collectives()))
    if any(d != gathered[0][0] for d, _ in gathered):
        failures.append(f"ranks disagree on (skipped, norm): {[d for d, _ in gathered]}")
    if any(c != gathered[0][1] for _, c in gathered):
        failures.append(f"ranks ran different collectives: {[c for _, c in gathered]}")
    skipped, norm = decisions[-1]
    if skipped != expected_skip(cell, float(norm)):
        failures.append(f"faulty step skipped={skipped} (norm {norm}), the documented rule says otherwise")
    if cell.fault == "none":
        reference = reference_norms(cell, data_ranks, fault_step + 1)
        got = [float(n) for _, n in decisions]
        if any(abs(a - b) > 2e-5 * max(1.0, abs(b)) for a, b in zip(got, reference, strict=True)):
            failures.append(f"norms {got} differ from one process {reference}")
    return failures


def worker(rank: int, world: int) -> dict[str, Any]:
    which = sys.argv[4] if len(sys.argv) > 4 else "ci"
    results: dict[str, list[str]] = {}
    for cell in cells(world, which):
        clear_recorded_collectives()
        try:
            failures = run_cell(cell)
        except Exception as exc:  # a crash is a failure of this cell; the others still run
            failures = [f"crashed: {exc!r}"[:500]]
            dist.barrier()
        results[cell.name] = failures
    return {"rank": rank, "cells": results}


if __name__ == "__main__":
    launch(worker, sys.argv[1:])
