"""Skips are not silent: WARNING lines on the ``stabilitykit`` logger and a one-line summary at the
end of a run, from the plain guard, a real Lightning Trainer and the real Hugging Face Trainer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

import stabilitykit as sk
from stabilitykit.lightning import StabilityCallback
from stabilitykit.run_log import RunSummary

CFG = sk.StabilityConfig(clip=sk.ClipConfig(mode="off"), log_every_n_steps=2)


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """This run's lines at ``level`` (the precision choice, also INFO, is left out)."""
    records = [r for r in caplog.records if r.name == "stabilitykit" and r.levelno == level]
    return [r.getMessage() for r in records if not r.getMessage().startswith("precision ")]


def test_plain_loop_logs_each_skip_and_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stabilitykit")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    guard = sk.StabilityGuard(model, torch.optim.AdamW(model.parameters()), CFG)
    for i in range(6):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        guard.backward(loss * float("nan") if i == 3 else loss)
        guard.step()
        guard.zero_grad()
    summary = guard.summary()
    assert isinstance(summary, RunSummary) and summary.skipped == 1 and summary["steps"] == 6
    guard.close()
    warnings = _messages(caplog, logging.WARNING)
    assert warnings == ["step 3 skipped: nonfinite_loss (first non-finite layer in backward order: 1)"]
    assert _messages(caplog, logging.INFO) == [f"run summary: {summary.line()}"]
    assert summary.line().startswith("6 steps, 1 skipped, 0 clipped, max grad norm ")


def test_many_skips_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stabilitykit")
    model = torch.nn.Linear(4, 2)
    cfg = sk.StabilityConfig(skip=sk.SkipConfig(max_consecutive=None), log_every_n_steps=50)
    guard = sk.StabilityGuard(model, torch.optim.SGD(model.parameters(), lr=0.1), cfg)
    for _ in range(150):
        guard.backward(model(torch.randn(2, 4)).sum() * float("nan"))
        guard.step()
        guard.zero_grad()
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 21  # the first 20, then one at step 119 naming the 99 left out
    assert "99 similar message(s) left out" in warnings[-1]


class NaNAt(BoringModel):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        if self.trainer.global_step == 2:
            out["loss"] = out["loss"] * float("nan")
        return out


def test_lightning_logs_the_skip_and_the_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stabilitykit")
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=5,
        callbacks=[StabilityCallback(CFG)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(NaNAt())
    assert [m.split(" (")[0] for m in _messages(caplog, logging.WARNING)] == ["step 2 skipped: nonfinite_loss"]
    infos = _messages(caplog, logging.INFO)
    assert len(infos) == 1 and infos[0].startswith("run summary: 5 steps, 1 skipped")


def test_hf_trainer_logs_the_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from hf_models import tiny_llama, token_batches
    from transformers import Trainer, TrainingArguments

    from stabilitykit.integrations import stabilize

    caplog.set_level(logging.INFO, logger="stabilitykit")
    rows = [{k: v[0] for k, v in b.items()} for b in token_batches(16, batch_size=1, seed=3)]
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, max_steps=3,
        logging_steps=1, save_strategy="no", disable_tqdm=True, max_grad_norm=0.0,
    )  # fmt: skip
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=rows)
    stabilize(trainer, CFG)
    trainer.train()
    infos = _messages(caplog, logging.INFO)
    assert len(infos) == 1 and infos[0].startswith("run summary: 3 steps, 0 skipped")


def test_the_summary_counts_a_rollback_its_undone_steps_and_skipped_ahead_batches_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="stabilitykit")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    recovery = sk.RecoveryConfig(enabled=True, snapshot_every=4, keep=2, trigger=["diverged"], skip_after=3)
    cfg = sk.StabilityConfig(log_every_n_steps=5, skip=sk.SkipConfig(max_consecutive=3), recovery=recovery)
    logged: list[dict[str, float]] = []

    class Metrics:
        def log_metrics(self, metrics: dict[str, float], step: int) -> None:
            logged.append(dict(metrics))

    guard = sk.StabilityGuard(model, opt, cfg, sinks=[Metrics()])
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        loss = model(torch.randn(16, 8, generator=gen)).pow(2).mean() * (float("nan") if 10 <= i < 13 else 1.0)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    summary = guard.summary()
    # rolled back at step 12 to the state before step 8 (steps 8..12 undone), batches 13..15 skipped after
    assert (summary.rollbacks, summary.undone_steps, summary.skipped_ahead) == (1, 5, 3)
    assert summary.skipped == 3 and summary.nonfinite_steps == 3  # the NaN steps only
    line = [m for m in _messages(caplog, logging.INFO) if m.startswith("run summary")][-1]
    assert "30 steps, 3 skipped" in line and "1 rollback(s): 5 step(s) undone, 3 skipped ahead" in line
    # one definition of each count: the logged metrics say the summary's numbers under the same names
    assert logged[-1]["stability/skipped/total"] == summary.skipped == 3
    assert logged[-1]["stability/skipped/ahead"] == summary.skipped_ahead == 3
