"""The examples run and do what their docstrings say."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import stabilitykit as sk
from tests.time_limits import run, timeout_for, waits_for

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(timeout_for("demo"))
def test_demo_skips_the_nan_batch_and_clips_the_spike(tmp_path, capsys) -> None:
    demo = _load("demo")
    summary = demo.main(["--steps", "210", "--out", str(tmp_path)])
    assert summary["steps"] == 210 and summary["skipped"] == 1
    assert summary["clipped"] >= 1 and summary["max_grad_norm"] > 100
    assert summary["nonfinite_source"] == "backward of lm_head at step 120"
    assert summary["last_loss"] < summary["first_loss"] / 2
    rows, events = sk.sinks.read_jsonl(tmp_path / "stability.jsonl")
    assert len(rows) == 22 and rows[-1]["step"] == 209  # and the final row from close()
    assert any(e["event"] == "skipped" and e["step"] == 120 for e in events)
    out = capsys.readouterr().out
    assert "NaN came from" in out
    assert "  step  200/210  loss" in out  # progress while it runs

    # The README's sample output stays true: the same summary labels and the same events.
    readme = (EXAMPLES.parent / "README.md").read_text()
    sample = readme.split("stabilitykit demo: tiny GPT, CPU\n", 1)[1].split("```", 1)[0]
    summary_block = out.split("stabilitykit demo: tiny GPT, CPU\n", 1)[1]

    def labels(block: str) -> list[str]:
        return [line[:19].strip() for line in block.splitlines() if line.startswith("  ")]

    def events_line(block: str) -> str:
        return next(line for line in block.splitlines() if line.strip().startswith("events"))

    assert labels(sample) == labels(summary_block)
    assert events_line(sample) == events_line(summary_block)


def test_plain_loop_example_resumes(tmp_path, capsys) -> None:
    _load("plain_loop").main(["--steps", "24", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "resumed from" in out and "at step 12" in out
    rows, _ = sk.sinks.read_jsonl(tmp_path / "stability.jsonl")
    assert [r["step"] for r in rows] == [0, 10, 20, 23]  # 23: the final row from close()


def test_lightning_example(tmp_path, capsys) -> None:
    callback = _load("lightning_gpt").main(["--steps", "45", "--out", str(tmp_path)])
    assert callback.engine is not None
    assert callback.summary().skipped == 1
    assert callback.summary().clipped >= 1
    assert "metrics.csv" in capsys.readouterr().out


def test_numerics_example_names_the_nan_source_and_skips_the_bad_batch() -> None:
    result = _load("numerics").main(["--steps", "30"])
    assert result["summary"]["skipped"] == 2
    record = result["record"]
    assert record.module == "blocks.2.mlp" and record.step == 15 and "numerics.py" in record.source
    assert [e.step for e in result["events"] if e.kind == "bad_batch"] == [25]
    assert result["metrics"]["stability/attention/max_logit"] > 0


def test_precision_report_example(tmp_path) -> None:
    report = _load("precision_report").main(["--out", str(tmp_path)])
    assert set(report.variants) == {"bf16", "fp16", "tf32", "bf16 + fp32 head"}
    assert (tmp_path / "precision.json").exists() and (tmp_path / "precision.png").exists()


def test_wandb_offline_example(tmp_path) -> None:
    result = _load("wandb_offline").main(["--steps", "90", "--out", str(tmp_path)])
    titles = [a["title"] for a in result["logged"].alerts]
    assert "stabilitykit: nonfinite at step 40" in titles and "stabilitykit: spike_alert at step 80" in titles
    assert result["report"].exists()


def test_hf_trainer_example(tmp_path) -> None:
    result = _load("hf_trainer").main(["--steps", "8", "--out", str(tmp_path)])
    skips = [r for r in result["log_history"] if "stability/events/skipped" in r]
    assert [r["stability/events/skipped_step"] for r in skips] == [5]
    assert result["skipped"] == 1 and result["resumed_skipped"] == 1 and result["resumed_steps"] == 12


def test_accelerate_loop_example(tmp_path) -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # Accelerate's process-wide singletons
    GradientState._reset_state()
    try:
        result = _load("accelerate_loop").main(["--steps", "8", "--out", str(tmp_path)])
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert result["summary"]["steps"] == 8 and result["summary"]["skipped"] == 1
    assert [bool(r.skipped) for r in result["reports"]].index(True) == 4
    assert result["restored_step"] == 4


def test_fabric_loop_example(tmp_path) -> None:
    result = _load("fabric_loop").main(["--steps", "8", "--out", str(tmp_path)])
    assert [(r["steps"], r["skipped"]) for r in result["summary"]["optimizers"]] == [(8, 0), (8, 1)]
    assert result["restored_step"] == 4
    rows, events = sk.sinks.read_jsonl(tmp_path / "stability.jsonl")
    assert any(e["event"] == "skipped" and e["step"] == 5 for e in events)
    assert any("stability/opt1/grad_norm/total" in r for r in rows)


def test_qk_clip_example_holds_the_logits_that_run_away_without_it(capsys) -> None:
    result = _load("qk_clip").main(["--steps", "40", "--tau", "8"])
    free, clipped = result["free"]["max_logit"], result["clipped"]["max_logit"]
    assert max(free[-10:]) > 25 and max(clipped[-10:]) < 14
    assert sum(r.get("stability/qk_clip/heads_clipped", 0) for r in result["clipped"]["rows"]) > 0
    assert "with QK-clip" in capsys.readouterr().out


def test_per_tensor_clipping_example_spares_the_healthy_tensors() -> None:
    results = _load("per_tensor_clipping").main(["--steps", "30", "--spike-at", "20"])
    fixed, per_tensor = results["global (fixed)"], results["per-tensor (AdaGC)"]
    assert fixed["others_kept"] < 0.05 and fixed["spiked_vs_usual"] > 5
    assert per_tensor["others_kept"] > 0.5 and per_tensor["spiked_vs_usual"] < 1.2


def test_update_ratio_example(tmp_path) -> None:
    result = _load("update_ratio").main(["--steps", "40", "--out", str(tmp_path)])
    sane, high = (result["runs"][lr] for lr in (3e-4, 3e-2))
    assert list(sane["ratios"]) == list(range(5, 40, 5))  # the update of steps 4, 9, ... logged at 5, 10, ...
    assert sane["ratios"][35] == 0.0 and high["ratios"][35] == 0.0  # step 34 was skipped
    assert 1e-4 < sane["median"] < 3e-3 and high["median"] > 10 * sane["median"]
    assert result["report"].stat().st_size > 30_000


def test_hand_set_lr_example_holds_the_schedule_through_skips(capsys) -> None:
    example = _load("hand_set_lr")
    for fused in ([], ["--fused"]):
        result = example.main(["--steps", "50", *fused])
        assert result["hand"] == result["scheduler"] and result["same_weights"]
        hand = result["hand"]
        # the schedule waited once after the skip at step 23 (at once, or at the next logging read when fused)
        assert any(hand[i] == hand[i + 1] for i in range(23, 33))
    assert "identical LRs: True, identical weights: True" in capsys.readouterr().out


@waits_for("example_recovery_ddp")
def test_recovery_ddp_example_rolls_both_ranks_back_together(tmp_path) -> None:
    script = Path(__file__).parent.parent / "examples" / "recovery_ddp.py"
    proc = run(
        [sys.executable, str(script), "--out", str(tmp_path)], "example_recovery_ddp", capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every rank rolled back together: True" in proc.stdout
    assert "replicas identical: True" in proc.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["restored_step"] for r in ranks[0]["rollbacks"]] == [50]
    assert (tmp_path / "rank0" / "skipped_batches.json").exists()


def test_recovery_example_rolls_back_and_goes_on(tmp_path, capsys) -> None:
    result = _load("recovery").main(["--steps", "90", "--out", str(tmp_path)])
    assert len(result["rollbacks"]) == 1
    record = result["skipped"]["rollbacks"][0]
    assert record["trigger"] == "diverged" and record["onset"] == 50 and record["restored_step"] == 40
    assert result["summary"]["steps"] == 90
    assert all(loss == loss for loss in result["losses"])  # finite again after the rollback
    _, events = sk.sinks.read_jsonl(tmp_path / "stability.jsonl")
    assert [e["restored_step"] for e in events if e["event"] == "rollback"] == [40]
    assert "rollback: rolled back after diverged" in capsys.readouterr().out


def test_custom_rule_example_skips_the_collapsed_router_step(tmp_path, capsys) -> None:
    example = _load("custom_rule")
    result = example.main(["--steps", "20", "--out", str(tmp_path)])
    assert result["steps"] == 20
    assert [tuple(s) for s in result["skipped"]] == [(example.COLLAPSE_AT, "router_collapse")]
    assert len(result["logged_entropy"]) == 5 and all(0.5 < e < 1.4 for e in result["logged_entropy"])
    assert "reason=router_collapse weights unchanged=True" in capsys.readouterr().out


def test_moe_routers_example_names_the_collapsed_router_after_the_bias() -> None:
    example = _load("moe_routers")
    result = example.main(["--steps", "36", "--bias-at", "30"])
    events = result["events"]
    assert events and all(e.step >= 30 for e in events)
    assert events[0].details["router"] == "model.layers.0.mlp.gate" and example.EXPERT in events[0].details["experts"]
    assert result["loads"][29] < 1.5 < result["loads"][30]


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed: pip install 'stabilitykit[deepspeed]' (bash scripts/setup.sh installs it)",
)
@waits_for("example_deepspeed_loop")
def test_deepspeed_example_skips_one_ranks_nan_on_every_rank(tmp_path) -> None:
    script = Path(__file__).parent.parent / "examples" / "deepspeed_loop.py"
    proc = run(
        [sys.executable, str(script), "--steps", "18", "--out", str(tmp_path)],
        "example_deepspeed_loop",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "every rank skipped the NaN steps: True" in proc.stdout
    # the streak at steps 12-13 diverged; rolled back at logging step 15 to the snapshot before step 12
    assert "to the same snapshot: True [[15, 12]]" in proc.stdout
    assert "parameters finite and identical on every rank: True" in proc.stdout
    assert "global norm equal to DeepSpeed's own: True" in proc.stdout
    # 18 steps: 11 applied before the snapshot, then 14-15 undone by the rollback, 16-17 applied
    assert "[13, 13]" in proc.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed: pip install 'stabilitykit[deepspeed]' (bash scripts/setup.sh installs it)",
)
@waits_for("example_deepspeed_hf_trainer")
def test_deepspeed_hf_trainer_example_skips_one_ranks_nan_on_every_rank(tmp_path) -> None:
    """The Trainer with deepspeed= (ZeRO-2) under torchrun on 2 CPU processes, started by the example itself."""
    script = Path(__file__).parent.parent / "examples" / "deepspeed_hf_trainer.py"
    proc = run(
        [sys.executable, str(script), "--steps", "6", "--out", str(tmp_path)],
        "example_deepspeed_hf_trainer",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 6 optimizer steps, step 2 skipped on both ranks: DeepSpeed's engine counts 5
    assert "rank 0: skipped steps [2], engine steps 5" in proc.stdout
    assert "rank 1: skipped steps [2], engine steps 5" in proc.stdout
    assert "every rank skipped step 2 (NaN on rank 1 only): True" in proc.stdout
    assert "parameters finite and identical on every rank: True" in proc.stdout
    assert "guard: 6 steps, 1 skipped" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/cuda runs the example for real")
def test_deepspeed_lightning_example_says_it_needs_cuda(capsys) -> None:
    """Without CUDA the example runs nothing and says why in one line (tests/cuda runs it on a GPU)."""
    assert _load("deepspeed_lightning").main([]) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "Lightning's DeepSpeed strategy needs CUDA GPUs" in out and "nothing was run" in out


def test_fp8_example_reports_fp8_rows_and_warns_on_the_massive_activation(tmp_path, capsys) -> None:
    pytest.importorskip("torchao.float8")
    result = _load("fp8").main(["--steps", "30", "--out", str(tmp_path), "--fallback"])
    assert len(result["converted"]) == 15 and result["fp8_rms_rel"] > 3 * result["bf16_rms_rel"]
    assert result["warnings"] == [(25, "model.layers.0.mlp.down_proj", "input", True)]
    assert "fp8 vs fp32: forward rms_rel" in capsys.readouterr().out
    _, events = sk.sinks.read_jsonl(tmp_path / "stability.jsonl")
    assert [e["layer"] for e in events if e["event"] == "fp8_warning"] == ["model.layers.0.mlp.down_proj"]


@waits_for("example_rerun_and_replicas")
def test_rerun_and_replicas_example_tells_the_machine_from_the_data(tmp_path) -> None:
    script = Path(__file__).parent.parent / "examples" / "rerun_and_replicas.py"
    proc = run(
        [sys.executable, str(script), "--out", str(tmp_path)],
        "example_rerun_and_replicas",
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rerun @ step 5: transient, rank 1" in proc.stdout
    assert "rerun @ step 12: reproducible, rank None" in proc.stdout
    assert "replica_mismatch @ step 19: rank 1, 0.weight" in proc.stdout
    assert "skipped steps: [12]" in proc.stdout
    line = json.loads((tmp_path / "rerun.jsonl").read_text().splitlines()[-1])
    assert (line["step"], line["verdict"]) == (12, "reproducible")


def test_recovery_lr_edge_example_lowers_the_lr_where_the_guard_alone_diverges(capsys) -> None:
    result = _load("recovery_lr_edge").main([])
    assert isinstance(result["alone"]["error"], sk.TrainingDivergedError)
    healed = result["recovery"]
    assert healed["error"] is None and healed["loss"] < 0.5
    assert [e.details["cause"] for e in healed["rollbacks"]] == ["undetermined", "lr", "lr"]
    assert list(healed["lr"].values())[-1] == pytest.approx(0.3)  # a quarter of the schedule's 1.2
    assert "cause lr, LR x0.25" in capsys.readouterr().out
