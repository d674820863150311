"""Without the deepspeed extra: ``import stabilitykit`` works and the DeepSpeed driver says how to install it.
With it: a Trainer that does not use DeepSpeed gets no DeepSpeed import (nor its log line) from stabilitykit.

Both run in one fresh interpreter (one launch): DeepSpeed hidden first, then given back."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.time_limits import run

ROOT = Path(__file__).resolve().parent.parent

# sys.modules["deepspeed"] = None makes "import deepspeed" fail as it does where it is not installed; deleting
# the entry gives it back. Then a Trainer without deepspeed=: markers split the output into what the imports,
# the Trainer's own construction and the guarded training print (DeepSpeed's logger writes to stdout, so the
# launch's stdout and stderr are one stream).
CODE = """
import sys, tempfile
sys.modules["deepspeed"] = None
import stabilitykit, stabilitykit.integrations
print("core import ok", flush=True)
try:
    from stabilitykit.integrations import DeepSpeedGuard
except ImportError as exc:
    print("== missing extra:", exc, flush=True)
del sys.modules["deepspeed"]
from stabilitykit.integrations.transformers import stabilize
from transformers import Trainer, TrainingArguments
from tests.hf_models import tiny_llama, token_batches
print("== imported, deepspeed loaded:", "deepspeed" in sys.modules, flush=True)
data = [{k: v[0] for k, v in b.items()} for b in token_batches(2, seed=1)]
args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=1, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
print("== Trainer built", flush=True)
stabilize(trainer)
trainer.train()
print("== trained", flush=True)
"""


@pytest.fixture(scope="module")
def output() -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = run(
        [sys.executable, "-c", CODE], "deepspeed_imports", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def test_core_import_needs_no_deepspeed_and_the_missing_extra_names_the_install(output: str) -> None:
    assert "core import ok" in output
    missing = next(line for line in output.splitlines() if line.startswith("== missing extra:"))
    assert "pip install 'stabilitykit[deepspeed]'" in missing
    assert "--no-build-isolation" in missing


def test_a_trainer_without_deepspeed_prints_no_accelerator_line_of_ours(output: str) -> None:
    """stabilitykit and its Trainer driver do not import DeepSpeed; the ``real_accelerator`` warning a
    venv with DeepSpeed prints comes from the Trainer's construction (Accelerate imports DeepSpeed there),
    once, and attaching the guard and training add none."""
    assert "== imported, deepspeed loaded: False" in output
    imports, rest = output.split("== imported", 1)
    construction, guarded = rest.split("== Trainer built", 1)
    assert "real_accelerator" not in imports and "real_accelerator" not in guarded, guarded
    installed = importlib.util.find_spec("deepspeed") is not None
    assert construction.count("real_accelerator") == (1 if installed else 0), construction
    assert "== trained" in guarded
