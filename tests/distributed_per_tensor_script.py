"""Run by tests/test_clip_per_tensor.py on 2 gloo processes: per-tensor clipping (AdaGC) across ranks.

    python tests/distributed_per_tensor_script.py 2 OUT_DIR PORT

Each layout (DDP, FSDP2 ``fully_shard`` at p = 2 and inf, FSDP1 FULL_SHARD with the original
parameters) trains ``ITERS`` steps of SGD under ``StabilityGuard`` with
``ClipConfig(mode="per_tensor_adaptive")``: a NaN in rank 1's grads at step ``NAN_AT`` (every rank
skips), one tensor's grad times ``SPIKE`` at step ``SPIKE_AT``. Each rank writes the pre-clip totals,
the clipped grads' per-tensor norms, the full parameters and the per-tensor EMAs; the test compares
them with ``train_reference`` (the same steps in one process on the whole batch).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.distributed_models import ResidualNet
from tests.distributed_models import wrap as wrap_net

ITERS = 7
NAN_AT = 3
SPIKE_AT = 5
SPIKE = 50.0
SPIKED = "blocks.1.fc.weight"
WIDTH, HIDDEN, CLASSES, PER_RANK = 8, 16, 4, 6


def make_net() -> ResidualNet:
    return ResidualNet(WIDTH, HIDDEN, 2, CLASSES)


def batch(rank: int, it: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * it + rank)
    return torch.randn(PER_RANK, WIDTH, generator=g) * 3, torch.randint(0, CLASSES, (PER_RANK,), generator=g)


def config(norm_type: float) -> Any:
    import stabilitykit as sk

    return sk.StabilityConfig(
        grad_norm=sk.GradNormConfig(norm_type=norm_type),
        clip=sk.ClipConfig(mode="per_tensor_adaptive", warmup_steps=2, warmup_max_norm=1.0),
        log_every_n_steps=4,
    )


def clean(name: str) -> str:
    """A parameter name without the wrappers' prefixes (DDP ``module.``, FSDP1 ``_fsdp_wrapped_module.``)."""
    return name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # type: ignore[no-any-return]


def _train(model: nn.Module, loss_of: Any, norm_type: float, nan_here: bool, read_grads: bool) -> dict[str, Any]:
    """The shared loop: ``loss_of(it)`` gives this process's loss for iteration ``it``."""
    import stabilitykit as sk

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = sk.StabilityGuard(model, opt, config(norm_type))
    named = [(clean(n), p) for n, p in model.named_parameters()]
    out: dict[str, Any] = {"norms": [], "coefs": [], "grads": {n: [] for n, _ in named}}
    for it in range(ITERS):
        guard.backward(loss_of(it))
        if it == NAN_AT and nan_here:
            first = next(p for _, p in named if p.grad is not None and _local(p.grad).numel())
            _local(first.grad).view(-1)[0] = math.nan  # type: ignore[arg-type]
        if it == SPIKE_AT:
            spiked = dict(named)[SPIKED].grad  # a DTensor scales its local shard; FSDP1: None where no shard lives
            if spiked is not None:
                spiked.mul_(SPIKE)
        report = guard.step()
        out["norms"].append(float(report.grad_norm))
        out["coefs"].append(float(report.clip_coef))
        if read_grads:
            for name, p in named:
                out["grads"][name].append(float(_full(p.grad).double().norm()) if p.grad is not None else 0.0)
        guard.zero_grad()
    out["skipped"] = guard.skipped_total
    out["gamma"] = guard.engine.clip.state_dict()["gamma"].tolist()  # type: ignore[union-attr]
    out["params"] = full_params(model)
    return out


def full_params(model: nn.Module) -> dict[str, list[float]]:
    """Every parameter, whole, as a flat list (FSDP1 gathered with ``summon_full_params``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if any(isinstance(m, FSDP) for m in model.modules()):
        with FSDP.summon_full_params(model):
            return {clean(n): p.detach().flatten().tolist() for n, p in model.named_parameters()}
    return {clean(n): _full(p.detach()).flatten().tolist() for n, p in model.named_parameters()}


def train_reference(norm_type: float) -> dict[str, Any]:
    """One process, both ranks' batches at once (the mean loss DDP and FSDP average to)."""
    model = make_net()

    def loss_of(it: int) -> torch.Tensor:
        x0, y0 = batch(0, it)
        x1, y1 = batch(1, it)
        return nn.functional.cross_entropy(model(torch.cat([x0, x1])), torch.cat([y0, y1]))

    return _train(model, loss_of, norm_type, nan_here=True, read_grads=True)


def wrap(kind: str) -> nn.Module:
    return wrap_net(make_net(), kind)


def collectives(rank: int) -> dict[str, int]:
    """All-reduces one non-logging ``guard.step()`` makes under FSDP2, with global and with per-tensor clipping."""
    import torch.distributed as dist

    import stabilitykit as sk

    counts: dict[str, int] = {}
    original = dist.all_reduce
    for mode in ("fixed", "per_tensor_adaptive"):
        model = wrap("fsdp2")
        guard = sk.StabilityGuard(
            model, torch.optim.SGD(model.parameters(), lr=0.05), sk.StabilityConfig(clip=sk.ClipConfig(mode=mode))
        )
        calls = [0]

        def counting(*args: Any, calls: list[int] = calls, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        for it in range(3):
            x, y = batch(rank, it)
            guard.backward(nn.functional.cross_entropy(model(x), y))
            dist.all_reduce = counting if it == 2 else original  # step 2: not a logging step
            try:
                guard.step()
            finally:
                dist.all_reduce = original
            guard.zero_grad()
        counts[mode] = calls[0]
    return counts


def worker(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {"collectives": collectives(rank)}
    for kind, norm_type in (("ddp", 2.0), ("fsdp2", 2.0), ("fsdp2", math.inf), ("fsdp1", 2.0)):
        model = wrap(kind)

        def loss_of(it: int, model: nn.Module = model) -> torch.Tensor:
            x, y = batch(rank, it)
            return nn.functional.cross_entropy(model(x), y)

        results[f"{kind}|{norm_type}"] = _train(
            model, loss_of, norm_type, nan_here=rank == 1, read_grads=kind != "fsdp1"
        )
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed_script_runner import launch

    launch(worker, sys.argv[1:])
