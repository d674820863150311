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


def test_the_command_writes_fp8_rows_and_names_the_converted_layers(tmp_path, capsys) -> None:
    from stabilitykit.cli import main

    model = "stabilitykit.testing.models:tiny_gpt"
    assert main(["precision", "--model", model, "--variants", "fp8", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "precision.json").read_text())
    assert set(data["variants"]) == {"fp8"} and "lm_head" in data["notes"]["fp8"]["converted"]
    rows = {r["module"]: r["rms_rel"] for r in data["variants"]["fp8"]["forward"]}
    assert rows["lm_head"] > 1e-2 and rows["tok_emb"] == 0.0  # an embedding is not converted: no error
    out = capsys.readouterr().out
    assert "fp8 vs fp32: forward rms_rel" in out and "layers converted (tensorwise, emulated)" in out


def test_select_precision_reports_fp8_capability_without_choosing_it() -> None:
    choice = sk.select_precision("cpu", log_choice=False)
    assert choice.fp8_capable is False and choice.fp8_recipe is None
    assert "no FP8 matmuls on cpu" in choice.fp8_reason
    assert choice.amp_dtype in (torch.bfloat16, None)  # the choice itself is still bf16 / fp32


# ---------------------------------------------------------------------------------------------- monitors

OUTLIER_LAYER = "model.layers.0.mlp.down_proj"


class _Rows:
    """A sink keeping every metrics row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append((step, dict(metrics)))


def _fp8_llama(seed: int = 0) -> nn.Module:
    from stabilitykit.compat.torchao_float8 import convert

    model = tiny_llama(seed)
    convert(model, emulate=True)
    return model.train()


def _inject_outlier(model: nn.Module, layer: str) -> None:
    """One value a million times the largest of the rest in ``layer``'s input: a massive activation."""

    def inject(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        x = args[0].clone()
        x.view(-1)[0] = 1e6 * x.detach().abs().max()
        return (x,)

    dict(model.named_modules())[layer].register_forward_pre_hook(inject, prepend=True)


def _train(
    model: nn.Module,
    steps: int,
    every: int = 2,
    fp8: sk.Fp8MonitorConfig | None = None,
    syncs: list[int] | None = None,
) -> tuple[_Rows, list[sk.Event], sk.StabilityGuard]:
    from stabilitykit.testing.syncs import count_host_syncs

    rows, events = _Rows(), []
    monitors = sk.MonitorConfig(fp8=fp8 or sk.Fp8MonitorConfig())
    cfg = sk.StabilityConfig(log_every_n_steps=every, monitors=monitors)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)  # skips on the device: no sync to skip
    guard = sk.StabilityGuard(model, opt, config=cfg, sinks=[rows])
    guard.hooks.on("fp8_warning", events.append)
    for batch in token_batches(steps, batch_size=8):
        with count_host_syncs() as counter:
            guard.backward(model(**batch).loss)
            guard.step()
            guard.zero_grad()
        if syncs is not None:
            syncs.append(len(counter.library_sites()))
    return rows, events, guard


def test_logged_fp8_statistics_match_torchaos_own_casts_of_the_same_tensors() -> None:
    """Every layer and role: what the monitor logged equals torchao's ``hp_tensor_to_float8_dynamic``
    (the cast ``Float8Linear`` itself calls) applied to the tensors the layer received."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    model = _fp8_llama()
    seen: dict[tuple[str, str], torch.Tensor] = {}
    for name, module in model.named_modules():
        if type(module).__name__ != "Float8Linear":
            continue

        def pre(m: nn.Module, args: Any, name: str = name) -> None:
            seen[name, "input"] = args[0].detach().clone()
            seen[name, "weight"] = m.weight.detach().t().clone()

        def post(m: nn.Module, args: Any, out: torch.Tensor, name: str = name) -> None:
            out.register_hook(lambda g: seen.__setitem__((name, "grad_output"), g.detach().clone()))

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    rows, events, _ = _train(model, steps=1, every=1)
    logged = rows.rows[0][1]
    modules = dict(model.named_modules())
    roles = {"input": GemmInputRole.INPUT, "weight": GemmInputRole.WEIGHT, "grad_output": GemmInputRole.GRAD_OUTPUT}
    assert len(seen) == 15 * 3
    for (name, role), x in seen.items():
        module = modules[name]
        cast = getattr(module.config, f"cast_config_{role}")
        fp8 = hp_tensor_to_float8_dynamic(x, cast.target_dtype, module.linear_mm_config, gemm_input_role=roles[role])
        restored = fp8.to_original_precision().float()
        nonzero = x != 0
        underflow = (nonzero & (fp8._data.float() == 0)).sum() / nonzero.sum()
        error = torch.linalg.vector_norm(restored - x.float()) / torch.linalg.vector_norm(x.float())
        key = f"stability/monitors/fp8_{{}}/{name}/{role}"
        assert logged[key.format("underflow")] == pytest.approx(float(underflow), abs=1e-7), (name, role)
        assert logged[key.format("error")] == pytest.approx(float(error), rel=1e-5), (name, role)
        assert logged[key.format("scale")] == pytest.approx(float(fp8._scale), rel=1e-6), (name, role)
        assert logged[key.format("amax")] == pytest.approx(float(x.abs().max()), rel=1e-6), (name, role)
        assert logged[key.format("saturation")] == 0.0
    assert not events


def test_a_healthy_run_raises_no_warning_and_syncs_only_to_log() -> None:
    syncs: list[int] = []
    rows, events, _ = _train(_fp8_llama(), steps=8, every=4, syncs=syncs)
    assert not events
    assert [s for i, s in enumerate(syncs) if i % 4] == [0] * 6, syncs  # unsampled steps: no host sync
    assert all(syncs[i] <= 1 for i in (0, 4)), syncs  # the logging step's one read carries the monitors
    values = [v for _, row in rows.rows for k, v in row.items() if "/fp8_underflow/" in k]
    assert len(values) == 2 * 45 and max(values) < sk.Fp8MonitorConfig().underflow / 5
    errors = [v for _, row in rows.rows for k, v in row.items() if "/fp8_error/" in k]
    assert 0.005 < max(errors) < sk.Fp8MonitorConfig().error / 2


def test_a_massive_activation_warns_for_that_layers_input_only() -> None:
    model = _fp8_llama()
    _inject_outlier(model, OUTLIER_LAYER)
    rows, events, _ = _train(model, steps=6, every=2)
    assert [(e.details["layer"], e.details["role"]) for e in events] == [(OUTLIER_LAYER, "input")]
    assert events[0].step == 2  # the second read above the threshold (patience 2)
    assert events[0].details["underflow"] > 0.99 and events[0].details["fallback"] is False
    last = rows.rows[-1][1]
    assert last[f"stability/monitors/fp8_underflow/{OUTLIER_LAYER}/input"] > 0.99
    others = [v for k, v in last.items() if "/fp8_underflow/" in k and OUTLIER_LAYER + "/input" not in k]
    assert len(others) == 44 and max(others) < sk.Fp8MonitorConfig().underflow


def test_fallback_runs_the_layer_in_high_precision_and_survives_a_resume() -> None:
    from stabilitykit.compat.torchao_float8 import in_high_precision

    model = _fp8_llama()
    _inject_outlier(model, OUTLIER_LAYER)
    rows, events, guard = _train(model, steps=6, every=2, fp8=sk.Fp8MonitorConfig(fallback=True))
    assert [e.details["fallback"] for e in events] == [True]
    modules = dict(model.named_modules())
    assert in_high_precision(modules[OUTLIER_LAYER])
    assert sum(in_high_precision(m) for m in modules.values() if type(m).__name__ == "Float8Linear") == 1
    assert not any(OUTLIER_LAYER in k for k in rows.rows[-1][1])  # no cast left to measure
    state = guard.state_dict()

    fresh = _fp8_llama()
    opt = torch.optim.AdamW(fresh.parameters(), lr=3e-3)
    cfg = sk.StabilityConfig(monitors=sk.MonitorConfig(fp8=sk.Fp8MonitorConfig(fallback=True)))
    resumed = sk.StabilityGuard(fresh, opt, config=cfg)
    resumed.load_state_dict(state)
    assert in_high_precision(dict(fresh.named_modules())[OUTLIER_LAYER])
    assert not in_high_precision(dict(fresh.named_modules())["model.layers.0.mlp.up_proj"])

    plain = tiny_llama()  # not converted: the saved fallback cannot be honoured, and loading says so
    guard = sk.StabilityGuard(plain, torch.optim.AdamW(plain.parameters(), lr=3e-3), config=cfg)
    with pytest.raises(ValueError, match="no Float8Linear for"):
        guard.load_state_dict(state)
