"""Recovery under torch.distributed: a fault on one rank rolls every rank back, at the same step, to the same snapshot.

Real gloo processes (``distributed_recovery_script.py``), a tiny HF Llama under DDP, FSDP2, FSDP1 and
tensor parallel (and a climb on one rank whose snapshots every rank drops), and
the real HF Trainer under ``torchrun`` (``hf_ddp_recovery_script.py``); the request encoding of
``recovery/agreement.py`` and the snapshot health encoding of ``recovery/vetting.py`` are checked here directly.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import stabilitykit as sk
from stabilitykit.compat.grad_scaler import ScalerAdapter
from stabilitykit.engine import StabilityEngine
from stabilitykit.engine.decision import RecoveryAnswer
from stabilitykit.engine.journal import Row
from stabilitykit.hooks import HookManager
from stabilitykit.recovery import Recovery
from stabilitykit.recovery.agreement import Agreement, decode_request, encode_request
from stabilitykit.recovery.vetting import HealthQueue, decode_health, encode_health
from tests.distributed_script_runner import run_torchrun, run_world
from tests.time_limits import limit, waits_for

SCRIPT = Path(__file__).parent / "distributed_recovery_script.py"
CASES = ["ddp-alert", "ddp-nan", "fsdp2-alert", "fsdp2-nan", "fsdp2-alert-disk", "fsdp1-alert", "tp-alert"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(SCRIPT, 2, tmp_path_factory.mktemp("recovery"), timeout=limit("distributed_recovery_script"))


@pytest.mark.parametrize("case", CASES)
@waits_for("distributed_recovery_script")
def test_every_rank_rolls_back_once_at_the_same_step_to_the_same_snapshot(ranks: list[dict], case: str) -> None:
    first, second = ranks[0][case], ranks[1][case]
    assert len(first["rollbacks"]) == 1
    assert first["rollbacks"] == second["rollbacks"]
    rollback = first["rollbacks"][0]
    assert rollback["trigger"] == ("spike_alert" if "alert" in case else "diverged")
    assert rollback["onset"] == 30  # the fault's first step, as the rank that saw it reported it
    assert rollback["restored_step"] == 28  # the newest snapshot at or before the onset (every 4 steps)
    assert rollback["at_step"] > 30


@pytest.mark.parametrize("case", [c for c in CASES if "alert" in c])
@waits_for("distributed_recovery_script")
def test_a_rank_rolls_back_on_another_ranks_alert(ranks: list[dict], case: str) -> None:
    """Only rank 1's loss jumped: rank 0 raised no alert of its own and still rolled back with it."""
    assert ranks[0][case]["alerts"] == []
    assert ranks[1][case]["alerts"] == [30]
    assert len(ranks[0][case]["rollbacks"]) == 1


@pytest.mark.parametrize("case", CASES)
@waits_for("distributed_recovery_script")
def test_each_rank_restores_its_own_state_bitwise(ranks: list[dict], case: str) -> None:
    """Parameters and optimizer state (the local shard under FSDP2) equal the rank's copy from before the
    restored step."""
    for rank in ranks:
        assert rank[case]["restored_equal"] == [True]
        assert rank[case]["finite"]


@pytest.mark.parametrize("case", ["ddp-alert", "ddp-nan"])
@waits_for("distributed_recovery_script")
def test_ddp_replicas_stay_identical_after_a_rollback(ranks: list[dict], case: str) -> None:
    assert ranks[0][case]["digest"] == ranks[1][case]["digest"]


@waits_for("distributed_recovery_script")
def test_fsdp2_shards_round_trip_through_disk_snapshots(ranks: list[dict]) -> None:
    """``storage=`` a directory: each rank wrote its own shard's snapshots and restored from the file."""
    for rank in ranks:
        files = rank["fsdp2-alert-disk"]["files"]
        assert "skipped_batches.json" in files
        assert any(name.startswith("snapshot-") for name in files)
    assert ranks[0]["fsdp2-alert-disk"]["rollbacks"] == ranks[0]["fsdp2-alert"]["rollbacks"]
    assert ranks[0]["fsdp2-alert-disk"]["digest"] == ranks[0]["fsdp2-alert"]["digest"]  # same run, from disk


@waits_for("distributed_recovery_script")
def test_a_snapshot_inside_one_ranks_climb_is_dropped_on_every_rank(ranks: list[dict]) -> None:
    """Rank 1 alone climbs (50x its loss at steps 30-37, finite), then diverges (NaN at 38-40). The snapshots
    due inside the climb (steps 32 and 36) are dropped on both ranks by the health agreed in the step record,
    so both restore step 28's, bitwise, and the replicas stay identical. Before, each rank ignored its
    detectors under torch.distributed and both restored step 36's, from inside the climb."""
    first, second = ranks[0]["ddp-climb"], ranks[1]["ddp-climb"]
    assert first["alerts"] == [] and second["alerts"] == [30]  # only rank 1's detectors saw the climb
    assert first["held"] == second["held"] == {"39": [20, 24, 28]}  # before the rollback: no climb snapshot
    assert len(first["rollbacks"]) == 1 and first["rollbacks"] == second["rollbacks"]
    rollback = first["rollbacks"][0]
    assert rollback["trigger"] == "diverged" and rollback["onset"] == 38
    assert rollback["restored_step"] == 28
    assert first["restored_equal"] == second["restored_equal"] == [True]
    assert first["digest"] == second["digest"] and first["finite"]


@waits_for("hf_ddp_recovery_script")
def test_hf_trainer_ddp_ranks_roll_back_together_on_one_ranks_alert(tmp_path: Path) -> None:
    """The real HF Trainer under ``torchrun`` (DDP over gloo through Accelerate): rank 1 alone alerts; rerun
    verdicts on faults on rank 1 only (``hf_ddp_recovery_script.py``)."""
    script = Path(__file__).parent / "hf_ddp_recovery_script.py"
    first, second = run_torchrun(script, 2, tmp_path, timeout=limit("hf_ddp_recovery_script"))
    assert first["world"] == second["world"] == 2
    assert first["alerts"] == [] and second["alerts"] == [12]
    assert len(first["rollbacks"]) == 1 and first["rollbacks"] == second["rollbacks"]
    assert first["rollbacks"][0]["restored_step"] == 12
    assert first["steps"] == second["steps"] == 20
    assert first["checksum"] == second["checksum"] and first["finite"]
    # the user's skip rule (raised on rank 1 only) skipped step 5 on both ranks; the summed metric agreed
    assert first["rule_skips"] == second["rule_skips"] == [[5, "quality_gate"]]
    assert first["sums"] == second["sums"] == [3.0]
    # rerun: one-time faults on rank 1 (its logits, its local gradient) transient, rank 1 named, the steps taken;
    # rank 1's NaN loss that comes again when the step is computed again is reproducible, skipped on both ranks
    verdicts = [[8, "transient", 1], [10, "transient", 1], [18, "reproducible", None]]
    assert first["reruns"] == second["reruns"] == verdicts
    assert first["skipped"] == second["skipped"] == [5, 18]
    # the same training again in the same processes without the one-time faults: the same weights, bitwise
    assert first["weights"] == first["clean_weights"] and second["weights"] == second["clean_weights"]


def _recovery(cfg: sk.StabilityConfig) -> None:
    """Build the recovery of a guard over ``cfg`` as it is built under torch.distributed (``agree=True``)."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    hooks = HookManager()
    engine = StabilityEngine(list(model.parameters()), cfg, model=model, hooks=hooks)
    Recovery(cfg.recovery, engine, model, opt, ScalerAdapter(None), hooks, dict, lambda state: None, agree=True)


def test_a_ring_the_agreement_latency_can_empty_warns() -> None:
    """Alert triggers roll back up to a logging interval late: snapshots taken meanwhile must not push out
    every one from before the onset."""

    def config(keep: int, every: int) -> sk.StabilityConfig:
        recovery = sk.RecoveryConfig(enabled=True, keep=keep, snapshot_every=every, trigger=["spike_alert"])
        return sk.StabilityConfig(log_every_n_steps=10, recovery=recovery)

    with pytest.warns(UserWarning, match=r"keep=2, snapshot_every=5\) may have nothing left"):
        _recovery(config(keep=2, every=5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _recovery(config(keep=3, every=5))  # (3 - 1) * 5 >= 10
    sync_off = sk.StabilityConfig(skip=sk.SkipConfig(sync_ranks=False), recovery=sk.RecoveryConfig(enabled=True))
    with pytest.raises(ValueError, match="needs SkipConfig\\(sync_ranks=True\\)"):
        _recovery(sync_off)


def _row(step: int, request: int) -> Row:
    return Row(step, 1.0, 1.0, 1.0, 1.0, 0, request=request)


def test_a_request_carries_its_trigger_and_onset() -> None:
    for trigger in ("diverged", "spike_alert", "loss_drift"):
        value = encode_request(trigger, onset=37, step=41)
        assert decode_request(value, 41) == (trigger, 37)
    assert encode_request("spike_alert", 40, 41) < encode_request("spike_alert", 30, 41)  # MAX: earliest onset


def test_an_agreement_sends_once_and_acts_on_the_earliest_onset() -> None:
    agreement = Agreement()
    assert agreement.request(5) == 0
    agreement.queue("spike_alert", 9)
    agreement.queue("diverged", 7)
    value = agreement.request(10)
    assert decode_request(value, 10) == ("diverged", 7)
    assert agreement.request(11) == 0  # sent once
    rows = [_row(10, value), _row(12, encode_request("spike_alert", 11, 12)), _row(13, 0)]
    agreement.read(RecoveryAnswer.of(rows).requests)
    assert agreement.take() == ("diverged", 7)
    assert agreement.take() is None


def test_a_snapshots_health_carries_its_step_and_any_ranks_unsettled_wins() -> None:
    for unsettled in (False, True):
        assert decode_health(encode_health(36, unsettled, 41), 41) == (36, unsettled)
    assert max(encode_health(36, False, 41), encode_health(36, True, 41)) == encode_health(36, True, 41)
    queue = HealthQueue()
    queue.judge(32, True)
    queue.judge(36, False)
    queue.judge(32, False)  # judged once
    assert decode_health(queue.send(40), 40) == (32, True)  # one a step, oldest first
    queue.forget_after(28)  # a rollback past both
    assert queue.send(41) == 0
