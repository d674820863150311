"""Layouts that span nodes, on 4 gloo CPU processes: FSDP1 hybrid strategies, FSDP2 HSDP, FSDP2 +
tensor parallel, tensor parallel + data parallel, 2 pipeline stages x FSDP2, and DTensor grads with
every pair of placements. Each must equal DDP + ``torch.nn.utils.clip_grad_norm_`` on every rank,
and a NaN/Inf on one rank must skip the step everywhere with the state bitwise unchanged.

CI runs a representative subset of the matrix (every layout at p = 2 and inf, p = 1 on two,
the NaN skip under the inf-norm on every layout); the whole matrix runs with
``STABILITYKIT_FULL_MATRIX=1`` (marked ``distributed_matrix``) or ``benchmarks/distributed_matrix.py``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

pytestmark = waits_for("distributed_layouts_script")  # the first test to ask for the launch waits for it

SCRIPT = Path(__file__).parent / "distributed_layouts_script.py"
RTOL = 1.3e-6
FULL = os.environ.get("STABILITYKIT_FULL_MATRIX") == "1"


def _run(tmp_path_factory: pytest.TempPathFactory, mode: str) -> list[dict]:
    return run_world(
        SCRIPT,
        4,
        tmp_path_factory.mktemp(f"layouts_{mode}"),
        mode,
        timeout=limit("distributed_layouts_script") if mode == "ci" else 900,
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _run(tmp_path_factory, "ci")


def check_parity(ranks: list[dict]) -> None:
    for r, rank in enumerate(ranks):
        for key, case in rank["parity"].items():
            got, ref = case["got"], case["ref"]
            for i, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
                assert math.isclose(a, b, rel_tol=RTOL), f"rank {r} {key} iteration {i}: {a} vs DDP {b}"
            assert got["params"], key
            for name, sums in got["params"].items():  # a pipeline stage holds its own layers only
                for a, b in zip(sums, ref["params"][name], strict=True):
                    assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), f"rank {r} {key}: {name} differs from DDP"


def check_skips(ranks: list[dict]) -> None:
    for key in ranks[0]["skip"]:
        cases = [rank["skip"][key] for rank in ranks]
        for r, case in enumerate(cases):
            assert case["skipped"] == 1 and case["skipped_step"], f"rank {r} did not skip: {key}"
            assert case["unchanged"], f"rank {r}: parameters or optimizer state changed on the skipped step: {key}"
            assert not math.isfinite(case["grad_norm"]), f"rank {r} reported a finite norm: {key}"


def test_every_layout_matches_ddp_on_every_rank(ranks: list[dict]) -> None:
    layouts = {k.split("|")[0] for k in ranks[0]["parity"]}
    assert layouts == {"fsdp1-hybrid", "fsdp1-hybrid-zero2", "fsdp2-hsdp-2x2", "fsdp2-tp", "tp-ddp", "pp2-fsdp2"}
    assert {k.split("|")[-2] for k in ranks[0]["parity"]} == {"1.0", "2.0", "inf"}
    check_parity(ranks)


def test_every_rank_sees_the_same_norm(ranks: list[dict]) -> None:
    for key in ranks[0]["parity"]:
        assert len({tuple(rank["parity"][key]["got"]["norms"]) for rank in ranks}) == 1, key


def test_nonfinite_on_one_rank_skips_everywhere_with_state_bitwise_unchanged(ranks: list[dict]) -> None:
    assert {k.split("|")[0] for k in ranks[0]["skip"]} >= {"fsdp1-hybrid", "fsdp2-hsdp-2x2", "fsdp2-tp", "pp2-fsdp2"}
    check_skips(ranks)


def test_a_finite_overflow_on_one_rank_is_clipped_and_taken_everywhere(ranks: list[dict]) -> None:
    for layout in ranks[0]["overflow"]:
        for r, rank in enumerate(ranks):
            case = rank["overflow"][layout]
            assert not case["skipped_step"] and case["skipped"] == 0, f"rank {r} skipped a finite step: {layout}"
            assert 1e38 <= case["grad_norm"] < math.inf, f"rank {r} {layout}: {case['grad_norm']}"
            assert case["grad_norm"] == ranks[0]["overflow"][layout]["grad_norm"], f"rank {r} {layout}: norms differ"
            assert case["params_finite"], f"rank {r} {layout}: non-finite parameters after the clipped step"


def test_dtensor_grads_with_any_placements_reduce_to_the_full_norm(ranks: list[dict]) -> None:
    for rank in ranks:
        for p, (got, ref) in rank["placements"].items():
            assert math.isclose(got, ref, rel_tol=RTOL), f"p={p}: {got} vs {ref}"


@pytest.mark.distributed_matrix
@pytest.mark.skipif(not FULL, reason="the whole 4-process matrix: set STABILITYKIT_FULL_MATRIX=1")
def test_whole_matrix_every_norm_max_norm_nan_and_inf(tmp_path_factory: pytest.TempPathFactory) -> None:
    ranks = _run(tmp_path_factory, "all")
    assert len(ranks[0]["parity"]) == 8 * 3 * 2 and len(ranks[0]["skip"]) == 8 * 3 * 2
    check_parity(ranks)
    check_skips(ranks)
