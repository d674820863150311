"""Run by tests/test_qk_clip.py on 2 gloo processes: QK-clip under FSDP2 and under tensor parallelism.

    python tests/distributed_qk_clip_script.py 2 OUT_DIR PORT

FSDP2 (``fully_shard``, q/k weights are DTensors sharded on dim 0, each rank a different batch):
after each rank's forward, ``apply()`` must write exactly the weights a single process writes
after seeing the same batches as micro-batches (fused qkv and separate projections with GQA).
A NaN batch on rank 1 alone must leave every rank's weights bitwise unchanged (gloo's MAX would
drop it). Tensor parallel (``parallelize_module``: q/k/v colwise, o rowwise; each rank computes
and owns 2 of 4 query heads and 1 of 2 key heads): the same input everywhere, the same weights
as the single process.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ITERS = 2


def _x(seed: int) -> Tensor:
    return torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(seed))


def _reference(fused: bool, parallel: bool = False) -> nn.Module:
    from tests.qk_models import AttnNet

    torch.manual_seed(0)
    net = AttnNet(16, 4, 2, fused, parallel)
    with torch.no_grad():
        for layer in net.layers:
            lay = layer.qk_clip_layout()
            lay.q_weight.mul_(3.0)
            if lay.k_weight is not lay.q_weight:
                lay.k_weight.mul_(3.0)
    return net


def _tau(net: nn.Module, batches: list[Tensor]) -> float:
    """A threshold between the heads' maxima, so some heads clip and some do not."""
    probe = copy.deepcopy(net)
    for layer in probe.layers:  # type: ignore[union-attr]
        layer.qk_clip_tracking = True
    probe(torch.cat(batches))
    maxima = torch.cat([layer.head_max for layer in probe.layers])  # type: ignore[union-attr]
    return float(maxima.median())


def _full(net: nn.Module) -> dict[str, Tensor]:
    out = {}
    for name, p in net.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def _compare(got: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, Any]:
    return {
        "bitwise": all(torch.equal(got[n], ref[n]) for n in ref),
        "max_abs_diff": max(float((got[n] - ref[n]).abs().max()) for n in ref),
    }


def fsdp2_case(rank: int, world: int, fused: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import stabilitykit as sk

    ref = _reference(fused)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    q0 = model.layers[0].qk_clip_layout().q_weight  # type: ignore[index,union-attr,operator]
    sharded = type(q0).__name__ == "DTensor" and q0.to_local().shape[0] < q0.shape[0]
    qk_ref = sk.nn.QKClip(ref, threshold=1.0)
    qk = sk.nn.QKClip(model, threshold=1.0)
    iterations = []
    for it in range(ITERS):
        batches = [_x(100 * it + r) for r in range(world)]
        tau = _tau(ref, batches)
        qk.threshold = qk_ref.threshold = tau
        for x in batches:  # the single process: every rank's batch as a micro-batch
            ref(x)
        qk_ref.apply()
        model(batches[rank])
        qk.apply()
        row = _compare(_full(model), _full(ref))
        row["heads_clipped"] = float(qk.stability_metrics()["qk_clip/heads_clipped"])
        row["ref_heads_clipped"] = float(qk_ref.stability_metrics()["qk_clip/heads_clipped"])
        iterations.append(row)

    before = _full(model)
    x = _x(7) * (torch.nan if rank == 1 else 1.0)
    model(x)
    qk.threshold = 1e-3  # every finite head would clip
    qk.apply()
    nan_unchanged = _compare(_full(model), before)["bitwise"]
    return {"sharded": sharded, "iterations": iterations, "nan_on_rank1_unchanged": nan_unchanged}


def tp_case(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import stabilitykit as sk

    ref = _reference(fused=False, parallel=True)  # each layer's logits from the input: no row-parallel sum between
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    plan: dict[str, Any] = {}
    for i in range(2):
        plan.update(
            {
                f"layers.{i}.q_proj": ColwiseParallel(),
                f"layers.{i}.k_proj": ColwiseParallel(),
                f"layers.{i}.v_proj": ColwiseParallel(),
                f"layers.{i}.o_proj": RowwiseParallel(),
            }
        )
    parallelize_module(model, mesh, plan)
    for layer in ref.layers:  # type: ignore[union-attr]
        layer.proj_chunks = world  # the reference projects in the ranks' row blocks: the same logits, bitwise
    for layer in model.layers:  # type: ignore[union-attr]
        layer.num_heads //= world  # type: ignore[operator]
        layer.num_kv_heads //= world  # type: ignore[operator]
    qk_ref = sk.nn.QKClip(ref, threshold=1.0)
    qk = sk.nn.QKClip(model, threshold=1.0)
    iterations = []
    for it in range(ITERS):
        x = _x(200 + it)  # tensor parallel: every rank sees the same input
        qk.threshold = qk_ref.threshold = _tau(ref, [x])
        ref(x)
        model(x)
        per = 4 // world
        local_heads = [
            bool(torch.equal(m.head_max, r.head_max[rank * per : (rank + 1) * per]))  # type: ignore[index]
            for m, r in zip(model.layers, ref.layers, strict=True)  # type: ignore[arg-type]
        ]
        qk_ref.apply()
        qk.apply()
        row = _compare(_full(model), _full(ref))
        row["local_heads_match"] = all(local_heads)
        row["heads_clipped"] = float(qk.stability_metrics()["qk_clip/heads_clipped"])
        row["ref_heads_clipped"] = float(qk_ref.stability_metrics()["qk_clip/heads_clipped"])
        iterations.append(row)
    return {"iterations": iterations}


def guard_case(rank: int, world: int) -> dict[str, Any]:
    """StabilityGuard with the qk_clip section on FSDP2, 3 AdamW steps, against one process on both batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import stabilitykit as sk

    ref = _reference(fused=True)
    model = copy.deepcopy(ref)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:  # type: ignore[union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cfg = sk.StabilityConfig(log_every_n_steps=2, qk_clip=sk.QKClipConfig(enabled=True, threshold=1.5))
    guards = [(net, sk.StabilityGuard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), cfg)) for net in (ref, model)]
    clipped = []
    for it in range(3):
        batches = [_x(300 + 10 * it + r) for r in range(world)]
        for net, guard in guards:
            xs = batches if net is ref else [batches[rank]]
            loss = torch.stack([net(x).square().mean() for x in xs]).mean()
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        clipped.append(float(guards[1][1].engines[0].qk_clip.stability_metrics()["qk_clip/heads_clipped"]))  # type: ignore[union-attr]
    got, want = _full(model), _full(ref)
    return {"max_abs_diff": max(float((got[n] - want[n]).abs().max()) for n in want), "heads_clipped": clipped}


def worker(rank: int, world: int) -> dict[str, Any]:
    return {
        "fsdp2_fused": fsdp2_case(rank, world, fused=True),
        "fsdp2_separate_gqa": fsdp2_case(rank, world, fused=False),
        "tp": tp_case(rank, world),
        "guard_fsdp2": guard_case(rank, world),
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed_script_runner import launch

    launch(worker, sys.argv[1:])
