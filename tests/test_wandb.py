"""WandbSink against real offline W&B runs, read back from their run-*.wandb transaction log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import wandb

import stabilitykit as sk
from stabilitykit.sinks import WandbRunFile, WandbSink
from tests.conftest import batches


def _offline_run(tmp_path: Path) -> wandb.sdk.wandb_run.Run:
    return wandb.init(project="stabilitykit-tests", dir=str(tmp_path), mode="offline", reinit="create_new")


def test_guard_metrics_definitions_and_alerts_reach_the_run_file(tmp_path: Path) -> None:
    run = _offline_run(tmp_path)
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=5, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[WandbSink(run)])
    for i, (x, y) in enumerate(batches(21)):
        loss = model.loss(x, y) * (float("nan") if i == 7 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    run.finish()
    logged = WandbRunFile.read(Path(run.dir).parent)

    rows = [r for r in logged.history if "stability/grad_norm/total" in r]
    assert [r["trainer/global_step"] for r in rows] == [0, 5, 10, 15, 20]
    assert rows[2]["stability/skipped/total"] == 1 and rows[1]["stability/skipped/total"] == 0
    assert "stability/grad_norm/blocks.0" in rows[0] and "stability/clip/coef" in rows[0]
    assert all(k.startswith(("stability/", "trainer/", "_")) for r in logged.history for k in r)
    markers = [r for r in logged.history if "stability/events/nonfinite" in r]
    assert [r["trainer/global_step"] for r in markers] == [7]
    assert logged.metrics["stability/*"] == {"glob": True, "step_metric": "trainer/global_step", "summary": []}
    assert "trainer/global_step" in logged.metrics
    assert [a["title"] for a in logged.alerts] == ["stabilitykit: nonfinite at step 7"]
    alert = logged.alerts[0]
    assert alert["level"] == "WARN" and len(alert["title"]) < 64 and "non-finite loss" in alert["text"]


def test_missing_run_warns_once_and_training_goes_on() -> None:
    assert wandb.run is None
    sink = WandbSink()
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    with pytest.warns(RuntimeWarning, match="no active W&B run") as caught:
        guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=2), sinks=[sink])
        for x, y in batches(6):
            guard.backward(model.loss(x, y))
            guard.step()
            guard.zero_grad()
    assert len([w for w in caught if "WandbSink" in str(w.message)]) == 1
    assert guard.step_count == 6


def test_lightning_wandb_logger_and_sink_share_the_step_metric(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import WandbLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    logger = WandbLogger(project="stabilitykit-tests", save_dir=str(tmp_path), offline=True)
    callback = StabilityCallback(sk.StabilityConfig(), sinks=[WandbSink(logger.experiment)])
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=10,
        log_every_n_steps=5,
        logger=logger,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(poison={3: float("nan")}), gpt_dataloader(10))
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    logged = WandbRunFile.read(run_dir)
    steps = [r["trainer/global_step"] for r in logged.history if "stability/grad_norm/total" in r]
    assert steps == [4, 9]  # Lightning's rows, through the sink only (the WandbLogger is skipped beside a WandbSink)
    assert logged.metrics["stability/*"]["step_metric"] == "trainer/global_step"
    assert [a["title"] for a in logged.alerts] == ["stabilitykit: nonfinite at step 3"]


def test_dashboard_spec_builds_offline_with_the_five_sections() -> None:
    workspace = sk.wandb_dashboard("my-team", "my-project", layers=["blocks.0", "lm_head"])
    assert [s.name for s in workspace.sections] == [
        "overview",
        "per-layer grad norms",
        "precision",
        "logits and attention",
        "update ratio",
    ]
    spec = workspace._to_model().model_dump(by_alias=True)
    assert spec["entity"] == "my-team" and spec["project"] == "my-project"
    overview = workspace.sections[0].panels
    assert {"stability/loss", "stability/grad_norm/total", "stability/events/spike_warning"} <= {
        y for p in overview for y in p.y
    }
    assert all(p.x == "trainer/global_step" for s in workspace.sections for p in s.panels)
    layer_panels = workspace.sections[1].panels
    assert layer_panels[0].metric_regex.startswith("^stability/grad_norm/")
    assert [p.y for p in layer_panels[1:]] == [["stability/grad_norm/blocks.0"], ["stability/grad_norm/lm_head"]]
    keys = {y for p in workspace.sections[3].panels for y in p.y}
    assert keys == {"stability/logits/log_z_mean", "stability/logits/log_z_max", "stability/attention/max_logit"}


def test_a_wandb_logger_alone_gets_the_event_markers_and_alerts(tmp_path: Path) -> None:
    """No WandbSink given: the WandbLogger among trainer.loggers is fed through one (markers, alerts), and
    the metrics are logged once, at Lightning's rows."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import WandbLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    logger = WandbLogger(project="stabilitykit-tests", save_dir=str(tmp_path), offline=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=10,
        log_every_n_steps=5,
        logger=logger,
        callbacks=[StabilityCallback(sk.StabilityConfig())],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(poison={3: float("nan")}), gpt_dataloader(10))
    run_dir = Path(logger.experiment.dir).parent
    wandb.finish()
    logged = WandbRunFile.read(run_dir)
    steps = [r["trainer/global_step"] for r in logged.history if "stability/grad_norm/total" in r]
    assert steps == [4, 9]
    markers = [r["trainer/global_step"] for r in logged.history if "stability/events/nonfinite" in r]
    assert markers == [3]
    assert [a["title"] for a in logged.alerts] == ["stabilitykit: nonfinite at step 3"]
