"""Rerun verdicts and replica checks in real gloo processes, every fault on rank 1 only.

One launch per world size (``distributed_rerun_script.py``): 2 processes (DDP: the plain loop's
rerun cells, the record and a run started again with it, a parameter corruption, 500 clean steps;
FSDP2: a transient NaN and a transient local-gradient flip in one run of 8 steps)
and 4 (DDP and HSDP on a 2 x 2 mesh: a parameter corruption on one replica, clean steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

pytestmark = waits_for("distributed_rerun_script_4")  # the larger world's launch

SCRIPT = Path(__file__).parent / "distributed_rerun_script.py"
FAULT_STEP = 6


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(SCRIPT, 2, tmp_path_factory.mktemp("rerun2"), timeout=limit("distributed_rerun_script_2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(SCRIPT, 4, tmp_path_factory.mktemp("rerun4"), timeout=limit("distributed_rerun_script_4"))


def _reruns(cell: dict) -> list[dict]:
    return [e for e in cell["events"] if e["kind"] == "rerun"]


@pytest.mark.parametrize("world", [2, 4])
def test_a_one_time_nan_in_rank_1s_forward_is_transient_names_rank_1_and_ends_bitwise_clean(
    two: list[dict], four: list[dict], world: int
) -> None:
    ranks = two if world == 2 else four
    for rank in ranks:
        cell = rank["nan-activation"]
        assert _reruns(cell) == [{"kind": "rerun", "step": FAULT_STEP, "verdict": "transient", "rank": 1}]
        assert cell["skipped"] == []  # the recomputed step was taken
        assert cell["hash"] == rank["clean"]["hash"]  # final weights: a clean run's, bitwise
    assert [r["nan-activation"]["fired"] for r in ranks] == [0, 1] + [0] * (world - 2)


def test_fsdp2_a_one_time_nan_in_rank_1s_forward_and_a_flip_in_its_local_gradient_are_transient_on_rank_1(
    two: list[dict],
) -> None:
    """FSDP2 over 2 ranks, one run: a NaN in rank 1's logits at step 4, a flipped bit in rank 1's unsharded
    gradient of ``head.weight`` at step 6 (before the reduce-scatter, which puts it in rank 0's shard). The
    recomputation's forward and backward go through the shards' own hooks; rank 1 is named by its own
    unsharded grads (``rerun/local.py``); the final shards are a clean run's, bitwise."""
    for rank in two:
        cell = rank["fsdp2-faults"]
        assert _reruns(cell) == [
            {"kind": "rerun", "step": step, "verdict": "transient", "rank": 1} for step in (FAULT_STEP - 2, FAULT_STEP)
        ]
        assert cell["skipped"] == []
        assert cell["hash"] == rank["fsdp2-clean"]["hash"]  # each rank's shard, bitwise
    assert [r["fsdp2-faults"]["fired"] for r in two] == [0, 2]


def test_a_one_time_exponent_flip_caught_as_a_spike_is_transient_on_rank_1(two: list[dict]) -> None:
    for rank in two:
        cell, clean = rank["flip-activation"], rank["clean-spike"]
        at_fault = [e for e in _reruns(cell) if e["step"] == FAULT_STEP]
        assert at_fault == [{"kind": "rerun", "step": FAULT_STEP, "verdict": "transient", "rank": 1}]
        assert FAULT_STEP not in cell["skipped"]
        assert cell["skipped"] == clean["skipped"]
        assert cell["hash"] == clean["hash"]


def test_a_one_time_flip_in_rank_1s_local_gradient_is_transient_and_names_rank_1(two: list[dict]) -> None:
    """Before DDP's all-reduce every rank's grads carry it and no loss differs: rank 1 is named by its own
    grads as DDP's communication hook saw them before the all-reduce (``rerun/local.py``)."""
    for rank in two:
        cell = rank["flip-grad"]
        assert _reruns(cell) == [{"kind": "rerun", "step": FAULT_STEP, "verdict": "transient", "rank": 1}]
        assert cell["skipped"] == []
        assert cell["hash"] == rank["clean"]["hash"]


def test_a_batch_of_huge_inputs_is_reproducible_skipped_everywhere_recorded_and_skipped_on_a_new_start(
    two: list[dict],
) -> None:
    for rank in two:
        cell = rank["huge-batch"]
        assert _reruns(cell) == [{"kind": "rerun", "step": FAULT_STEP, "verdict": "reproducible", "rank": None}]
        assert cell["skipped"] == [FAULT_STEP]
        again = rank["huge-batch-again"]
        assert _reruns(again) == []  # known bad: skipped without computing it twice
        assert again["skipped"] == [FAULT_STEP]
        assert [e["reason"] for e in again["events"] if e["kind"] == "skipped"] == ["bad_batch"]
    lines = [json.loads(line) for line in two[0]["record"]]
    assert [(e["step"], e["batch"], e["verdict"], e["rank"]) for e in lines] == [
        (FAULT_STEP, FAULT_STEP, "reproducible", None)
    ]


@pytest.mark.parametrize(("world", "layout"), [(2, "ddp"), (4, "ddp"), (4, "hsdp")])
def test_a_finite_corruption_of_one_parameter_on_one_replica_is_reported_at_the_next_check(
    two: list[dict], four: list[dict], world: int, layout: str
) -> None:
    ranks = two if world == 2 else four
    check_step = 9  # checks after steps 4, 9, ...; the flip happens before step 6's forward
    expected = {"kind": "replica_mismatch", "step": check_step, "tensor": "blocks.0.fc.weight"}
    for r, rank in enumerate(ranks):
        events = rank[f"{layout}-param"]["events"]
        if layout == "hsdp" and r in (0, 2):  # the replica group {0, 2} holds the same shard alike
            assert events == []
            continue
        assert len(events) == 1, events
        event = events[0]
        assert {k: event[k] for k in expected} == expected
        if layout == "ddp":  # three replicas agree: the odd one out; two: the second of the pair (rank 1)
            assert event["rank"] == 1
        else:
            assert event["rank"] in (1, 3)  # HSDP 2 x 2: rank 1's replica group is {1, 3}; two replicas


def test_clean_runs_report_nothing(two: list[dict], four: list[dict]) -> None:
    """500 clean DDP steps (rerun on, a replica check every 5 steps) and 25 clean HSDP steps: no event."""
    for rank in two:
        assert rank["ddp-clean-long"]["events"] == []
        assert rank["clean"]["events"] == []
    for rank in four:
        assert rank["hsdp-clean"]["events"] == []
