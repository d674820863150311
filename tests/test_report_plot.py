"""``stabilitykit report``: the one-page picture from a guard JSONL log and from a Lightning CSV log."""

from __future__ import annotations

from pathlib import Path

import torch

import stabilitykit as sk
from stabilitykit.cli import main
from stabilitykit.report_plot import load_run_log
from tests.conftest import batches


def _jsonl_run(path: Path) -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=2, clip=sk.ClipConfig(mode="fixed", max_norm=1.0))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(path)])
    for i, (x, y) in enumerate(batches(40)):
        loss = model.loss(x, y) * (float("nan") if i == 11 else 1000.0 if i == 30 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()


def test_report_from_jsonl_marks_skips_and_spikes(tmp_path: Path, capsys) -> None:
    log = tmp_path / "run.jsonl"
    _jsonl_run(log)
    run = load_run_log(log)
    assert run.layer_names()[:2] == ["tok_emb", "pos_emb"] and "blocks.0" in run.layer_names()
    kinds = {e["kind"]: e["step"] for e in run.events}
    assert kinds["skipped"] == 11 and kinds["spike_warning"] == 30
    assert main(["report", str(log), "-o", str(tmp_path / "report.png")]) == 0
    assert (tmp_path / "report.png").stat().st_size > 30_000
    assert "wrote" in capsys.readouterr().out


def test_report_from_lightning_csv(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from stabilitykit.lightning import StabilityCallback
    from stabilitykit.testing.lightning_gpt import GPTModule, gpt_dataloader

    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=20,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path, name="csv"),
        callbacks=[StabilityCallback(sk.StabilityConfig())],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(poison={5: float("nan")}), gpt_dataloader(20))
    run = load_run_log(tmp_path / "csv")
    assert [r["step"] for r in run.rows][:3] == [0, 2, 4] and "model.blocks.0" in run.layer_names()
    assert "model.lm_head" in run.layer_names()
    assert [e["step"] for e in run.events if e["kind"] == "skipped"] == [6]  # seen at the next logging step
    assert main(["report", str(tmp_path / "csv"), "-o", str(tmp_path / "csv.png")]) == 0
    assert (tmp_path / "csv.png").stat().st_size > 30_000
