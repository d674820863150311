"""tests/cuda is collected by the README's test command and, without a GPU, skipped with its reason."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from tests.time_limits import run

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: tests/cuda runs for real")
def test_cuda_tests_are_collected_and_skipped_with_the_reason() -> None:
    out = run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/cuda"],
        "cuda_collect",
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-2000:]
    assert "CUDA not available: tests/cuda runs on a GPU machine (scripts/gpu_check.sh)" in out.stdout
    assert " passed" not in out.stdout and "skipped" in out.stdout


@pytest.mark.filterwarnings("ignore:stabilitykit. AdamW.step.. was called directly")  # the benchmark's other arms
def test_gpu_benchmark_runs_its_code_path_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/gpu.py --tiny --device cpu: every arm runs and the table prints (numbers mean nothing here).
    Run as ``__main__`` in this process: the script's own code, without a second interpreter's imports."""
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpu.py", "--tiny", "--device", "cpu", "--rounds", "1"])
    runpy.run_path(str(ROOT / "benchmarks" / "gpu.py"), run_name="__main__")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| clip", "| guard", "| lightning grad_norm", "| per-param logger"]
