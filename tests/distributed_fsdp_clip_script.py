"""PyTorch's FSDP1 clip-grad-norm tests (test/distributed/fsdp/test_fsdp_clip_grad_norm.py), ported
to gloo on the CPU with ``sk.clip_grad_norm_`` in place of ``FSDP.clip_grad_norm_``.

    python tests/distributed_fsdp_clip_script.py WORLD OUT_DIR PORT [ci|all]

The models are torch's ``TransformerWithSharedParams`` (tied embedding/output weights) and
``NestedWrappedModule`` rebuilt here: ``torch.testing._internal`` needs test-only packages.
Differences from the original, on purpose: the total stays fp32 for fp16 grads (torch returns
fp16), and ``offload_params`` is left out (the parameters are on the CPU already).
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
RTOL, ATOL = 1.3e-6, 1e-5  # torch.testing's defaults for float32, as in the original assertEqual


class TransformerWithSharedParams(nn.Module):
    """torch's test model: an nn.Transformer between an embedding and an output projection sharing weights."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        d_vocab, d_model, self.bs = 23, 16, 2
        self.embed_tokens = nn.Embedding(d_vocab, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=8, dropout=0.1
        )
        self.output_proj = nn.Linear(d_model, d_vocab)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", self.embed_tokens.weight.new_ones((d_model,)))
        self.bn = nn.BatchNorm1d(self.bs)
        self.eval()  # deterministic=True in the original: no dropout

    def get_input(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        return torch.arange(12).view(6, self.bs), torch.arange(self.bs * 4).view(4, self.bs)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_tokens(src_ids) + self.vocab_bias
        tgt = self.bn(self.embed_tokens(tgt_ids))
        return self.output_proj(self.transformer(src, tgt))

    def get_loss(self, inp: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.view(-1, out.size(-1)), inp[1].view(-1), reduction="sum")


def nested_wrapped_module(fsdp_kwargs: dict[str, Any]) -> nn.Module:
    """torch's ``NestedWrappedModule`` with FSDP inside (RECURSIVE), then wrapped at the top."""
    torch.manual_seed(0)

    def wrap(m: nn.Module) -> nn.Module:
        return FSDP(m, **fsdp_kwargs)

    inner = nn.Sequential(
        nn.Linear(8, 4),
        wrap(nn.Sequential(wrap(nn.Linear(4, 16)), nn.Linear(16, 16))),
        wrap(nn.Linear(16, 4)),
        nn.Linear(4, 8),
    )
    return FSDP(inner, **fsdp_kwargs)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL))


def ddp_parity(max_norm: float, norm_type: float, strategy: str, use_orig_params: bool) -> dict[str, Any]:
    """``_test_ddp_parity``: DDP + torch's clip vs FSDP1 + ``sk.clip_grad_norm_`` (4 iterations)."""
    import stabilitykit as sk

    rank = dist.get_rank()
    ddp = nn.parallel.DistributedDataParallel(TransformerWithSharedParams())
    kw: dict[str, Any] = {"use_orig_params": use_orig_params, "device_id": CPU}
    net = TransformerWithSharedParams()
    if strategy == "mixed":
        net.transformer.encoder = FSDP(net.transformer.encoder, sharding_strategy=ShardingStrategy.NO_SHARD, **kw)
        net.transformer.decoder = FSDP(net.transformer.decoder, sharding_strategy=ShardingStrategy.FULL_SHARD, **kw)
        fsdp = FSDP(net, sharding_strategy=ShardingStrategy.FULL_SHARD, **kw)
    else:
        policy = ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.TransformerDecoderLayer})
        fsdp = FSDP(net, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=policy, **kw)
    ddp_opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    fsdp_opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    inp = ddp.module.get_input(1 + rank)
    for model in (ddp, fsdp):
        model.module.get_loss(inp, model(*inp)).backward()
    for p in itertools.chain(ddp.parameters(), fsdp.parameters()):
        if p.grad is not None:  # None for use_orig_params=True where a rank holds no shard
            p.grad *= 100  # so that clipping really clips
    ddp_grads = [p.grad.detach().clone() for p in ddp.parameters()]
    fsdp_grads = [p.grad.detach().clone() if p.grad is not None else None for p in fsdp.parameters()]
    pairs = []
    ref = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=max_norm, norm_type=norm_type)
    got = sk.clip_grad_norm_(fsdp, max_norm=max_norm, norm_type=norm_type)
    pairs.append([float(got), float(ref)])
    clipped = all(not torch.equal(p.grad, g) for p, g in zip(ddp.parameters(), ddp_grads, strict=True))
    clipped &= all(
        (p.grad is None) if g is None else not torch.equal(p.grad, g)
        for p, g in zip(fsdp.parameters(), fsdp_grads, strict=True)
    )
    ddp_opt.step()
    fsdp_opt.step()
    with FSDP.summon_full_params(fsdp):
        same = [
            n1 == n2.replace("_fsdp_wrapped_module.", "") and _close(p1, p2)
            for (n1, p1), (n2, p2) in zip(ddp.module.named_parameters(), fsdp.named_parameters(), strict=True)
        ]
    for i in range(3):
        set_to_none = i % 2 == 0
        ddp_opt.zero_grad(set_to_none=set_to_none)
        fsdp_opt.zero_grad(set_to_none=set_to_none)
        inp = ddp.module.get_input(1 + rank)
        for model in (ddp, fsdp):
            model(*inp).sum().backward()
        ref = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=max_norm, norm_type=norm_type)
        got = sk.clip_grad_norm_(fsdp, max_norm=max_norm, norm_type=norm_type)
        pairs.append([float(got), float(ref)])
        ddp_opt.step()
        fsdp_opt.step()
    return {"norms": pairs, "clipped": clipped, "params_equal": all(same), "dtype": str(got.dtype)}


def low_precision_grads(max_norm: float, norm_type: float, strategy: str, use_orig_params: bool) -> dict[str, Any]:
    """``_test_low_precision_grads``: fp16 grads kept; our total is fp32 and equals the exact norm."""
    import stabilitykit as sk

    kw = {
        "sharding_strategy": ShardingStrategy[strategy],
        "use_orig_params": use_orig_params,
        "mixed_precision": MixedPrecision(
            param_dtype=torch.float16, reduce_dtype=torch.float16, keep_low_precision_grads=True
        ),
        "device_id": CPU,
    }
    model = nested_wrapped_module(kw)
    torch.manual_seed(1 + dist.get_rank())
    model(torch.rand(4, 8)).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    all_fp16 = all(g.dtype == torch.float16 for g in grads)
    exact = _exact_norm(model, norm_type, sharded=strategy != "NO_SHARD")
    total = sk.clip_grad_norm_(model, max_norm=max_norm, norm_type=norm_type)
    per_grad = [
        float(torch.linalg.vector_norm(p.grad.float(), norm_type)) for p in model.parameters() if p.grad is not None
    ]
    return {
        "all_fp16": all_fp16,
        "dtype": str(total.dtype),
        "total": float(total),
        "exact": exact,
        "max_grad_norm": max(per_grad, default=0.0),
    }


def _exact_norm(model: nn.Module, norm_type: float, sharded: bool) -> float:
    """The global norm in float64 from every rank's local grads (a sum over ranks when sharded)."""
    local = [p.grad.double().flatten() for p in model.parameters() if p.grad is not None]
    flat = torch.cat(local) if local else torch.zeros(0, dtype=torch.float64)
    if norm_type == math.inf:
        value = torch.tensor([flat.abs().max().item() if flat.numel() else 0.0], dtype=torch.float64)
        if sharded:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value)
    value = torch.tensor([float(flat.abs().pow(norm_type).sum())], dtype=torch.float64)
    if sharded:
        dist.all_reduce(value)
    return float(value) ** (1.0 / norm_type)


def no_gradients(use_orig_params: bool) -> dict[str, Any]:
    """``_test_no_gradients``: forward only; the total is an fp32 zero and the warning names this rank."""
    import stabilitykit as sk

    mp = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    module = FSDP(
        nn.Linear(24, 24),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=mp,
        device_id=CPU,
        use_orig_params=use_orig_params,
    )
    module(torch.randn(32, 24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        total = sk.clip_grad_norm_(module, 1.0)
    messages = [str(w.message) for w in caught if "no parameter has a gradient" in str(w.message)]
    return {"dtype": str(total.dtype), "total": float(total), "messages": messages}


def rank_without_grads(strategy: str, use_orig_params: bool) -> dict[str, Any]:
    """Rank 1 has no grads at all: it joins the reduction, warns naming itself, every rank agrees."""
    import stabilitykit as sk

    policy = ModuleWrapPolicy({nn.TransformerEncoderLayer, nn.TransformerDecoderLayer})
    model = FSDP(
        TransformerWithSharedParams(),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=policy,
        use_orig_params=use_orig_params,
        device_id=CPU,
    )
    inp = model.module.get_input(1)
    model(*inp).sum().backward()
    if dist.get_rank() == 1:
        model.zero_grad(set_to_none=True)
    out = {}
    for p in (2.0, math.inf):
        exact = _exact_norm(model, p, sharded=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            total = sk.clip_grad_norm_(model, 1e9, norm_type=p)
        warned = [str(w.message) for w in caught if "no parameter has a gradient" in str(w.message)]
        out[str(p)] = {"total": float(total), "exact": exact, "warned": warned}
    return out


def params_without_module(use_orig_params: bool) -> str:
    """``sk.clip_grad_norm_(fsdp.parameters())``: refused with a message naming the fix."""
    import stabilitykit as sk

    model = FSDP(nn.Linear(8, 8), use_orig_params=use_orig_params, device_id=CPU)
    model(torch.randn(4, 8)).sum().backward()
    try:
        sk.clip_grad_norm_(model.parameters(), 1.0)
    except ValueError as err:
        return str(err)
    return ""


def worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    full = mode == "all"
    out: dict[str, Any] = {"ddp_parity": {}, "low_precision": {}}
    strategies = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "mixed") if full else ("FULL_SHARD", "NO_SHARD", "mixed")
    for max_norm, norm_type, strategy, orig in itertools.product((1, 2.5), (1, 2, math.inf), strategies, (False, True)):
        if not full and max_norm == 2.5 and (norm_type != 2 or orig):
            continue  # the CI subset: max_norm 2.5 once per strategy
        key = f"{strategy}|orig={orig}|{float(norm_type)}|{max_norm}"
        out["ddp_parity"][key] = ddp_parity(max_norm, float(norm_type), strategy, orig)
    for max_norm, norm_type, strategy, orig in itertools.product(
        (1, 2.5), (1, 2, math.inf), ("FULL_SHARD", "NO_SHARD"), (False, True)
    ):
        if not full and max_norm == 2.5:
            continue
        key = f"{strategy}|orig={orig}|{float(norm_type)}|{max_norm}"
        out["low_precision"][key] = {
            **low_precision_grads(max_norm, float(norm_type), strategy, orig),
            "max_norm": max_norm,
        }
    out["no_gradients"] = {str(orig): no_gradients(orig) for orig in (False, True)}
    out["rank_without_grads"] = {
        f"{s}|orig={o}": rank_without_grads(s, o) for s in ("FULL_SHARD", "SHARD_GRAD_OP") for o in (False, True)
    }
    out["params_without_module"] = {str(o): params_without_module(o) for o in (False, True)}
    return out


def _worker_all(rank: int, world: int) -> dict[str, Any]:
    return worker(rank, world, "all")


def _worker_ci(rank: int, world: int) -> dict[str, Any]:
    return worker(rank, world, "ci")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    from distributed_script_runner import launch

    launch(_worker_all if (sys.argv[4:] or ["ci"])[0] == "all" else _worker_ci, sys.argv[1:])
