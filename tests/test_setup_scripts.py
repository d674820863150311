"""scripts/setup.sh, which demo.sh and test.sh run first: it says what it does while it builds the venv."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from tests.time_limits import run

ROOT = Path(__file__).resolve().parent.parent

#: Stands in for ``python3``: ``-m venv DIR`` makes DIR/bin/python, a python that accepts any pip
#: install and import check (the real ones take minutes and a package index).
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  mkdir -p "$3/bin"
  printf '#!/usr/bin/env bash\\nexit 0\\n' > "$3/bin/python"
  chmod +x "$3/bin/python"
fi
exit 0
"""


def _checkout(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    checkout = tmp_path / "stabilitykit"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "setup.sh", checkout / "scripts" / "setup.sh")
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    fake = tmp_path / "fake-python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return checkout, {**os.environ, "PYTHON": str(fake)}


def test_setup_says_what_it_does_on_the_first_run_and_nothing_after(tmp_path: Path) -> None:
    checkout, env = _checkout(tmp_path)
    first = run(["bash", "scripts/setup.sh"], "setup_script", cwd=checkout, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    assert lines[0] == "stabilitykit setup: creating .venv with " + env["PYTHON"] + " (first run only)"
    assert any("installing torch==2.13.0 into .venv" in line and "a few minutes" in line for line in lines)
    assert any("installing stabilitykit with every extra" in line for line in lines)
    assert any(
        line.startswith("stabilitykit setup: ready in ") and "later runs skip this step" in line for line in lines
    )
    # DeepSpeed's comm op is built here, announced, into the venv's own extensions folder
    assert "stabilitykit setup: building DeepSpeed's CPU comm op once into .venv/torch_extensions" in lines[-2]
    assert lines[-1].startswith("stabilitykit setup: DeepSpeed's comm op built in ")
    again = run(["bash", "scripts/setup.sh"], "setup_script", cwd=checkout, env=env, capture_output=True, text=True)
    assert again.returncode == 0 and again.stderr == "" and again.stdout == ""
