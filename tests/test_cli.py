"""The ``stabilitykit`` command's bad arguments: one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from stabilitykit.cli import main
from tests.time_limits import run

ROOT = Path(__file__).resolve().parent.parent


def test_precision_model_that_is_not_a_function_is_one_line_through_the_console_script(tmp_path: Path) -> None:
    """``--model os:path`` names a module: the real entry point prints one line and exits 2."""
    done = run(
        [sys.executable, "-m", "stabilitykit.cli", "precision", "--model", "os:path", "--out", str(tmp_path)],
        "cli_bad_model",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "stabilitykit precision: error: --model os:path: os.path is a module, not a function returning "
        "(model, batch, loss_fn)"
    ]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--model", "examples.models:tiny_gpt", "--variants", "bf16,int3"],
            "--variants: unknown built-in variant 'int3': use bf16, fp16, tf32, fp32",
        ),
        (["--model", "examples.models:tiny_gpt", "--variants", " , "], "--variants names no variant"),
        (["--model", "no_such_module_xyz:f"], "--model no_such_module_xyz:f: cannot import 'no_such_module_xyz'"),
        (["--model", "examples.models:no_such_factory"], "examples.models has no attribute 'no_such_factory'"),
        (["--model", "os:sep"], "os.sep is a str, not a function"),
        (["--model", "os:getcwd"], "the factory must return (model, batch, loss_fn), got str"),
        (["--model", "examples.models:tiny_gpt", "--max-elements", "0"], "--max-elements must be at least 1"),
    ],
)
def test_precision_bad_arguments_are_one_line_and_exit_2(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    assert main(["precision", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("stabilitykit precision: error: ")
    assert message in err[0]


def test_precision_out_that_is_a_file_is_one_line_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    blocker = tmp_path / "taken"
    blocker.write_text("")
    assert main(["precision", "--model", "examples.models:tiny_gpt", "--out", str(blocker)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"stabilitykit precision: error: --out {blocker}: cannot create the folder")
    assert captured.out == ""  # the evaluation did not run


def test_the_documented_precision_model_works_from_any_folder(tmp_path: Path) -> None:
    """The guide's command, run where a user runs it: not the repository's root."""
    elsewhere = tmp_path / "somewhere"
    elsewhere.mkdir()
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}  # the package as installed, nothing else
    done = run(
        [sys.executable, "-m", "stabilitykit.cli", "precision", "--model", "stabilitykit.testing.models:tiny_gpt",
         "--variants", "bf16", "--out", str(tmp_path / "report")],
        "cli_precision", capture_output=True, text=True, cwd=elsewhere, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "report" / "precision.json").is_file()
    guide = (ROOT / "docs" / "guides" / "precision-report.md").read_text()
    assert "stabilitykit precision --model stabilitykit.testing.models:tiny_gpt" in guide
