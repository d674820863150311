"""Run by tests/test_distributed_layouts.py on 4 gloo processes: the layouts that span nodes.

    python tests/distributed_layouts_script.py 4 OUT_DIR PORT [ci|all]

Layouts: FSDP1 HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (shard 2 x replicate 2, use_orig_params both
ways), FSDP2 HSDP on a 2 x 2 mesh, FSDP2 + tensor parallel (dp 2 x tp 2), tensor parallel with
hand-averaged data parallel (Replicate and Partial-free TP grads beside plain ones), and a
2-stage pipeline x FSDP2 dp 2 (``extra_group`` = the pipeline group). For each: 3 iterations of
forward, backward, ``sk.clip_grad_norm_``, AdamW; the totals and the full parameters go next to
a DDP + ``torch.nn.utils.clip_grad_norm_`` reference on the same data. Then, per layout and
norm type, a NaN or Inf on rank 3 only under ``StabilityGuard``: every rank must skip with its
parameters and optimizer state bitwise unchanged. Then DTensor grads with every pair of
placements (Shard, Replicate, Partial) on a 2 x 2 mesh against the norm of the full tensors.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ITERS = 3
NORMS = (1.0, 2.0, math.inf)
LAYOUTS = (
    "fsdp1-hybrid|orig=True",
    "fsdp1-hybrid|orig=False",
    "fsdp1-hybrid-zero2|orig=True",
    "fsdp1-hybrid-zero2|orig=False",
    "fsdp2-hsdp-2x2",
    "fsdp2-tp",
    "tp-ddp",
    "pp2-fsdp2",
)
#: The representative subset CI runs: every layout at p = 2 and inf, max_norm 1; p = 1 on two.
CI_PARITY = [(lay, p, 1.0) for lay in LAYOUTS for p in (2.0, math.inf)] + [
    ("fsdp1-hybrid|orig=True", 1.0, 1.0),
    ("fsdp2-tp", 1.0, 2.5),
]
CI_SKIP = [(lay, math.inf, "nan") for lay in LAYOUTS] + [
    ("fsdp2-tp", 2.0, "inf"),
    ("pp2-fsdp2", 1.0, "nan"),
]
#: A finite 1e38 on rank 3 overflows the fp32 norm: re-measured in fp64, clipped and taken everywhere.
CI_OVERFLOW = ["fsdp1-hybrid|orig=True", "fsdp2-hsdp-2x2", "fsdp2-tp", "pp2-fsdp2"]
WIDTH, HIDDEN = 12, 32  # even, so tensor-parallel shards are equal


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, HIDDEN)
        self.proj = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(4)])
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    """One pipeline stage of ``Net``: its blocks keep their names (``blocks.2``), the last adds the head."""

    def __init__(self, net: Net, stage: int) -> None:
        super().__init__()
        half = len(net.blocks) // 2
        ids = range(half) if stage == 0 else range(half, len(net.blocks))
        self.blocks = nn.ModuleDict({str(i): net.blocks[i] for i in ids})
        self.head = net.head if stage == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def batch(data_rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + data_rank)
    return torch.randn(6, WIDTH, generator=g) * 3, torch.randint(0, 5, (6,), generator=g)


@dataclass
class Setup:
    """A layout ready to train: its module, how one iteration's backward runs, what to clip with."""

    model: nn.Module
    backward: Callable[[int], torch.Tensor]  # iteration -> loss (backward done, grads final)
    extra_group: Any | None = None
    foreach: bool = True
    names: dict[str, nn.Parameter] = field(default_factory=dict)


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _loss(model: nn.Module, data_rank: int, it: int) -> torch.Tensor:
    x, y = batch(data_rank, it)
    return nn.functional.cross_entropy(model(x), y)


def _tp(net: Net, tp_mesh: Any) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in net.blocks:
        parallelize_module(block, tp_mesh, {"fc": ColwiseParallel(), "proj": RowwiseParallel()})


def setup(layout: str) -> Setup:
    """Build ``layout`` on the 4 processes (2 x 2 everywhere)."""
    rank = dist.get_rank()
    net = Net()
    if layout.startswith("fsdp1-hybrid"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        strategy = ShardingStrategy._HYBRID_SHARD_ZERO2 if "zero2" in layout else ShardingStrategy.HYBRID_SHARD
        mesh = _mesh((2, 2), ("replicate", "shard"))
        kw = {"sharding_strategy": strategy, "use_orig_params": layout.endswith("True"), "device_mesh": mesh}
        for i, block in enumerate(net.blocks):
            net.blocks[i] = FSDP(block, device_id=torch.device("cpu"), **kw)  # type: ignore[arg-type]
        model = FSDP(net, device_id=torch.device("cpu"), **kw)  # type: ignore[arg-type]
        return Setup(model, lambda it: _backward(model, rank, it))
    if layout == "fsdp2-hsdp-2x2":
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh((2, 2), ("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return Setup(net, lambda it: _backward(net, rank, it))
    if layout == "fsdp2-tp":
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh((2, 2), ("dp", "tp"))
        dp_rank = mesh.get_coordinate()[0]
        _tp(net, mesh["tp"])
        for block in net.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(net, mesh=mesh["dp"])
        return Setup(net, lambda it: _backward(net, dp_rank, it))
    if layout == "tp-ddp":
        mesh = _mesh((2, 2), ("dp", "tp"))
        dp_rank = mesh.get_coordinate()[0]
        dp_group = mesh["dp"].get_group()
        _tp(net, mesh["tp"])

        def backward_tp(it: int) -> torch.Tensor:
            loss = _backward(net, dp_rank, it)
            for p in net.parameters():  # data parallel by hand: average the local grads over dp
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(local, op=dist.ReduceOp.AVG, group=dp_group)
            return loss

        return Setup(net, backward_tp, foreach=False)
    if layout == "pp2-fsdp2":
        return _pipeline(net)
    raise ValueError(layout)


def _backward(model: nn.Module, data_rank: int, it: int) -> torch.Tensor:
    loss = _loss(model, data_rank, it)
    loss.backward()
    return loss.detach()


def _pipeline(net: Net) -> Setup:
    """2 stages x FSDP2 over dp 2; activations and their grads go by send/recv between stages."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh((2, 2), ("pp", "dp"))
    stage_id, dp_rank = mesh.get_coordinate()
    stage = Stage(net, stage_id)
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage, mesh=mesh["dp"])
    peer = dist.get_rank() + (2 if stage_id == 0 else -2)

    def backward_pp(it: int) -> torch.Tensor:
        x, y = batch(dp_rank, it)
        if stage_id == 0:
            out = stage(x)
            dist.send(out.detach().contiguous(), peer)
            grad = torch.empty_like(out)
            dist.recv(grad, peer)
            out.backward(grad)
            return torch.zeros(())
        act = torch.empty(x.shape[0], WIDTH)
        dist.recv(act, peer)
        act.requires_grad_(True)
        loss = nn.functional.cross_entropy(stage(act), y)
        loss.backward()
        dist.send(act.grad.contiguous(), peer)
        return loss.detach()

    return Setup(stage, backward_pp, extra_group=mesh["pp"].get_group())


def reference_group(layout: str) -> Any | None:
    """The group DDP averages over for the reference: whole world, or the ranks with distinct data."""
    if layout in ("fsdp2-tp", "tp-ddp"):
        return _mesh((2, 2), ("dp", "tp"))["dp"].get_group()
    if layout == "pp2-fsdp2":
        return _mesh((2, 2), ("pp", "dp"))["dp"].get_group()
    return None


def data_rank(layout: str) -> int:
    if layout in ("fsdp2-tp", "tp-ddp"):
        return dist.get_rank() // 2
    if layout == "pp2-fsdp2":
        return dist.get_rank() % 2
    return dist.get_rank()


def _clean(name: str) -> str:
    for part in ("_fsdp_wrapped_module.", "module."):
        name = name.replace(part, "")
    return name


def full_params(model: nn.Module) -> dict[str, list[float]]:
    """name -> [sum, sum of squares] of each full parameter (float64)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def sums(t: torch.Tensor) -> list[float]:
        d = t.detach().double()
        return [float(d.sum()), float(d.square().sum())]

    if any(isinstance(m, FSDP) for m in model.modules()):
        with FSDP.summon_full_params(model):
            return {_clean(n): sums(p) for n, p in model.named_parameters()}
    out = {}
    for n, p in model.named_parameters():
        out[_clean(n)] = sums(p.full_tensor() if hasattr(p, "full_tensor") else p)
    return out


def reference(layout: str, norm_type: float, max_norm: float) -> dict[str, Any]:
    net = Net()
    group = reference_group(layout)
    ddp = nn.parallel.DistributedDataParallel(net, process_group=group)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    norms = []
    for it in range(ITERS):
        _backward(ddp, data_rank(layout), it)
        norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": full_params(ddp)}


def train(layout: str, norm_type: float, max_norm: float) -> dict[str, Any]:
    import stabilitykit as sk

    s = setup(layout)
    opt = torch.optim.AdamW(s.model.parameters(), lr=1e-2, foreach=s.foreach)
    norms = []
    start = time.perf_counter()
    for it in range(ITERS):
        s.backward(it)
        extra = {"extra_group": s.extra_group} if s.extra_group is not None else {}
        norms.append(float(sk.clip_grad_norm_(s.model, max_norm, norm_type, **extra)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "params": full_params(s.model), "seconds": time.perf_counter() - start}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """A hash of this rank's parameter shards and optimizer state, bit for bit."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(_local(p).detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        for key, value in sorted(opt.state.get(p, {}).items()):
            h.update(key.encode())
            if torch.is_tensor(value):
                h.update(_local(value).detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def skip_case(layout: str, norm_type: float, value: str) -> dict[str, Any]:
    """A NaN/Inf in one grad on rank 3 only, at step 1 of 3: every rank skips, its state bitwise kept.

    With ``value="1e38"`` (finite, but its square overflows fp32), set on every rank so replicas stay
    identical, no rank may skip: the step is re-measured in fp64 and clipped.
    """
    import stabilitykit as sk

    s = setup(layout)
    opt = torch.optim.AdamW(s.model.parameters(), lr=1e-2, foreach=s.foreach)
    cfg = sk.StabilityConfig(
        grad_norm=sk.GradNormConfig(norm_type=norm_type),
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        log_every_n_steps=1,
    )
    guard = sk.StabilityGuard(s.model, opt, cfg, extra_group=s.extra_group)
    out: dict[str, Any] = {}
    for it in range(3):
        s.backward(it)  # grads final (a pipeline's backward runs across stages); no loss for the guard
        if it == 1:
            if dist.get_rank() == 3 or value == "1e38":  # 1e38 on every rank keeps replicas identical
                p = next(q for q in s.model.parameters() if q.grad is not None and _local(q.grad).numel())
                _local(p.grad).view(-1)[0] = float(value)
            before = state_digest(s.model, opt)
        report = guard.step()
        if it == 1:
            out["unchanged"] = state_digest(s.model, opt) == before
            out["grad_norm"] = float(report.grad_norm)
            out["skipped_step"] = bool(report.skipped)
        guard.zero_grad()
    guard.close()
    out["skipped"] = guard.skipped_total
    out["params_finite"] = all(bool(torch.isfinite(_local(q)).all()) for q in s.model.parameters())
    return out


def placements_case() -> dict[str, Any]:
    """DTensor grads with every pair of (Shard, Replicate, Partial) placements on a 2 x 2 mesh."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    import stabilitykit as sk

    mesh = _mesh((2, 2), ("a", "b"))
    coord = mesh.get_coordinate()
    kinds = {"S": Shard(0), "R": Replicate(), "P": Partial()}
    params, fulls = [], []
    for i, (ka, kb) in enumerate((a, b) for a in "SRP" for b in "SRP"):
        g = torch.Generator().manual_seed(7 + i)
        full = torch.randn(8, 3, generator=g) * (i + 1)
        fulls.append(full)
        param_pl = [Replicate() if k == "P" else kinds[k] for k in (ka, kb)]
        param = nn.Parameter(distribute_tensor(torch.zeros(8, 3), mesh, param_pl))
        # the grad's local piece: Shard/Replicate by distribute_tensor; a Partial dim holds a share
        local = distribute_tensor(full, mesh, param_pl).to_local().clone()
        for dim, k in enumerate((ka, kb)):
            if k == "P":
                local = local * (0.25 if coord[dim] == 0 else 0.75)
        grad_pl = [kinds[k] for k in (ka, kb)]
        param.grad = DTensor.from_local(local, mesh, grad_pl, run_check=False, shape=full.shape, stride=full.stride())
        params.append(param)
    out = {}
    for p in NORMS:
        ref = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(f, p) for f in fulls]), p)
        saved = [q.grad for q in params]
        got = sk.clip_grad_norm_(params, 1e9, p)
        for q, g in zip(params, saved, strict=True):
            q.grad = g
        out[str(p)] = [float(got), float(ref)]
    return out


def worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    assert world == 4, "the layouts need 2 x 2 processes"
    full = mode == "all"
    parity = [(lay, p, m) for lay in LAYOUTS for p in NORMS for m in (1.0, 2.5)] if full else CI_PARITY
    skips = [(lay, p, v) for lay in LAYOUTS for p in NORMS for v in ("nan", "inf")] if full else CI_SKIP
    results: dict[str, Any] = {"parity": {}, "skip": {}}
    refs: dict[tuple[str, float, float], dict[str, Any]] = {}
    for layout, p, max_norm in parity:
        ref_key = ((reference_group(layout) is None and "world") or layout, p, max_norm)
        if ref_key not in refs:
            refs[ref_key] = reference(layout, p, max_norm)
        results["parity"][f"{layout}|{p}|{max_norm}"] = {"got": train(layout, p, max_norm), "ref": refs[ref_key]}
    for layout, p, value in skips:
        if os.environ.get("SK_DEBUG"):
            print(f"rank {rank}: skip {layout} {p} {value}", file=sys.stderr, flush=True)
        results["skip"][f"{layout}|{p}|{value}"] = skip_case(layout, p, value)
    results["overflow"] = {layout: skip_case(layout, 2.0, "1e38") for layout in CI_OVERFLOW}
    results["placements"] = placements_case()
    return results


def _worker_all(rank: int, world: int) -> dict[str, Any]:
    return worker(rank, world, "all")


def _worker_ci(rank: int, world: int) -> dict[str, Any]:
    return worker(rank, world, "ci")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed_script_runner import launch

    mode = sys.argv[4] if len(sys.argv) > 4 else "ci"
    launch(_worker_all if mode == "all" else _worker_ci, sys.argv[1:])
