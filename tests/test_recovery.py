"""Recovery: snapshots of healthy steps, rollback past a divergence or an alert, training goes on."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk
from stabilitykit.recovery import SKIPPED_FILE
from stabilitykit.testing.syncs import count_host_syncs
from tests.hf_models import tiny_llama, token_batches
from tests.recovery_setups import diverged_only_config, mlp, mlp_batches


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (so -0.0 and 0.0, or two NaN payloads, differ)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
        "opt": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in enumerate(opt.state[p] for p in (q for g in opt.param_groups for q in g["params"]))
        },
        "lr": [g["lr"] for g in opt.param_groups],
    }


def _assert_bitwise(expected: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer) -> None:
    now = _state(model, opt)
    for section in ("params", "buffers"):
        for name, value in expected[section].items():
            assert torch.equal(_bits(value), _bits(now[section][name])), f"{section} {name} differs from the snapshot"
    assert expected["opt"].keys() == now["opt"].keys()
    for i, state in expected["opt"].items():
        assert state.keys() == now["opt"][i].keys(), f"optimizer state keys of parameter {i}"
        for key, value in state.items():
            other = now["opt"][i][key]
            if torch.is_tensor(value):
                assert torch.equal(_bits(value), _bits(other)), f"optimizer state {i}.{key} differs"
            else:
                assert value == other
    assert expected["lr"] == now["lr"]


def _llama_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


class Recorder:
    """The training state at the end of every step (keyed by the steps done), and the rollbacks seen.

    At each rollback event it checks, right after the restore, that the parameters, buffers,
    optimizer state and learning rates equal the restored snapshot's bitwise.
    """

    def __init__(self, guard: sk.StabilityGuard, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        self.states: dict[int, dict[str, Any]] = {}
        self.skipped: set[int] = set()
        self.rollbacks: list[sk.Event] = []
        guard.hooks.on("rollback", self.on_rollback)

    def record(self, guard: sk.StabilityGuard, report: sk.StepReport) -> None:
        self.states[guard.step_count] = _state(self.model, self.opt)

    def on_rollback(self, event: sk.Event) -> None:
        restored = event.details["restored_step"]
        _assert_bitwise(self.states[restored], self.model, self.opt)
        self.rollbacks.append(event)


def _run_llama(fused: bool, cfg: sk.StabilityConfig, poison: range, steps: int = 30) -> tuple[Any, Recorder, list]:
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched)
    recorder = Recorder(guard, model, opt)
    reports = []
    for i, batch in enumerate(token_batches(steps)):
        loss = _llama_loss(model, batch)
        if i in poison:
            loss = loss * float("nan")
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        reports.append(report)
        recorder.record(guard, report)
    return guard, recorder, reports


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_nan_streak_rolls_back_bitwise_and_training_goes_on(fused: bool) -> None:
    guard, recorder, reports = _run_llama(fused, diverged_only_config(), poison=range(10, 14))
    assert len(recorder.rollbacks) == 1
    event = recorder.rollbacks[0]
    d = event.details
    assert d["trigger"] == "diverged" and d["onset"] == 10
    assert d["restored_step"] == 8  # the newest snapshot at or before the onset (taken every 4 steps)
    assert d["skipped_from"] == 8 and d["skipped_to"] == event.step
    assert d["skipped_to"] >= 12  # the third skipped step in a row (a fused optimizer learns of it at a read)
    assert len(reports) == 30 and guard.step_count == 30  # the loop went on to the end
    last = [float(r.loss) for r in reports[-5:]]
    assert all(math.isfinite(v) for v in last)
    assert all(torch.isfinite(p).all() for p in guard.model.parameters())
    guard.close()


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_snapshots_of_skipped_steps_are_never_used(fused: bool) -> None:
    """Snapshots every step: those taken after a skipped step are dropped (pending ones at the next read)."""
    cfg = diverged_only_config(snapshot_every=1, keep=50)
    guard, recorder, reports = _run_llama(fused, cfg, poison=range(10, 14), steps=20)
    skipped = {r.step for r in reports if bool(r.skipped)}
    assert skipped >= {10, 11, 12}
    assert recorder.rollbacks and recorder.rollbacks[0].details["restored_step"] == 10
    recovery = guard.engine.recovery
    assert recovery is not None
    guard.engine.flush()
    for snapshot in recovery.store.snapshots:
        assert snapshot.confirmed
        assert snapshot.step - 1 not in skipped, f"a snapshot after skipped step {snapshot.step - 1} was kept"
    guard.close()


def test_rollback_limit_raises_training_diverged() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(max_rollbacks=2, window=100))
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    with pytest.raises(sk.TrainingDivergedError) as info:
        for i, x in enumerate(mlp_batches(60)):
            loss = model(x).pow(2).mean()
            if i >= 10:
                loss = loss * float("nan")  # the run never recovers
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
    assert isinstance(info.value, sk.RollbackLimitError)
    assert len(events) == 2 and info.value.rollbacks == 2
    guard.close()


def test_rollback_without_a_snapshot_raises_as_before() -> None:
    """A run that diverges from its first step has no healthy state (the first snapshot comes after the first
    step taken): the divergence raises as without recovery."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(snapshot_every=50))
    with pytest.raises(sk.TrainingDivergedError) as info:
        for x in mlp_batches(20):
            loss = model(x).pow(2).mean() * float("nan")
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
    assert not isinstance(info.value, sk.RollbackLimitError)
    guard.close()


def test_rollback_is_recorded_in_jsonl_file_and_state(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
    cfg = diverged_only_config(record_dir=str(tmp_path / "records"))
    sink = sk.sinks.JsonlSink(tmp_path / "run.jsonl")
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched, sinks=[sink])
    for i, x in enumerate(mlp_batches(25)):
        loss = model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    state = guard.state_dict()
    guard.close()
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    rollbacks = [line for line in lines if line.get("event") == "rollback"]
    assert len(rollbacks) == 1
    row = rollbacks[0]
    assert row["restored_step"] == 8 and row["skipped_from"] == 8 and row["skipped_to"] == row["step"]
    assert row["skipped_steps"] == row["skipped_to"] - 8 + 1
    saved = json.loads((tmp_path / "records" / SKIPPED_FILE).read_text())
    assert saved["rollbacks"][0]["skipped_from"] == 8
    assert saved["rollbacks"][0]["skipped_to"] == row["skipped_to"]
    # the rollback count and ranges round-trip through state_dict / load_state_dict
    assert state["optimizers"][0]["recovery"]["rollbacks"][0]["restored_step"] == 8
    model2 = mlp()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, fused=True)
    guard2 = sk.StabilityGuard(model2, opt2, cfg)
    guard2.load_state_dict(state)
    assert guard2.state_dict()["optimizers"][0]["recovery"] == state["optimizers"][0]["recovery"]
    guard2.close()


def test_disk_storage_rolls_back_bitwise(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(storage=str(tmp_path / "snaps")))
    recorder = Recorder(guard, model, opt)
    for i, x in enumerate(mlp_batches(25)):
        if i == 10:
            guard.summary()  # a flush waits for the files: their host copies are freed, the rollback reads a file
        loss = model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
        guard.backward(loss)
        recorder.record(guard, guard.step())
        guard.zero_grad()
    assert len(recorder.rollbacks) == 1
    guard.summary()
    files = sorted(p.name for p in (tmp_path / "snaps").glob("snapshot-*.pt"))
    assert 1 <= len(files) <= 2  # keep=2 on disk
    assert (tmp_path / "snaps" / SKIPPED_FILE).exists()  # record_dir defaults to the storage directory
    guard.close()
    assert not list((tmp_path / "snaps").glob("snapshot-*.pt"))  # closing drops the snapshots


def test_a_snapshot_that_cannot_be_written_warns_and_training_goes_on(tmp_path: Path) -> None:
    """Disk storage under a path that is a file: every write fails on the writer thread; each failure is a
    warning naming the snapshot, the run keeps training, and the divergence then raises as without recovery."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the snapshot directory should be")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(
        model, opt, diverged_only_config(storage=str(blocker / "snaps"), record_dir=str(tmp_path / "records"))
    )
    with pytest.warns(RuntimeWarning, match=r"could not write the recovery snapshot of step \d+"):
        for x in mlp_batches(9):
            guard.backward(model(x).pow(2).mean())
            guard.step()
            guard.zero_grad()
        guard.summary()  # waits for the writes: their failures are reported
    assert guard.engine.recovery is not None and guard.engine.recovery.store.confirmed == []
    with pytest.raises(sk.TrainingDivergedError):  # nothing to roll back to: raised as before
        for x in mlp_batches(6):
            guard.backward(model(x).pow(2).mean() * float("nan"))
            guard.step()
            guard.zero_grad()
    guard.close()


def test_a_reload_drops_the_old_snapshots_and_snapshots_after_its_first_step() -> None:
    """Loading an earlier state into the same guard (``fabric.load``, an in-process resume): snapshots of
    the run before the load are another trajectory and are dropped; the first step after the load takes
    one, so a divergence right after it rolls back there, bitwise, instead of raising."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(snapshot_every=4, keep=2))
    recorder = Recorder(guard, model, opt)
    saved: dict[str, Any] = {}
    for i, x in enumerate(mlp_batches(14)):
        if i == 10:
            saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "guard": guard.state_dict()})
        guard.backward(model(x).pow(2).mean())
        recorder.record(guard, guard.step())
        guard.zero_grad()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    guard.load_state_dict(saved["guard"])
    for i, x in enumerate(mlp_batches(8, seed=5), start=10):  # other batches than the first pass's
        bad = 11 <= i < 14
        guard.backward(model(x).pow(2).mean() * (float("nan") if bad else 1.0))
        recorder.record(guard, guard.step())
        guard.zero_grad()
    # the snapshot of the load's first step; before, the ring still held the first pass's 8 and 12, and the
    # rollback went back to 8, past the load
    assert [r.details["restored_step"] for r in recorder.rollbacks] == [11]


class SpySGD(torch.optim.SGD):
    """SGD that notes the learning rate each step runs with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[float] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(self.param_groups[0]["lr"])
        return super().step(closure)


def test_lr_is_scaled_during_the_cooldown_only() -> None:
    model = mlp()
    opt = SpySGD(model.parameters(), lr=0.1)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(lr_scale=0.5, cooldown_steps=3))
    ran: dict[int, float] = {}
    for i, x in enumerate(mlp_batches(25)):
        loss = model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if not bool(report.skipped):
            ran[report.step] = opt.seen[-1]
        assert opt.param_groups[0]["lr"] == 0.1  # outside the step: the schedule's value
    recovery = guard.engine.recovery
    assert recovery is not None and [r.at_step for r in recovery.log.records] == [12]
    assert ran[13] == ran[14] == ran[15] == pytest.approx(0.05)
    assert ran[9] == ran[16] == 0.1
    guard.close()


def test_spike_alert_trigger_rolls_back() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        spikes=sk.SpikeConfig(warmup_steps=10),
        recovery=sk.RecoveryConfig(enabled=True, snapshot_every=5, trigger=["spike_alert"], min_lookback=1),
    )
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    for i, x in enumerate(mlp_batches(40)):
        loss = model(x).pow(2).mean() * (1e4 if i == 30 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    assert len(events) == 1
    d = events[0].details
    assert d["trigger"] == "spike_alert" and d["trigger_step"] == 30
    assert d["restored_step"] == 25  # newest at or before 30 - min_lookback
    guard.close()


def test_snapshot_step_adds_no_host_sync() -> None:
    """A fused optimizer between logging steps: taking a (pending) snapshot reads nothing from the device."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(snapshot_every=4))
    data = mlp_batches(10)
    for x in data[:3]:  # the first step creates optimizer state (a one-time read); step 2 is not a logging step
        guard.backward(model(x).pow(2).mean())
        guard.step()
        guard.zero_grad()
    x = data[3]
    loss = model(x).pow(2).mean()
    with count_host_syncs() as counter:
        guard.backward(loss)
        guard.step()  # step 3 ends with 4 steps done: a snapshot, pending until step 5's read
    assert counter.count == 0, counter.sites
    recovery = guard.engine.recovery
    assert recovery is not None and [s.step for s in recovery.store.snapshots] == [1, 4]  # the first step's, then 4
    assert not recovery.store.snapshots[1].confirmed
    guard.zero_grad()
    for x in data[4:6]:
        guard.backward(model(x).pow(2).mean())
        guard.step()
        guard.zero_grad()
    assert recovery.store.snapshots[-1].step == 4 and recovery.store.snapshots[-1].confirmed  # step 3 was taken
    guard.close()


def test_recovery_off_keeps_state_and_divergence_as_before() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(skip=sk.SkipConfig(max_consecutive=3)))
    assert guard.engine.recovery is None and "recovery" not in guard.state_dict()["optimizers"][0]
    with pytest.raises(sk.TrainingDivergedError):
        for x in mlp_batches(10):
            guard.backward(model(x).pow(2).mean() * float("nan"))
            guard.step()
            guard.zero_grad()
    guard.close()


def test_several_optimizers_are_refused() -> None:
    model = mlp()
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[3].parameters(), lr=0.1)]
    with pytest.raises(ValueError, match="one optimizer"):
        sk.StabilityGuard(model, opts, diverged_only_config())


def test_config_is_strict_and_off_by_default() -> None:
    assert sk.StabilityConfig().recovery.enabled is False
    with pytest.raises(ValueError, match="snapshot_evry"):
        sk.RecoveryConfig(snapshot_evry=5)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        sk.RecoveryConfig(trigger=["nan"])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        sk.RecoveryConfig(trigger=[])


# ---------------------------------------------------------------------------------------------- Lightning


class _StatesByStep:
    """A Lightning callback (listed before StabilityCallback): the state at the end of each global step."""

    def __init__(self) -> None:
        import lightning.pytorch as pl

        class _Callback(pl.Callback):
            def on_train_batch_end(inner, trainer, module, outputs, batch, batch_idx) -> None:
                self.states[trainer.global_step] = _state(module, trainer.optimizers[0])

        self.callback = _Callback()
        self.states: dict[int, dict[str, Any]] = {}
        self.rollbacks: list[sk.Event] = []
        self.module: Any = None
        self.optimizer: Any = None

    def on_rollback(self, event: sk.Event) -> None:
        _assert_bitwise(self.states[event.details["restored_step"]], self.module, self.optimizer)
        self.rollbacks.append(event)


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_lightning_rollback_then_checkpoint_then_resume(tmp_path: Path, fused: bool) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    cfg = sk.StabilityConfig(
        log_every_n_steps=5,
        skip=sk.SkipConfig(max_consecutive=3),
        recovery=sk.RecoveryConfig(
            enabled=True,
            snapshot_every=5,
            trigger=["diverged"],
            skip_after=0,
            cooldown_steps=0,
            record_dir=str(tmp_path / "records"),
        ),
    )

    def trainer(max_steps: int, callbacks: list[Any]) -> pl.Trainer:
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=10, save_top_k=-1)
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            logger=False,
            callbacks=[*callbacks, checkpoint],
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )

    states = _StatesByStep()
    callback = StabilityCallback(cfg)
    callback.hooks.on("rollback", states.on_rollback)
    module = GPTModule(fused=fused, poison={12: float("nan"), 13: float("nan"), 14: float("nan")}, scheduler=True)
    first = trainer(30, [states.callback, callback])

    def keep_refs(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        states.module, states.optimizer = pl_module, trainer.optimizers[0]

    states.callback.on_fit_start = keep_refs  # type: ignore[method-assign]
    first.fit(module, gpt_dataloader(n_batches=40))
    assert first.global_step == 30
    assert len(states.rollbacks) == 1
    d = states.rollbacks[0].details
    assert d["restored_step"] == 10 and d["onset"] == 12 and d["skipped_to"] >= 14
    saved = json.loads((tmp_path / "records" / SKIPPED_FILE).read_text())
    assert saved["rollbacks"][0]["skipped_from"] == 10
    # the checkpoint written after the rollback (global step 20) resumes
    ckpt = tmp_path / "ckpt" / "epoch=0-step=20.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    resumed_callback = StabilityCallback(cfg)
    resumed = trainer(40, [resumed_callback])
    resumed.fit(GPTModule(fused=fused, scheduler=True), gpt_dataloader(n_batches=40), ckpt_path=str(ckpt))
    assert resumed.global_step == 40
    engine = resumed_callback.engines[0]
    assert engine.recovery is not None and [r.restored_step for r in engine.recovery.log.records] == [10]
    assert all(torch.isfinite(p).all() for p in resumed.lightning_module.parameters())


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            sk.StabilityConfig(
                spikes=sk.SpikeConfig(loss_drift_alert=None),
                recovery=sk.RecoveryConfig(enabled=True, trigger=["loss_drift"]),
            ),
            "loss_drift_alert",
        ),
        (
            sk.StabilityConfig(
                skip=sk.SkipConfig(max_consecutive=None), recovery=sk.RecoveryConfig(enabled=True, trigger=["diverged"])
            ),
            "nothing can diverge",
        ),
        (
            sk.StabilityConfig(
                spikes=sk.SpikeConfig(enabled=False),
                recovery=sk.RecoveryConfig(enabled=True, trigger=["spike_alert"]),
            ),
            "no spike_alert",
        ),
    ],
)
def test_triggers_that_cannot_fire_warn(config: sk.StabilityConfig, words: str) -> None:
    model = mlp()
    with pytest.warns(UserWarning, match=words):
        sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), config).close()


# ---------------------------------------------------------------------------------------------- HF Trainer


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_hf_trainer_rollback_then_checkpoint_then_resume(tmp_path: Path, optim: str) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabilitykit.integrations import stabilize

    rows = [{k: v[0] for k, v in batch.items()} for batch in token_batches(160, batch_size=1, seed=3)]
    poisoned = {6, 7, 8}
    states: dict[int, dict[str, Any]] = {}
    rollbacks: list[sk.Event] = []

    class Poison(TrainerCallback):
        """NaN logits during the optimizer steps that start at the poisoned global steps."""

        def __init__(self, model: nn.Module) -> None:
            self.active = False
            model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if self.active else None)

        def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.active = state.global_step in poisoned

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):  # type: ignore[no-untyped-def]
            self.active = False
            states[state.global_step] = _state(model, optimizer.optimizer)

    def run(root: Path, max_steps: int, resume: str | None = None) -> tuple[Trainer, Any]:
        model = tiny_llama()
        args = TrainingArguments(
            output_dir=str(root),
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=4,
            max_steps=max_steps,
            learning_rate=1e-2,
            lr_scheduler_type="linear",
            logging_steps=3,
            save_strategy="steps",
            save_steps=15,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
            optim=optim,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[Poison(model)])
        cfg = sk.StabilityConfig(
            skip=sk.SkipConfig(max_consecutive=3),
            recovery=sk.RecoveryConfig(
                enabled=True, snapshot_every=3, trigger=["diverged"], skip_after=0, cooldown_steps=0
            ),
        )
        callback = stabilize(trainer, cfg)

        def check(event: sk.Event) -> None:
            _assert_bitwise(states[event.details["restored_step"]], model, trainer.optimizer.optimizer)
            rollbacks.append(event)

        callback.hooks.on("rollback", check)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, callback

    trainer, _ = run(tmp_path, 20)
    assert trainer.state.global_step == 20 and len(rollbacks) == 1
    assert rollbacks[0].details["restored_step"] == 6 and rollbacks[0].details["onset"] == 6
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    checkpoint = tmp_path / "checkpoint-15"
    assert (checkpoint / "trainer_state.json").exists()
    poisoned.clear()
    resumed, callback = run(tmp_path, 25, resume=str(checkpoint))
    assert resumed.state.global_step == 25
    assert callback.engine is not None and callback.engine.recovery is not None
    assert [r.restored_step for r in callback.engine.recovery.log.records] == [6]


def test_rollback_is_a_warning_log_line_and_a_wandb_alert(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import wandb

    from stabilitykit.sinks import WandbRunFile, WandbSink

    run = wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline", reinit="create_new")
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(), sinks=[WandbSink(run)])
    with caplog.at_level(logging.WARNING, logger="stabilitykit"):
        for i, x in enumerate(mlp_batches(20)):
            loss = model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
    guard.close()
    run.finish()
    lines = [r for r in caplog.records if r.levelno == logging.WARNING and "rolled back" in r.getMessage()]
    assert len(lines) == 1 and "steps 8..12" in lines[0].getMessage()
    logged = WandbRunFile.read(Path(run.dir).parent)
    titles = [a["title"] for a in logged.alerts]
    assert "stabilitykit: rollback at step 12" in titles
    alert = logged.alerts[titles.index("stabilitykit: rollback at step 12")]
    assert alert["level"] == "WARN" and "restored the state before step 8" in alert["text"]
    assert [r["trainer/global_step"] for r in logged.history if "stability/events/rollback" in r] == [12]


def test_grad_scaler_and_rng_come_back_with_the_snapshot() -> None:
    """A streak of bad batches (data guard, mode "skip") under a GradScaler: the scale, its growth
    tracker and (restore_rng=True) the torch generator are the snapshot's after the rollback."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    cfg = sk.StabilityConfig(
        log_every_n_steps=5,
        skip=sk.SkipConfig(max_consecutive=3),
        data=sk.DataGuardConfig(mode="skip"),
        recovery=sk.RecoveryConfig(
            enabled=True, snapshot_every=4, trigger=["diverged"], skip_after=0, cooldown_steps=0, restore_rng=True
        ),
    )
    guard = sk.StabilityGuard(model, opt, cfg, scaler=scaler)
    saved: dict[int, tuple[float, int, torch.Tensor]] = {}
    seen: list[tuple[sk.Event, float, int, torch.Tensor]] = []

    def on_rollback(event: sk.Event) -> None:
        seen.append((event, scaler.get_scale(), scaler.state_dict()["_growth_tracker"], torch.get_rng_state()))

    guard.hooks.on("rollback", on_rollback)
    for i, x in enumerate(mlp_batches(20)):
        if 10 <= i < 13:
            x = x * float("nan")  # a bad batch: skipped by the data guard before its forward
        guard.check_batch(x)
        loss = model(x).pow(2).mean()
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
        saved[guard.step_count] = (scaler.get_scale(), scaler.state_dict()["_growth_tracker"], torch.get_rng_state())
        torch.rand(1)  # the loop draws from the generator every step
    assert len(seen) == 1
    event, scale, tracker, rng = seen[0]
    restored = event.details["restored_step"]
    assert event.details["trigger"] == "diverged" and restored == 8
    assert (scale, tracker) == saved[restored][:2]
    assert saved[restored][0] != saved[12][0]  # the scale moved after the snapshot: the restore is visible
    assert torch.equal(rng, saved[restored][2])
    guard.close()


def test_loss_drift_and_spike_alert_are_told_apart() -> None:
    """Only the alerts of the configured rule roll back (the drift rule is named in the alert's details)."""
    from stabilitykit.spikes import DRIFT_RULE

    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = sk.StabilityConfig(
        log_every_n_steps=1,
        spikes=sk.SpikeConfig(loss_drift_alert=8.0),
        recovery=sk.RecoveryConfig(enabled=True, snapshot_every=4, trigger=["loss_drift"]),
    )
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("rollback", events.append)
    for i, x in enumerate(mlp_batches(20)):
        guard.backward(model(x).pow(2).mean())
        guard.step()
        guard.zero_grad()
        # alerts as the ledger hands them to the library's observers (recovery never reads the user's bus)
        if i == 9:  # an alert of another rule: no rollback
            for observe in guard.engine.readout.observers:
                observe(sk.Event("spike_alert", 9, "loss jumped", {"rule": "loss"}))
        if i == 14:  # the drift rule's alert, as the spike monitor raises it
            for observe in guard.engine.readout.observers:
                observe(sk.Event("spike_alert", 14, "loss climbed", {"rule": DRIFT_RULE}))
        if i == 16:  # the same alert on the user's event bus is output only: it triggers nothing
            guard.hooks.emit(sk.Event("spike_alert", 16, "loss climbed", {"rule": DRIFT_RULE}))
    assert [(e.details["trigger"], e.details["trigger_step"], e.details["restored_step"]) for e in events] == [
        ("loss_drift", 14, 12)
    ]
    guard.close()


def test_schedule_step_follows_the_restored_scheduler() -> None:
    """``guard.schedule_step`` (for an LR set by hand) is the restored scheduler's count after a rollback."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    guard = sk.StabilityGuard(model, opt, diverged_only_config(), scheduler=sched)
    at_rollback: list[tuple[int, int, int]] = []
    guard.hooks.on("rollback", lambda e: at_rollback.append((guard.step_count, guard.schedule_step, sched.last_epoch)))
    for i, x in enumerate(mlp_batches(20)):
        guard.backward(model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0))
        guard.step()
        guard.zero_grad()
        assert guard.schedule_step == sched.last_epoch
    assert at_rollback == [(13, 8, 8)]  # the step count goes on; the schedule is the snapshot's (step 8)
    guard.close()


# ---------------------------------------------------------------------------------------------- Accelerate


def test_accelerate_guard_rolls_back_with_accumulation() -> None:
    """AccelerateGuard (a StabilityGuard) inherits recovery: accumulation over 2 micro-batches, bf16,
    AcceleratedOptimizer and AcceleratedScheduler restored in place."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from stabilitykit.integrations import AccelerateGuard

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
        model = tiny_llama()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        guard = AccelerateGuard(accelerator, model, optimizer, diverged_only_config(), scheduler=scheduler)
        inner = optimizer.optimizer
        recorder = Recorder(guard, model, inner)
        for i, batch in enumerate(token_batches(40, batch_size=2, seed=1)):
            step = i // 2
            with accelerator.accumulate(model):
                loss = model(**batch).loss * (float("nan") if 10 <= step < 13 else 1.0)
                guard.backward(loss)
                report = guard.step()
                guard.zero_grad()
            if report is not None:
                recorder.record(guard, report)
        assert guard.step_count == 20 and len(recorder.rollbacks) == 1
        assert recorder.rollbacks[0].details["restored_step"] == 8
        assert scheduler.scheduler.last_epoch < 20 - 3  # the schedule is the snapshot's, behind the step count
        guard.close()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_fabric_guard_rolls_back() -> None:
    from lightning.fabric import Fabric

    from stabilitykit.integrations import FabricGuard

    fabric = Fabric(accelerator="cpu", devices=1)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=2, gamma=0.9)
    guard = FabricGuard(fabric, model, optimizer, diverged_only_config(), scheduler=scheduler)
    recorder = Recorder(guard, model, optimizer.optimizer)
    for i, x in enumerate(mlp_batches(20)):
        guard.backward(model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0))
        recorder.record(guard, guard.step())
        guard.zero_grad()
    assert len(recorder.rollbacks) == 1 and recorder.rollbacks[0].details["restored_step"] == 8
    assert guard.step_count == 20 and guard.schedule_step == scheduler.last_epoch
    guard.close()


def test_snapshots_and_host_buffers_stay_bounded_over_a_long_run() -> None:
    """Nothing grows per step: ``keep`` snapshots, a few pending, and a pool of reused host buffers."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, diverged_only_config(snapshot_every=2, keep=2))
    recovery = guard.engine.recovery
    assert recovery is not None
    held, pooled = [], []
    data = mlp_batches(8)
    for i in range(400):
        guard.backward(model(data[i % 8]).pow(2).mean())
        guard.step()
        guard.zero_grad()
        held.append(len(recovery.store.snapshots))
        pooled.append(recovery.store.copier.pooled)
    assert max(held) <= 2 + 3  # keep, plus the pending ones of one logging interval (5 steps, every 2)
    assert max(pooled[200:]) == max(pooled[:200])  # the pool stopped growing early
    per_snapshot = recovery.store.snapshots[-1].nbytes
    assert recovery.snapshot_bytes <= 5 * per_snapshot
    guard.close()


def test_a_rollback_is_never_left_out_by_the_log_rate_limit(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from stabilitykit.run_log import EventLog

    log = EventLog(first=3, every=100)
    with caplog.at_level(logging.WARNING, logger="stabilitykit"):
        for step in range(10):
            log(sk.Event("skipped", step, f"step {step} skipped: nonfinite_loss"))
        log(sk.Event("rollback", 10, "rolled back after diverged at step 9"))
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4 and messages[-1].startswith("rolled back after diverged")


def test_a_param_group_added_mid_run_drops_the_old_snapshots() -> None:
    """Fine-tuning style: the head trains first, the body joins at step 9. The snapshots of steps 4 and
    8 hold the old set of parameters, so a divergence right after has nothing to go back to."""
    model = mlp()
    opt = torch.optim.AdamW(model[3].parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    recovery = guard.engine.recovery
    assert recovery is not None
    with pytest.raises(sk.TrainingDivergedError) as info:
        for i, x in enumerate(mlp_batches(30)):
            if i == 9:
                assert [s.step for s in recovery.store.snapshots] == [4, 8]
                opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
            guard.backward(model(x).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0))
            guard.step()
            guard.zero_grad()
    assert not isinstance(info.value, sk.RollbackLimitError) and info.value.step == 12
    assert recovery.store.snapshots == []  # step 11 was skipped: no snapshot of the new set yet
    guard.close()


def test_a_param_group_added_mid_run_is_restored_with_the_new_set() -> None:
    model = mlp()
    opt = torch.optim.AdamW(model[3].parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, diverged_only_config())
    recorder = Recorder(guard, model, opt)
    for i, x in enumerate(mlp_batches(30)):
        if i == 9:
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
        guard.backward(model(x).pow(2).mean() * (float("nan") if 14 <= i < 17 else 1.0))
        recorder.record(guard, guard.step())
        guard.zero_grad()
    assert [e.details["restored_step"] for e in recorder.rollbacks] == [12]  # bitwise, both groups
    guard.close()


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw_fused"])
def test_skip_after_skips_the_next_batches_without_a_sync_or_a_streak(fused: bool) -> None:
    """``skip_after=5``: after the rollback the next five batches are measured, not trained on
    (parameters and optimizer state unchanged across them, the scheduler held), with no host
    sync and no divergence streak; then training resumes. Recorded in the event and the state."""
    cfg = diverged_only_config(skip_after=5)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched)
    recorder = Recorder(guard, model, opt)
    syncs, reasons, lrs = {}, {}, {}
    for i, batch in enumerate(token_batches(30)):
        loss = _llama_loss(model, batch)
        guard.backward(loss * float("nan") if i in range(10, 14) else loss)
        with count_host_syncs() as counter:
            report = guard.step()
        guard.zero_grad()
        syncs[i], lrs[i] = counter.count, opt.param_groups[0]["lr"]
        reasons[i] = report.reason  # outside the counted block: it may read a pending decision
        recorder.record(guard, report)
    assert len(recorder.rollbacks) == 1
    event = recorder.rollbacks[0]
    at = event.step
    ahead = range(at + 1, at + 6)
    assert event.details["skip_ahead_to"] == at + 5 and f"steps {at + 1}..{at + 5} are skipped too" in event.message
    assert [reasons[i] for i in ahead] == ["after_rollback"] * 5
    before, after = recorder.states[at + 1], recorder.states[at + 6]
    for name, value in before["params"].items():
        assert torch.equal(_bits(value), _bits(after["params"][name])), f"{name} trained on a skipped-ahead batch"
    assert len({lrs[i] for i in ahead}) == 1, "the LR schedule waits over the skipped batches"
    assert all(syncs[i] == 0 for i in ahead if (i % 5) != 0), syncs
    assert reasons[at + 6] != "after_rollback"
    final = recorder.states[30]["params"]["lm_head.weight"]
    assert not torch.equal(_bits(after["params"]["lm_head.weight"]), _bits(final)), "training resumed after them"
    state = guard.state_dict()["optimizers"][0]
    assert state["recovery"]["skip_until"] == at + 6
    assert state["recovery"]["rollbacks"][0]["skip_ahead_to"] == at + 5
    assert sum(r == "after_rollback" for r in reasons.values()) == 5
    nonfinite_skips = sum(r is not None and r != "after_rollback" for r in reasons.values())
    summary = guard.summary()  # the skipped-ahead batches are counted apart from the bad steps
    assert summary.skipped == nonfinite_skips and summary.skipped_ahead == 5 and summary.rollbacks == 1
    guard.close()


def test_batches_skipped_ahead_never_fire_the_next_trigger() -> None:
    """Bad data that goes on past the rollback (huge losses on the skipped-ahead batches) raises no
    spike alert and no second rollback: those batches are not scored by the detectors."""
    cfg = sk.StabilityConfig(
        log_every_n_steps=5,
        skip=sk.SkipConfig(max_consecutive=3),
        recovery=sk.RecoveryConfig(
            enabled=True, snapshot_every=4, keep=2, trigger=["diverged", "spike_alert"], skip_after=5
        ),
    )
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = sk.StabilityGuard(model, opt, cfg)
    alerts: list[sk.Event] = []
    rollbacks: list[sk.Event] = []
    guard.hooks.on("spike_alert", alerts.append)
    guard.hooks.on("rollback", rollbacks.append)
    for i, batch in enumerate(token_batches(40)):  # after the detectors' 20 warm-up steps
        loss = _llama_loss(model, batch)
        if i in range(24, 27):
            loss = loss * float("nan")  # the streak: a rollback at step 26
        elif i in range(27, 32):
            loss = loss * 1e4  # the bad data goes on over the five skipped-ahead batches
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    assert [e.step for e in rollbacks] == [26]
    assert not [e for e in alerts if 27 <= e.step <= 31], alerts
