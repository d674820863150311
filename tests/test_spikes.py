"""Spike detectors, the warning/alert monitor and device-side skip-on-spike, on real values (no model needed)."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from stabilitykit.config import SkipConfig, SpikeConfig
from stabilitykit.events import EVENT_KINDS, Event
from stabilitykit.spike_skip import SpikeSkipRule
from stabilitykit.spikes import (
    DRIFT_RULE,
    LEVEL_RULE,
    MEDIAN_RULE,
    PredictiveDetector,
    SpikeMonitor,
    TrendDetector,
)
from stabilitykit.testing.syncs import count_host_syncs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from spike_suite import ground_truth, olmo_rule, synthetic_stream


def _ar1(n: int, sigma: float, phi: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    noise, out = 0.0, []
    for _ in range(n):
        noise = phi * noise + sigma * math.sqrt(1 - phi * phi) * rng.gauss(0, 1)
        out.append(math.exp(noise))
    return out


def test_predictive_detector_learns_autocorrelation_and_scores_a_3x_jump() -> None:
    values = _ar1(2000, sigma=0.35, phi=0.9, seed=1)  # innovation 0.153: a 3x jump is ~7 deviations
    detector = PredictiveDetector(size=1)
    for x in values:
        detector.update([x])
    assert 0.6 < detector.phi() < 0.98
    assert 0.10 < detector.scale() < 0.25  # near the innovation, far below the stationary 0.35
    z = detector.update([values[-1] * 3.0])[0]
    assert z > 5.0


def test_predictive_detector_scale_is_debiased_from_the_first_steps_for_any_scale_alpha() -> None:
    values = _ar1(40, sigma=0.1, phi=0.0, seed=11)
    scales = {}
    for scale_rate in (0.1, 0.03):
        detector = PredictiveDetector(size=1, scale_rate=scale_rate)
        for x in values:
            detector.update([x])
        scales[scale_rate] = detector.scale()
    # noise std 0.1 (sample: 0.12); an EMA started at 0 would sit at 1 - 0.97**39 = 70% of it at 0.03
    assert all(0.1 < s < 0.16 for s in scales.values()), scales  # undebiased: 0.085 at 0.03
    with pytest.raises(ValueError, match="scale_rate"):
        PredictiveDetector(scale_rate=1.5)


def test_predictive_detector_never_ingests_nan_or_inf_and_keeps_scoring() -> None:
    detector = PredictiveDetector(size=1)
    for x in _ar1(200, 0.1, 0.5, seed=2):
        detector.update([x])
    before = detector.state_dict()
    assert detector.update([math.nan]) == [0.0] and detector.update([math.inf]) == [0.0]
    assert detector.update([-1.0]) == [0.0]
    assert detector.state_dict() == before
    assert detector.update([10.0])[0] > 10  # a 10x jump right after the NaN is still seen


def test_monitor_alerts_rarely_on_a_noisy_autocorrelated_stream_and_catches_spikes() -> None:
    stream = synthetic_stream(0.35, 0.9, seed=3, steps=4000)
    monitor = SpikeMonitor(SpikeConfig(), [])
    alerts: set[int] = set()
    for step, x in enumerate(stream.values):
        if any(e.kind == "spike_alert" for e in monitor.update(step, x, None, None)):
            alerts.add(step)
    big = [t for t, f in stream.spikes.items() if f >= 3]
    recall = sum(t in alerts for t in big) / len(big)
    clean = [t for t in range(100, len(stream.values)) if t not in stream.spikes and t not in stream.bad]
    false_alarms = sum(t in alerts for t in clean if t not in stream.ignore)
    assert recall >= 0.9
    assert false_alarms <= 2
    # the window rule users compare with misses more of the same spikes
    flag = olmo_rule()
    olmo = {t for t, x in enumerate(stream.values) if flag(x)}
    assert sum(t in olmo for t in big) / len(big) < recall


def test_monitor_with_a_loss_alerts_only_when_grad_norm_and_loss_jump_together() -> None:
    """A 20x grad-norm outlier the loss does not follow pages never; by default (``look_confirm_steps``) it is not
    even a look, only a count (``spikes/grad_jumps_unconfirmed``), and a look held across a resume is the same.
    Grad norm and loss jumping together page, and the look is raised at once (the loss followed)."""

    def run(config: SpikeConfig, resume_at: int | None = None) -> tuple[SpikeMonitor, dict[int, list[Event]]]:
        monitor = SpikeMonitor(config, [])
        values = _ar1(300, 0.1, 0.5, seed=7)
        losses = [2.0 * math.exp(0.03 * random.Random(t).gauss(0, 1)) for t in range(300)]
        events: dict[int, list[Event]] = {}
        for t in range(300):
            if t == resume_at:
                saved, monitor = monitor.state_dict(), SpikeMonitor(config, [])
                monitor.load_state_dict(saved)
            x, loss = values[t], losses[t]
            if t == 150:
                x *= 20  # a one-batch grad-norm outlier: the loss does not move
            if t == 250:
                x, loss = x * 5, loss * 1.5  # both jump: a real spike
            events[t] = monitor.update(t, x, loss, None)
        return monitor, events

    def kinds(events: dict[int, list[Event]]) -> dict[int, list[str]]:
        return {t: [e.kind for e in es] for t, es in events.items() if es}

    monitor, events = run(SpikeConfig(look_confirm_steps=None))
    assert "spike_warning" in kinds(events)[150] and "spike_alert" not in kinds(events)[150]
    assert "spike_alert" in kinds(events)[250]
    for resume_at in (None, 151):  # the outlier's look held at the save
        monitor, events = run(SpikeConfig(), resume_at)
        assert 150 not in kinds(events) and monitor.metrics()["spikes/grad_jumps_unconfirmed"] == 1.0
        assert kinds(events)[250] == ["spike_warning", "loss_spike", "spike_alert"]
        assert events[250][0].details["jump_step"] == 250 and events[250][0].details["source"] == "grad_norm"


def test_a_joint_jump_pages_only_when_the_loss_holds_at_the_next_step() -> None:
    """A hard batch raises grad norm and loss for one step and the loss falls back: a look at most, no page
    (``joint_confirm``); the same jump held pages one step later, as the joint rule."""
    values = _ar1(300, 0.1, 0.5, seed=7)
    losses = [2.0 * math.exp(0.03 * random.Random(t).gauss(0, 1)) for t in range(300)]

    def alerts(config: SpikeConfig) -> list[tuple[int, Any]]:
        monitor, out = SpikeMonitor(config, []), []
        for t in range(300):
            x, loss = values[t], losses[t]
            if t == 150:
                x, loss = x * 3, loss * 1.15  # one hard batch: loss z-score 4.6, under z_loss_alert
            if 250 <= t < 253:
                x, loss = x * 3, loss * 1.2  # a rise that holds
            out += [(e.step, e.details["rule"]) for e in monitor.update(t, x, loss, None) if e.kind == "spike_alert"]
        return out

    assert alerts(SpikeConfig()) == [(251, "grad norm and loss")]
    assert alerts(SpikeConfig(joint_confirm=False)) == [(150, "grad norm and loss"), (250, "grad norm and loss")]


def test_looks_keep_a_cooldown_and_a_precursor_rearms_only_after_falling_back_across_a_resume() -> None:
    """Two layers' attention logits grow 18x, 8 steps apart, then hover (x/÷1.3 every 4 steps): one look
    (``warning_cooldown``); without the cooldown one per layer, and with no hysteresis (``trend_rearm=1``)
    each layer warns again as it hovers at the threshold. A resume inside the cooldown keeps it."""

    def logit(t: int, lag: int) -> float:
        wiggle = (1.3 if (t // 4) % 2 else 1 / 1.3) if t > 215 + lag else 1.0
        return 10.0 * 1.05 ** min(max(0, t - 150 - lag), 60) * wiggle

    def looks(monitor: SpikeMonitor, steps: range) -> list[tuple[int, str]]:
        events: list[Event] = []
        for t in steps:
            signals = {"monitors/attn_logit_max/h.0.attn": logit(t, 0), "monitors/attn_logit_max/h.1.attn": logit(t, 8)}
            events += monitor.update(t, 1.0, 2.0, None, signals=signals)
        return [(e.step, str(e.details["module"])) for e in events if e.kind == "spike_warning"]

    assert looks(SpikeMonitor(SpikeConfig(), []), range(300)) == [(198, "h.0.attn")]
    assert looks(SpikeMonitor(SpikeConfig(warning_cooldown=1), []), range(300)) == [
        (198, "h.0.attn"),
        (206, "h.1.attn"),
    ]
    flapping = looks(SpikeMonitor(SpikeConfig(warning_cooldown=1, trend_rearm=1.0), []), range(300))
    assert flapping == [(198, "h.0.attn"), (206, "h.1.attn"), (252, "h.0.attn"), (260, "h.1.attn")]
    a, b = SpikeMonitor(SpikeConfig(), []), SpikeMonitor(SpikeConfig(), [])
    looks(a, range(200))
    b.load_state_dict(a.state_dict())
    assert b.last_warning_step == 198 and looks(b, range(200, 300)) == looks(a, range(200, 300)) == []


def test_monitor_warning_is_separate_from_alert_and_names_the_signal() -> None:
    monitor = SpikeMonitor(SpikeConfig(per_layer=True), ["a", "b"])
    rng = random.Random(0)
    events = []
    for step in range(300):
        grad = math.exp(rng.gauss(0, 0.05))
        logit = 10.0 * (1.04 ** max(0, step - 150))  # attention logit growth after step 150 (4x in 35 steps)
        events += monitor.update(step, grad, 2.0, [grad, grad], signals={"attention/max_logit": logit})
    kinds = [e.kind for e in events]
    assert "spike_warning" in kinds and "spike_alert" not in kinds
    assert any(e.details.get("signal") == "attention/max_logit" for e in events)
    warning = next(e for e in events if e.details.get("signal") == "attention/max_logit")
    assert warning.details["source"] == "attention_logits" and "qk-norm" in warning.details["advice"]
    assert "qk-norm" in warning.message
    assert "spike_alert" in EVENT_KINDS


def test_trend_detector_keeps_its_time_constants_when_fed_on_logging_steps_only() -> None:
    every, sparse = TrendDetector(), TrendDetector()
    growth_every = growth_sparse = 0.0
    for step in range(300):
        logit = 10.0 * 1.02 ** max(0, step - 100)
        growth_every = every.update(logit, step)
        if step % 10 == 0:
            growth_sparse = sparse.update(logit, step)
            if step == 60:
                assert growth_sparse == 0.0 and sparse.count == 7  # warm after 50 steps, not 50 values
    assert growth_every > 1.0
    assert abs(growth_sparse - growth_every) < 0.25 * growth_every
    twin = TrendDetector()
    twin.load_state_dict(sparse.state_dict())
    assert twin.update(40.0, 300) == sparse.update(40.0, 300)


def test_monitor_alert_cooldown_and_state_round_trip() -> None:
    cfg = SpikeConfig(alert_cooldown=10)
    a, b = SpikeMonitor(cfg, []), SpikeMonitor(cfg, [])
    values = _ar1(300, 0.1, 0.5, seed=4)
    for step, x in enumerate(values[:200]):
        a.update(step, x, None, None)
    b.load_state_dict(a.state_dict())
    earlier = a.metrics()["spikes/alerts"]
    out_a, out_b = [], []
    for step in range(200, 215):
        x = 50.0 if step in (201, 205, 213) else values[step]
        out_a += [e.kind for e in a.update(step, x, None, None) if e.kind == "spike_alert"]
        out_b += [e.kind for e in b.update(step, x, None, None) if e.kind == "spike_alert"]
    assert out_a == out_b == ["spike_alert", "spike_alert"]  # 201 and 213; 205 falls in the cooldown
    assert a.metrics()["spikes/alerts"] == earlier + 2


def test_loss_drift_alert_catches_a_loss_that_climbs_over_several_steps_and_is_on_at_4_by_default() -> None:
    rng = random.Random(8)
    grads = [math.exp(0.05 * rng.gauss(0, 1)) for _ in range(400)]
    losses = [3.0 * math.exp(0.04 * rng.gauss(0, 1)) for _ in range(400)]
    for t in range(300, 400):
        losses[t] *= math.exp(0.05 * min(t - 299, 15))  # +5% a step for 15 steps: no step's z reaches 3
    runs = {}
    assert SpikeConfig().loss_drift_alert == 4.0  # chosen on the monitors benchmark's tuning runs
    for drift in (None, 4.0):
        alone = SpikeConfig(loss_drift_alert=drift, loss_level_alert=None, loss_median_alert=None)  # the drift rule
        monitor = SpikeMonitor(alone, [])
        alerts, top = [], 0.0
        for t in range(400):
            alerts += [e for e in monitor.update(t, grads[t], losses[t], None) if e.kind == "spike_alert"]
            top = max(top, monitor.last_z[1]) if 300 <= t < 315 else top
        runs[drift] = alerts
    assert top < SpikeConfig().z_joint
    assert runs[None] == []
    assert [e.step for e in runs[4.0]] == [304]
    event = runs[4.0][0]
    assert event.details["rule"].startswith("loss (") and "climbed" in event.message
    assert event.details["loss_drift"] >= 4.0


def test_a_jump_inside_the_cooldown_of_a_drift_alert_still_alerts_but_not_of_a_jump_alert() -> None:
    """A loss that climbs (drift alert), then jumps 10 steps later: the jump pages too (the climb became a
    jump; a ``spike_alert`` recovery trigger acts on it). A second jump inside a jump's cooldown does not."""
    rng = random.Random(8)
    grads = [math.exp(0.05 * rng.gauss(0, 1)) for _ in range(400)]
    losses = [3.0 * math.exp(0.04 * rng.gauss(0, 1)) for _ in range(400)]
    for t in range(300, 400):
        losses[t] *= math.exp(0.05 * min(t - 299, 15))  # the climb of the test above: a drift alert at 304
    losses[314] *= 20.0  # then a jump, 10 steps later
    losses[320] *= 20.0  # and another jump, 6 steps after that one
    monitor = SpikeMonitor(SpikeConfig(), [])
    alerts = [e for t in range(400) for e in monitor.update(t, grads[t], losses[t], None)]
    alerts = [e for e in alerts if e.kind == "spike_alert"]
    assert [(e.step, e.details["rule"]) for e in alerts] == [(304, DRIFT_RULE), (314, "loss")]
    restored = SpikeMonitor(SpikeConfig(), [])
    restored.load_state_dict(monitor.state_dict())
    assert restored.last_alert_drift is False and restored.last_alert_step == 314


def test_loss_drift_state_round_trips_and_resets_after_an_alert() -> None:
    cfg = SpikeConfig(loss_drift_alert=5.0)
    a, b = SpikeMonitor(cfg, []), SpikeMonitor(cfg, [])
    rng = random.Random(3)
    for t in range(100):
        a.update(t, math.exp(0.05 * rng.gauss(0, 1)), 2.0 * math.exp(0.04 * rng.gauss(0, 1)), None)
    a.update(100, 1.0, 2.0 * math.exp(0.1), None)  # one ~2.5-scale rise: some excess, no alert
    assert 0 < a.loss_drift < 5.0 and a.metrics()["spikes/loss_drift"] == a.loss_drift
    b.load_state_dict(a.state_dict())
    assert b.loss_drift == a.loss_drift
    events = [e for t in range(101, 104) for e in a.update(t, 1.0, 2.0 * math.exp(0.1 * (t - 99)), None)]
    assert [e.kind for e in events].count("spike_alert") == 1 and a.loss_drift < 5.0


def test_ground_truth_rule_finds_a_spike_and_a_divergence() -> None:
    loss = [3.0 - 0.001 * t for t in range(400)]
    loss[150] = 5.0
    for t in range(250, 400):
        loss[t] = 8.0
    truth = ground_truth(loss)
    assert truth.spikes[0] == (150, 150) and truth.divergences == [250]
    assert not truth.healthy[150] and truth.healthy[110] and not truth.healthy[300]
    # the early-warning corpus's rule: the same on a quiet loss, and on a loss that moves ~25% a step
    # (ResNet's) it labels a burst that holds, not the noise, and not a lone step 1.5x up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "warning"))
    from truth import onsets_of

    quiet = onsets_of(np.array(loss))
    assert quiet.onsets == [(150, 150), (250, 250)] and np.array_equal(quiet.healthy, truth.healthy)
    rng = np.random.default_rng(0)
    noisy = 0.6 * np.exp(0.25 * rng.standard_normal(500))
    noisy[300] = 0.6 * 1.5
    noisy[200:210] *= 4.0
    found = onsets_of(noisy)
    assert [t for _, t in found.onsets] == [200], found.onsets
    assert ground_truth(noisy).spikes[0][1] < 200  # the rule written on language models labels the noise


# ----------------------------------------------------------------------------- skip-on-spike
def _feed(rule: SpikeSkipRule, values: list[float], loss: float = 2.0) -> list[bool]:
    out = []
    for v in values:
        total = torch.tensor(v)
        out.append(bool(rule.decide(total, torch.tensor(loss), torch.isfinite(total))))
    return out


def test_spike_skip_rule_skips_an_outlier_and_not_the_noise() -> None:
    rule = SpikeSkipRule(z_threshold=6.0, warmup_steps=20)
    noise = _ar1(300, 0.1, 0.0, seed=5)
    assert not any(_feed(rule, noise))
    assert _feed(rule, [20.0]) == [True]
    assert not any(_feed(rule, noise[:50]))


def test_spike_skip_rule_is_nan_safe_and_adopts_a_level_shift() -> None:
    rule = SpikeSkipRule(z_threshold=6.0, warmup_steps=20)
    _feed(rule, _ar1(100, 0.05, 0.0, seed=6))
    before = {k: v.clone() for k, v in rule.state_dict().items()}
    assert _feed(rule, [math.nan, math.inf]) == [False, False]  # the non-finite rule skips these
    after = rule.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    flags = _feed(rule, [5.0] * 20)  # a lasting 5x level shift: skipped briefly, then adopted
    assert flags[0] and not any(flags[10:])
    skip_loss = rule.decide(torch.tensor(5.0), torch.tensor(40.0), torch.tensor(True))
    assert bool(skip_loss)  # a loss 20x above its level is a spike too


def test_spike_skip_rule_makes_no_host_sync_and_round_trips() -> None:
    rule = SpikeSkipRule(warmup_steps=5)
    values = torch.exp(torch.randn(30) * 0.1)
    with count_host_syncs() as syncs:
        flags = [rule.decide(v, torch.tensor(2.0), torch.isfinite(v)) for v in values]
    assert syncs.count == 0 and all(f.dtype == torch.bool and f.dim() == 0 for f in flags)
    twin = SpikeSkipRule(warmup_steps=5)
    twin.load_state_dict(rule.state_dict())
    x = torch.tensor(30.0)
    assert bool(rule.decide(x)) and bool(twin.decide(x))
    with pytest.raises(KeyError, match="count"):
        twin.load_state_dict({"mean": torch.zeros(2), "abs_dev": torch.zeros(2)})


def test_skip_config_spike_fields_validate() -> None:
    cfg = SkipConfig(spike=True, spike_z=5.0)
    assert cfg.spike and cfg.spike_z == 5.0 and cfg.spike_warmup_steps == 50
    with pytest.raises(ValueError, match="spike_rate"):
        SkipConfig(spike_rate=1.5)


def _early_run(blow_up_at: int, factor: float, steps: int = 200, **config: Any) -> list[Event]:
    """Alerts on a loss that falls from 5.5 to 2 over 60 steps (noise 4%), held ``factor`` times higher from
    ``blow_up_at`` on (reached over 10 steps), grad norms stationary."""
    rng = random.Random(5)
    monitor = SpikeMonitor(SpikeConfig(**config), [])
    alerts = []
    for t in range(steps):
        loss = (2.0 + 3.5 * math.exp(-t / 15)) * math.exp(0.04 * rng.gauss(0, 1))
        if t >= blow_up_at:
            loss *= factor ** min(1.0, (t - blow_up_at + 1) / 10)
        grad = math.exp(0.05 * rng.gauss(0, 1))
        alerts += [e for e in monitor.update(t, grad, loss, None) if e.kind == "spike_alert"]
    return alerts


def test_loss_level_alert_catches_a_blow_up_inside_the_warm_up_and_one_that_lasts() -> None:
    """A loss that climbs 8x from step 12 (inside the 20-step warm-up: no z-score yet, and by its end the
    climb is the baseline) pages once with the loss-level rule; without it nothing ever pages."""
    assert SpikeConfig().loss_level_alert == 2.0
    alerts = _early_run(12, 8.0)
    assert [e.details["rule"] for e in alerts] == [LEVEL_RULE]  # once per excursion, not every cooldown
    assert 12 <= alerts[0].step <= 22 and alerts[0].details["level_ratio"] >= 2.0
    assert "above its best level" in alerts[0].message
    assert _early_run(12, 8.0, loss_level_alert=None, loss_median_alert=None) == []
    assert [e.details["rule"] for e in _early_run(12, 8.0, loss_level_alert=None)] == [MEDIAN_RULE]  # the median's


def test_loss_level_alert_is_quiet_on_a_healthy_run_and_rearms_after_the_loss_comes_back() -> None:
    assert _early_run(10**9, 1.0, steps=2000) == []  # a falling, then flat, noisy loss: no page in 2000 steps
    rules: dict[float | None, list[tuple[int, str]]] = {None: [], 3.0: []}
    for median, seen in rules.items():  # the level rule alone, and with the median rule (default) before it
        monitor = SpikeMonitor(SpikeConfig(loss_drift_alert=None, loss_median_alert=median), [])
        rng = random.Random(2)
        for t in range(400):
            loss = 2.0 * math.exp(0.04 * rng.gauss(0, 1))
            for start in (100, 250):  # two separate excursions to 3x, each reached over 10 steps, 50 steps long
                if start <= t < start + 50:
                    loss *= 3.0 ** min(1.0, (t - start + 1) / 10)
            seen += [(t, e.details["rule"]) for e in monitor.update(t, 1.0, loss, None) if e.kind == "spike_alert"]
        assert len(seen) == 2 and 100 <= seen[0][0] < 150 and 250 <= seen[1][0] < 300, seen  # once per excursion
    assert {rule for _, rule in rules[None]} == {LEVEL_RULE} and {rule for _, rule in rules[3.0]} == {MEDIAN_RULE}
    assert rules[3.0][0][0] < rules[None][0][0]  # the median pages on the way up, the level at 2x its best


def test_loss_median_alert_pages_a_rise_that_holds_on_a_noisy_loss_and_not_one_noisy_step() -> None:
    """A loss whose steps move 25% apart (the corpus's ResNet): one step at 2.5x does not page, 2.5x held for ten
    steps does, within four steps; the one-step z-scores alone (no CUSUM, no level
    rule) miss it. The recent losses are in the state: a resumed monitor pages at the same step."""

    def run(config: SpikeConfig, resume_at: int | None = None) -> list[Event]:
        rng = random.Random(3)
        monitor, alerts = SpikeMonitor(config, []), []
        for t in range(260):
            loss = 0.6 * math.exp(0.25 * rng.gauss(0, 1)) * (2.5 if t == 150 or 220 <= t < 230 else 1.0)
            if t == resume_at:
                monitor, saved = SpikeMonitor(config, []), monitor.state_dict()
                monitor.load_state_dict(saved)
            alerts += [e for e in monitor.update(t, 1.0, loss, None) if e.kind == "spike_alert"]
        return alerts

    z_only = {"loss_drift_alert": None, "loss_level_alert": None}
    assert SpikeConfig().loss_median_alert == 3.0
    paged = run(SpikeConfig(**z_only))
    assert [(e.step, e.details["rule"]) for e in paged] == [(223, MEDIAN_RULE)]  # the rise's 4th step
    assert "holds well above" in paged[0].message
    assert run(SpikeConfig(**z_only, loss_median_alert=None)) == []
    assert [e.step for e in run(SpikeConfig(**z_only), resume_at=200)] == [223]
    assert 220 <= run(SpikeConfig())[0].step <= 223  # with every rule on (here the CUSUM is first)


def test_loss_level_state_round_trips() -> None:
    cfg = SpikeConfig()
    a, b = SpikeMonitor(cfg, []), SpikeMonitor(cfg, [])
    for t in range(50):
        a.update(t, 1.0, 3.0 - t * 0.01, None)
    b.load_state_dict(a.state_dict())
    assert b.level.state_dict() == a.level.state_dict() and b.last_step == 49
    after_a = [a.update(50 + t, 1.0, 9.0, None) for t in range(10)]
    assert after_a == [b.update(50 + t, 1.0, 9.0, None) for t in range(10)]
    assert SpikeMonitor(cfg, []).state_dict()["level"]["best"] is None  # nothing seen: no best, JSON-safe


def test_a_3_percent_bump_on_a_flat_loss_does_not_page_but_a_real_jump_does() -> None:
    """A flat loss (random tokens: 5.4, noise 0.1%) has almost no noise of its own; the scale floor
    (``scale_floor``, log units) keeps a 3% bump from scoring as a many-sigma jump."""
    rng = random.Random(5)

    def run(bump: float, config: SpikeConfig) -> list[Event]:
        monitor = SpikeMonitor(config, [])
        events: list[Event] = []
        for t in range(200):
            loss = 5.4 * math.exp(0.001 * rng.gauss(0, 1)) * (bump if 150 <= t < 153 else 1.0)
            grad = math.exp(0.05 * rng.gauss(0, 1)) * (bump if 150 <= t < 153 else 1.0)
            events += monitor.update(t, grad, loss, None)
        return [e for e in events if e.kind == "spike_alert"]

    assert run(1.03, SpikeConfig()) == []
    assert run(1.03, SpikeConfig(scale_floor=0.0)), "without the floor the bump pages (the bug this guards)"
    alerts = run(1.5, SpikeConfig())
    assert alerts and alerts[0].step == 150
    assert alerts[0].details["signal"] == "loss" and "advice" in alerts[0].details and "lead" in alerts[0].details


def test_precursor_trends_wait_for_the_loss_to_stall_and_the_gate_survives_a_resume() -> None:
    """Early training grows every signal while the loss falls fast: a trend warns only once the loss has
    stopped falling (``trend_while_stalled``), and the loss trend behind that gate is in the state."""

    def feed(monitor: SpikeMonitor, steps: range) -> list[Event]:
        events: list[Event] = []
        for t in steps:
            loss = 5.0 * math.exp(-0.02 * min(t, 100))  # falls fast until step 100, then flat
            logit = 2.0 * 1.04**t  # grows all along
            events += monitor.update(t, 1.0, loss, None, signals={"monitors/attn_logit_max/blocks.1.attn": logit})
        return [e for e in events if e.kind == "spike_warning"]

    gated = feed(SpikeMonitor(SpikeConfig(), []), range(320))
    assert gated and all(e.step > 100 for e in gated), [e.step for e in gated]
    assert gated[0].details["module"] == "blocks.1.attn"
    ungated = feed(SpikeMonitor(SpikeConfig(trend_while_stalled=None), []), range(320))
    assert ungated and ungated[0].step < 100  # without the gate, learning itself warns
    first, resumed = SpikeMonitor(SpikeConfig(), []), SpikeMonitor(SpikeConfig(), [])
    feed(first, range(140))
    resumed.load_state_dict(first.state_dict())
    assert resumed.loss_trend_value == pytest.approx(first.loss_trend_value)
    assert [e.step for e in feed(resumed, range(140, 320))] == [e.step for e in feed(first, range(140, 320))]


def test_the_corpus_defaults_are_quieter_than_the_previous_ones_on_the_tuning_families() -> None:
    """The committed early-warning corpus, tuning families (GPT-2, BERT, 500-step runs): the defaults page 0
    times in 7,848 healthy steps and look 9 times (1.15 per 1,000) where the previous defaults (joint pages
    unconfirmed, the loss's scale floor on the grad norm's looks, no look cooldown or trend hysteresis) paged
    5 times and looked 24 (``score.py --split tune`` prints both); both alert 10 of 13 onsets without the median
    rule (``loss_median_alert``), the defaults 12 with it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "warning"))
    from bound import arrivals, is_data_event
    from score import TUNE, load, ours, score
    from truth import onsets_of

    runs = load(families=TUNE)
    now = score(runs, {"now": ours()})["now"]["all"]
    assert (now.pages, now.looks, now.recalled, now.onsets, now.healthy) == (0, 9, 12, 13, 7848)
    # the bound on warning ahead (bound.py): 8 of the 13 onsets came with a burst or the data shift
    data = [is_data_event(m, arrivals(r.meta)) for r in runs for m, _ in onsets_of(r.col("loss")).onsets]
    assert (len(data), sum(data)) == (13, 8)


def test_layer_share_trend_names_the_layer_whose_share_of_the_grad_norm_grows_and_is_off_by_default() -> None:
    """A small layer's grad norm grows 64x over 60 steps while the other stays: with ``layer_share_trend`` a
    look names that layer (``grad_share/<layer>``); by default nothing is said; the trend is in the state."""

    def feed(config: SpikeConfig) -> tuple[SpikeMonitor, list[Event]]:
        monitor = SpikeMonitor(config, ["embed", "blocks.1.attn"])
        events: list[Event] = []
        for t in range(300):
            layers = [1.0, 0.05 * (64.0 ** (min(max(t - 200, 0), 60) / 60))]
            events += monitor.update(t, math.sqrt(sum(x * x for x in layers)), 2.0, layers)
        return monitor, [e for e in events if e.kind == "spike_warning"]

    assert feed(SpikeConfig())[1] == []
    monitor, looks = feed(SpikeConfig(layer_share_trend=True))
    assert [e.details["signal"] for e in looks] == ["grad_share/blocks.1.attn"] and 200 < looks[0].step < 260
    assert looks[0].details["source"] == "layer_grad_share"
    assert "grad_share/blocks.1.attn" in monitor.state_dict()["trends"]
