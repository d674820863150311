"""LR schedulers given to the plain-loop guard the wrong way: each mistake a clear error or warning naming it
and the fix, before it can run (real torch schedulers, a real GradScaler-free loop)."""

from __future__ import annotations

import warnings

import pytest
import torch

import stabilitykit as sk


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(guard: sk.StabilityGuard, model: torch.nn.Module, steps: int, also: object = None) -> None:
    for _ in range(steps):
        guard.backward(model(torch.randn(4, 4)).pow(2).mean())
        guard.step()
        guard.zero_grad()
        if also is not None:
            also.step()  # type: ignore[attr-defined]


def test_a_scheduler_in_the_scaler_place_is_named() -> None:
    model, opt = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    with pytest.raises(TypeError, match=r"scaler= got StepLR, an LR scheduler: the fourth positional .* scheduler=sch"):
        sk.StabilityGuard(model, opt, None, sched)


def test_a_scheduler_class_is_named() -> None:
    model, opt = _setup()
    with pytest.raises(TypeError, match=r"got the class StepLR, not a scheduler: .*scheduler=StepLR\(optimizer"):
        sk.StabilityGuard(model, opt, scheduler=torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize(
    ("interval", "fix"), [("step", "pass the scheduler itself"), ("epoch", "step it yourself once per epoch")]
)
def test_lightnings_scheduler_dict_is_named(interval: str, fix: str) -> None:
    model, opt = _setup()
    config = {"scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5), "interval": interval}
    with pytest.raises(
        TypeError, match=rf"got a dict \(Lightning's lr_scheduler config, interval='{interval}'\); {fix}"
    ):
        sk.StabilityGuard(model, opt, scheduler=config)


def test_reduce_lr_on_plateau_is_refused_by_name() -> None:
    model, opt = _setup()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau, which steps on a metric .*scheduler\.step\(val_loss\)"):
        sk.StabilityGuard(model, opt, scheduler=plateau)


def test_the_optimizer_as_its_own_scheduler_is_named() -> None:
    model, opt = _setup()
    with pytest.raises(TypeError, match=r"scheduler= got the optimizer SGD: .* would step twice"):
        sk.StabilityGuard(model, opt, scheduler=opt)


def test_a_scheduler_of_another_optimizer_is_named() -> None:
    model, opt = _setup()
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"StepLR built on another optimizer \(SGD at 0x[0-9a-f]+\)"):
        sk.StabilityGuard(model, opt, scheduler=torch.optim.lr_scheduler.StepLR(other, step_size=5))


def test_a_scheduler_passed_and_stepped_by_hand_warns_once() -> None:
    model, opt = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    guard = sk.StabilityGuard(model, opt, scheduler=sched)
    with pytest.warns(UserWarning, match=r"StepLR\.step\(\) was called outside the guard .*runs twice as fast") as got:
        _train(guard, model, 4, also=sched)
    assert sum("outside the guard" in str(w.message) for w in got) == 1
    guard.close()


def test_a_scheduler_stepped_only_by_the_guard_does_not_warn() -> None:
    """Skips hold it and a rollback restores it: neither is a step by hand."""
    model, opt = _setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    cfg = sk.StabilityConfig(skip=sk.SkipConfig(max_consecutive=2), recovery=sk.RecoveryConfig(snapshot_every=2))
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*outside the guard.*")
        for i in range(12):
            loss = model(torch.randn(4, 4)).pow(2).mean() * (float("nan") if i in (5, 6) else 1.0)
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
    assert guard.summary().rollbacks == 1
    guard.close()
