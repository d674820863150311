"""Soft-capping: values and gradients of ``cap * tanh(x / cap)``, the module's pre-cap metric, and
``QKNormAttention(softcap=...)``: the explicit path against SDPA and a hand reference, the causal
mask, dropout, and the pre-cap max-logit metric QK-clip reads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import stabilitykit as sk


def test_values_bounds_and_gradient() -> None:
    x = torch.linspace(-500, 500, 2001, dtype=torch.float64, requires_grad=True)
    y = sk.nn.softcap(x, 30.0)
    torch.testing.assert_close(y, 30.0 * torch.tanh(x / 30.0))
    assert float(y.detach().abs().max()) <= 30.0 and float(y.detach().max()) > 29.99
    small = torch.tensor([1e-3, -0.5, 2.0], dtype=torch.float64)
    torch.testing.assert_close(sk.nn.softcap(small, 50.0), small, rtol=1e-3, atol=0)  # near the identity
    y.sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 1 - torch.tanh(x.detach() / 30.0) ** 2)
    assert float(x.grad.min()) >= 0 and float(x.grad[1000]) == 1.0  # slope 1 at 0, fading when saturated
    assert sk.nn.softcap(torch.tensor([math.inf, -math.inf]), 5.0).tolist() == [5.0, -5.0]
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="cap must be a finite number > 0"):
            sk.nn.softcap(x, bad)  # type: ignore[arg-type]


def test_softcap_module_reports_the_pre_cap_max_on_measured_steps_only() -> None:
    cap = sk.nn.SoftCap(30.0)
    logits = torch.tensor([[1.0, 80.0, -200.0]])
    out = cap(logits)
    assert cap.stability_metrics() == {}
    assert float(out.max()) < 30.0
    cap.measure_metrics = True
    cap(logits)
    assert float(cap.stability_metrics()["logits/max_precap"]) == 80.0
    assert "cap=30.0" in repr(cap)


def _attention(softcap: float | None, dropout: float = 0.0, qk_norm: bool = False) -> sk.nn.QKNormAttention:
    torch.manual_seed(0)
    attn = sk.nn.QKNormAttention(32, 4, qk_norm=qk_norm, dropout=dropout, bias=True, softcap=softcap)
    with torch.no_grad():
        attn.qkv.weight[:64].mul_(6.0)  # large logits, so the cap bites
    return attn


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(seed))


def test_explicit_path_equals_sdpa_when_the_cap_is_far_and_a_hand_reference_when_it_bites() -> None:
    x = _x()
    sdpa, far = _attention(None), _attention(1e6)
    torch.testing.assert_close(far(x), sdpa(x), rtol=1e-5, atol=1e-5)

    capped = _attention(5.0)
    b, t, c = x.shape
    q, k, v = capped.qkv(x).split(c, dim=-1)
    q, k, v = (z.view(b, t, 4, 8).transpose(1, 2) for z in (q, k, v))
    scores = 5.0 * torch.tanh((q @ k.transpose(-2, -1)) / math.sqrt(8) / 5.0)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    reference = capped.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, c))
    out = capped(x)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, sdpa(x), atol=1e-3)  # the cap changed the attention


def test_causal_mask_kept_with_softcap() -> None:
    attn = _attention(5.0)
    x = _x()
    y = x.clone()
    y[:, 4:] = torch.randn(2, 3, 32)  # change only the future
    torch.testing.assert_close(attn(x)[:, :4], attn(y)[:, :4])
    assert not torch.allclose(attn(x)[:, 4:], attn(y)[:, 4:])


def test_dropout_only_in_training_on_the_explicit_path() -> None:
    attn = _attention(5.0, dropout=0.5)
    x = _x()
    torch.manual_seed(1)
    first = attn(x)
    torch.manual_seed(2)
    assert not torch.allclose(first, attn(x))
    attn.eval()
    torch.testing.assert_close(attn(x), attn(x))
    torch.testing.assert_close(attn(x), _attention(5.0).eval()(x))


def test_grads_flow_through_the_cap() -> None:
    attn = _attention(5.0)
    x = _x().requires_grad_(True)
    attn(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and float(x.grad.abs().sum()) > 0
    assert attn.qkv.weight.grad is not None and torch.isfinite(attn.qkv.weight.grad).all()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_max_logit_metric_and_qk_clip_maxima_are_pre_cap(qk_norm: bool) -> None:
    attn = _attention(5.0, qk_norm=qk_norm)
    if not qk_norm:
        attn.qk_clip_tracking = True
    attn.measure_metrics = True
    x = _x()
    attn(x)
    b, t, c = x.shape
    q, k, _ = attn.qkv(x).split(c, dim=-1)
    q, k = (z.view(b, t, 4, 8).transpose(1, 2) for z in (q, k))
    if attn.qk_norm is not None:
        q, k = attn.qk_norm(q, k)
    raw = ((q @ k.transpose(-2, -1)) / math.sqrt(8)).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    metric = float(attn.stability_metrics()["attention/max_logit"])
    assert metric == pytest.approx(float(raw.detach().max()), rel=1e-5)
    if not qk_norm:
        assert metric > 5.0  # above the cap: the value before it
        head_max = attn.qk_clip_max_logits()
        assert head_max is not None
        torch.testing.assert_close(head_max, raw.detach().amax(dim=(0, 2, 3)), rtol=1e-5, atol=1e-5)
    attn.eval()  # no per-head maxima outside training
    attn(x)
    assert attn.qk_clip_max_logits() is None


def test_softcap_attention_under_qk_clip() -> None:
    model = torch.nn.Sequential(_attention(5.0))
    qk = sk.nn.QKClip(model, threshold=4.0)
    model(_x())
    before = float(qk.stability_metrics()["qk_clip/max_logit/0"])
    assert before > 5.0
    qk.apply()
    model(_x())
    assert float(qk.stability_metrics()["qk_clip/max_logit/0"]) <= 4.0 * (1 + 1e-5)


def test_sdpa_path_unchanged_without_softcap() -> None:
    attn = _attention(None)
    x = _x()
    b, t, c = x.shape
    q, k, v = attn.qkv(x).split(c, dim=-1)
    q, k, v = (z.view(b, t, 4, 8).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(attn(x), attn.proj(y.transpose(1, 2).reshape(b, t, c)))
