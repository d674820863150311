"""The recovery benchmark's scoring (``benchmarks/recovery_defaults.py``): its null perturbation changes the data
and nothing else, "within noise" is the null perturbations' spread, and the committed runs say what the
recovery guides quote."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from recovery_defaults import (  # noqa: E402
    Runs,
    data_at,
    load_runs,
    null_differences,
    null_noise,
    schedule_of,
    split_null,
    versus,
)

#: The persistent-LR runs the recovery benchmarks guide quotes (guard alone, defaults, null perturbations).
COMMITTED = BENCHMARKS / "recovery_defaults_runs_v3.jsonl"


def _batches(scenario: str, steps: int = 8) -> list[torch.Tensor]:
    data = np.arange(10_000, dtype=np.uint8)
    gen, noise = torch.Generator().manual_seed(1002), torch.Generator().manual_seed(5002)
    return [data_at(step, scenario, data, gen, noise, middle=100)[0] for step in range(steps)]


def test_a_null_perturbation_redraws_the_data_from_its_position_and_changes_nothing_else() -> None:
    assert split_null("hot10_w20~d5") == ("hot10_w20", 5)
    assert split_null("hot10_w20") == ("hot10_w20", None)
    assert schedule_of("hot10_w20~d5") == schedule_of("hot10_w20")
    plain, perturbed = _batches("hot10_w20"), _batches("hot10_w20~d5")
    for step in range(5):
        assert torch.equal(plain[step], perturbed[step]), step
    for step in range(5, 8):
        assert not torch.equal(plain[step], perturbed[step]), step
    again = _batches("hot10_w20~d5")
    assert all(torch.equal(a, b) for a, b in zip(perturbed, again, strict=True))  # the same null each time


def _run(final: float) -> dict[str, object]:
    return {"final": final, "gave_up": False, "actions": [], "restored_first_step": False}


def test_within_noise_is_twice_the_rms_of_the_null_perturbations_of_the_same_arm() -> None:
    runs: Runs = {
        ("m", "hot", "none", 0): _run(3.0),
        ("m", "hot", "none", 1): _run(3.5),  # the seed spread (0.5) is not the measure once nulls exist
        ("m", "hot~d20", "none", 0): _run(3.1),
        ("m", "hot~d100", "none", 0): _run(2.9),
        ("m", "hot~d20", "none", 1): _run(3.5),
        ("m", "other~d20", "none", 0): _run(9.0),  # another scenario's null: not this arm's
        ("m", "hot", "defaults", 0): _run(3.25),
        ("m", "hot", "defaults", 1): _run(3.45),
    }
    assert sorted(null_differences(runs, "m", "hot")) == pytest.approx([-0.1, 0.0, 0.1])
    assert null_noise(runs, "m", "hot") == pytest.approx(2 * math.sqrt(0.02 / 3))  # 0.163
    assert null_noise(runs, "m", "cold") is None
    text = versus(runs, "defaults")
    assert "0 better, 1 within noise, 1 worse, 0 gave up" in text  # +0.25 > 0.163; -0.05 within
    assert "hot~d20" not in text  # the null perturbations are the measure, not rows


def test_the_committed_persistent_runs_score_as_the_recovery_guide_says() -> None:
    """The guide's tally and its rows marked worse are what the committed runs score to, recomputed here; no run
    of the defaults gave up or restored the first step's state."""
    runs = load_runs(COMMITTED)
    text = versus(runs, "defaults")
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guides" / "recovery-benchmarks.md").read_text()
    tally = text.split("defaults against none")[1].split("nats): ", 1)[1].splitlines()[0]
    assert f"defaults against none, every run of this section: {tally}" in guide, tally
    worse = {
        (k[0], k[1], k[3])
        for k, r in runs.items()
        if k[2] == "defaults"
        and split_null(k[1])[1] is None
        and r["final"] - runs[k[0], k[1], "none", k[3]]["final"] > (null_noise(runs, k[0], k[1]) or math.inf)
    }
    marked = {
        (cells[0], cells[1], int(cells[2].rstrip("*")))
        for line in guide.splitlines()
        if "**worse**" in line and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    assert worse == marked, (worse, marked)
    assert not any(r["gave_up"] for k, r in runs.items() if k[2] == "defaults")
    assert not any(r.get("restored_first_step") for r in runs.values())
