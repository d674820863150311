"""Recovery on a real GPU: snapshots go to pinned host memory on a side stream with no host sync,
and a rollback restores CUDA parameters and fused optimizer state bitwise. Skipped where CUDA is absent."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import stabilitykit as sk
from stabilitykit.recovery.host_copy import saved_tensors

DEVICE = "cuda"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).to(DEVICE)


def _config(**recovery: Any) -> sk.StabilityConfig:
    return sk.StabilityConfig(
        log_every_n_steps=5,
        skip=sk.SkipConfig(max_consecutive=3),
        recovery=sk.RecoveryConfig(
            enabled=True, snapshot_every=4, **{"trigger": ["diverged"], "skip_after": 0, **recovery}
        ),
    )


def _step(guard: sk.StabilityGuard, model: torch.nn.Module, x: torch.Tensor, scale: float = 1.0) -> sk.StepReport:
    guard.backward(model(x).pow(2).mean() * scale)
    report = guard.step()
    guard.zero_grad()
    return report


def test_snapshot_step_makes_no_host_sync_and_lands_in_pinned_memory() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, _config())
    x = torch.randn(32, 64, device=DEVICE)
    for _ in range(3):
        _step(guard, model, x)  # step 0 logs and creates optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(guard, model, x)  # step 3: 4 steps done, a snapshot (pending: not a logging step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not [w for w in caught if "synchroniz" in str(w.message)]
    recovery = guard.engine.recovery
    assert recovery is not None
    (snapshot,) = recovery.store.snapshots
    assert snapshot.tree is not None
    snapshot.tree.wait()
    params = list(saved_tensors(snapshot.tree.tree["params"]))
    assert params and all(s.data.is_pinned() and s.device.type == "cuda" for s in params)
    guard.close()


@pytest.mark.parametrize("fused", [True, False])
def test_rollback_restores_cuda_state_bitwise(fused: bool) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    guard = sk.StabilityGuard(model, opt, _config())
    states: dict[int, dict[str, Any]] = {}
    rollbacks: list[sk.Event] = []

    def check(event: sk.Event) -> None:
        expected = states[event.details["restored_step"]]
        for name, p in model.named_parameters():
            assert torch.equal(p, expected["params"][name]), name
        for i, p in enumerate(model.parameters()):
            for key, value in expected["opt"][i].items():
                assert torch.equal(opt.state[p][key], value), f"{i}.{key}"
        rollbacks.append(event)

    guard.hooks.on("rollback", check)
    x = torch.randn(32, 64, device=DEVICE)
    for i in range(25):
        _step(guard, model, x, float("nan") if 10 <= i < 13 else 1.0)
        states[guard.step_count] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "opt": [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()],
        }
    assert len(rollbacks) == 1 and rollbacks[0].details["restored_step"] == 8
    assert all(torch.isfinite(p).all() for p in model.parameters())
    guard.close()
