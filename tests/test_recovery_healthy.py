"""Recovery restores only healthy states: a snapshot after the first step, none kept from inside a climb."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import stabilitykit as sk


def _problem(seed: int = 0) -> tuple[nn.Linear, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A linear regression the model learns in a few dozen steps, and its batches."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    w = torch.randn(16, 1, generator=gen)
    batches = []
    for _ in range(120):
        x = torch.randn(32, 16, generator=gen)
        batches.append((x, x @ w + 0.3 * torch.randn(32, 1, generator=gen)))
    return nn.Linear(16, 1), batches


def _run(config: sk.StabilityConfig, loss_factor: Any, lr_boost: set[int] | None = None) -> list[sk.Event]:
    """Train the regression under ``config``; the loss the guard sees times ``loss_factor(step)``; the LR 1000x
    at the steps in ``lr_boost``. The rollback events."""
    model, batches = _problem()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    guard = sk.StabilityGuard(model, opt, config)
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    for step, (x, y) in enumerate(batches):
        boost = lr_boost is not None and step in lr_boost
        if boost:
            for group in opt.param_groups:
                group["lr"] *= 1000.0
        loss = nn.functional.mse_loss(model(x), y) * loss_factor(step)
        guard.backward(loss)
        guard.step()
        if boost:
            for group in opt.param_groups:
                group["lr"] /= 1000.0
        guard.zero_grad()
    guard.close()
    return rollbacks


def _config(**recovery: Any) -> sk.StabilityConfig:
    settings: dict[str, Any] = {"trigger": ["diverged", "spike_alert"], "keep": 3, **recovery}
    return sk.StabilityConfig(log_every_n_steps=5, recovery=sk.RecoveryConfig(**settings))


def test_a_blow_up_before_the_first_snapshot_multiple_rolls_back_to_the_first_step() -> None:
    """Two steps at 1000x the LR at step 30, with snapshot_every=100: the first step's snapshot is there to go
    back to (before, there was none and the alert stayed an alert)."""
    rollbacks = _run(_config(snapshot_every=100), lambda step: 1.0, lr_boost={30, 31})
    assert rollbacks, "the blow-up was not rolled back"
    assert rollbacks[0].details["restored_step"] == 1 and rollbacks[0].details["trigger"] == "spike_alert"


def test_a_snapshot_taken_inside_a_climb_is_not_a_restore_point() -> None:
    """While the model still learns, the loss climbs 4% a step over steps 60-109 (no step jumps); snapshots come
    every 5 steps. The alert comes when the loss's level is 2x its best (about step 100); the rollback restores
    a state from before the climb had lifted the level half way (by 2 ** 0.5), not the newest snapshot before the
    alert (the climb's own: step 100 before this change)."""

    def climb(step: int) -> float:
        return math.exp(0.04 * (step - 60)) if 60 <= step < 110 else 1.0

    rollbacks = _run(_config(snapshot_every=5), climb)
    assert len(rollbacks) == 1, rollbacks
    first = rollbacks[0].details
    assert first["trigger_step"] >= 95 and first["trigger"] == "spike_alert"
    newest_before_alert = first["trigger_step"] // 5 * 5
    assert first["restored_step"] <= newest_before_alert - 10, first


def test_without_spike_detection_snapshots_are_taken_on_their_cadence() -> None:
    """No detector, nothing to vet: the cadence and the first step's snapshot, as configured."""
    config = sk.StabilityConfig(
        log_every_n_steps=5,
        spikes=sk.SpikeConfig(enabled=False),
        recovery=sk.RecoveryConfig(snapshot_every=10, keep=50),
    )
    model, batches = _problem()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    guard = sk.StabilityGuard(model, opt, config)
    for x, y in batches[:35]:
        guard.backward(nn.functional.mse_loss(model(x), y))
        guard.step()
        guard.zero_grad()
    recovery = guard.core.recovery
    assert recovery is not None and [s.step for s in recovery.store.snapshots] == [1, 10, 20, 30]
    guard.close()


def test_presets_are_named_recipes_that_are_on_and_take_overrides() -> None:
    bad = sk.RecoveryConfig.preset("bad_data")
    assert bad.enabled and bad.trigger == ["diverged", "spike_alert"] and bad.skip_after == 50
    blow = sk.RecoveryConfig.preset("blow_up", keep=3)
    assert blow.enabled and blow.trigger == ["diverged", "spike_alert"] and blow.skip_after == 0 and blow.keep == 3
    try:
        sk.RecoveryConfig.preset("bad-data")  # type: ignore[arg-type]
    except ValueError as exc:
        assert "'bad_data'" in str(exc) and "'blow_up'" in str(exc)
    else:
        raise AssertionError("an unknown preset was accepted")


def test_bad_data_preset_rolls_back_a_burst_of_bad_labels_and_skips_past_it() -> None:
    """Targets 30x off for steps 60-79: the bad_data preset rolls back once and skips the next 50 batches."""
    model, batches = _problem()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    guard = sk.StabilityGuard(
        model, opt, sk.StabilityConfig(log_every_n_steps=5, recovery=sk.RecoveryConfig.preset("bad_data"))
    )
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    for step, (x, y) in enumerate(batches):
        target = y * 30.0 if 60 <= step < 80 else y
        guard.backward(nn.functional.mse_loss(model(x), target))
        guard.step()
        guard.zero_grad()
    guard.close()
    assert len(rollbacks) == 1
    details = rollbacks[0].details
    assert details["trigger"] == "spike_alert" and 60 <= details["trigger_step"] < 65
    assert details["restored_step"] <= 60 and details["skip_ahead_to"] == details["at_step"] + 50
