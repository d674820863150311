"""What a skip guarantees, and bad input refused by name: buffers, optimizer state a skipped step
would create, optimizer subclasses, failing replays, corrupted state, frozen configs, unsupported
parameters and optimizers."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

import stabilitykit as sk
from stabilitykit.state import STATE_VERSION

NAN = float("nan")


def _bn_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def _data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.parametrize("trace", ["off", "on_nonfinite"])
def test_a_skipped_step_leaves_batchnorm_running_stats_as_they_were(fused: bool, trace: str) -> None:
    model = _bn_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode=trace), log_every_n_steps=100)
    guard = sk.StabilityGuard(model, opt, cfg)
    bn = model[1]
    for step, (x, y) in enumerate(_data(8)):
        if step == 4:
            x = x.clone()
            x[0, 0] = NAN
            before = {name: b.clone() for name, b in bn.named_buffers()}
        loss_fn = lambda x=x, y=y: torch.nn.functional.cross_entropy(model(x), y)
        guard.backward(loss_fn())
        report = guard.step(replay=loss_fn)
        guard.zero_grad()
        if step == 4:
            assert bool(report.skipped)
            for name, value in bn.named_buffers():
                assert torch.equal(value, before[name]), f"BatchNorm {name} changed on a skipped step"
    assert bn.num_batches_tracked.item() == 7
    model.eval()
    assert torch.isfinite(model(_data(1)[0][0])).all()


def test_fused_sgd_momentum_created_by_a_skipped_first_step_does_not_survive() -> None:
    data = _data(4)
    torch.manual_seed(0)
    model, reference = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, fused=True)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=100))
    x, y = data[0]
    guard.backward(torch.nn.functional.cross_entropy(model(x), y) * NAN)  # NaN on the very first step
    assert bool(guard.step().skipped)
    guard.zero_grad()
    assert not any(opt.state.get(p) for p in model.parameters()), "the skipped step created momentum buffers"
    for x, y in data[1:]:
        guard.backward(torch.nn.functional.cross_entropy(model(x), y))
        guard.step()
        guard.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_subclass_with_its_own_step_work_is_skipped_on_the_host() -> None:
    class EmaAdamW(torch.optim.AdamW):
        def __init__(self, params, **kwargs):
            super().__init__(params, **kwargs)
            self.ema_updates = 0

        def step(self, closure=None):
            out = super().step(closure)
            self.ema_updates += 1  # extra work a found_inf skip would not stop
            return out

    model = torch.nn.Linear(8, 4)
    opt = EmaAdamW(model.parameters(), lr=1e-2, fused=True)
    assert not sk.engine.is_fused(opt)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=100))
    for step, (x, y) in enumerate(_data(4)):
        guard.backward(torch.nn.functional.cross_entropy(model(x), y) * (NAN if step == 2 else 1.0))
        guard.step()
        guard.zero_grad()
    assert opt.ema_updates == 3


def test_a_failing_replay_warns_and_training_goes_on() -> None:
    model = _bn_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = sk.StabilityConfig(nan_trace=sk.NaNTraceConfig(mode="on_nonfinite"), log_every_n_steps=100)
    guard = sk.StabilityGuard(model, opt, cfg)

    def gone() -> torch.Tensor:
        raise KeyError("the batch is gone")

    x, y = _data(1)[0]
    guard.backward(torch.nn.functional.cross_entropy(model(x), y) * NAN)
    with pytest.warns(RuntimeWarning, match="replaying the non-finite batch of step 0 failed"):
        report = guard.step(replay=gone)
    assert bool(report.skipped) and guard.step_count == 1


def _trained_guard(steps: int = 3) -> sk.StabilityGuard:
    model = _bn_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=2))
    for x, y in _data(steps):
        guard.backward(torch.nn.functional.cross_entropy(model(x), y))
        guard.step()
        guard.zero_grad()
    return guard


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda s: s["optimizers"][0]["engine"]["ledger"].pop("counters"), "optimizers.0.engine.ledger.counters"),
        (
            lambda s: s["optimizers"][0]["engine"]["ledger"]["counters"].update(skipped_total="3"),
            "optimizers.0.engine.ledger.counters.skipped_total",
        ),
        (lambda s: s["optimizers"][0]["engine"].update(step=-4), "optimizers.0.engine.step"),
        (lambda s: s["optimizers"][0].pop("engine"), "optimizers.0.engine"),
        (lambda s: s["optimizers"][0]["engine"]["journal"].update(rows=[[1.0]]), "optimizers.0.engine.journal.rows"),
    ],
)
def test_corrupted_state_is_refused_by_key_and_nothing_loads(mutate, where: str) -> None:
    source = _trained_guard(5)
    state = copy.deepcopy(source.state_dict())
    mutate(state)
    target = _trained_guard(2)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=f"'{where}'") as err:
        target.load_state_dict(state)
    assert "Nothing was loaded" in str(err.value)
    after = target.state_dict()
    (after_core,), (before_core,) = after["optimizers"], before["optimizers"]
    assert after_core["engine"]["step"] == before_core["engine"]["step"] == 2
    assert after_core["engine"]["ledger"] == before_core["engine"]["ledger"]


def test_state_from_a_newer_release_is_refused() -> None:
    guard = _trained_guard()
    state = guard.state_dict()
    state["version"] = 99
    with pytest.raises(ValueError, match="newer than this release"):
        guard.load_state_dict(state)


def test_configs_are_frozen_and_bad_config_arguments_are_named(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(clip=sk.ClipConfig(mode="fixed", max_norm=1.0)))
    with pytest.raises(ValidationError, match="frozen"):
        guard.config.clip.max_norm = 5.0  # used to be accepted and silently ignored
    path = tmp_path / "cfg.yaml"
    path.write_text("clip:\n  mode: fixed\n  max_norm: 0.5\n")
    assert sk.StabilityGuard(model, opt, config=str(path)).config.clip.max_norm == 0.5
    with pytest.raises(TypeError, match="ClipConfig go inside one"):
        sk.StabilityGuard(model, opt, config=sk.ClipConfig(mode="fixed"))  # type: ignore[arg-type]


def test_a_contradiction_that_can_never_take_effect_warns_once() -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = sk.StabilityConfig(skip=sk.SkipConfig(nonfinite=False, max_consecutive=3))
    sk.config._WARNED.clear()  # once per process: start this test from a clean slate
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sk.StabilityGuard(model, opt, cfg)
        sk.StabilityGuard(model, opt, cfg)
    assert sum("max_consecutive=...) has no effect" in str(w.message) for w in caught) == 1


def test_unsupported_parameters_and_optimizers_are_refused_by_name() -> None:
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"module '0' \(Embedding\(sparse=True\)\)"):
        sk.StabilityGuard(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1))
    complex_net = torch.nn.Linear(4, 4).to(torch.complex64)
    with pytest.raises(TypeError, match="parameter 'weight' is complex"):
        sk.StabilityGuard(complex_net, torch.optim.SGD(complex_net.parameters(), lr=0.1))
    net = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"cannot guard torch\.optim\.LBFGS"):
        sk.StabilityGuard(net, torch.optim.LBFGS(net.parameters()))


def test_skip_on_spike_skips_a_finite_outlier_on_the_device_with_state_intact() -> None:
    from stabilitykit.testing.syncs import count_host_syncs

    model = _bn_net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    cfg = sk.StabilityConfig(skip=sk.SkipConfig(spike=True, spike_warmup_steps=10), log_every_n_steps=100)
    guard = sk.StabilityGuard(model, opt, cfg)
    reports = []
    for step, (x, y) in enumerate(_data(30)):
        loss = torch.nn.functional.cross_entropy(model(x), y) * (1000.0 if step == 25 else 1.0)
        guard.backward(loss)
        if step == 25:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with count_host_syncs() as syncs:
                report = guard.step()
            assert syncs.count == 0
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        else:
            report = guard.step()
        guard.zero_grad()
        reports.append(report)
    assert [r.step for r in reports if bool(r.skipped)] == [25]
    assert reports[25].reason == "spike"
    assert guard.summary()["skipped"] == 1


def _fused_guard_with_unread_nan_row() -> tuple[torch.nn.Module, dict]:
    """A fused guard whose state holds two unread rows, the second a NaN step."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=10))
    for i in range(3):  # step 0 logs; steps 1 and 2 stay unread on the device (fused: no read)
        guard.backward(model(torch.randn(8, 4)).sum() * (float("nan") if i == 2 else 1.0))
        guard.step()
        guard.zero_grad()
    state = guard.state_dict()
    assert state["version"] == STATE_VERSION
    return model, state


def _as_version_10(state: dict) -> dict:
    """``state`` as version 10 wrote it: the journal's snapshot column was named ``verdict``, and the spike monitor
    kept no recent losses and held no look."""
    old = copy.deepcopy(state)
    old["version"] = 10
    journal = old["optimizers"][0]["engine"]["journal"]
    assert "health" in journal["columns"]
    journal["columns"] = ["verdict" if c == "health" else c for c in journal["columns"]]
    journal["carried"] = [{("verdict" if k == "health" else k): v for k, v in r.items()} for r in journal["carried"]]
    spikes = old["optimizers"][0]["engine"]["ledger"]["spikes"]
    for key in ("median", "median_alerted", "pending_look"):  # the spike monitor's parts of version 13
        del spikes[key]
    return old


def test_a_state_of_the_version_before_loads() -> None:
    """A version 10 state (its journal's snapshot column named ``verdict``) loads: its unread rows, held for
    the device or carried on the host, are folded as this version's are (older layouts are refused:
    ``test_recovery_escalation.py``)."""
    model, state = _fused_guard_with_unread_nan_row()

    def fresh(every: int) -> sk.StabilityGuard:
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)
        return sk.StabilityGuard(model, optimizer, sk.StabilityConfig(log_every_n_steps=every))

    carrier = fresh(1)  # another cadence: the saved rows are carried on the host, and saved so
    carrier.load_state_dict(state)
    carried = carrier.state_dict()
    assert len(carried["optimizers"][0]["engine"]["journal"]["carried"]) == 2
    for saved in (state, carried):
        old = _as_version_10(saved)
        guard = fresh(10)
        guard.load_state_dict(old)
        guard.backward(model(torch.randn(8, 4)).sum())
        guard.step()
        assert (guard.summary().steps, guard.summary().skipped) == (4, 1)
        assert guard.engine.counters.last_bad_reason == "nonfinite_loss"
        assert old["version"] == 10 and "verdict" in old["optimizers"][0]["engine"]["journal"]["columns"]


@pytest.mark.parametrize("every", [1, 2, 5, 20])
def test_a_resume_with_another_log_cadence_folds_the_saved_rows(every: int) -> None:
    """State saved with log_every_n_steps=10 holding unread rows (one a NaN step) loads under another
    cadence: the rows are folded, nothing is lost, and training goes on at the new cadence."""
    model, state = _fused_guard_with_unread_nan_row()
    rows_jsonl: list[int] = []

    class Steps:
        def log_metrics(self, metrics: dict, step: int) -> None:
            rows_jsonl.append(step)

    fresh = sk.StabilityGuard(
        model,
        torch.optim.AdamW(model.parameters(), fused=True),
        sk.StabilityConfig(log_every_n_steps=every),
        sinks=[Steps()],
    )
    fresh.load_state_dict(state)
    for _ in range(6):
        fresh.backward(model(torch.randn(8, 4)).sum())
        fresh.step()
        fresh.zero_grad()
    summary = fresh.summary()
    assert summary.steps == 9
    assert summary.skipped == 1
    assert fresh.engine.counters.last_bad_reason == "nonfinite_loss"
    assert rows_jsonl == [s for s in range(3, 9) if s % every == 0]
