"""Recovery restores only healthy states: a snapshot after the first step, none kept from inside a climb."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import stabilitykit as sk
from tests.hf_models import SEQ, VOCAB, tiny_llama
from tests.recovery_setups import regression


def _run(config: sk.StabilityConfig, loss_factor: Any, lr_boost: set[int] | None = None) -> list[sk.Event]:
    """Train the regression under ``config``; the loss the guard sees times ``loss_factor(step)``; the LR 1000x
    at the steps in ``lr_boost``. The rollback events."""
    model, batches = regression()
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


def test_a_blow_up_before_the_first_snapshot_multiple_never_restores_the_initial_weights() -> None:
    """Two steps at 1000x the LR at step 30, with snapshot_every=100: the only snapshot is the first step's, 30
    steps back (over max_lookback_share of the run): nothing is rolled back; the LR is lowered where the run is,
    said in a "recovery" event, and training goes on. When the 50 lowered steps end, the loss is still far
    above the best the run held (the blow-up did not pass): the LR goes to the first backoff level instead of
    back to the optimizer's."""
    model, batches = regression()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    logged: dict[int, dict[str, float]] = {}

    class Sink:
        def log_metrics(self, metrics: Any, step: int) -> None:
            logged[step] = dict(metrics)

    guard = sk.StabilityGuard(model, opt, _config(snapshot_every=100), sinks=[Sink()])
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    guard.hooks.on("recovery", events.append)
    for step, (x, y) in enumerate(batches):
        boost = step in (30, 31)
        for group in opt.param_groups:
            group["lr"] *= 1000.0 if boost else 1.0
        guard.backward(nn.functional.mse_loss(model(x), y))
        guard.step()
        for group in opt.param_groups:
            group["lr"] /= 1000.0 if boost else 1.0
        guard.zero_grad()
    guard.close()
    used = [m["stability/lr/0"] for _, m in sorted(logged.items()) if "stability/lr/0" in m]  # not the final row
    assert [e.kind for e in events] == ["recovery", "recovery"], events
    details = events[0].details
    assert details["action"] == "lr_backoff" and details["trigger"] == "spike_alert"
    assert details["oldest_restorable"] > 1 and details["cause"] == "undetermined"
    assert details["lr_factor"] == 0.5 and "no healthy snapshot" in events[0].message
    until = details["lr_until"]
    # the LR the steps used, as logged: halved from the alert until lr_until, the optimizer's own value after
    halved = [step for step, m in logged.items() if m.get("stability/lr/0") == 0.025]
    assert halved and min(halved) > details["trigger_step"], (halved, until)
    further = events[1].details
    assert further["trigger"] == "unrecovered" and further["cause"] == "lr" and further["loss_ratio"] >= 1.5
    assert further["trigger_step"] == until - 1 and further["lr_until"] > len(batches)
    assert used[-1] == 0.025 and until < len(batches)  # still halved at the end: the first backoff level
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_snapshot_taken_inside_a_climb_is_not_a_restore_point() -> None:
    """While the model still learns, the loss climbs 4% a step over steps 60-109 (no step jumps); snapshots come
    every 5 steps. The alert comes when the loss's level is 2x its best (about step 100); the rollback restores
    a state from before the climb had lifted the level half way (by 2 ** 0.5), not the newest snapshot before the
    alert (the climb's own: step 100 before this change)."""

    def climb(step: int) -> float:
        return math.exp(0.04 * (step - 60)) if 60 <= step < 110 else 1.0

    # the level rule's climb (the median rule pages earlier, at step 92: 1.85x the median before)
    config = _config(snapshot_every=5).model_copy(update={"spikes": sk.SpikeConfig(loss_median_alert=None)})
    rollbacks = _run(config, climb)
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
    model, batches = regression()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    guard = sk.StabilityGuard(model, opt, config)
    for x, y in batches[:35]:
        guard.backward(nn.functional.mse_loss(model(x), y))
        guard.step()
        guard.zero_grad()
    recovery = guard.engine.recovery
    assert recovery is not None and [s.step for s in recovery.store.snapshots] == [1, 10, 20, 30]
    guard.close()


def test_presets_are_named_recipes_that_are_on_and_take_overrides() -> None:
    bad = sk.RecoveryConfig.preset("bad_data")
    assert bad.enabled and bad.trigger == ["diverged", "spike_alert"] and bad.skip_after == 100
    blow = sk.RecoveryConfig.preset("blow_up", keep=3)
    assert blow.enabled and blow.trigger == ["diverged", "spike_alert"] and blow.skip_after == 0 and blow.keep == 3
    try:
        sk.RecoveryConfig.preset("bad-data")  # type: ignore[arg-type]
    except ValueError as exc:
        assert "'bad_data'" in str(exc) and "'blow_up'" in str(exc)
    else:
        raise AssertionError("an unknown preset was accepted")


def test_bad_data_preset_rolls_back_a_burst_of_bad_labels_and_skips_past_it() -> None:
    """Targets 30x off for steps 60-79: the bad_data preset rolls back once and skips the next 100 batches;
    the batches skipped were bad (measured on the restored weights), so the data is named the cause."""
    model, batches = regression()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    preset = sk.RecoveryConfig.preset("bad_data", snapshot_every=20)  # a restore point inside max_lookback_share
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=5, recovery=preset))
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
    assert details["restored_step"] <= 60 and details["skip_ahead_to"] == details["at_step"] + 100


# ---------------------------------------------------------------------------------------------- the defaults


def _train(config: sk.StabilityConfig, lr_boost: range = range(0), bad_labels: range = range(0)) -> tuple[int, float]:
    """The regression under ``config`` with the LR 1000x at the steps of ``lr_boost`` and targets 30x off at
    those of ``bad_labels``: (rollbacks, the final loss on the true targets of the last 20 batches)."""
    model, batches = regression(steps=250)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    guard = sk.StabilityGuard(model, opt, config)
    rollbacks: list[sk.Event] = []
    guard.hooks.on("rollback", rollbacks.append)
    for step, (x, y) in enumerate(batches):
        scale = 1000.0 if step in lr_boost else 1.0
        for group in opt.param_groups:
            group["lr"] = 0.05 * scale
        guard.backward(nn.functional.mse_loss(model(x), y * 30.0 if step in bad_labels else y))
        guard.step()
        guard.zero_grad()
    guard.close()
    with torch.no_grad():
        final = torch.stack([nn.functional.mse_loss(model(x), y) for x, y in batches[-20:]]).mean()
    return len(rollbacks), float(final)


def test_a_recovery_config_given_with_nothing_set_rolls_back_a_wrecked_run_and_leaves_a_healthy_one_alone() -> None:
    """``RecoveryConfig()`` and nothing else: two steps at 1000x the LR (a finite blow-up: nothing is
    non-finite) and 20 steps of targets 30x off (bad data) are rolled back and end near the healthy run; the
    healthy run is never rolled back. Before the defaults changed (trigger ``["diverged"]``, ``skip_after=0``)
    neither wrecked run was rolled back."""
    given = sk.StabilityConfig(recovery=sk.RecoveryConfig())
    healthy_rollbacks, healthy = _train(given)
    assert healthy_rollbacks == 0
    _, wrecked = _train(sk.StabilityConfig(), lr_boost=range(150, 152))
    assert wrecked > 100 * healthy, (wrecked, healthy)  # without recovery the blow-up stays
    for wreck in ({"lr_boost": range(150, 152)}, {"bad_labels": range(150, 170)}):
        rollbacks, final = _train(given, **wreck)
        assert 1 <= rollbacks <= 2 and final < 1.5 * healthy, (wreck, rollbacks, final, healthy)
    old = sk.StabilityConfig(recovery=sk.RecoveryConfig(trigger=["diverged"], skip_after=0))
    assert _train(old, lr_boost=range(150, 152))[0] == 0


def test_the_default_trigger_rests_quietly_with_spike_detection_off() -> None:
    """The default trigger holds "spike_alert"; with SpikeConfig(enabled=False) only an explicit alert trigger
    warns that it cannot fire (tests/test_recovery.py), the default does not."""
    import warnings

    model, _ = regression()
    config = sk.StabilityConfig(spikes=sk.SpikeConfig(enabled=False), recovery=sk.RecoveryConfig())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), config).close()


def test_the_defaults_roll_back_a_blow_up_under_the_hugging_face_trainer_and_not_a_healthy_stretch(
    tmp_path: Path,
) -> None:
    """The real ``Trainer`` (its defaults: fused AdamW, ``max_grad_norm=1.0``) guarded by ``stabilize`` with
    ``RecoveryConfig()`` and nothing else, on a tiny random-init Llama learning a counting pattern: 110 healthy
    steps fire nothing; then the LR 1000x for two steps (the Trainer's clipping does not save it) is rolled
    back once, to the snapshot of step 100, and the batches after it are measured at the healthy loss."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabilitykit.integrations import stabilize

    gen = torch.Generator().manual_seed(0)
    counting = [(s + torch.arange(SEQ)) % VOCAB for s in torch.randint(0, VOCAB, (130 * 8,), generator=gen)]

    class BlowUp(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            if state.global_step in (110, 111):
                for group in optimizer.param_groups:
                    group["lr"] *= 1000.0

        def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):  # type: ignore[no-untyped-def]
            for group, lr in zip(optimizer.param_groups, lr_scheduler.get_last_lr(), strict=True):
                group["lr"] = lr  # the schedule's again

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8,
        max_steps=130,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=10,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    rows = [{"input_ids": ids, "labels": ids} for ids in counting]
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=rows, callbacks=[BlowUp()])
    rollbacks: list[sk.Event] = []
    stabilize(trainer, sk.StabilityConfig(recovery=sk.RecoveryConfig())).hooks.on("rollback", rollbacks.append)
    trainer.train()
    loss = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    assert loss[110] < 0.5 and loss[120] > 100 * loss[110], loss  # learnt, then wrecked
    assert len(rollbacks) == 1, rollbacks  # none in the healthy steps 0-109
    details = rollbacks[0].details
    assert details["trigger"] == "spike_alert" and details["trigger_step"] in (110, 111), details
    assert details["restored_step"] == 100 and details["skip_ahead_to"] > 130
    assert loss[130] < 2 * loss[110], loss  # the batches after it, measured on the restored state
