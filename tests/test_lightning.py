"""StabilityCallback with a real Trainer and a tiny GPT LightningModule."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision
from lightning_checks import StateAt

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.testing.lightning_gpt import GPTModule, ManualGPTModule, gpt_dataloader
from tests.time_limits import run

CFG = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0))


def _trainer(tmp_path: Path, callbacks: list, **kwargs: Any) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=20,
        logger=CSVLogger(tmp_path, name="csv"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=5,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **defaults)


class SelfLogging(GPTModule):
    """Logs its own loss with ``self.log``, as LightningModules do."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


@pytest.mark.parametrize("fused", [True, False])
def test_nan_step_is_skipped_and_metrics_reach_the_logger(tmp_path: Path, fused: bool) -> None:
    callback = StabilityCallback(CFG)
    snap = StateAt(7)
    module = SelfLogging(fused=fused, poison={7: float("nan")}, scheduler=True)
    trainer = _trainer(tmp_path, [callback, snap])
    trainer.fit(module, gpt_dataloader())
    snap.assert_unchanged()
    if not fused:  # a fused optimizer's scheduler catches up at the next logging step
        assert snap.before["lr"] == snap.after["lr"]
    engine = callback.engine
    assert engine is not None and int(engine.counters.skipped_total) == 1
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 19  # 20 steps, one skipped
    rows = list(csv.DictReader((Path(trainer.logger.log_dir) / "metrics.csv").open()))
    logged = [r for r in rows if r.get("stability/grad_norm/total")]
    assert [int(r["step"]) for r in logged] == [4, 9, 14, 19]  # Lightning's own logging rows
    own = [int(r["step"]) for r in rows if r.get("train_loss")]
    assert own == [4, 9, 14, 19], "the stability metrics share rows with the module's own self.log"
    assert float(logged[0]["stability/skipped/total"]) == 0.0 and float(logged[1]["stability/skipped/total"]) == 1.0
    assert "stability/grad_norm/model.blocks.0" in rows[0]


def test_gradient_clip_val_conflict_names_both_settings(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, [StabilityCallback(CFG)], gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"gradient_clip_val=1\.0.*ClipConfig\(mode='fixed'\)"):
        trainer.fit(GPTModule(), gpt_dataloader(4))


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-scaler"])
@pytest.mark.parametrize("fused", [True, False])
def test_mixed_precision_and_accumulation(tmp_path: Path, precision: str, fused: bool) -> None:
    kwargs: dict[str, Any] = {"accumulate_grad_batches": 2, "max_steps": 10}
    if precision == "fp16-scaler":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    else:
        kwargs["precision"] = "bf16-mixed"
    callback = StabilityCallback(CFG)
    snap = StateAt(4)
    module = GPTModule(fused=fused, poison={4: float("inf")})
    trainer = _trainer(tmp_path, [callback, snap], **kwargs)
    trainer.fit(module, gpt_dataloader(40))
    assert trainer.global_step == 10
    snap.assert_unchanged()
    engine = callback.engine
    assert engine is not None and int(engine.counters.skipped_total) >= 1
    assert callback.last_report is not None
    assert 0 < float(callback.last_report.grad_norm) < 50  # unscaled norms, even with fused + fp16
    # an Inf *loss* is a bad batch even under a GradScaler (the loss is computed before any scaling):
    # it counts toward divergence and is never mistaken for an fp16 overflow
    assert engine.counters.last_bad_reason == "nonfinite_loss"
    assert int(engine.counters.overflow_total) == 0


def test_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive", warmup_steps=4), log_every_n_steps=3)

    def fit(max_steps: int, ckpt: str | None, root: Path) -> StabilityCallback:
        callback = StabilityCallback(cfg)
        trainer = _trainer(root, [callback], max_steps=max_steps, enable_checkpointing=True, logger=False)
        # one repeated batch: the resumed run sees the same data wherever Lightning restarts the epoch
        data = gpt_dataloader(8, repeat=True)
        trainer.fit(GPTModule(poison={3: float("nan"), 12: float("nan")}), data, ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(root / "mid.ckpt")
        return callback

    straight = fit(16, None, tmp_path / "a")
    fit(8, None, tmp_path / "b")
    resumed = fit(16, str(tmp_path / "b" / "mid.ckpt"), tmp_path / "c")
    a, b = (cb.state_dict()["optimizers"][0]["engine"] for cb in (straight, resumed))
    assert a["step"] == b["step"] == 16
    assert a["ledger"]["counters"] == b["ledger"]["counters"]
    for name, value in a["clip"].items():
        torch.testing.assert_close(value, b["clip"][name], rtol=1e-6, atol=1e-7, msg=f"clip.{name}")
    detector_a, detector_b = a["ledger"]["spikes"]["detector"], b["ledger"]["spikes"]["detector"]
    for name, value in detector_a.items():
        torch.testing.assert_close(value, detector_b[name], rtol=1e-6, atol=1e-7, msg=f"detector.{name}")
    assert a["journal"]["infos"] == b["journal"]["infos"]
    assert a["ledger"]["counters"]["skipped_total"] == 2
    ckpt = torch.load(tmp_path / "b" / "mid.ckpt", weights_only=False)
    assert StabilityCallback(cfg).state_key in ckpt["callbacks"]


def test_two_instances_keep_separate_state(tmp_path: Path) -> None:
    first, second = StabilityCallback(CFG, name="main"), StabilityCallback(CFG, name="shadow")
    assert first.state_key != second.state_key


def _two_process_lightning(
    tmp_path: Path, strategy: str, recovery: bool = False, rule: bool = False
) -> list[dict[str, Any]]:
    script = Path(__file__).parent / "lightning_ddp_script.py"
    env = {
        **os.environ,
        "SK_OUT": str(tmp_path),
        "SK_STRATEGY": strategy,
        "SK_RECOVERY": "1" if recovery else "0",
        "SK_RULE": "1" if rule else "0",
        "PYTHONPATH": str(Path(__file__).parent.parent),
    }
    proc = run(
        [sys.executable, str(script)],
        "lightning_ddp_script",
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_nan_on_one_rank(tmp_path: Path, strategy: str) -> None:
    """DDP with rerun on: step 5's NaN on rank 1 comes again when the step is computed again (reproducible,
    skipped on both ranks); a NaN in rank 1's logits at step 8, once, is transient, rank 1 named, the step taken,
    and the final weights equal bitwise those of a second fit in the same processes without step 8's fault."""
    results = _two_process_lightning(tmp_path, strategy)
    assert results[0]["checksum"] == results[1]["checksum"]
    assert results[0]["skipped"] == results[1]["skipped"] == 1
    assert results[0]["steps"] == results[1]["steps"] == 12
    if strategy == "ddp":
        for result in results:
            assert result["reruns"] == [[5, "reproducible", None], [8, "transient", 1]]
            assert [step for step, _ in result["skipped_events"]] == [5]
            assert result["weights"] == result["clean_weights"]


def test_two_processes_a_custom_rule_on_one_rank_skips_both_and_a_recorded_metric_is_summed(tmp_path: Path) -> None:
    """A user's skip rule raised on rank 1 only (from training_step, through sk.record) skips the step on
    both ranks; a metric recorded with reduce="sum" is logged agreed (1 + 2) on both. The same launch:
    replica checks under Lightning DDP, one weight of rank 1 corrupted before step 6, reported at step 7's
    check (and 11's) on both ranks (two replicas: the second, rank 1, is named); the other tensors stay equal.
    Rerun on: a one-time flip in rank 1's local gradient at step 9 is judged transient, naming rank 1."""
    results = _two_process_lightning(tmp_path, "ddp", rule=True)
    for result in results:
        assert result["skipped_events"] == [[5, "quality_gate"]]
        assert result["skipped"] == 1
        assert result["rank_id"] == [3.0]
        corrupted = {"rank": 1, "tensor": "model.blocks.0.mlp.fc.weight"}  # it stays corrupted: every check after
        assert result["mismatches"] == [{"step": 7, **corrupted}, {"step": 11, **corrupted}]
        assert result["reruns"] == [[9, "transient", 1]]  # rank 1's local gradient, before the all-reduce
    assert results[0]["checksum"] == results[1]["checksum"]


def test_two_processes_roll_back_together_on_one_ranks_nan_streak(tmp_path: Path) -> None:
    """Recovery under Lightning DDP: a NaN streak on rank 1 only rolls both ranks back at the same step."""
    results = _two_process_lightning(tmp_path, "ddp", recovery=True)
    assert len(results[0]["rollbacks"]) == 1
    assert results[0]["rollbacks"] == results[1]["rollbacks"]
    assert results[0]["rollbacks"][0]["onset"] == 5
    assert results[0]["checksum"] == results[1]["checksum"]  # the replicas are still identical
    assert results[0]["finite"] and results[1]["finite"]
    assert results[0]["steps"] == 12


def test_manual_optimization_skips_too(tmp_path: Path) -> None:
    callback = StabilityCallback(CFG)
    snap = StateAt(6)
    trainer = _trainer(tmp_path, [callback, snap], max_steps=12)
    trainer.fit(ManualGPTModule(fused=False, poison={6: float("nan")}), gpt_dataloader(20))
    snap.assert_unchanged()
    assert callback.engine is not None and int(callback.engine.counters.skipped_total) == 1
    assert callback.last_report is not None and float(callback.last_report.grad_norm) > 0


def test_data_guard_raise_names_the_label_index(tmp_path: Path) -> None:
    cfg = sk.StabilityConfig(data=sk.DataGuardConfig(mode="raise", num_classes=64, label_keys=[1]))
    loader = gpt_dataloader(6)
    _xs, ys = loader.dataset.tensors  # type: ignore[attr-defined]
    ys[8 * 4 + 2, 5] = 70  # batch 4, row 2
    trainer = _trainer(tmp_path, [StabilityCallback(cfg)], max_steps=6)
    with pytest.raises(sk.BadBatchError, match=r"step 4: batch\[1\]\[2\]\[5\] is 70, outside \[0, 64\)"):
        trainer.fit(GPTModule(), loader)


def test_on_nonfinite_replay_in_lightning_names_the_source(tmp_path: Path) -> None:
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode="on_nonfinite"))
    callback = StabilityCallback(cfg)
    events: list[sk.Event] = []
    callback.hooks.on("nonfinite", events.append)
    trainer = _trainer(tmp_path, [callback], max_steps=8)
    trainer.fit(GPTModule(poison={5: float("nan")}), gpt_dataloader(8))
    record = callback.last_nonfinite
    assert record is not None and record.step == 5
    assert record.source is not None and "lightning_gpt.py" in record.source and "factor" in record.source
    assert [e.step for e in events] == [5] and events[0].details.get("module") == record.module


def test_precision_event_says_the_fp16_scaler_run_uses_loss_scaling(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    log = tmp_path / "run.jsonl"
    callback = StabilityCallback(CFG, sinks=[sk.sinks.JsonlSink(log)])
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    trainer = _trainer(tmp_path, [callback], max_steps=2, plugins=plugins, logger=False)
    trainer.fit(GPTModule(), gpt_dataloader(4))
    _, events = sk.sinks.read_jsonl(log)
    (precision,) = [e for e in events if e["event"] == "precision"]
    assert precision["grad_scaler"] is True and "bf16" not in precision["message"]
    assert "lightning_precision" not in precision and "use_grad_scaler" not in precision
