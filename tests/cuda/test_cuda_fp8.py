"""FP8 with real FP8 matmuls (torchao ``Float8Linear``, not emulated) on a GPU of compute capability
8.9 or newer: the capability report, the precision report's FP8 rows, and the FP8 monitors against
torchao's own casts, a massive activation warned about for its layer only, no sync off logging
steps. Skipped without CUDA (conftest), without FP8 tensor cores, or without torchao."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import stabilitykit as sk

pytest.importorskip("torchao.float8")
pytest.importorskip("transformers")

from tests.hf_models import tiny_llama, token_batches

DEVICE = "cuda"
LAYER = "model.layers.0.mlp.down_proj"


def _fp8_device() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not _fp8_device(), reason="FP8 matmuls need compute capability 8.9 or newer")


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [{k: v.to(DEVICE) for k, v in b.items()} for b in token_batches(n, batch_size=8)]


def _fp8_llama() -> nn.Module:
    from stabilitykit.compat.torchao_float8 import convert

    model = tiny_llama().to(DEVICE)
    conversion = convert(model, emulate=False)
    assert len(conversion.converted) == 15
    return model.train()


class _Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append(dict(metrics))


def _train(model: nn.Module, steps: int, every: int, syncs: list[int] | None = None) -> tuple[_Rows, list[sk.Event]]:
    from stabilitykit.testing.syncs import count_host_syncs

    rows, events = _Rows(), []
    cfg = sk.StabilityConfig(log_every_n_steps=every, monitors=sk.MonitorConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, config=cfg, sinks=[rows])
    guard.hooks.on("fp8_warning", events.append)
    for batch in _batches(steps):
        with count_host_syncs() as counter:
            guard.backward(model(**batch).loss)
            guard.step()
            guard.zero_grad()
        if syncs is not None:
            syncs.append(len(counter.library_sites()))
    return rows, events


def test_select_precision_reports_fp8_by_capability() -> None:
    choice = sk.select_precision(DEVICE, log_choice=False)
    assert choice.fp8_capable is _fp8_device()
    assert choice.fp8_recipe == ("tensorwise" if _fp8_device() else None)
    assert choice.amp_dtype is not None  # the choice stays bf16 / fp16: FP8 is reported, not chosen


@needs_fp8
def test_precision_report_fp8_rows_with_real_fp8_matmuls() -> None:
    report = sk.precision_eval.evaluate(
        tiny_llama().to(DEVICE), _batches(1)[0], lambda m, b: m(**b).loss, variants=("bf16", "fp8"), progress=False
    )
    notes = report.notes["fp8"]
    assert notes["emulated"] is False and len(notes["converted"]) == 15
    for phase in ("forward", "backward"):
        fp8 = {r["module"]: r["rms_rel"] for r in report.variants["fp8"][phase]}
        bf16 = {r["module"]: r["rms_rel"] for r in report.variants["bf16"][phase]}
        for module in (m for m in notes["converted"] if m in fp8):
            assert fp8[module] > 2 * bf16[module] > 0, (phase, module, fp8[module], bf16[module])
    assert set(report.to_dict()) == {"reference", "variants", "notes"}


@needs_fp8
def test_monitors_match_torchao_casts_and_warn_on_a_massive_activation_only_there() -> None:
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    model = _fp8_llama()
    seen: dict[str, torch.Tensor] = {}
    target = dict(model.named_modules())[LAYER]

    def pre(m: nn.Module, args: Any) -> None:
        seen["input"] = args[0].detach().clone()

    target.register_forward_pre_hook(pre)
    rows, events = _train(model, steps=1, every=1)
    x = seen["input"]
    cast = target.config.cast_config_input
    role = GemmInputRole.INPUT
    fp8 = hp_tensor_to_float8_dynamic(x, cast.target_dtype, target.linear_mm_config, gemm_input_role=role)
    nonzero = x != 0
    underflow = float((nonzero & (fp8._data.float() == 0)).sum() / nonzero.sum())
    error = float(torch.linalg.vector_norm(fp8.to_original_precision().float() - x) / torch.linalg.vector_norm(x))
    assert rows.rows[0][f"stability/monitors/fp8_underflow/{LAYER}/input"] == pytest.approx(underflow, abs=1e-7)
    assert rows.rows[0][f"stability/monitors/fp8_error/{LAYER}/input"] == pytest.approx(error, rel=1e-4)
    assert not events

    healthy_syncs: list[int] = []
    _, healthy = _train(_fp8_llama(), steps=8, every=4, syncs=healthy_syncs)
    assert not healthy
    assert [s for i, s in enumerate(healthy_syncs) if i % 4] == [0] * 6, healthy_syncs

    model = _fp8_llama()

    def inject(m: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0].clone()
        x.view(-1)[0] = 1e6 * x.detach().abs().max()
        return (x,)

    dict(model.named_modules())[LAYER].register_forward_pre_hook(inject, prepend=True)
    _, warned = _train(model, steps=6, every=2)
    assert [(e.details["layer"], e.details["role"]) for e in warned] == [(LAYER, "input")]
