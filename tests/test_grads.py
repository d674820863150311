"""Fused norms and clipping against per-parameter references and torch's clip_grad_norm_."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import stabilitykit as sk
from stabilitykit.engine.layers import layer_names_for
from tests.conftest import batches


def _backward(model: torch.nn.Module) -> None:
    x, y = batches(1)[0]
    model.zero_grad()
    model.loss(x, y).backward()  # type: ignore[operator]


def _reference(model: torch.nn.Module, p: float, grouping: str = "auto") -> dict[str, float]:
    named = [(n, q) for n, q in model.named_parameters()]
    layers = layer_names_for(named, model, grouping)
    sums: dict[str, list[float]] = {}
    for (_name, param), layer in zip(named, layers, strict=False):
        g = param.grad.double().flatten()
        sums.setdefault(layer, []).append(g.abs().max().item() if p == math.inf else (g.abs() ** p).sum().item())
    out = {}
    everything = []
    for layer, parts in sums.items():
        everything += parts
        out[layer] = max(parts) if p == math.inf else sum(parts) ** (1 / p)
    out["total"] = max(everything) if p == math.inf else sum(everything) ** (1 / p)
    return out


def test_auto_grouping_finds_blocks(gpt: torch.nn.Module) -> None:
    names = layer_names_for(list(gpt.named_parameters()), gpt, "auto")
    assert list(dict.fromkeys(names)) == [
        "tok_emb",
        "pos_emb",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.3",
        "ln_f",
        "lm_head",
    ]


def test_regex_top_and_param_grouping(gpt: torch.nn.Module) -> None:
    named = list(gpt.named_parameters())
    regex = layer_names_for(named, gpt, [r"blocks\.\d+\.attn", r"blocks\.\d+\.mlp"])
    assert "blocks.0.attn" in regex and "blocks.3.mlp" in regex and "blocks.1" in regex  # ln1/ln2 fall back
    assert set(layer_names_for(named, gpt, "top")) == {"tok_emb", "pos_emb", "blocks", "ln_f", "lm_head"}
    assert layer_names_for(named, gpt, "param") == [n for n, _ in named]


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_norms_equal_per_parameter_reference(gpt: torch.nn.Module, p: float) -> None:
    _backward(gpt)
    got = sk.grad_norms(gpt, norm_type=p)
    ref = _reference(gpt, p)
    assert got.keys() == ref.keys()
    for key, value in ref.items():
        assert got[key].dtype == torch.float32
        assert got[key].item() == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("p", [1.0, 2.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e4])
def test_clip_matches_torch(gpt: torch.nn.Module, p: float, max_norm: float) -> None:
    _backward(gpt)
    twin = copy.deepcopy(gpt)
    for a, b in zip(gpt.parameters(), twin.parameters(), strict=False):
        b.grad = a.grad.clone()
    ours = sk.clip_grad_norm_(gpt.parameters(), max_norm, norm_type=p)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm, norm_type=p)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    for (name, a), b in zip(gpt.named_parameters(), twin.parameters(), strict=False):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-12, msg=name)


def test_nonfinite_norm_never_spreads(gpt: torch.nn.Module) -> None:
    _backward(gpt)
    gpt.lm_head.weight.grad[0, 0] = float("nan")
    before = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    total = sk.clip_grad_norm_(gpt.parameters(), 0.1)
    assert torch.isnan(total)
    for name, param in gpt.named_parameters():
        assert torch.equal(param.grad.nan_to_num(), before[name].nan_to_num()), name
    assert torch.isfinite(gpt.blocks[0].mlp.fc.weight.grad).all()  # torch would have made this NaN
    with pytest.raises(RuntimeError, match="non-finite"):
        sk.clip_grad_norm_(gpt.parameters(), 0.1, error_if_nonfinite=True)


def test_inf_grad_gives_inf_norm_not_nan(gpt: torch.nn.Module) -> None:
    _backward(gpt)
    gpt.lm_head.weight.grad[0, 0] = float("inf")
    norms = sk.grad_norms(gpt)
    assert math.isinf(norms["total"].item()) and math.isinf(norms["lm_head"].item())
    assert math.isfinite(norms["blocks.0"].item())


def test_low_precision_grads_accumulate_in_fp32() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096, dtype=torch.bfloat16)) for _ in range(3)]
    for param in params:
        param.grad = torch.randn_like(param) * 3
    ref = torch.cat([q.grad.double() for q in params]).norm().item()
    total = sk.clip_grad_norm_(params, 1e9)
    assert total.dtype == torch.float32
    assert total.item() == pytest.approx(ref, rel=1e-5)


def test_params_without_grads_and_no_grads_at_all(gpt: torch.nn.Module) -> None:
    with pytest.warns(RuntimeWarning, match="no parameter has a gradient"):
        norms = sk.grad_norms(gpt)
    assert norms["total"].item() == 0.0
    _backward(gpt)
    gpt.pos_emb.weight.grad = None
    assert sk.grad_norms(gpt)["pos_emb"].item() == 0.0


def test_invalid_arguments() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="max_norm"):
        sk.clip_grad_norm_([p], -1.0)
    with pytest.raises(ValueError, match="norm_type"):
        sk.clip_grad_norm_([p], 1.0, norm_type=0)


def test_float64_grads_are_measured_in_float64_beside_fp32_and_bf16() -> None:
    """fp64 grads (alone or mixed with fp32/bf16) are measured in fp64: torch's narrowing error is gone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2).to(torch.bfloat16)
    )

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = model[1](model[0](x.double()).float()).to(torch.bfloat16)
        return model[2](h).float()

    forward(torch.randn(16, 4)).pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.double()) for g in grads]))
    norms = sk.grad_norms(model)
    assert norms["total"].dtype == torch.float64
    torch.testing.assert_close(norms["total"], reference, rtol=1e-12, atol=0)
    before = [g.clone() for g in grads]
    total = sk.clip_grad_norm_(model.parameters(), 0.01)
    torch.testing.assert_close(total, reference, rtol=1e-12, atol=0)
    for g, b in zip(grads, before, strict=True):
        torch.testing.assert_close(g, (b.double() * (0.01 / (reference + 1e-6))).to(b.dtype))

    only64 = torch.nn.Linear(3, 3).double()
    only64(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
    guard = sk.StabilityGuard(only64, torch.optim.AdamW(only64.parameters()), sk.StabilityConfig(log_every_n_steps=1))
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in only64.parameters()]))
    report = guard.step()
    assert report.grad_norm.dtype == torch.float64 and torch.equal(report.grad_norm, expected)


@pytest.mark.parametrize("foreach", [None, False, True])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_clip_grad_norm_is_a_drop_in_for_torchs(foreach: bool | None, norm_type: float) -> None:
    """PyTorch's own ``test_clip_grad_norm`` calls, with ``foreach=`` and ``error_if_nonfinite=``."""
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 10)
    for model in (ours, theirs):
        model(x).pow(2).sum().backward()
    got = sk.clip_grad_norm_(ours.parameters(), 0.5, norm_type, False, foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, norm_type, False, foreach)
    torch.testing.assert_close(got, want)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    ours.weight.grad[0, 0] = math.inf
    pattern = rf"The total norm of order {norm_type} for gradients from `parameters` is non-finite"
    with pytest.raises(RuntimeError, match=pattern):
        sk.clip_grad_norm_(ours.parameters(), 0.5, norm_type, error_if_nonfinite=True, foreach=foreach)
    with pytest.raises(RuntimeError, match=pattern):
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 0.5, norm_type, error_if_nonfinite=True, foreach=foreach)
    with pytest.raises(TypeError, match="model="):
        sk.clip_grad_norm_(ours.parameters(), 0.5, 2.0, False, ours)  # type: ignore[arg-type]
