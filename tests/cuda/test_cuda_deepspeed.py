"""Lightning's DeepSpeed strategy (CUDA only: Lightning refuses any other accelerator) under
DeepSpeedStabilityCallback: a NaN step skipped, the parameters finite, DeepSpeed's engine not
counting the skipped step. Skipped where CUDA is absent (tests/cuda/conftest.py) or DeepSpeed is not
installed.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest
import torch

from tests.test_deepspeed import _tiny_module

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_lightning_deepspeed_skips_a_nan_step(tmp_path: Path, strategy: str) -> None:
    import lightning.pytorch as pl

    import stabilitykit as sk
    from stabilitykit.integrations.deepspeed_lightning import DeepSpeedStabilityCallback

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    callback = DeepSpeedStabilityCallback(sk.StabilityConfig(log_every_n_steps=2))
    skipped: list[int] = []
    callback.hooks.on("skipped", lambda e: skipped.append(e.step))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu",
        devices=1,
        max_steps=6,
        gradient_clip_val=0.0,
        callbacks=[callback],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = _tiny_module(bad_step=3)
    trainer.fit(module)
    engine = trainer.strategy.deepspeed_engine
    assert skipped == [3]
    assert engine.global_steps == 5
    assert all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in engine.module.parameters())


def test_deepspeed_lightning_example_skips_the_nan_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """examples/deepspeed_lightning.py on one GPU: ZeRO-2, the NaN at step 5 skipped, DeepSpeed not counting it."""
    import importlib.util as util

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    path = Path(__file__).resolve().parents[2] / "examples" / "deepspeed_lightning.py"
    spec = util.spec_from_file_location("deepspeed_lightning_example", path)
    assert spec and spec.loader
    example = util.module_from_spec(spec)
    spec.loader.exec_module(example)
    result = example.main(["--steps", "10", "--out", str(tmp_path)])
    assert result == {"skipped": [example.BAD_STEP], "global_steps": 9, "finite": True}
    out = capsys.readouterr().out
    assert "skipped steps [5]" in out and "guard: 10 steps, 1 skipped" in out
