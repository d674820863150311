"""FP8 (torchao float8, emulated on the CPU): the precision report's "fp8" variant, the capability
report and the FP8 health monitors, checked against torchao's own cast functions."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk
from stabilitykit.precision_eval import evaluate

pytest.importorskip("torchao.float8")
transformers = pytest.importorskip("transformers")

from hf_models import tiny_gpt2, tiny_llama, token_batches  # noqa: E402

ROW_KEYS = {"module", "rms_rel", "rms_abs", "max_abs", "max_rel", "scale"}


def _hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


@pytest.fixture(scope="module")
def reports() -> dict[str, sk.precision_eval.PrecisionReport]:
    batch = token_batches(1)[0]
    return {
        name: evaluate(build(), batch, _hf_loss, variants=("bf16", "fp8"), progress=False)
        for name, build in (("llama", tiny_llama), ("gpt2", tiny_gpt2))
    }


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fp8_rows_exceed_bf16_on_the_converted_layers(reports, name, tmp_path) -> None:
    report = reports[name]
    notes = report.notes["fp8"]
    converted = set(notes["converted"])
    assert notes["emulated"] is True and notes["recipe"] == "tensorwise"
    assert "lm_head" in converted
    for phase in ("forward", "backward"):
        fp8 = {r["module"]: r["rms_rel"] for r in report.variants["fp8"][phase]}
        bf16 = {r["module"]: r["rms_rel"] for r in report.variants["bf16"][phase]}
        assert [r["module"] for r in report.variants["fp8"][phase]] == list(bf16)  # same rows, same order
        measured = [m for m in converted if m in fp8]
        assert measured, phase
        for module in measured:  # FP8's 3 mantissa bits (e4m3) against bf16's 7: several times the error
            assert fp8[module] > 3 * bf16[module] > 0, (phase, module, fp8[module], bf16[module])
    data = json.loads(report.save_json(tmp_path / "precision.json").read_text())
    assert set(data) == {"reference", "variants", "notes"} and data["reference"] == "fp32"
    assert set(data["variants"]) == {"bf16", "fp8"}
    assert set(data["variants"]["fp8"]) == {"forward", "backward"}
    assert set(data["variants"]["fp8"]["forward"][0]) == ROW_KEYS
    assert sk.precision_eval.PrecisionReport.load_json(tmp_path / "precision.json").notes == report.notes


def test_layers_left_in_high_precision_are_named_with_the_reason(reports) -> None:
    llama = reports["llama"].notes["fp8"]
    assert len(llama["converted"]) == 2 * 7 + 1 and llama["high_precision"] == {}
    gpt2 = reports["gpt2"].notes["fp8"]
    assert gpt2["converted"] == ["lm_head"]  # GPT-2's attention and MLP are transformers Conv1D layers
    conv = gpt2["high_precision"]["transformer.h.0.attn.c_attn"]
    assert "Conv1D is not an nn.Linear" in conv
    assert len(gpt2["high_precision"]) == 2 * 4


def test_a_linear_with_unaligned_dimensions_stays_in_high_precision() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 10))
    report = evaluate(model, torch.randn(8, 32), lambda m, x: m(x).square().mean(), variants=["fp8"], progress=False)
    notes = report.notes["fp8"]
    assert notes["converted"] == ["0"]
    assert notes["high_precision"] == {"2": "weight 10x48: FP8 GEMMs need both dimensions divisible by 16"}
    rows = {r["module"]: r["rms_rel"] for r in report.variants["fp8"]["forward"]}
    assert rows["0"] > 1e-2  # converted: FP8 error; the ReLU and the last layer only carry it on
    assert isinstance(model[0], nn.Linear) and type(model[0]) is nn.Linear  # the user's model is untouched


def test_fp8_without_torchao_names_the_extra(monkeypatch, capsys) -> None:
    from stabilitykit.cli import main

    monkeypatch.setitem(sys.modules, "torchao", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r"stabilitykit\[fp8\]"):
        evaluate(nn.Linear(16, 16), torch.randn(4, 16), lambda m, x: m(x).sum(), variants=["fp8"], progress=False)
    assert main(["precision", "--model", "stabilitykit.testing.models:tiny_gpt", "--variants", "bf16,fp8"]) == 2
    assert "stabilitykit[fp8]" in capsys.readouterr().err


def test_select_precision_reports_fp8_capability_without_choosing_it() -> None:
    choice = sk.select_precision("cpu", log_choice=False)
    assert choice.fp8_capable is False and choice.fp8_recipe is None
    assert "no FP8 matmuls on cpu" in choice.fp8_reason
    assert choice.amp_dtype in (torch.bfloat16, None)  # the choice itself is still bf16 / fp32
