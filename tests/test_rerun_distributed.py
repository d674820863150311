"""Rerun verdicts and replica checks in real gloo processes, every fault on rank 1 only.

One launch per world size, 2 and 4 processes (``distributed_rerun_script.py``): under DDP and FSDP2, the
plain loop with ``guard.step(replay=...)``, a clean run and one with a one-time NaN and a one-time
exponent flip in rank 1's forward, a one-time flip in its local gradient and a batch of huge inputs on
rank 1; a run started again with the rerun record (2 processes); a parameter corruption on one replica
(DDP; HSDP on a 2 x 2 mesh with 4); long clean runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

pytestmark = waits_for("distributed_rerun_script_4")  # the larger world's launch

SCRIPT = Path(__file__).parent / "distributed_rerun_script.py"
FAULT_STEP = 6  # the replica cells' corruption
TRANSIENT = (4, 5, 6)  # a NaN and a flip in rank 1's logits, a flip in its local gradient: distributed_rerun_script
HUGE_STEP = 7


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(SCRIPT, 2, tmp_path_factory.mktemp("rerun2"), timeout=limit("distributed_rerun_script_2"))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(SCRIPT, 4, tmp_path_factory.mktemp("rerun4"), timeout=limit("distributed_rerun_script_4"))


def _reruns(cell: dict) -> list[dict]:
    return [e for e in cell["events"] if e["kind"] == "rerun"]


@pytest.mark.parametrize(("world", "layout"), [(2, "ddp"), (2, "fsdp2"), (2, "fsdp1"), (4, "ddp"), (4, "fsdp2")])
def test_one_time_faults_on_rank_1_are_transient_a_huge_batch_reproducible_and_the_weights_a_clean_runs(
    two: list[dict], four: list[dict], world: int, layout: str
) -> None:
    """One run, faults on rank 1 only: a NaN in its logits at step 4, a flipped exponent bit in its local
    gradient of ``head.weight`` at step 5 (under DDP before the all-reduce, which carries it to every rank;
    under FSDP2 and FSDP1 in the unsharded gradient, before the reduce-scatter puts it in another rank's
    shard), a
    flipped exponent bit in its logits at step 6 (a large finite logit, flagged by skip-on-spike), each once:
    each judged transient naming rank 1, the recomputed step taken. Then a batch of huge inputs on rank 1 at
    step 7, Inf however often it is computed: reproducible, skipped on every rank, recorded. The final weights
    (each rank's shard under FSDP2) are those of the same configuration's clean run over steps 0-6, bitwise.

    Both runs flag step 3 alike (skip-on-spike's first step after its warm-up, on a loss that falls fast):
    computed again it comes out the same, so it is reproducible and skipped in both."""
    ranks = two if world == 2 else four
    for rank in ranks:
        cell, clean = rank[f"{layout}-faults"], rank[f"{layout}-clean"]
        transient = [{"kind": "rerun", "step": s, "verdict": "transient", "rank": 1} for s in TRANSIENT]
        huge = {"kind": "rerun", "step": HUGE_STEP, "verdict": "reproducible", "rank": None}
        assert _reruns(cell) == _reruns(clean) + transient + [huge]
        assert all(e["verdict"] == "reproducible" for e in _reruns(clean))
        assert cell["skipped"] == clean["skipped"] + [HUGE_STEP]  # the recomputed steps were taken
        assert cell["hash"] == clean["hash"]  # final weights: a clean run's, bitwise
    assert [r[f"{layout}-faults"]["fired"] for r in ranks] == [0, len(TRANSIENT)] + [0] * (world - 2)
    clean_steps = {e["step"] for e in _reruns(ranks[0][f"{layout}-clean"])}
    lines = [json.loads(line) for line in ranks[0][f"{layout}-record"]]
    assert [(e["step"], e["batch"], e["verdict"], e["rank"]) for e in lines if e["step"] not in clean_steps] == [
        (s, s, "transient", 1) for s in TRANSIENT
    ] + [(HUGE_STEP, HUGE_STEP, "reproducible", None)]


def test_a_run_started_again_with_the_record_skips_the_known_bad_batches_without_computing_them_twice(
    two: list[dict],
) -> None:
    for rank in two:
        again = rank["ddp-again"]
        assert _reruns(again) == []  # known bad: skipped without computing it twice
        assert HUGE_STEP in again["skipped"]
        assert again["skipped"] == rank["ddp-faults"]["skipped"]
        assert {e["reason"] for e in again["events"] if e["kind"] == "skipped"} == {"bad_batch"}


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
    """500 clean DDP steps (rerun on, a replica check every 5 steps) and 25 clean HSDP steps: no event (with
    ``STABILITYKIT_FULL_MATRIX=1``: 500 HSDP steps and 500 FSDP2 steps too)."""
    for rank in two:
        assert rank["ddp-clean-long"]["events"] == []
        assert rank.get("fsdp2-clean-long", {"events": []})["events"] == []
    for rank in four:
        assert rank["hsdp-clean"]["events"] == []
