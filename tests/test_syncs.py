"""Host syncs on the step path, counted (not guessed)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import stabilitykit as sk
from stabilitykit.testing.syncs import count_host_syncs
from tests.conftest import batches


def _ours(counter) -> int:
    return len(counter.library_sites())


@pytest.mark.parametrize("update_ratio", [False, True])  # True: steps 4, 9, 14 copy the weights and measure
@pytest.mark.parametrize("clip", ["fixed", "adaptive", "per_tensor_adaptive"])
def test_fused_adamw_zero_syncs_off_logging_steps_one_on(clip: str, update_ratio: bool) -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    grad_norm = sk.GradNormConfig(update_ratio=update_ratio)
    cfg = sk.StabilityConfig(clip=sk.ClipConfig(mode=clip, warmup_steps=3), log_every_n_steps=5, grad_norm=grad_norm)
    guard = sk.StabilityGuard(model, opt, cfg, scheduler=sched, sinks=[sk.sinks.ConsoleSink(stream=io.StringIO())])
    counts = []
    for i, (x, y) in enumerate(batches(15)):
        loss = model.loss(x, y) * (float("nan") if i == 7 else 1.0)
        with count_host_syncs() as counter:
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        counts.append(counter.count)
    logging = [i for i in range(15) if i % 5 == 0]
    assert [counts[i] for i in logging] == [1, 1, 1], counts
    assert all(counts[i] == 0 for i in range(15) if i not in logging), counts  # the NaN step 7 included


def test_non_fused_pays_one_sync_per_step_and_none_when_skipping_is_off() -> None:
    model = sk.testing.tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=5))
    per_step = []
    for x, y in batches(6):
        with count_host_syncs() as counter:
            guard.backward(model.loss(x, y))
            guard.step()
            guard.zero_grad()
        per_step.append(_ours(counter))
    assert per_step == [1, 1, 1, 1, 1, 1]  # logging steps fold the decision into the metrics read
    guard.close()

    cfg = sk.StabilityConfig(log_every_n_steps=5, skip=sk.SkipConfig(nonfinite=False))
    guard = sk.StabilityGuard(model, opt, cfg)
    per_step = []
    for x, y in batches(6):
        with count_host_syncs() as counter:
            guard.backward(model.loss(x, y))
            guard.step()
            guard.zero_grad()
        per_step.append(counter.count)
    assert per_step == [1, 0, 0, 0, 0, 1]


def test_counter_sees_every_kind_of_sync() -> None:
    t = torch.ones(3)
    with count_host_syncs() as counter:
        t.sum().item()
        float(t.sum())
        bool(t.sum() > 0)
        t.tolist()
        torch.ones(1) + 1  # not a sync
    assert counter.count == 4


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_sgd_settles_after_one_applied_step_with_or_without_optimizer_state(momentum: float) -> None:
    """Fused SGD without momentum never creates optimizer state: after one applied step that created
    none, the guard stops deciding on the host (it paid one sync every step before)."""
    model = sk.testing.tiny_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=momentum, fused=True)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=5))
    counts = []
    for i, (x, y) in enumerate(batches(15)):
        loss = model.loss(x, y) * (float("nan") if i in (1, 7) else 1.0)
        with count_host_syncs() as counter:
            guard.backward(loss)
            guard.step()
            guard.zero_grad()
        counts.append(_ours(counter))
    assert [counts[i] for i in (0, 5, 10)] == [1, 1, 1], counts
    assert all(counts[i] == 0 for i in range(15) if i not in (0, 5, 10)), counts  # the NaN steps included
    assert guard.skipped_total == 2
    guard.close()


def test_library_sites_are_matched_by_the_package_location_not_a_folder_named_stabilitykit(tmp_path) -> None:
    # a fresh clone in a folder named "stabilitykit": its tests live under .../stabilitykit/tests/
    import importlib.util

    from stabilitykit.testing.syncs import PACKAGE_DIR

    clone_tests = tmp_path / "stabilitykit" / "tests"
    clone_tests.mkdir(parents=True)
    (clone_tests / "reference_sync.py").write_text("def read(t):\n    return float(t.sum())\n")
    spec = importlib.util.spec_from_file_location("reference_sync", clone_tests / "reference_sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    model = sk.testing.tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=1), sinks=[])
    ((x, y),) = batches(1)
    with count_host_syncs() as counter:
        module.read(torch.ones(3))  # the test's own sync, in a folder named stabilitykit
        guard.backward(model.loss(x, y))
        guard.step()
    assert Path(sk.__file__).resolve().parent == PACKAGE_DIR
    assert any(str(clone_tests) in site for site in counter.sites)
    assert not any(str(clone_tests) in site for site in counter.library_sites())
    assert len(counter.library_sites()) == 1  # the logging step's one read
    guard.close()


@pytest.mark.filterwarnings("ignore:stabilitykit.*transient fault")
@pytest.mark.parametrize("arm", ["fused", "fused-every-step", "non-fused"])
def test_rerun_adds_no_sync_to_a_step_and_reruns_where_the_host_reads(arm: str) -> None:
    """Rerun armed (a replay every step): the counts of a run without rerun. A NaN first pass at step 4
    (between logging steps) and at step 6 (a logging step) is re-run where the host reads that step's
    decision anyway (every step of a non-fused optimizer, logging steps of a fused one; every step when
    asked); the rerun step pays two reads more (its row, the comparison), and the steps after it none (step 8:
    the re-measured row does not stay in the journal to fill it early)."""
    model = sk.testing.tiny_gpt()
    fused = arm != "non-fused"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=None if fused else False)
    rerun = sk.RerunConfig(read_every_step=arm == "fused-every-step", max_transient=None)
    guard = sk.StabilityGuard(model, opt, sk.StabilityConfig(log_every_n_steps=3, rerun=rerun), sinks=[])
    verdicts: list[tuple[int, str]] = []
    guard.hooks.on("rerun", lambda e: verdicts.append((e.step, e.details["verdict"])))
    counts = []
    for i, (x, y) in enumerate(batches(9)):

        def loss_of(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return model.loss(x, y)

        with count_host_syncs() as counter:
            guard.backward(loss_of() * (float("nan") if i in (4, 6) else 1.0))  # the first pass only
            guard.step(replay=loss_of)
            guard.zero_grad()
        counts.append(_ours(counter))
    per_step = 1 if arm != "fused" else 0
    expected = [1 if i % 3 == 0 else per_step for i in range(9)]
    rerun_steps = [6] if arm == "fused" else [4, 6]
    for i in rerun_steps:
        expected[i] += 2
    assert counts == expected
    assert verdicts == [(i, "transient") for i in rerun_steps]
    assert guard.skipped_total == (1 if arm == "fused" else 0)  # step 4 skipped on the device, not re-run
    guard.close()
