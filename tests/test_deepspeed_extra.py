"""Without the deepspeed extra: ``import stabilitykit`` works and the DeepSpeed driver says how to install it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str) -> subprocess.CompletedProcess[str]:
    # sys.modules["deepspeed"] = None makes "import deepspeed" fail as it does where it is not installed
    prelude = "import sys; sys.modules['deepspeed'] = None\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_core_import_needs_no_deepspeed() -> None:
    proc = _run("import stabilitykit, stabilitykit.integrations; print('ok')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_missing_extra_names_the_install() -> None:
    proc = _run("from stabilitykit.integrations import DeepSpeedGuard")
    assert proc.returncode != 0
    assert "pip install 'stabilitykit[deepspeed]'" in proc.stderr
    assert "--no-build-isolation" in proc.stderr
