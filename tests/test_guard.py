"""StabilityGuard on a real tiny GPT: skip-the-batch, clipping, GradScaler, accumulation, state."""

from __future__ import annotations

import math

import pytest
import torch

import stabilitykit as sk
from tests.conftest import assert_bitwise_equal, batches, snapshot

FIXED = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0), log_every_n_steps=5)


def _optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    if kind == "foreach":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)


def _train(model, optimizer, data, config=FIXED, poison=None, scheduler=None, **kwargs):
    guard = sk.StabilityGuard(model, optimizer, config, scheduler=scheduler, **kwargs)
    reports = []
    for i, (x, y) in enumerate(data):
        loss = model.loss(x, y)
        if poison is not None and i == poison:
            loss = loss * float("nan")
        guard.backward(loss)
        reports.append(guard.step())
        guard.zero_grad()
    return guard, reports


@pytest.mark.parametrize("kind", ["fused", "foreach", "sgd"])
def test_nan_batch_is_skipped_bitwise(kind: str) -> None:
    data = batches(30)
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, kind)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    guard = sk.StabilityGuard(model, opt, FIXED, scheduler=sched)
    for _i, (x, y) in enumerate(data[:12]):
        guard.backward(model.loss(x, y))
        guard.step()
        guard.zero_grad()
    before = snapshot(model, opt)
    lr_before = [g["lr"] for g in opt.param_groups]
    x, y = data[12]
    guard.backward(model.loss(x, y) * float("nan"))
    report = guard.step()
    guard.zero_grad()
    assert bool(report.skipped) and report.reason == "nonfinite_loss"
    assert_bitwise_equal(before, snapshot(model, opt))
    if kind != "fused":  # a fused optimizer decides on the device; its scheduler catches up at logging
        assert [g["lr"] for g in opt.param_groups] == lr_before
    for x, y in data[13:]:
        guard.backward(model.loss(x, y))
        guard.step()
        guard.zero_grad()
    assert guard.summary()["skipped"] == 1
    assert sched.last_epoch == len(data) - 1  # the scheduler advanced once per applied update


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_run_with_nan_batch_matches_run_without_it(kind: str) -> None:
    data = batches(16)  # the NaN at logging step 10, then 5 steps (logging step 15 among them) after it
    clean = sk.testing.tiny_gpt()
    opt_clean = _optimizer(clean, kind)
    _train(clean, opt_clean, data[:10] + data[11:])
    dirty = sk.testing.tiny_gpt()
    opt_dirty = _optimizer(dirty, kind)
    _guard, reports = _train(dirty, opt_dirty, data, poison=10)
    assert [r.step for r in reports if bool(r.skipped)] == [10]
    x, y = batches(1, seed=7)[0]
    with torch.no_grad():
        a, b = clean.loss(x, y).item(), dirty.loss(x, y).item()
    assert b == pytest.approx(a, rel=0.01)
    assert_bitwise_equal(snapshot(clean, opt_clean), snapshot(dirty, opt_dirty))


def test_scheduler_catches_up_with_fused_skips_at_logging_step() -> None:
    data = batches(10)
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "fused")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train(model, opt, data, poison=2, scheduler=sched)  # logging steps 0 and 5: debt paid from step 5 on
    assert sched.last_epoch == 9  # 10 steps, one skipped


def test_clipping_and_report_fields() -> None:
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "fused")
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=0.01))
    guard = sk.StabilityGuard(model, opt, cfg)
    x, y = batches(1)[0]
    guard.backward(model.loss(x, y))
    ref = sk.grad_norms(model)["total"].item()
    report = guard.step()
    assert report.grad_norm.item() == pytest.approx(ref, rel=1e-6)
    assert report.clip_coef.item() == pytest.approx(0.01 / (ref + 1e-6), rel=1e-5)
    assert bool(report.clipped) and not bool(report.skipped) and report.reason is None
    assert report.to_dict()["step"] == 0
    assert set(report.layers) >= {"blocks.0", "lm_head"}


def test_adaptive_clipping_clips_a_spike_and_ignores_nan() -> None:
    data = batches(60)
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "fused")
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive", warmup_steps=10), log_every_n_steps=1000)
    guard = sk.StabilityGuard(model, opt, cfg)
    for i, (x, y) in enumerate(data):
        loss = model.loss(x, y)
        if i == 40:
            loss = loss * 1000.0
        if i == 45:
            loss = loss * float("inf")
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if i == 40:
            assert bool(report.clipped) and report.clip_coef.item() < 0.01
        if i < 10:
            assert not bool(report.clipped)
    st = guard.engine.clip.state_dict()
    assert math.isfinite(st["mean"].item()) and math.isfinite(st["var"].item())
    assert st["count"].item() == 59  # the Inf step never entered the statistics


def test_gradient_accumulation_equals_full_batch() -> None:
    x, y = batches(1)[0]
    full = sk.testing.tiny_gpt()
    g_full = sk.StabilityGuard(full, _optimizer(full, "fused"), FIXED)
    g_full.backward(full.loss(x, y))
    r_full = g_full.step()
    acc = sk.testing.tiny_gpt()
    g_acc = sk.StabilityGuard(acc, _optimizer(acc, "fused"), FIXED)
    for half in (slice(0, 4), slice(4, 8)):
        g_acc.backward(acc.loss(x[half], y[half]) / 2)
    r_acc = g_acc.step()
    assert r_acc.grad_norm.item() == pytest.approx(r_full.grad_norm.item(), rel=1e-5)
    assert r_acc.loss.item() == pytest.approx(r_full.loss.item(), rel=1e-5)  # the sum of the halves
    # Adam divides by sqrt(v): for the tiniest grads a reordered float sum moves the update by up to
    # lr * 1e-3, so the tolerance is set from the learning rate (3e-3), not from float32's epsilon
    for a, b in zip(full.parameters(), acc.parameters(), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=3e-6 * 10)


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_fp16_grad_scaler_overflow_step(kind: str) -> None:
    data = batches(12)
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = sk.StabilityGuard(model, opt, FIXED, scaler=scaler)
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model.loss(x, y)
        if i == 6:
            before = snapshot(model, opt)
            scale_before = scaler.get_scale()
            loss = loss * 1e30  # overflows fp16 grads once scaled
        guard.backward(loss)
        report = guard.step()
        guard.zero_grad()
        if i == 6:
            assert bool(report.skipped) and report.reason == "fp16_overflow"
            assert_bitwise_equal(before, snapshot(model, opt))
            assert scaler.get_scale() == scale_before / 2  # update() ran: the scale backed off
        else:
            assert not bool(report.skipped), i
            assert math.isfinite(report.grad_norm.item())
    guard.engine.readout.flush(guard.engine.step)
    assert guard.engine.consecutive == 0  # an fp16 overflow is not a run towards divergence
    assert guard.engine.counters.overflow_total == 1 and guard.engine.counters.skipped_total == 1


def test_fused_scaler_norms_are_unscaled_and_clip_matches_torch() -> None:
    x, y = batches(1)[0]
    model = sk.testing.tiny_gpt()
    twin = sk.testing.tiny_gpt()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=0.05))
    guard = sk.StabilityGuard(model, _optimizer(model, "fused"), cfg, scaler=scaler)
    guard.backward(model.loss(x, y))
    twin.loss(x, y).backward()
    ref = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    scaled = [p.grad.clone() for p in model.parameters()]
    report = guard.engine.evaluate(grad_scale=scaler._get_scale_async(), scaler_active=True)
    assert report.report.grad_norm.item() == pytest.approx(ref.item(), rel=1e-5)
    for p, t, s in zip(model.parameters(), twin.parameters(), scaled, strict=False):
        torch.testing.assert_close(p.grad / 2.0**12, t.grad, rtol=1e-4, atol=1e-8)
        assert not torch.equal(p.grad, s)  # clipped in place, still scaled


def test_unscale_exactly_once_when_user_already_unscaled() -> None:
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "foreach")
    scaler = torch.amp.GradScaler("cpu")
    guard = sk.StabilityGuard(model, opt, FIXED, scaler=scaler)
    x, y = batches(1)[0]
    guard.backward(model.loss(x, y))
    scaler.unscale_(opt)  # e.g. the user looked at the grads
    report = guard.step()  # must not unscale again (that raises in torch)
    assert math.isfinite(report.grad_norm.item()) and report.grad_norm.item() < 100


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_divergence_error_names_step_and_layer(kind: str) -> None:
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, kind)
    cfg = sk.StabilityConfig(skip=sk.SkipConfig(max_consecutive=3), log_every_n_steps=4)
    guard = sk.StabilityGuard(model, opt, cfg)
    seen: list[sk.Event] = []
    guard.hooks.on("diverged", seen.append)
    with pytest.raises(sk.TrainingDivergedError) as info:
        for x, y in batches(12):
            loss = model.loss(x, y)
            model.blocks[2].mlp.fc.weight.register_hook(lambda g: g * float("nan"))
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
    err = info.value
    assert err.consecutive >= 3 and err.layer == "blocks.2"
    assert "blocks.2" in str(err) and f"step {err.step}" in str(err)
    assert err.step <= 4  # fused: found at the next logging step (4); others at once (2)
    assert seen and seen[0].kind == "diverged"


def test_state_dict_round_trip_matches_uninterrupted_run() -> None:
    data = batches(30)

    def run(resume_at: int | None) -> dict:
        model = sk.testing.tiny_gpt()
        opt = _optimizer(model, "fused")
        cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode="adaptive", warmup_steps=5), log_every_n_steps=3)
        guard = sk.StabilityGuard(model, opt, cfg)
        for i, (x, y) in enumerate(data):
            if i == resume_at:
                state = (guard.state_dict(), opt.state_dict(), model.state_dict())
                model = sk.testing.tiny_gpt(seed=1)
                opt = _optimizer(model, "fused")
                model.load_state_dict(state[2])
                opt.load_state_dict(state[1])
                guard = sk.StabilityGuard(model, opt, cfg)
                guard.load_state_dict(state[0])
            loss = model.loss(x, y) * (float("nan") if i in (7, 17) else 1.0)
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        return guard.state_dict()["optimizers"][0]["engine"]

    straight, resumed = run(None), run(15)
    assert straight["step"] == resumed["step"] == 30
    assert straight["ledger"] == resumed["ledger"]
    for name, value in straight["clip"].items():
        torch.testing.assert_close(value, resumed["clip"][name], rtol=0, atol=0, msg=f"clip.{name}")
    torch.testing.assert_close(straight["journal"]["rows"], resumed["journal"]["rows"], rtol=0, atol=0, equal_nan=True)
    assert straight["journal"]["infos"] == resumed["journal"]["infos"]
    assert straight["ledger"]["counters"]["skipped_total"] == 2


def test_jsonl_sink_lines_and_failing_sink_is_disabled(tmp_path) -> None:
    class Broken:
        calls = 0

        def log_metrics(self, metrics, step):
            Broken.calls += 1
            raise ConnectionError("logging backend down")

    path = tmp_path / "run.jsonl"
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "fused")
    with pytest.warns(RuntimeWarning, match="Broken.*disabled"):
        _guard, _ = _train(model, opt, batches(20), poison=3, sinks=[Broken(), sk.sinks.JsonlSink(path)])
    assert Broken.calls == 1
    rows, events = sk.sinks.read_jsonl(path)
    assert [r["step"] for r in rows] == [0, 5, 10, 15]
    assert rows[1]["stability/skipped/total"] == 1
    assert "stability/grad_norm/blocks.0" in rows[0] and "stability/loss" in rows[0]
    assert {e["event"] for e in events} >= {"nonfinite", "skipped"}
    skipped = next(e for e in events if e["event"] == "skipped")
    assert skipped["step"] == 3 and skipped["reason"] == "nonfinite_loss"


def test_schedule_step_counts_steps_less_skips_and_survives_a_resume() -> None:
    """``guard.schedule_step`` (for an LR set by hand) waits on a skip, as a held scheduler does."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = sk.StabilityGuard(model, optimizer, sk.StabilityConfig(log_every_n_steps=10))
    seen = []
    for step in range(6):
        seen.append(guard.schedule_step)
        loss = model(torch.randn(3, 4)).pow(2).mean()
        guard.backward(loss * float("nan") if step == 2 else loss)
        guard.step()
        guard.zero_grad()
    assert seen == [0, 1, 2, 2, 3, 4]
    state = guard.state_dict()
    other = sk.StabilityGuard(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sk.StabilityConfig())
    other.load_state_dict(state)
    assert other.schedule_step == 5 and other.step_count == 6
    guard.close()
    other.close()


def test_reading_the_summary_before_close_keeps_the_final_row(tmp_path) -> None:
    # the quickstart's order: print(guard.summary().line()), then guard.close()
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "fused")
    log = tmp_path / "run.jsonl"
    cfg = sk.StabilityConfig(log_every_n_steps=10)
    guard, _ = _train(model, opt, batches(25), config=cfg, sinks=[sk.sinks.JsonlSink(log)])
    summary = guard.summary()
    assert summary["steps"] == 25
    guard.close()
    rows, _ = sk.sinks.read_jsonl(log)
    assert [row["step"] for row in rows] == [0, 10, 20, 24]
    assert guard.summary()["steps"] == 25  # reading it again changes nothing
    assert [row["step"] for row in sk.sinks.read_jsonl(log)[0]] == [0, 10, 20, 24]


@pytest.mark.parametrize("with_scheduler", [False, True])
def test_a_fused_skip_names_the_scheduler_hold_only_with_a_scheduler(with_scheduler: bool) -> None:
    model = sk.testing.tiny_gpt()
    opt = _optimizer(model, "fused")
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0) if with_scheduler else None
    messages: list[str] = []
    cfg = sk.StabilityConfig(log_every_n_steps=5)
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=scheduler)
    guard.hooks.on("skipped", lambda event: messages.append(event.message))
    for i, (x, y) in enumerate(batches(6)):
        guard.backward(model.loss(x, y) * (float("nan") if i == 2 else 1.0))
        guard.step()
        guard.zero_grad()
    guard.close()
    (message,) = messages
    assert "fused optimizer" in message
    assert ("LR scheduler" in message) is with_scheduler
