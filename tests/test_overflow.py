"""Huge but finite gradients: an fp32 overflow of the norm is not a NaN.

One element of 1e38, or a tensor norm above ~1.8e19, overflows the fp32 sum of squares. Where the
host knows the step's decision (a non-fused optimizer with skipping on, or a logging step), the
step is re-measured in fp64 and, with clipping on, clipped and taken; real Inf/NaN stay skipped.
"""

from __future__ import annotations

import pytest
import torch

import stabilitykit as sk


def _setup(fused: bool, clip: str = "fixed", log_every: int = 1) -> tuple[torch.nn.Module, sk.StabilityGuard]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused, foreach=not fused)
    fixed = {"max_norm": 1.0} if clip == "fixed" else {}  # max_norm elsewhere would warn that it has no effect
    cfg = sk.StabilityConfig(log_every_n_steps=log_every, clip=sk.ClipConfig(mode=clip, warmup_steps=1, **fixed))
    return model, sk.StabilityGuard(model, opt, cfg)


def _backward_with(model: torch.nn.Module, values: list[float]) -> torch.Tensor:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    loss = model(x).square().mean()
    loss.backward()
    grad = model[0].weight.grad
    assert grad is not None
    for i, v in enumerate(values):
        grad.view(-1)[i] = v
    return loss.detach()


@pytest.mark.parametrize(
    "values", [[1e38], [1e20] * 4, [3e19, -3e19]], ids=["one-element-1e38", "norm-2e20", "norm-4e19"]
)
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused-logging-step"])
def test_a_finite_overflow_is_clipped_and_taken_not_skipped(values: list[float], fused: bool) -> None:
    model, guard = _setup(fused)
    _backward_with(model, values)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    true_norm = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads]))
    assert not torch.isfinite(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    before = [p.detach().clone() for p in model.parameters()]
    report = guard.step()
    assert not bool(report.skipped) and report.reason is None
    assert float(report.grad_norm) == pytest.approx(float(true_norm), rel=1e-6)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in model.parameters()]))  # type: ignore[union-attr]
    assert float(clipped) == pytest.approx(1.0, rel=1e-4)
    steps = [p.detach() - b for p, b in zip(model.parameters(), before, strict=True)]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert float(torch.linalg.vector_norm(torch.cat([s.flatten() for s in steps]))) == pytest.approx(0.1, rel=1e-3)
    assert guard.skipped_total == 0


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_real_inf_or_nan_beside_a_huge_value_is_still_skipped(bad: float) -> None:
    model, guard = _setup(False)
    _backward_with(model, [1e38, bad])
    before = [p.detach().clone() for p in model.parameters()]
    report = guard.step()
    assert bool(report.skipped) and report.reason == "nonfinite_grad"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_without_clipping_an_overflowed_step_is_skipped() -> None:
    # Nothing would bring the grads back into range: Adam's second moment would store inf.
    model, guard = _setup(False, clip="off")
    _backward_with(model, [1e38])
    assert guard.step().reason == "nonfinite_grad"


def test_adaptive_clipping_takes_the_overflowed_step_at_its_threshold() -> None:
    model, guard = _setup(False, clip="adaptive")
    for _ in range(3):
        _backward_with(model, [])
        guard.step()
        guard.zero_grad()
    _backward_with(model, [1e38])
    report = guard.step()
    assert not bool(report.skipped)
    assert 0 < float(report.clip_coef) < 1e-36
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fused_non_logging_step_keeps_the_skip_as_documented() -> None:
    # The fused decision stays on the device (no sync): a finite overflow is skipped there.
    model, guard = _setup(True, log_every=100)
    _backward_with(model, [])
    guard.step()
    guard.zero_grad()
    _backward_with(model, [1e38])
    before = [p.detach().clone() for p in model.parameters()]
    report = guard.step()
    assert report.reason == "nonfinite_grad"
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_the_event_of_a_huge_finite_grad_says_overflowed_fp32_not_non_finite() -> None:
    """Clipping off: a finite 3e19 grad is skipped as documented, and its event says what happened."""
    model, guard = _setup(False, clip="off")
    events: list[sk.Event] = []
    guard.hooks.on("nonfinite", events.append)
    _backward_with(model, [3e19, -3e19])
    assert guard.step().reason == "nonfinite_grad"
    guard.zero_grad()
    assert len(events) == 1
    message = events[0].message
    assert message.startswith("grad norm overflowed fp32 (first layer to overflow in backward order: ")
    assert "non-finite" not in message
    assert events[0].details["overflowed_fp32"] is True
    _backward_with(model, [float("nan")])  # a real NaN is still called non-finite
    guard.step()
    assert events[1].message.startswith("non-finite grad") and "overflowed_fp32" not in events[1].details
