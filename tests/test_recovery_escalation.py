"""Recovery on trouble that comes back: the LR lowered one level at a time when the LR is to blame, the data
skipped again when the data is, never a restore of the initial weights; the LR each step used, logged."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk
from tests.recovery_setups import diverged_only_config, mlp, mlp_batches, regression


class Metrics:
    """A sink keeping every logging step's metrics."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics: Any, step: int) -> None:
        self.rows.setdefault(step, {}).update(metrics)


def _hot_run(recovery: sk.RecoveryConfig | None, peak: float = 1.2, steps: int = 170) -> dict[str, Any]:
    """SGD warmed up over 30 steps to ``peak`` (past the edge) and held there, as a user's schedule would."""
    model, batches = regression(steps)
    opt = torch.optim.SGD(model.parameters(), lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    cfg = sk.StabilityConfig(log_every_n_steps=5, **({"recovery": recovery} if recovery is not None else {}))
    sink = Metrics()
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched, sinks=[sink])
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    error = None
    try:
        for x, y in batches:
            guard.backward(nn.functional.mse_loss(model(x), y))
            guard.step()
            guard.zero_grad()
    except sk.TrainingDivergedError as exc:
        error = exc
    with torch.no_grad():
        final = float(sum(nn.functional.mse_loss(model(x), y) for x, y in batches[-20:])) / 20
    summary = guard.summary()
    guard.close()
    return {"error": error, "events": events, "final": final, "summary": summary, "metrics": sink.rows}


def test_a_learning_rate_past_the_edge_is_lowered_one_level_at_a_time() -> None:
    """The guard alone diverges (a streak of non-finite steps); the defaults roll back, find the trouble back on
    data the restored model reads fine, lower the LR to 0.5x then 0.25x (held backoff_steps, nothing skipped for
    it), and the run ends converged. No rollback restores the first step's state."""
    alone = _hot_run(None)
    assert isinstance(alone["error"], sk.TrainingDivergedError)
    run = _hot_run(sk.RecoveryConfig(snapshot_every=10))
    assert run["error"] is None and run["final"] < 0.3, run["final"]
    rollbacks = [e.details for e in run["events"] if e.kind == "rollback"]
    assert [(d["cause"], d["lr_factor"]) for d in rollbacks] == [("undetermined", 0.5), ("lr", 0.5), ("lr", 0.25)]
    assert rollbacks[0]["skip_ahead_to"] is not None  # the first: the data may be to blame too
    for d in rollbacks[1:]:
        assert d["skip_ahead_to"] is None and d["lr_until"] == d["at_step"] + 1 + 500  # held backoff_steps
    assert all(d["restored_step"] > 1 for d in rollbacks)
    assert "learning rate, lowered further" in run["events"][-1].message
    line = run["summary"].line()
    assert "causes: undetermined: 1, lr: 2" in line and "lowered to 0.25x" in line, line
    # what the steps used, as logged: a quarter of the schedule's 1.2 after the last rollback
    last = rollbacks[-1]["at_step"]
    after = [m["stability/lr/0"] for s, m in run["metrics"].items() if s > last + 1 and "stability/lr/0" in m]
    assert after and all(lr == pytest.approx(0.3) for lr in after)


def test_a_long_burst_of_bad_data_is_named_the_data_and_recovery_stands_down_without_raising() -> None:
    """Targets 30x off for steps 60-149, 20 batches skipped after each rollback: the skipped batches are bad on
    the restored weights, so each recurrence is the data's (skipped again, the LR not lowered further). Past
    max_rollbacks an alert stops the rollbacks with a "recovery" event and the run goes on, as the guard alone
    would: RollbackLimitError is for a divergence that lowering the LR did not fix."""
    model, batches = regression(170)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    recovery = sk.RecoveryConfig(snapshot_every=20, skip_after=20)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=5, recovery=recovery))
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    for step, (x, y) in enumerate(batches):
        target = y * 30.0 if 60 <= step < 150 else y
        guard.backward(nn.functional.mse_loss(model(x), target))
        guard.step()
        guard.zero_grad()
    guard.close()
    rollbacks = [e.details for e in events if e.kind == "rollback"]
    assert [d["cause"] for d in rollbacks] == ["undetermined", "data", "data"], events
    assert all(d["skip_ahead_to"] == d["at_step"] + 20 and d["lr_factor"] == 0.5 for d in rollbacks)
    stand_down = [e for e in events if e.kind == "recovery"]
    assert stand_down and stand_down[0].details["action"] == "stand_down" and stand_down[0].details["cause"] == "data"
    assert "stops rolling back" in stand_down[0].message and "inspect the data" in stand_down[0].message


def test_the_rollback_limit_error_says_what_was_tried() -> None:
    """Non-finite steps from step 10 on, except the first batch after each rollback (so the restored model reads
    the new data fine: the LR is blamed): the LR lowered to 0.5x, then 0.25x, and the next divergence raises
    RollbackLimitError naming each LR it tried."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    with pytest.raises(sk.RollbackLimitError) as info:
        for i, x in enumerate(mlp_batches(60)):
            loss = model(x).pow(2).mean()
            fresh = bool(rollbacks) and i == rollbacks[-1].step + 1
            guard.backward(loss * float("nan") if i >= 10 and not fresh else loss)
            guard.step()
            guard.zero_grad()
    causes = [(e.details["cause"], e.details["lr_factor"]) for e in rollbacks]
    assert causes == [("undetermined", 1.0), ("lr", 0.5), ("lr", 0.25)], causes
    error = info.value
    assert "Lowering the learning rate did not help" in str(error) and "times 0.25" in str(error)
    assert error.tried is not None and "times 0.5" in error.tried
    guard.close()


def test_an_optimizer_without_lr_rolls_back_with_one_warning() -> None:
    """``pytorch_optimizer``'s A2Grad has no "lr" in its param groups (its step size comes from ``lips`` and
    the step count): the rollback's LR cooldown is skipped with one warning naming it (not KeyError: 'lr'),
    the rollback itself happens, and no lr metric is logged for the groups without one."""
    a2grad = pytest.importorskip("pytorch_optimizer").A2Grad
    model = mlp()
    opt = a2grad(model.parameters(), lips=10.0)
    assert "lr" not in opt.param_groups[0]
    cfg = diverged_only_config(cooldown_steps=10)
    sink = Metrics()
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sink])
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    with pytest.warns(RuntimeWarning, match="A2Grad has param groups without an 'lr'") as caught:
        for i, x in enumerate(mlp_batches(30)):
            loss = model(x).pow(2).mean()
            guard.backward(loss * float("nan") if 10 <= i < 13 else loss)
            guard.step()
            guard.zero_grad()
    assert sum("without an 'lr'" in str(w.message) for w in caught) == 1
    assert len(rollbacks) == 1 and all(torch.isfinite(p).all() for p in model.parameters())
    assert sink.rows and not any(k.startswith("stability/lr") for m in sink.rows.values() for k in m)
    guard.close()


def test_the_lr_each_group_used_is_logged_cooldown_included() -> None:
    """``stability/lr/<group>`` on logging steps: what the step used (the rollback's cooldown included), while
    the param groups outside the step keep the schedule's values."""
    model = mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 0.01}], lr=0.1)
    cfg = diverged_only_config(lr_scale=0.5, cooldown_steps=3).model_copy(update={"log_every_n_steps": 1})
    sink = Metrics()
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sink])
    for i, x in enumerate(mlp_batches(20)):
        loss = model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    logged = {s: (m["stability/lr/0"], m["stability/lr/1"]) for s, m in sink.rows.items() if "stability/lr/0" in m}
    assert logged[9] == (0.1, 0.01) and logged[16] == (0.1, 0.01)
    assert logged[13] == logged[15] == (pytest.approx(0.05), pytest.approx(0.005))
    assert opt.param_groups[0]["lr"] == 0.1


def test_several_optimizers_log_their_lr_under_their_own_prefix() -> None:
    model = mlp()
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.AdamW(model[3].parameters(), lr=3e-3)
    sink = Metrics()
    guard = sk.StabilityGuard(model, [first, second], sk.StabilityConfig(log_every_n_steps=2), sinks=[sink])
    for x in mlp_batches(4):
        guard.backward(model(x).pow(2).mean())
        guard.step(optimizer=first)
        guard.step(optimizer=second)
        guard.zero_grad()
    guard.close()
    keys = {k for m in sink.rows.values() for k in m if "/lr/" in k}
    assert keys == {"stability/opt0/lr/0", "stability/opt1/lr/0"}
    values = {k: v for m in sink.rows.values() for k, v in m.items() if "/lr/" in k}
    assert values["stability/opt1/lr/0"] == 3e-3 and math.isclose(values["stability/opt0/lr/0"], 0.1)


def _spike_at_40_then_nans(spike: float, nan_from: int, steps: int) -> list[sk.Event]:
    """The regression under AdamW (snapshot_every=50, streaks of 3 diverge): the loss the guard sees ``spike``
    times at step 40, non-finite at steps ``nan_from`` to ``nan_from + 2``. Its rollback and recovery events."""
    model, batches = regression(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    cfg = sk.StabilityConfig(
        log_every_n_steps=5,
        skip=sk.SkipConfig(max_consecutive=3),
        spikes=sk.SpikeConfig(warmup_steps=10),
        recovery=sk.RecoveryConfig(snapshot_every=50),
    )
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        guard.backward(loss * (spike if step == 40 else float("nan") if nan_from <= step < nan_from + 3 else 1.0))
        guard.step()
        guard.zero_grad()
    guard.close()
    return events


def test_an_alert_before_any_restore_point_leaves_one_for_the_next_trouble() -> None:
    """An alert at step 40 finds no snapshot inside the bound (only the first step's): the LR is halved where the
    run is. The snapshot due at step 50 falls in the alert's cooldown; recovery's lowered LR holds and the loss
    is back near its earlier level, so it is taken and kept. Non-finite steps 52-54 then roll back to it, and
    the cause is undetermined (nothing was measured after the LR was lowered in place: no evidence against
    the data), so the next 50 batches are skipped as on any first trouble. Without that snapshot the
    divergence would raise (nothing inside the bound); blamed on the LR, nothing would be skipped."""
    events = _spike_at_40_then_nans(spike=1e4, nan_from=52, steps=58)
    assert [e.kind for e in events] == ["recovery", "rollback"], [e.message for e in events]
    lowered, rollback = events[0].details, events[1].details
    assert lowered["action"] == "lr_backoff" and lowered["trigger_step"] == 40 and lowered["cause"] == "undetermined"
    assert rollback["trigger"] == "diverged" and rollback["restored_step"] == 50, rollback
    assert rollback["cause"] == "undetermined" and rollback["skip_ahead_to"] == rollback["at_step"] + 50


@pytest.mark.parametrize(("nan_from", "cause"), [(95, "lr"), (60, "undetermined")])
def test_trouble_back_once_an_lr_lowered_in_place_has_ended_is_the_lrs(nan_from: int, cause: str) -> None:
    """A 100x loss at step 40 finds no restore point inside the bound: the LR is halved where the run is until
    step 90, and the snapshot of step 50 is kept. Non-finite steps from 95, once the full LR is back, follow
    the LR (the trouble held off while the LR was low): the rollback blames the LR, skips no batch and holds
    0.5x for backoff_steps. From 60, while the LR is still lowered, nothing tells the LR from the data: the
    cause is undetermined and the next 50 batches are skipped, as on any first trouble."""
    events = _spike_at_40_then_nans(spike=100.0, nan_from=nan_from, steps=nan_from + 20)
    assert [e.kind for e in events] == ["recovery", "rollback"], [e.message for e in events]
    lowered, rollback = events[0].details, events[1].details
    assert lowered["cause"] == "undetermined" and lowered["lr_until"] == 91 and lowered["lr_factor"] == 0.5
    assert rollback["restored_step"] == 50 and rollback["cause"] == cause, events[1].message
    if cause == "lr":
        assert rollback["skip_ahead_to"] is None and rollback["lr_until"] > 500
    else:
        assert rollback["skip_ahead_to"] == rollback["at_step"] + 50


def test_trouble_still_there_when_the_lowered_lr_ends_lowers_it_further() -> None:
    """The loss the guard sees is 5x from step 30 on, for good (AdamW: the updates keep their size). The alert
    finds no restore point inside the bound, so the LR is halved where the run is for 50 steps; when that
    ends the loss is still 5x its level from before, and the loss-level alert does not page twice for one
    excursion: the LR goes to the first backoff level (0.5x for 500 steps, cause "lr") instead of back to
    the schedule's, said in a recovery event."""
    model, batches = regression(110)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sink = Metrics()
    cfg = sk.StabilityConfig(log_every_n_steps=5, spikes=sk.SpikeConfig(warmup_steps=10), recovery=sk.RecoveryConfig())
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sink])
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    for step, (x, y) in enumerate(batches):
        guard.backward(nn.functional.mse_loss(model(x), y) * (5.0 if step >= 30 else 1.0))
        guard.step()
        guard.zero_grad()
    guard.close()
    assert [(e.details["action"], e.details["cause"]) for e in events] == [
        ("lr_backoff", "undetermined"),
        ("lr_backoff", "lr"),
    ], [e.message for e in events]
    first, second = events[0].details, events[1].details
    assert second["trigger"] == "unrecovered" and second["loss_ratio"] >= 1.5 and second["lr_factor"] == 0.5
    assert second["trigger_step"] >= first["lr_until"] - 1 and second["lr_until"] > 500
    assert "did not pass" in events[1].message
    after = [m["stability/lr/0"] for s, m in sink.rows.items() if s > first["lr_until"] and "stability/lr/0" in m]
    assert after and all(lr == pytest.approx(0.005) for lr in after)


def test_a_run_wrecked_from_its_first_step_is_judged_against_its_first_loss_when_the_lowered_lr_ends() -> None:
    """The loss the guard sees is 300x from step 1 on, falling 3% a step (a run blown up from its start that
    slowly comes down): the alert at step 4 has no restore point, so the LR is halved where the run is. When
    that ends the loss has fallen steadily (it is near the best 5-step median the run held, which the rule
    alone would call recovered) but is still dozens of times the loss of the first step, before any update:
    the trouble did not pass, and the LR goes to the next level, said against the first step's loss."""
    model, batches = regression(120)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=5, recovery=sk.RecoveryConfig()))
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    seen: list[float] = []
    for step, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y) * (1.0 if step == 0 else 300.0 * 0.97**step)
        seen.append(float(loss.detach()))
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    state = guard.state_dict()
    guard.close()
    assert [(e.details["action"], e.details["cause"]) for e in events] == [
        ("lr_backoff", "undetermined"),
        ("lr_backoff", "lr"),
    ], [e.message for e in events]
    first, further = events[0].details, events[1].details
    end = first["lr_until"] - 1
    best_held = min(sorted(seen[i : i + 5])[2] for i in range(end - 3))
    assert sorted(seen[end - 4 : end + 1])[2] < 1.5 * best_held  # the best it held alone: "recovered"
    assert further["trigger"] == "unrecovered" and further["loss_ratio"] > 10 and further["trigger_step"] == end
    assert further["loss_against"].startswith("the loss of its first step") and "first step" in events[1].message
    assert state["optimizers"][0]["recovery"]["escalation"]["initial_loss"] == pytest.approx(seen[0])


def _hot_parts(peak: float = 1.2) -> tuple[nn.Linear, torch.optim.SGD, Any, sk.StabilityGuard, Metrics, list[sk.Event]]:
    """``_hot_run``'s model, SGD, schedule and guard (snapshot_every=10), its metrics sink and its events."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 30))
    sink = Metrics()
    cfg = sk.StabilityConfig(log_every_n_steps=5, recovery=sk.RecoveryConfig(snapshot_every=10))
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched, sinks=[sink])
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    return model, opt, sched, guard, sink, events


def test_a_resume_mid_backoff_keeps_the_lr_and_the_next_decision() -> None:
    """Saved right after the second rollback (the LR blamed, 0.5x for 500 steps) and loaded into a fresh guard:
    the resumed run uses the same LR at every step and, when the trouble comes back, blames the LR again and
    goes to 0.25x, as the run that was not interrupted does. Without what the skipped data showed in the state, the
    resumed run would call the same trouble "undetermined" and skip batches the LR is to blame for."""
    _, batches = regression(170)
    model, opt, sched, guard, sink, events = _hot_parts()
    saved: dict[str, Any] = {}
    for i, (x, y) in enumerate(batches):
        guard.backward(nn.functional.mse_loss(model(x), y))
        guard.step()
        guard.zero_grad()
        if not saved and len(events) == 2:
            saved = copy.deepcopy(
                {"at": i + 1, "model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
            )
            saved["guard"] = copy.deepcopy(guard.state_dict())
            seen = len(events)
    guard.close()
    assert saved and [e.details["cause"] for e in events[:2]] == ["undetermined", "lr"]
    model2, opt2, sched2, guard2, sink2, events2 = _hot_parts()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    guard2.load_state_dict(saved["guard"])
    assert guard2.state_dict()["optimizers"][0]["recovery"] == saved["guard"]["optimizers"][0]["recovery"]
    for x, y in batches[saved["at"] :]:
        guard2.backward(nn.functional.mse_loss(model2(x), y))
        guard2.step()
        guard2.zero_grad()
    guard2.close()
    after = [(e.kind, e.details["cause"], e.details["lr_factor"], e.details["trigger_step"]) for e in events[seen:]]
    assert after and after == [
        (e.kind, e.details["cause"], e.details["lr_factor"], e.details["trigger_step"]) for e in events2
    ]
    assert after[0][1:3] == ("lr", 0.25)
    lrs = {s: m["stability/lr/0"] for s, m in sink.rows.items() if s > saved["at"] and "stability/lr/0" in m}
    lrs2 = {s: m["stability/lr/0"] for s, m in sink2.rows.items() if s > saved["at"] and "stability/lr/0" in m}
    assert lrs and lrs == lrs2


def test_a_state_of_the_previous_layout_is_refused_and_loads_nothing() -> None:
    """A state saved before the escalation was kept in full (version 9: level, changes and last action only) is
    refused naming both versions, and the guard it was given to keeps its own LR backoff; one of version 11
    (without ``while_bad``) loads."""
    from stabilitykit.state import OLDEST_READ, STATE_VERSION

    model, _, _, guard, _, events = _hot_parts()
    for x, y in regression(120)[1]:
        guard.backward(nn.functional.mse_loss(model(x), y))
        guard.step()
        guard.zero_grad()
    assert events
    state = copy.deepcopy(guard.state_dict())
    old = state["optimizers"][0]["recovery"]["escalation"]
    state["optimizers"][0]["recovery"]["escalation"] = {k: old[k] for k in ("level", "changes", "last_action")}
    state["version"] = 9
    fresh = _hot_parts()[3]
    before = fresh.state_dict()
    refused = rf"version 9 .*reads versions {OLDEST_READ} to {STATE_VERSION} only\. Nothing was loaded"
    with pytest.raises(ValueError, match=refused):
        fresh.load_state_dict(state)
    assert fresh.state_dict()["optimizers"][0]["recovery"] == before["optimizers"][0]["recovery"]
    # version 11 (the escalation without ``while_bad``) loads, a fixed skip as it had
    state = copy.deepcopy(guard.state_dict())
    del state["optimizers"][0]["recovery"]["escalation"]["while_bad"]
    state["version"] = 11
    fresh.load_state_dict(state)
    assert fresh.state_dict()["optimizers"][0]["recovery"] == guard.state_dict()["optimizers"][0]["recovery"]
    # version 13 (no first-step loss) loads: not known, the end of a lowered LR judged as it was
    state = copy.deepcopy(guard.state_dict())
    assert state["optimizers"][0]["recovery"]["escalation"]["initial_loss"] is not None
    del state["optimizers"][0]["recovery"]["escalation"]["initial_loss"]
    state["version"] = 13
    fresh.load_state_dict(state)
    assert fresh.state_dict()["optimizers"][0]["recovery"]["escalation"]["initial_loss"] is None
    fresh.close()
    guard.close()


def test_batches_skipped_again_for_bad_data_are_skipped_only_while_they_measure_bad() -> None:
    """Targets 30x off for steps 60-129, 50 batches skipped after a rollback: the first skip (62-111) is all bad, the
    trouble recurs at 112 and is the data's; the second skip ends as soon as 5 skipped batches in a row measure
    fine on the restored weights (the burst over at 130), not 50 batches later (the end of the run)."""
    model, batches = regression(170)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    recovery = sk.RecoveryConfig(snapshot_every=20)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=5, recovery=recovery))
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    trained = []
    for step, (x, y) in enumerate(batches):
        target = y * 30.0 if 60 <= step < 130 else y
        guard.backward(nn.functional.mse_loss(model(x), target))
        if not bool(guard.step().skipped):
            trained.append(step)
        guard.zero_grad()
    guard.close()
    rollbacks = [e.details for e in events]
    assert [d["cause"] for d in rollbacks] == ["undetermined", "data"], [e.message for e in events]
    second = rollbacks[1]["at_step"]
    resumed = min(s for s in trained if s > second)
    assert 135 <= resumed <= 140 < second + 50, (second, resumed)
    assert "while they measure bad" in events[1].message
