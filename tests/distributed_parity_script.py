"""Run by tests/test_distributed.py in real processes (gloo, CPU): DDP vs FSDP1 vs FSDP2 parity.

    python tests/distributed_parity_script.py WORLD_SIZE OUT_DIR PORT

For each sharding x norm type x max_norm (and use_orig_params for FSDP1): 4 iterations of
forward, backward, clip, AdamW step (FSDP1 strategies, FSDP2 and the
HSDP meshes W x 1 and 1 x W); records the total norms and a checksum of the full
parameters, next to a DDP + torch.nn.utils.clip_grad_norm_ reference. Then a NaN injected into
one rank's grads under the guard, and a rank with no grads.
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ITERS = 4
NORMS = (1.0, 2.0, math.inf)
MAX_NORMS = (1.0, 2.5)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width + 3)
        self.proj = nn.Linear(2 * width + 3, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(13) for _ in range(3)])
        self.head = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randn(6, 13, generator=g) * 3, torch.randint(0, 5, (6,), generator=g)


def loss_of(model: nn.Module, rank: int, it: int) -> torch.Tensor:
    x, y = batch(rank, it)
    return nn.functional.cross_entropy(model(x), y)


def wrap(kind: str, orig: bool) -> tuple[nn.Module, Any]:
    """The model wrapped for ``kind``, and a hook run after backward (None or a grad fix-up)."""
    net = Net()
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(net), None
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        strategy = {
            "fsdp1-full": ShardingStrategy.FULL_SHARD,
            "fsdp1-grad-op": ShardingStrategy.SHARD_GRAD_OP,
            "fsdp1-no-shard": ShardingStrategy.NO_SHARD,
            "fsdp1-mixed": ShardingStrategy.FULL_SHARD,
        }[kind]
        cpu = torch.device("cpu")
        for i, block in enumerate(net.blocks):
            inner = ShardingStrategy.NO_SHARD if kind == "fsdp1-mixed" and i == 0 else strategy
            net.blocks[i] = FSDP(block, sharding_strategy=inner, use_orig_params=orig, device_id=cpu)
        return FSDP(net, sharding_strategy=strategy, use_orig_params=orig, device_id=cpu), None
    from torch.distributed.fsdp import fully_shard

    if kind.startswith("fsdp2-hsdp"):  # HSDP: a (replicate, shard) mesh of W x 1 or 1 x W
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        shape = (world, 1) if kind.endswith("Wx1") else (1, world)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net, None
    for block in net.blocks:
        fully_shard(block)
    if kind == "fsdp2":
        fully_shard(net)
        return net, None

    def average_head() -> None:  # fsdp2-mixed: the head stays a plain replicated module, averaged by hand
        for p in net.head.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)

    return net, average_head


def full_checksum(model: nn.Module, kind: str) -> list[float]:
    if kind.startswith("fsdp1"):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            return [v for p in model.parameters() for v in _sums(p)]
    return [v for p in model.parameters() for v in _sums(p.full_tensor() if hasattr(p, "full_tensor") else p)]


def _sums(t: torch.Tensor) -> tuple[float, float]:
    """Sum and sum of squares of a full parameter, in float64."""
    d = t.detach().double()
    return float(d.sum()), float(d.square().sum())


def train(kind: str, orig: bool, norm_type: float, max_norm: float, rank: int) -> dict[str, Any]:
    import stabilitykit as sk

    model, after_backward = wrap(kind, orig)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=kind != "fsdp2-mixed")  # foreach needs one tensor type
    norms = []
    for it in range(ITERS):
        loss_of(model, rank, it).backward()
        if after_backward is not None:
            after_backward()
        if kind == "ddp":
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        else:
            total = sk.clip_grad_norm_(model, max_norm, norm_type)
        norms.append(float(total))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "checksum": full_checksum(model, kind)}


def guard_nan_case(kind: str, rank: int, norm_type: float = 2.0, value: float = math.nan) -> dict[str, Any]:
    """A NaN/Inf in rank 1's grads (after reduction): every rank skips; state bitwise kept, equal on all ranks."""
    from distributed_layouts_script import state_digest

    import stabilitykit as sk

    model, after_backward = wrap(kind, True)
    mixed = kind == "fsdp2-mixed"  # DTensor and plain params: neither fused nor foreach
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=not mixed, foreach=False if mixed else None)
    cfg = sk.StabilityConfig(
        grad_norm=sk.GradNormConfig(norm_type=norm_type),
        clip=sk.ClipConfig(mode="fixed", max_norm=1.0),
        log_every_n_steps=3,
    )
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[dict[str, Any]] = []
    guard.hooks.on("nonfinite", lambda e: events.append({"step": e.step, **e.details}))
    unchanged = None
    for it in range(4):
        guard.backward(loss_of(model, rank, it))
        if after_backward is not None:
            after_backward()
        if it == 2:
            if rank == 1:
                p = next(q for q in model.parameters() if q.grad is not None)
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                grad.view(-1)[0] = value
            before = state_digest(model, opt)
        guard.step()
        if it == 2:
            unchanged = state_digest(model, opt) == before
        guard.zero_grad()
    guard.close()
    return {
        "checksum": full_checksum(model, kind),
        "skipped": guard.skipped_total,
        "unchanged": unchanged,
        "events": events,
    }


def no_grad_rank_case(rank: int) -> dict[str, Any]:
    """Rank 1 has no grads at all: it still joins the all-reduce and warns; nothing hangs."""
    import stabilitykit as sk

    model, _ = wrap("fsdp2", True)
    loss_of(model, rank, 0).backward()
    if rank == 1:
        model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = sk.clip_grad_norm_(model, 1.0)
    return {"total": float(total), "warned": any("no parameter has a gradient" in str(w.message) for w in caught)}


def worker(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    kinds = [
        ("fsdp1-full", True), ("fsdp1-full", False), ("fsdp1-grad-op", True), ("fsdp1-grad-op", False),
        ("fsdp1-no-shard", True), ("fsdp1-no-shard", False), ("fsdp1-mixed", True), ("fsdp1-mixed", False),
        ("fsdp2", True), ("fsdp2-mixed", True), ("fsdp2-hsdp-Wx1", True), ("fsdp2-hsdp-1xW", True),
    ]  # fmt: skip
    for norm_type in NORMS:
        for max_norm in MAX_NORMS:
            results[f"ddp|{norm_type}|{max_norm}"] = train("ddp", True, norm_type, max_norm, rank)
            for kind, orig in kinds:
                results[f"{kind}|orig={orig}|{norm_type}|{max_norm}"] = train(kind, orig, norm_type, max_norm, rank)
    for kind, orig in kinds:
        if not orig:
            continue  # the guard cases build with use_orig_params=True
        for norm_type, value in ((1.0, math.nan), (2.0, math.inf), (math.inf, math.nan)):
            results[f"nan|{kind}|{norm_type}|{value}"] = guard_nan_case(kind, rank, norm_type, value)
    results["nan|ddp|2.0|nan"] = guard_nan_case("ddp", rank)
    results["no_grad_rank"] = no_grad_rank_case(rank)
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed_script_runner import launch

    launch(worker, sys.argv[1:])
