"""StabilityTrainerCallback in a real Hugging Face Trainer (tiny random-init Llama on the CPU):
the true pre-clip norm, a NaN skipped bitwise, the scheduler held, metrics and events in
log_history at logging_steps, state across save_steps + resume_from_checkpoint."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_models import tiny_llama, token_batches
from transformers import Trainer, TrainerCallback, TrainingArguments

import stabilitykit as sk
from stabilitykit.integrations import StabilityTrainerCallback, stabilize

NAN = float("nan")


def _dataset(n: int = 64) -> list[dict[str, torch.Tensor]]:
    rows = []
    for batch in token_batches(n, batch_size=1, seed=3):
        rows.append({k: v[0] for k, v in batch.items()})
    return rows


def _args(root: Path, **kwargs: Any) -> TrainingArguments:
    defaults: dict[str, Any] = dict(
        output_dir=str(root),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=8,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=2,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    defaults.update(kwargs)
    return TrainingArguments(**defaults)


class Poison(TrainerCallback):
    """NaN out lm_head's output during the optimizer step that starts at ``global_step == step``."""

    def __init__(self, model: torch.nn.Module, step: int) -> None:
        self.step = step
        self.active = False
        model.lm_head.register_forward_hook(lambda m, i, out: out * NAN if self.active else None)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = state.global_step == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.active = False


class StateAt(TrainerCallback):
    """Parameters and optimizer state around the optimizer step that starts at ``global_step == step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.before: dict[str, Any] = {}
        self.after: dict[str, Any] = {}

    def _take(self, model, optimizer) -> dict[str, Any]:
        return {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "opt": copy.deepcopy(optimizer.state_dict()["state"]),
        }

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step and not self.before:
            self.before = self._take(model, optimizer)

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        if state.global_step == self.step + 1 and not self.after:
            self.after = self._take(model, optimizer)

    def assert_unchanged(self) -> None:
        assert self.before and self.after
        for name, value in self.before["params"].items():
            assert torch.equal(value, self.after["params"][name]), f"parameter {name} changed on a skipped step"
        assert self.before["opt"].keys() == self.after["opt"].keys()
        for key, state in self.before["opt"].items():
            for field, value in state.items():
                assert torch.equal(value, self.after["opt"][key][field]), f"optimizer state {key}.{field} changed"


class GradProbe(TrainerCallback):
    """The global norm of the grads the optimizer is about to use, per global step."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.norms[state.global_step] = float(torch.nn.utils.get_total_norm(grads))


def test_true_pre_clip_norm_with_the_trainers_max_grad_norm(tmp_path: Path) -> None:
    norms = {}
    for max_grad_norm in (0.0, 0.5):
        model = tiny_llama()
        probe = GradProbe()
        trainer = Trainer(
            model=model,
            args=_args(tmp_path / str(max_grad_norm), max_steps=1, max_grad_norm=max_grad_norm, logging_steps=1),
            train_dataset=_dataset(),
            callbacks=[probe],
        )
        callback = stabilize(trainer, sk.StabilityConfig())
        trainer.train()
        report = callback.last_report
        assert report is not None and report.step == 0
        logged = next(row for row in trainer.state.log_history if "loss" in row)
        norms[max_grad_norm] = (float(report.grad_norm), probe.norms[0], logged)
    true_norm, seen_unclipped, _ = norms[0.0]
    assert true_norm == pytest.approx(seen_unclipped, rel=1e-5), "nothing clipped: the optimizer saw the true norm"
    ours, seen_clipped, logged = norms[0.5]
    assert true_norm > 0.6, "the case of the issue: the true norm is above max_grad_norm"
    assert ours == pytest.approx(true_norm, rel=1e-6), "the norm is read before the Trainer's clipping"
    assert seen_clipped == pytest.approx(0.5, rel=1e-4), "the Trainer's max_grad_norm still clips"
    assert logged["grad_norm"] == pytest.approx(true_norm, rel=1e-6)
    assert logged["stability/grad_norm/total"] == pytest.approx(true_norm, rel=1e-6)


def test_max_grad_norm_and_stabilitykit_clipping_are_refused(tmp_path: Path) -> None:
    trainer = Trainer(model=tiny_llama(), args=_args(tmp_path, max_grad_norm=1.0), train_dataset=_dataset(8))
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0.*ClipConfig\(mode='fixed'\)"):
        stabilize(trainer, sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed")))


def test_unattached_callback_says_how_to_attach(tmp_path: Path) -> None:
    trainer = Trainer(
        model=tiny_llama(), args=_args(tmp_path), train_dataset=_dataset(8), callbacks=[StabilityTrainerCallback()]
    )
    with pytest.raises(RuntimeError, match="stabilize"):
        trainer.train()


def _run(
    root: Path, poison: int, max_steps: int, resume: str | None = None, optim: str = "adamw_torch_fused"
) -> tuple[Trainer, Any, StateAt]:
    model = tiny_llama()
    state_at = StateAt(poison)
    trainer = Trainer(
        model=model,
        args=_args(root, max_steps=8, save_strategy="steps", save_steps=4, optim=optim),
        train_dataset=_dataset(),
        callbacks=[Poison(model, poison), state_at],
    )
    callback = stabilize(trainer, sk.StabilityConfig())
    if max_steps < 8:  # an interrupted run: stop after max_steps, checkpoints as configured
        trainer.add_callback(_StopAt(max_steps))
    trainer.train(resume_from_checkpoint=resume)
    return trainer, callback, state_at


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"trainer_state.json holds {name}, which strict JSON parsers reject")


class _StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_nan_skipped_bitwise_scheduler_held_logged_and_resumed_exactly(tmp_path: Path, optim: str) -> None:
    poison = 2  # the optimizer step that starts at global_step 2 (the third)
    trainer, callback, state_at = _run(tmp_path / "full", poison, max_steps=8, optim=optim)
    state_at.assert_unchanged()
    assert trainer.state.global_step == 8
    assert trainer.lr_scheduler.last_epoch == 7, "8 optimizer steps, 1 skipped: the scheduler advanced 7 times"
    assert type(trainer.lr_scheduler) is torch.optim.lr_scheduler.LambdaLR, "the hold is undone after training"
    assert callback.engine.step == 8 and callback.engine.skipped_total == 1
    history = trainer.state.log_history
    events = [row for row in history if "stability/events/skipped" in row]
    # a fused AdamW (the Trainer's default) skips on the device and the host learns of it at the next
    # logging step (global step 4); a non-fused one at once (the step ends at global step 3).
    # ``_step`` always names the skipped step.
    fused = bool(trainer.optimizer.optimizer.defaults.get("fused"))
    assert fused == (optim == "adamw_torch_fused") and callback.engine.fused == fused
    reported_at = 4 if fused else poison + 1
    assert [(row["step"], row["stability/events/skipped_step"]) for row in events] == [(reported_at, poison)]
    train_rows = [row for row in history if "loss" in row and "train_runtime" not in row]
    assert [row["step"] for row in train_rows] == [2, 4, 6, 8]
    for row in train_rows:
        assert row["stability/grad_norm/total"] == pytest.approx(row["grad_norm"], rel=1e-6)
    assert train_rows[1]["stability/skipped/total"] == 1.0 and train_rows[0]["stability/skipped/total"] == 0.0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())

    # interrupted after the checkpoint at step 4, then resumed from it: the same run, bit for bit
    _run(tmp_path / "part", poison, max_steps=5, optim=optim)
    checkpoint = tmp_path / "part" / "checkpoint-4"
    assert (checkpoint / "trainer_state.json").exists()
    json.loads((checkpoint / "trainer_state.json").read_text(), parse_constant=_refuse_constant)  # strict JSON
    resumed, resumed_cb, _ = _run(tmp_path / "part", poison, max_steps=8, resume=str(checkpoint), optim=optim)
    assert resumed_cb.engine.step == 8
    assert resumed_cb.engine.skipped_total == 1, "the skip before the checkpoint survives the resume"
    for (name, p), q in zip(trainer.model.named_parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q), f"{name} differs after resume"
    assert resumed.lr_scheduler.last_epoch == 7


def test_checkpoint_state_is_strict_json_and_resumes(tmp_path: Path) -> None:
    """Unread journal rows (clipping off: a NaN threshold) are saved as strict JSON, and load back."""
    args = _args(tmp_path, max_steps=4, logging_steps=3, save_strategy="steps", save_steps=4)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=_dataset())
    callback = stabilize(trainer, sk.StabilityConfig(clip=sk.ClipConfig(mode="off")))
    trainer.train()
    text = (tmp_path / "checkpoint-4" / "trainer_state.json").read_text()
    json.loads(text, parse_constant=_refuse_constant)
    assert '"nan"' in text  # the unread row's threshold, as a string
    resumed = Trainer(model=tiny_llama(), args=_args(tmp_path, max_steps=5, logging_steps=3), train_dataset=_dataset())
    resumed_cb = stabilize(resumed, sk.StabilityConfig(clip=sk.ClipConfig(mode="off")))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed_cb.engine.step == 5 and callback.engine.step == 4


def test_an_event_after_the_last_logging_step_keeps_the_run_summary_last(tmp_path: Path) -> None:
    """A NaN near the end: its events join the final entry, which still holds ``train_loss``."""
    model = tiny_llama()
    trainer = Trainer(
        model=model, args=_args(tmp_path, max_steps=5, logging_steps=2), train_dataset=_dataset(),
        callbacks=[Poison(model, 4)],
    )  # fmt: skip
    stabilize(trainer, sk.StabilityConfig())
    trainer.train()
    last = trainer.state.log_history[-1]
    assert "train_loss" in last and last["stability/events/skipped_step"] == 4.0


def test_console_lines_carry_no_per_layer_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The Trainer's printed log lines stay short; log_history (and every report_to) keeps every key."""
    trainer = Trainer(model=tiny_llama(), args=_args(tmp_path, max_steps=2, logging_steps=1), train_dataset=_dataset())
    stabilize(trainer, sk.StabilityConfig())
    trainer.train()
    printed = capsys.readouterr().out
    assert "stability/grad_norm/total" in printed and "stability/grad_norm/model.layers.0" not in printed
    assert any("stability/grad_norm/model.layers.0" in row for row in trainer.state.log_history)


def test_restore_callback_states_from_checkpoint_keeps_the_binding_and_restores_every_callback(
    tmp_path: Path,
) -> None:
    """``restore_callback_states_from_checkpoint=True``: a fresh run trains; a resumed run hands the
    saved state to the same attached callback (the one ``stabilize`` returned) and still restores
    the other callbacks' state (early stopping)."""
    from transformers import EarlyStoppingCallback

    def trainer_for(max_steps: int, patience: int) -> tuple[Trainer, StabilityTrainerCallback]:
        model = tiny_llama()
        args = _args(
            tmp_path,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=4,
            eval_strategy="steps",
            eval_steps=4,
            load_best_model_at_end=True,
            metric_for_best_model="loss",
            restore_callback_states_from_checkpoint=True,
        )
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=_dataset(),
            eval_dataset=_dataset(8),
            callbacks=[Poison(model, 1), EarlyStoppingCallback(early_stopping_patience=patience)],
        )
        return trainer, stabilize(trainer, sk.StabilityConfig())

    first, first_cb = trainer_for(4, patience=5)
    first.train()  # a fresh run with the flag set trains (it used to be refused)
    assert first_cb.engine.step == 4 and first_cb.engine.skipped_total == 1

    resumed, resumed_cb = trainer_for(8, patience=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    callbacks = resumed.callback_handler.callbacks
    assert any(cb is resumed_cb for cb in callbacks), "the attached callback stays the one training"
    assert sum(isinstance(cb, StabilityTrainerCallback) for cb in callbacks) == 1
    assert resumed_cb.engine.step == 8 and resumed_cb.engine.skipped_total == 1, "the saved state was restored"
    early = next(cb for cb in callbacks if isinstance(cb, EarlyStoppingCallback))
    assert early.early_stopping_patience == 5, "early stopping's saved state was restored too"


def test_alerts_page_the_active_wandb_run_as_the_wandb_sink_does(tmp_path: Path) -> None:
    """``alerts=True`` pages the same kinds as ``WandbSink`` (``spike_alert``, never ``spike_warning``),
    with its titles, levels and wait, read back from a real offline W&B run file."""
    import wandb

    from stabilitykit.sinks import WandbRunFile
    from stabilitykit.sinks.wandb import ALERT_KINDS

    # the global run, as the Trainer's own WandbCallback (report_to="wandb") makes it
    run = wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline", reinit="finish_previous")
    assert wandb.run is run
    model = tiny_llama()
    trainer = Trainer(
        model=model, args=_args(tmp_path, max_steps=6), train_dataset=_dataset(), callbacks=[Poison(model, 1)]
    )
    callback = stabilize(trainer, sk.StabilityConfig(), alerts=True)
    assert callback.alert_on == set(ALERT_KINDS) and "spike_warning" not in callback.alert_on
    trainer.train()
    run.finish()
    alerts = WandbRunFile.read(Path(run.dir).parent).alerts
    assert [a["title"] for a in alerts] == ["stabilitykit: nonfinite at step 1"]
    assert alerts[0]["level"] == "WARN" and "non-finite" in alerts[0]["text"]


def test_a_spike_warning_raised_by_a_layer_logs_1_not_a_negative_z_score() -> None:
    from stabilitykit.sinks.trainers import event_value as _event_value
    from stabilitykit.spikes import StepScores, warning_rule

    cfg = sk.SpikeConfig()
    by_layer = StepScores(12, 1.3, 2.0, -2.09, 0.1, "model.layers.1.mlp", None, 0.0)
    event = warning_rule(by_layer, cfg)
    assert event is not None and event.details["z"] == -2.09
    assert _event_value(event) == 1.0  # the total's z-score (negative here) is not what raised it
    by_total = StepScores(12, 9.0, 2.0, 7.5, 0.1, None, None, 0.0)
    event = warning_rule(by_total, cfg)
    assert event is not None and _event_value(event) == 7.5


def _printed_entries(text: str) -> list[dict[str, Any]]:
    """The dicts the Trainer's console printed (one per log entry)."""
    import ast

    entries = []
    for segment in text.replace("\r", "\n").splitlines():
        segment = segment.strip()
        if segment.startswith("{") and segment.endswith("}"):
            entries.append(ast.literal_eval(segment.replace("nan", "None")))
    return entries


@pytest.mark.parametrize("console", ["short", "all"])
def test_the_console_shows_what_a_person_reads_and_warnings_get_their_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], console: str
) -> None:
    import sys

    from stabilitykit.run_log import LOGGER, TqdmSafeHandler

    handlers = [h for h in LOGGER.handlers if isinstance(h, TqdmSafeHandler)]
    assert handlers, "the stabilitykit logger's own handler"
    previous = handlers[0].setStream(sys.stderr)  # the stream the bars write to in this test
    try:
        model = tiny_llama()
        args = _args(tmp_path, max_steps=6, logging_steps=2, disable_tqdm=False, max_grad_norm=0.0)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[Poison(model, 3)])
        stabilize(trainer, sk.StabilityConfig(monitors=sk.MonitorConfig()), console=console)
        trainer.train()
        captured = capsys.readouterr()
    finally:
        handlers[0].setStream(previous)
    text = captured.out + captured.err
    entries = [e for e in _printed_entries(text) if "loss" in e]
    assert len(entries) == 3
    history = [row for row in trainer.state.log_history if "loss" in row]
    assert all(len([k for k in row if k.startswith("stability/")]) > 30 for row in history)  # report_to: all
    stability_keys = {k for e in entries for k in e if k.startswith("stability/")}
    if console == "short":
        assert stability_keys <= {
            "stability/grad_norm/total",
            "stability/skipped/total",
            "stability/nonfinite/total",
            "stability/events/skipped",
            "stability/events/skipped_step",
            "stability/events/nonfinite",
            "stability/events/nonfinite_step",
        }
        assert {"loss", "grad_norm", "stability/grad_norm/total", "stability/skipped/total"} <= set(entries[-1])
        assert max(len(str(e)) for e in entries) < 400
    else:
        assert len(stability_keys) > 30
    # the skip's WARNING line starts a line of its own: never glued onto the end of a bar
    lines = [line for line in text.replace("\r", "\n").splitlines() if "stabilitykit:" in line]
    assert any("skipped" in line for line in lines)
    assert all(line.startswith("stabilitykit:") for line in lines), lines


def test_the_run_summary_counts_the_steps_max_grad_norm_clipped_across_a_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import math

    def train(resume: str | None) -> tuple[Trainer, Any]:
        model = tiny_llama()
        args = _args(tmp_path, max_steps=8, max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=4)
        trainer = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[Poison(model, 3)])
        callback = stabilize(trainer, sk.StabilityConfig())
        trainer.train(resume_from_checkpoint=resume)
        return trainer, callback

    caplog.set_level(logging.INFO, logger="stabilitykit")
    trainer, callback = train(None)
    norms = [row["grad_norm"] for row in trainer.state.log_history if "grad_norm" in row]
    expected = sum(1 for n in norms if math.isfinite(n) and n > 0.5)
    assert len(norms) == 8 and expected >= 5  # the NaN step is skipped, not clipped
    summary = callback.summary()
    assert summary is not None and summary.clipped == expected and summary.skipped == 1
    assert any(f"1 skipped, {expected} clipped" in r.getMessage() for r in caplog.records)
    _, resumed = train(str(tmp_path / "checkpoint-4"))
    again = resumed.summary()
    assert again is not None and again.clipped == expected and again.skipped == 1
