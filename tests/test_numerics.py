"""Numerics toolkit: z-loss, qk-norm, replay of a non-finite batch, data guard, precision, fp16 diagnosis."""

from __future__ import annotations

import math

import pytest
import torch

import stabilitykit as sk
from tests.conftest import assert_bitwise_equal, batches, snapshot


# ------------------------------------------------------------------ z-loss
def test_z_loss_equals_the_formula_with_and_without_mask() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 4
    expected = 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(sk.nn.z_loss(logits), expected)
    mask = torch.rand(3, 5) > 0.4
    expected_masked = 1e-3 * torch.logsumexp(logits, -1)[mask].pow(2).mean()
    torch.testing.assert_close(sk.nn.z_loss(logits, 1e-3, mask=mask), expected_masked)
    with pytest.raises(ValueError, match="mask shape"):
        sk.nn.z_loss(logits, mask=mask[:, :2])


def test_z_loss_gradient_pulls_log_z_toward_zero() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(64, 32) + 3.0).requires_grad_()
    start = torch.logsumexp(logits.detach(), -1).abs().mean()
    opt = torch.optim.SGD([logits], lr=5000.0)
    for _ in range(20):
        opt.zero_grad()
        sk.nn.z_loss(logits, coefficient=1e-2).backward()
        opt.step()
    end = torch.logsumexp(logits.detach(), -1).abs().mean()
    assert end < start * 0.5


def test_cross_entropy_with_z_loss_parts_and_ignore_index() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 9)
    target = torch.randint(0, 9, (2, 6))
    target[0, :2] = -100
    out = sk.nn.cross_entropy_with_z_loss(logits, target, coefficient=1e-4)
    keep = target != -100
    ce = torch.nn.functional.cross_entropy(logits[keep], target[keep])
    lz = torch.logsumexp(logits[keep], -1)
    torch.testing.assert_close(out.cross_entropy, ce)
    torch.testing.assert_close(out.z_loss, 1e-4 * lz.pow(2).mean())
    torch.testing.assert_close(out.loss, ce + out.z_loss)
    torch.testing.assert_close(out.log_z_mean, lz.mean())
    torch.testing.assert_close(out.log_z_max, lz.max())


# ------------------------------------------------------------------ qk-norm
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_qk_norm_gives_unit_rms_per_head_in_both_layouts(kind: str) -> None:
    torch.manual_seed(0)
    b, h, t, d = 2, 4, 5, 8
    norm = sk.nn.QKNorm(d, h, per_head=True, kind=kind)
    q, k = torch.randn(b, h, t, d) * 7 + 1, torch.randn(b, h, t, d) * 0.1
    qn, kn = norm(q, k)
    assert qn.shape == q.shape and kn.shape == k.shape
    for x in (qn, kn):
        torch.testing.assert_close(x.pow(2).mean(-1).sqrt(), torch.ones(b, h, t), rtol=1e-3, atol=1e-3)
    flat_q = q.transpose(1, 2).reshape(b, t, h * d)
    flat_out, _ = norm(flat_q, flat_q)
    torch.testing.assert_close(flat_out.reshape(b, t, h, d).transpose(1, 2), qn, rtol=1e-5, atol=1e-5)


def test_qk_norm_full_width_mode_and_shape_errors() -> None:
    b, h, t, d = 2, 4, 5, 8
    norm = sk.nn.QKNorm(d, h, per_head=False)
    q = torch.randn(b, t, h * d) * 3
    qn, _ = norm(q, q)
    torch.testing.assert_close(qn.pow(2).mean(-1).sqrt(), torch.ones(b, t), rtol=1e-3, atol=1e-3)
    heads, _ = norm(q.reshape(b, t, h, d).transpose(1, 2), q.reshape(b, t, h, d).transpose(1, 2))
    torch.testing.assert_close(heads.transpose(1, 2).reshape(b, t, h * d), qn, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_heads=4, head_dim=8"):
        norm(torch.randn(b, t, 7), torch.randn(b, t, 7))


def test_module_metrics_log_z_and_max_attention_logit_on_logging_steps(tmp_path) -> None:
    model = sk.testing.tiny_gpt(qk_norm=True, z_loss=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(log_every_n_steps=4)
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(tmp_path / "m.jsonl")])
    attn = model.blocks[0].attn
    measured = []
    for x, y in batches(9):
        measured.append(attn.measure_metrics)
        guard.backward(model.loss(x, y))
        guard.step()
        guard.zero_grad()
    guard.close()
    assert measured == [True, False, False, False, True, False, False, False, True]
    rows, _ = sk.sinks.read_jsonl(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [0, 4, 8]
    for row in rows:
        assert 0 < row["stability/attention/max_logit"] < 100
        assert row["stability/logits/log_z_max"] >= row["stability/logits/log_z_mean"] > 0


# ------------------------------------------------------------------ replay
def test_on_nonfinite_replay_names_module_and_source_line(tmp_path) -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode="on_nonfinite"), log_every_n_steps=50)
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("nonfinite", events.append)
    poisoned = {"on": False}

    def poison(module, inputs, output):
        return output * float("nan") if poisoned["on"] else output

    model.blocks[1].mlp.register_forward_hook(poison)
    for i, (x, y) in enumerate(batches(8)):
        poisoned["on"] = i == 5
        before = snapshot(model, opt)
        guard.backward(model.loss(x, y))
        report = guard.step(replay=lambda x=x, y=y: model.loss(x, y))
        guard.zero_grad()
        if i == 5:
            assert bool(report.skipped)
            assert_bitwise_equal(before, snapshot(model, opt))
    record = guard.last_nonfinite
    assert record is not None and record.module.startswith("blocks.1.mlp") and record.phase == "forward"
    assert record.step == 5
    assert record.source is not None and "test_numerics.py" in record.source
    assert len(events) == 1 and events[0].step == 5 and events[0].details["module"] == record.module


# ------------------------------------------------------------------ data guard
def test_check_batch_names_the_bad_label_index_and_step() -> None:
    x, y = batches(1)[0]
    y = y.clone()
    y[2, 7] = 99
    with pytest.raises(sk.BadBatchError, match=r"batch\[1\]\[2\]\[7\] is 99, outside \[0, 64\)") as info:
        sk.check_batch((x, y), num_classes=64, step=12, label_keys=(1,))
    assert info.value.step == 12 and "step 12" in str(info.value)
    with pytest.raises(sk.BadBatchError, match=r"batch\['labels'\]\[0\]\[3\]"):
        bad = y.clone()
        bad[0, 3] = -5
        sk.check_batch({"input_ids": x, "labels": bad}, num_classes=64)


def test_data_guard_skip_mode_skips_the_step_without_a_sync() -> None:
    from stabilitykit.testing.syncs import count_host_syncs

    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    cfg = sk.StabilityConfig(data=sk.DataGuardConfig(mode="skip", num_classes=64, label_keys=[1]), log_every_n_steps=5)
    guard = sk.StabilityGuard(model, opt, cfg)
    events: list[sk.Event] = []
    guard.hooks.on("bad_batch", events.append)
    for i, (x, y) in enumerate(batches(10)):
        if i == 3:
            y = y.clone()
            y[0, 0] = 64
            before = snapshot(model, opt)
        with count_host_syncs() as counter:
            guard.check_batch((x, y))
            guard.backward(model.loss(x, y.clamp(max=63)))
            report = guard.step()
        guard.zero_grad()
        if i == 3:
            assert counter.count == 0
            assert_bitwise_equal(before, snapshot(model, opt))
            assert report.reason == "bad_batch"  # read lazily (step 3 is not a logging step): one sync
    assert [e.step for e in events] == [3]
    assert guard.summary()["skipped"] == 1


# ------------------------------------------------------------------ precision
def test_select_precision_on_cpu_and_tf32_and_determinism(monkeypatch) -> None:
    choice = sk.select_precision("cpu")
    assert choice.amp_dtype == torch.bfloat16 and choice.lightning_precision == "bf16-mixed"
    assert not choice.use_grad_scaler and "bf16" in choice.reason
    with choice.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert sk.configure_tf32() is True and torch.get_float32_matmul_precision() == "high"
        torch.set_float32_matmul_precision("medium")
        assert sk.configure_tf32() is False and torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(previous)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        applied = sk.set_determinism(123)
        assert applied["seed"] == 123 and applied["cudnn.deterministic"] is True
        assert torch.are_deterministic_algorithms_enabled()
        a = torch.rand(3)
        sk.set_determinism(123)
        assert torch.equal(a, torch.rand(3))
    finally:
        torch.use_deterministic_algorithms(False)


# ------------------------------------------------------------------ fp16 overflow diagnosis
def test_repeated_fp16_overflows_recommend_bf16() -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    cfg = sk.StabilityConfig(log_every_n_steps=10, fp16=sk.Fp16Config(window=20, max_overflow_share=0.1))
    guard = sk.StabilityGuard(model, opt, cfg, scaler=scaler)
    warnings: list[sk.Event] = []
    guard.hooks.on("fp16_warning", warnings.append)
    for i, (x, y) in enumerate(batches(21)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(x, y)
        if i % 4 == 1:
            loss = loss * 1e30  # overflows once scaled
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    assert warnings, "no fp16 warning after 5 overflows in 20 steps"
    event = warnings[0]
    assert event.details["recommendation"] == "bf16" and "bf16" in event.message
    assert event.details["overflow_rate"] > 0.1
    assert guard.engine.counters.overflow_total == 5
    assert math.isfinite(guard.engine.readout.last_host_metrics["stability/scaler/scale"])


def test_precision_advice_is_given_only_when_asked() -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    events: list[sk.Event] = []
    hooks = sk.HookManager()
    hooks.on("precision", events.append)
    asked = sk.StabilityConfig(precision=sk.PrecisionConfig(report_choice=True))
    guard = sk.StabilityGuard(model, opt, asked, hooks=hooks)
    assert guard.precision_choice is not None and guard.precision_choice.lightning_precision == "bf16-mixed"
    assert events == []  # emitted with the run's first step
    ((x, y),) = batches(1)
    guard.backward(model.loss(x, y))
    guard.step()
    assert len(events) == 1 and events[0].details["advice"]["amp_dtype"] == "bfloat16" and events[0].step == 0
    assert "advice" in events[0].message and "cpu" in events[0].message
    assert sk.StabilityGuard(model, opt, sk.StabilityConfig()).precision_choice is None  # the default: no advice


def test_precision_event_says_what_a_gradscaler_run_uses(tmp_path, caplog) -> None:
    # fp16 autocast with a GradScaler: the log must not claim bf16 or "no loss scaling needed"
    import logging

    caplog.set_level(logging.INFO, logger="stabilitykit")
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    log = tmp_path / "run.jsonl"
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(), scaler=scaler, sinks=[sk.sinks.JsonlSink(log)])
    for x, y in batches(2):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(x, y)
        guard.backward(loss)
        guard.step()
        guard.zero_grad()
    guard.close()
    _, events = sk.sinks.read_jsonl(log)
    (precision,) = [e for e in events if e["event"] == "precision"]
    assert precision["grad_scaler"] is True and precision["param_dtype"] == "float32"
    assert "GradScaler" in precision["message"] and "bf16" not in precision["message"]
    assert "use_grad_scaler" not in precision and "lightning_precision" not in precision and "advice" not in precision
    lines = [r.getMessage() for r in caplog.records if r.name == "stabilitykit"]
    assert not any("no loss scaling needed" in line or "bf16-mixed" in line for line in lines)
    assert any(line.startswith("precision on cpu: float32 parameters, a GradScaler") for line in lines)
