"""PyTorch's own FSDP1 clip-grad-norm tests, ported to gloo on 2 CPU processes (see the script).

CI runs a representative subset (``ci``); ``STABILITYKIT_FULL_MATRIX=1`` or
``benchmarks/distributed_matrix.py`` runs all of it. The subprocess has a hard timeout.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

pytestmark = waits_for("distributed_fsdp_clip_script")  # the first test to ask for the launch waits for it

SCRIPT = Path(__file__).parent / "distributed_fsdp_clip_script.py"
MODE = "all" if os.environ.get("STABILITYKIT_FULL_MATRIX") == "1" else "ci"
RTOL = 1.3e-6  # torch.testing's float32 default, as the original test's assertEqual


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_world(
        SCRIPT, 2, tmp_path_factory.mktemp("fsdp_clip"), MODE, timeout=limit("distributed_fsdp_clip_script")
    )


def test_ddp_parity_across_strategies_orig_params_max_norms_and_norm_types(ranks: list[dict]) -> None:
    cases = ranks[0]["ddp_parity"]
    assert {k.split("|")[0] for k in cases} >= {"FULL_SHARD", "NO_SHARD", "mixed"}
    assert {k.split("|")[2] for k in cases} == {"1.0", "2.0", "inf"}
    assert {k.split("|")[3] for k in cases} == {"1", "2.5"}
    for rank in ranks:
        for key, case in rank["ddp_parity"].items():
            for i, (got, ref) in enumerate(case["norms"]):
                assert math.isclose(got, ref, rel_tol=RTOL), f"{key} iteration {i}: {got} vs DDP {ref}"
            assert case["clipped"], f"{key}: some grad was left unclipped"
            assert case["params_equal"], f"{key}: parameters differ from DDP's after the step"
            assert case["dtype"] == "torch.float32"


def test_low_precision_grads_stay_fp16_and_the_total_is_exact_fp32(ranks: list[dict]) -> None:
    for rank in ranks:
        assert rank["low_precision"]
        for key, case in rank["low_precision"].items():
            assert case["all_fp16"], key
            assert case["dtype"] == "torch.float32", key  # torch returns fp16 here; fp32 is kept on purpose
            assert math.isclose(case["total"], case["exact"], rel_tol=1e-6), key
            assert case["max_grad_norm"] <= case["max_norm"] * (1 + 1e-3), key  # fp16 rounding of clipped grads


def test_no_gradients_gives_an_fp32_zero_and_names_each_rank(ranks: list[dict]) -> None:
    for r, rank in enumerate(ranks):
        for case in rank["no_gradients"].values():
            assert case["dtype"] == "torch.float32" and case["total"] == 0.0
            assert case["messages"] == [f"stabilitykit: no parameter has a gradient on rank {r}; its grad norm is 0"]


def test_a_rank_without_grads_joins_and_every_rank_gets_the_exact_norm(ranks: list[dict]) -> None:
    for key in ranks[0]["rank_without_grads"]:
        for p in ("2.0", "inf"):
            cases = [rank["rank_without_grads"][key][p] for rank in ranks]
            assert cases[0]["total"] == cases[1]["total"] > 0, key
            assert math.isclose(cases[0]["total"], cases[0]["exact"], rel_tol=RTOL), key
            assert cases[0]["warned"] == [] and cases[1]["warned"], key


def test_fsdp1_parameters_without_their_module_are_refused_with_the_fix(ranks: list[dict]) -> None:
    for message in ranks[0]["params_without_module"].values():
        assert "managed by FSDP1" in message and "sk.clip_grad_norm_(fsdp_model" in message
