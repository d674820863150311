"""Run by tests/test_update_ratio.py on 2 gloo processes: the update ratio under DDP, FSDP2 and FSDP1.

    python tests/distributed_update_script.py 2 OUT_DIR PORT

For DDP, FSDP2 and FSDP1 (grad norm p = 2, where the update sums ride in the grad-norm all-reduce;
FSDP2 also p = inf, where they get their own SUM): 7 guarded AdamW steps with ``update_ratio=True`` and
``log_every_n_steps=2``, a NaN in rank 1's loss at step 3 (skipped everywhere). Each rank records
what its sink received and, as the reference, the same training by hand in one process (the
mean of both ranks' losses, the weights copied before each step, norms after). For DDP and
FSDP2 the all-reduces of the run are counted with and without the update ratio.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed_models import ResidualNet
from tests.distributed_models import wrap as wrap_net

STEPS = 7
EVERY = 2
NAN_STEP = 3


def make_net() -> ResidualNet:
    return ResidualNet(13, 29, 3, 5)


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(6, 13, generator=g) * 3, torch.randint(0, 5, (6,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def layer_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]


def hand_metrics(before: dict[str, torch.Tensor], model: nn.Module) -> dict[str, float]:
    update: dict[str, float] = {}
    weight: dict[str, float] = {}
    for name, p in model.named_parameters():
        w = p.detach().double()
        layer = layer_of(name)
        update[layer] = update.get(layer, 0.0) + float((w - before[name]).square().sum())
        weight[layer] = weight.get(layer, 0.0) + float(w.square().sum())

    def ratio(u: float, w: float) -> float:
        return 0.0 if u == 0 else math.sqrt(u / w)

    out = {
        "update_ratio": ratio(sum(update.values()), sum(weight.values())),
        "weight_norm": math.sqrt(sum(weight.values())),
    }
    for layer in update:
        out[f"update_ratio/{layer}"] = ratio(update[layer], weight[layer])
        out[f"weight_norm/{layer}"] = math.sqrt(weight[layer])
    return out


def reference(world: int) -> list[dict[str, float]]:
    """One process: the mean of every rank's loss, the NaN step skipped; metrics of the steps before logging steps."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        if step != NAN_STEP:
            (sum(loss_of(model, r, step) for r in range(world)) / world).backward()
            opt.step()
            opt.zero_grad()
        if (step + 1) % EVERY == 0:
            out.append(hand_metrics(before, model))
    return out


class Capture:
    """A sink: the update-ratio metrics of every logging step."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log_metrics(self, metrics: Any, step: int) -> None:
        keep = {
            k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(("stability/update", "stability/weight"))
        }
        if keep:
            self.rows.append({"step": step, "metrics": keep})


def wrap(kind: str) -> nn.Module:
    """``"fsdp1-orig"`` / ``"fsdp1-flat"``: FSDP1 with / without ``use_orig_params``; else ``"ddp"`` or FSDP2."""
    fsdp1 = kind.startswith("fsdp1")
    return wrap_net(make_net(), "fsdp1" if fsdp1 else kind, use_orig_params=kind.endswith("orig"))


def train(kind: str, norm_type: float, rank: int, update_ratio: bool) -> tuple[list[dict[str, Any]], int]:
    """The guarded run; what the sink got, and how many all-reduces it made."""
    import stabilitykit as sk

    model = wrap(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    cfg = sk.StabilityConfig(
        log_every_n_steps=EVERY,
        grad_norm=sk.GradNormConfig(norm_type=norm_type, update_ratio=update_ratio),
    )
    sink = Capture()
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sink])
    calls = [0]
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for step in range(STEPS):
            loss = loss_of(model, rank, step)
            guard.backward(loss * (math.nan if step == NAN_STEP and rank == 1 else 1.0))
            guard.step()
            guard.zero_grad()
    finally:
        dist.all_reduce = original
    guard.close()
    return sink.rows, calls[0]


def worker(rank: int, world: int) -> dict[str, Any]:
    ref = reference(world)
    results: dict[str, Any] = {}
    cases = (("ddp", 2.0), ("fsdp2", 2.0), ("fsdp2", math.inf), ("fsdp1-orig", 2.0), ("fsdp1-flat", 2.0))
    for kind, norm_type in cases:
        logged, with_ratio = train(kind, norm_type, rank, True)
        case: dict[str, Any] = {"logged": logged, "reference": ref}
        if not kind.startswith("fsdp1"):
            _, without = train(kind, norm_type, rank, False)
            case["collectives"] = {"with": with_ratio, "without": without}
        results[f"{kind}|{norm_type}"] = case
    return results


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed_script_runner import launch

    launch(worker, sys.argv[1:])
