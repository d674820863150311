"""Layer-wise precision report and the ``stabilitykit precision`` command."""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk
from stabilitykit.precision_eval import Variant, evaluate
from stabilitykit.testing import char_batches, tiny_gpt


def _gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model.loss(*batch)  # type: ignore[operator]


@pytest.fixture(scope="module")
def gpt_report() -> sk.precision_eval.PrecisionReport:
    model = tiny_gpt()
    batch = next(char_batches(batch_size=4))
    return evaluate(model, batch, _gpt_loss, variants=("fp32", "bf16", "fp16"), progress=False)


def test_fp32_variant_has_zero_error(gpt_report) -> None:
    for phase in ("forward", "backward"):
        rows = gpt_report.variants["fp32"][phase]
        assert rows and all(r["rms_rel"] == 0.0 and r["max_abs"] == 0.0 for r in rows)


def test_bf16_error_exceeds_fp16_error_on_a_gpt(gpt_report) -> None:
    for phase in ("forward", "backward"):
        bf16 = [r["rms_rel"] for r in gpt_report.variants["bf16"][phase]]
        fp16 = [r["rms_rel"] for r in gpt_report.variants["fp16"][phase]]
        assert sorted(bf16)[len(bf16) // 2] > 2 * sorted(fp16)[len(fp16) // 2]
        assert max(bf16) > max(fp16) > 0


def test_every_layer_reported_in_depth_order(gpt_report) -> None:
    model = tiny_gpt()
    forward = [r["module"] for r in gpt_report.variants["bf16"]["forward"]]
    assert forward[0] == "tok_emb" and forward[-1] == "lm_head"
    blocks = [m for m in forward if m.startswith("blocks.") and m.count(".") == 1]
    assert blocks == [f"blocks.{i}" for i in range(len(model.blocks))]
    assert forward.index("blocks.0.attn") < forward.index("blocks.1.attn") < forward.index("ln_f")
    backward = [r["module"] for r in gpt_report.variants["bf16"]["backward"]]
    assert backward[0] == "lm_head" and backward.index("blocks.3") < backward.index("blocks.0")
    data = gpt_report.to_dict()
    assert data["reference"] == "fp32" and set(data["variants"]["bf16"]) == {"forward", "backward"}
    assert set(data["variants"]["bf16"]["forward"][0]) == {
        "module",
        "rms_rel",
        "rms_abs",
        "max_abs",
        "max_rel",
        "scale",
    }
    summary = gpt_report.summary()["bf16"]["forward"]
    assert next(iter(summary)) == "first: tok_emb" and list(summary)[-1] == "last: lm_head"


class TwoCalls(nn.Module):
    """A shared layer called twice and a module returning a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.split = SplitHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(self.shared(torch.tanh(self.shared(x))))
        return a.sum() + b.pow(2).sum()


class SplitHead(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x[:, :8] * 3, x[:, 8:] / 3


def test_tuple_outputs_modules_called_twice_and_user_variants() -> None:
    torch.manual_seed(0)
    model = TwoCalls()
    x = torch.randn(32, 16)
    swapped = {"swap": lambda m: _with_scaled_split(m)}
    report = evaluate(
        model,
        x,
        lambda m, b: m(b),
        variants={
            "bf16": "bf16",
            "half_context": Variant("half_context", lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
            "same": contextlib.nullcontext,  # a context-manager class: an instance per run
            **swapped,
        },
        progress=False,
    )
    assert all(r["rms_rel"] == 0 for r in report.variants["same"]["forward"])
    forward = [r["module"] for r in report.variants["bf16"]["forward"]]
    assert forward == ["shared", "shared#1", "split"]
    assert report.variants["half_context"]["forward"][0]["rms_rel"] > 0
    swap_rows = {r["module"]: r for r in report.variants["swap"]["forward"]}
    assert swap_rows["shared"]["rms_rel"] == 0 and swap_rows["split"]["rms_rel"] > 0.1
    assert model.split.__class__ is SplitHead  # the transform worked on a copy


def _with_scaled_split(model: nn.Module) -> nn.Module:
    class Scaled(SplitHead):
        def forward(self, x):
            a, b = super().forward(x)
            return a * 1.5, b

    model.split = Scaled()
    return model


def test_report_json_and_plot_and_cli(tmp_path, monkeypatch, capsys) -> None:
    from stabilitykit.cli import main

    monkeypatch.chdir(tmp_path.parent)
    examples = __import__("pathlib").Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(examples))
    code = main(["precision", "--model", "examples.models:tiny_gpt", "--variants", "bf16,fp16", "--out", str(tmp_path)])
    assert code == 0
    data = json.loads((tmp_path / "precision.json").read_text())
    assert set(data["variants"]) == {"bf16", "fp16"}
    assert (tmp_path / "precision.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "bf16 vs fp32: forward rms_rel" in out and "first: tok_emb" in out
    loaded = sk.precision_eval.PrecisionReport.load_json(tmp_path / "precision.json")
    assert not math.isnan(loaded.variants["bf16"]["forward"][1]["rms_rel"])
    assert main(["precision", "--model", "nocolon"]) == 2
    assert "package.module:function" in capsys.readouterr().err
