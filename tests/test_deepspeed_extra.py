"""Without the deepspeed extra: ``import stabilitykit`` works and the DeepSpeed driver says how to install it."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.time_limits import run

ROOT = Path(__file__).resolve().parent.parent

# sys.modules["deepspeed"] = None makes "import deepspeed" fail as it does where it is not installed
CODE = """
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
