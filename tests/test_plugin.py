"""The pytest plugin's regression fixtures, run in real inner pytest sessions (pytester)."""

from __future__ import annotations

import json

import pytest

TEST_FILE = """
import torch
from stabilitykit.testing import tiny_gpt, char_batches

def test_gpt_grads(grad_norm_regression):
    model = tiny_gpt(seed=0)
    x, y = next(char_batches(batch_size=4))
    (model.loss(x, y) * SCALE).backward()
    grad_norm_regression("tiny_gpt_block0", model, rtol=0.05)
"""


def _write(pytester: pytest.Pytester, scale: float) -> None:
    pytester.makepyfile(test_gpt=TEST_FILE.replace("SCALE", repr(scale)))


def test_missing_reference_skips_with_a_seeding_hint(pytester: pytest.Pytester) -> None:
    _write(pytester, 1.0)
    result = pytester.runpytest_inprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*no grad-norm reference for 'tiny_gpt_block0' on device 'CPU'*--stabilitykit-update-refs*"]
    )


def test_update_records_then_compare_passes_and_a_change_fails(pytester: pytest.Pytester) -> None:
    _write(pytester, 1.0)
    pytester.runpytest_inprocess("--stabilitykit-update-refs").assert_outcomes(skipped=1)
    refs = json.loads((pytester.path / "grad_norm_refs.json").read_text())
    assert set(refs) == {"tiny_gpt_block0"} and refs["tiny_gpt_block0"]["CPU"] > 0
    pytester.runpytest_inprocess().assert_outcomes(passed=1)
    _write(pytester, 1.5)  # block 0 grads grow by 50%
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*grad norm of 'tiny_gpt_block0' on CPU: got *, reference *, relative error 0.5 > rtol 0.05*"]
    )


def test_env_variable_records_and_device_key_map_from_ini(pytester: pytest.Pytester, monkeypatch) -> None:
    pytester.makeini("[pytest]\nstabilitykit_device_keys =\n    Xeon=XEON\n")
    pytester.makeconftest("import pytest\n@pytest.fixture\ndef stabilitykit_device_key():\n    return 'MYBOX'\n")
    _write(pytester, 1.0)
    monkeypatch.setenv("STABILITYKIT_UPDATE_REFS", "1")
    pytester.runpytest_inprocess().assert_outcomes(skipped=1)
    refs = json.loads((pytester.path / "grad_norm_refs.json").read_text())
    assert list(refs["tiny_gpt_block0"]) == ["MYBOX"]


PRECISION_TEST = """
from stabilitykit.testing import tiny_gpt, char_batches

def test_bf16_error(precision_regression):
    model = tiny_gpt(seed=0)
    batch = next(char_batches(batch_size=4))
    if BREAK:
        model.lm_head.weight.data.mul_(40.0)
    precision_regression("tiny_gpt", model, batch, lambda m, b: m.loss(*b), variants=("bf16",), rtol=0.5)
"""


def test_precision_regression_records_and_catches_a_growing_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_prec=PRECISION_TEST.replace("BREAK", "False"))
    pytester.runpytest_inprocess("--stabilitykit-update-refs").assert_outcomes(skipped=1)
    refs = json.loads((pytester.path / "precision_refs.json").read_text())
    assert "blocks.0" in refs["tiny_gpt"]["CPU"]["bf16"]["forward"]
    pytester.runpytest_inprocess().assert_outcomes(passed=1)
    pytester.makepyfile(test_prec=PRECISION_TEST.replace("BREAK", "True"))
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*precision of 'tiny_gpt' on CPU regressed in * module(s)*", "*bf16 *: got rms_rel *"])
