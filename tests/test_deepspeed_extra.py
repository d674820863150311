"""Without the deepspeed extra: ``import stabilitykit`` works and the DeepSpeed driver says how to install it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.time_limits import run

ROOT = Path(__file__).resolve().parent.parent

# sys.modules["deepspeed"] = None makes "import deepspeed" fail as it does where it is not installed
CODE = """
import importlib.util
import subprocess
import sys
sys.modules["deepspeed"] = None
import stabilitykit, stabilitykit.integrations
print("core import ok")
from stabilitykit.integrations import DeepSpeedGuard
"""


def test_core_import_needs_no_deepspeed_and_the_missing_extra_names_the_install() -> None:
    proc = run([sys.executable, "-c", CODE], "import_without_deepspeed", capture_output=True, text=True, cwd=ROOT)
    assert "core import ok" in proc.stdout, proc.stderr
    assert proc.returncode != 0
    assert "pip install 'stabilitykit[deepspeed]'" in proc.stderr
    assert "--no-build-isolation" in proc.stderr


# A Trainer without deepspeed=: markers on stderr split its output into what the imports, the Trainer's
# own construction and the guarded training print.
TRAINER = """
import sys, tempfile
import stabilitykit
from stabilitykit.integrations.transformers import stabilize
from transformers import Trainer, TrainingArguments
from tests.hf_models import tiny_llama, token_batches
print("== imported, deepspeed loaded:", "deepspeed" in sys.modules, file=sys.stderr, flush=True)
data = [{k: v[0] for k, v in b.items()} for b in token_batches(2, seed=1)]
args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=1, report_to=[],
                         use_cpu=True, save_strategy="no", disable_tqdm=True)
trainer = Trainer(model=tiny_llama(), args=args, train_dataset=data)
print("== Trainer built", file=sys.stderr, flush=True)
stabilize(trainer)
trainer.train()
print("== trained", file=sys.stderr, flush=True)
"""


def test_a_trainer_without_deepspeed_prints_no_accelerator_line_of_ours() -> None:
    """stabilitykit and its Trainer driver do not import DeepSpeed; the ``real_accelerator`` warning a
    venv with DeepSpeed prints comes from the Trainer's construction (Accelerate imports DeepSpeed there),
    once, and attaching the guard and training add none."""
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    out = subprocess.PIPE
    proc = run(
        [sys.executable, "-c", TRAINER],
        "hf_trainer_noise",
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "== imported, deepspeed loaded: False" in proc.stdout  # DeepSpeed's logger writes to stdout: one stream
    imports, rest = proc.stdout.split("== imported", 1)
    construction, guarded = rest.split("== Trainer built", 1)
    assert "real_accelerator" not in imports and "real_accelerator" not in guarded, guarded
    installed = importlib.util.find_spec("deepspeed") is not None
    assert construction.count("real_accelerator") == (1 if installed else 0), construction
    assert "== trained" in guarded
