"""Distributed correctness on 2 and 3 CPU processes (gloo): DDP, FSDP1, FSDP2, mixed sharding.

One script per world size runs every configuration inside the same processes (a spawn costs
seconds; a configuration costs milliseconds), with a timeout so a hang fails fast.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.distributed_script_runner import run_world
from tests.time_limits import limit, waits_for

pytestmark = waits_for("distributed_parity_script_3")  # the first test to ask for the launch waits for it

SCRIPT = Path(__file__).parent / "distributed_parity_script.py"


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    world = request.param
    return run_world(
        SCRIPT, world, tmp_path_factory.mktemp(f"world{world}"), timeout=limit(f"distributed_parity_script_{world}")
    )


def _configs(results: dict) -> list[str]:
    return [k for k in results if not k.startswith(("ddp|", "nan|", "no_grad"))]


def test_every_sharding_matches_ddp_norms_and_parameters(ranks: list[dict]) -> None:
    results = ranks[0]
    configs = _configs(results)
    kinds = {k.split("|")[0] for k in configs}
    assert kinds == {
        "fsdp1-full", "fsdp1-grad-op", "fsdp1-no-shard", "fsdp1-mixed", "fsdp2", "fsdp2-mixed",
        "fsdp2-hsdp-Wx1", "fsdp2-hsdp-1xW",
    }  # fmt: skip
    assert len(configs) == 12 * 3 * 2  # shardings (x use_orig_params) x norm types x max_norm
    for key in configs:
        norm_type, max_norm = key.split("|")[-2:]
        ref = results[f"ddp|{norm_type}|{max_norm}"]
        got = results[key]
        for i, (a, b) in enumerate(zip(got["norms"], ref["norms"], strict=True)):
            assert math.isclose(a, b, rel_tol=1.3e-6), f"{key}: iteration {i} norm {a} vs DDP {b}"
        for a, b in zip(got["checksum"], ref["checksum"], strict=True):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{key}: parameters differ from DDP's"


def test_every_rank_sees_the_same_global_norm(ranks: list[dict]) -> None:
    for key in _configs(ranks[0]):
        norms = [r[key]["norms"] for r in ranks]
        assert all(n == norms[0] for n in norms), key


def test_nonfinite_on_one_rank_skips_everywhere_for_every_layout_and_norm(ranks: list[dict]) -> None:
    keys = [k for k in ranks[0] if k.startswith("nan|")]
    assert {k.split("|")[1] for k in keys} == {"ddp", *{k.split("|")[0] for k in _configs(ranks[0])}}
    assert {k.split("|")[2] for k in keys} == {"1.0", "2.0", "inf"}
    for key in keys:
        cases = [r[key] for r in ranks]
        assert [c["skipped"] for c in cases] == [1] * len(ranks), key
        assert all(c["unchanged"] for c in cases), f"{key}: state changed on the skipped step"
        assert all(c["checksum"] == cases[0]["checksum"] for c in cases), f"{key}: parameters differ across ranks"
        assert all(e["step"] == 2 for c in cases for e in c["events"]), key
        assert [e["rank"] for e in cases[1]["events"]] == [1], key


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "fsdp1-full", "fsdp2-hsdp-Wx1"])
def test_nan_names_block_and_rank(ranks: list[dict], kind: str) -> None:
    cases = [r[f"nan|{kind}|2.0|inf" if kind != "ddp" else "nan|ddp|2.0|nan"] for r in ranks]
    bad = cases[1]["events"]
    assert bad[0]["layer"] == "blocks.0" and bad[0]["reason"] == "nonfinite_grad", bad
    for other in cases[0]["events"]:
        assert other["step"] == 2 and other["rank"] == 0


def test_rank_without_grads_joins_the_reduction_and_warns(ranks: list[dict]) -> None:
    cases = [r["no_grad_rank"] for r in ranks]
    assert all(c["total"] == cases[0]["total"] > 0 for c in cases)
    assert [c["warned"] for c in cases] == [False, True] + [False] * (len(ranks) - 2)
