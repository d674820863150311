"""The generated fault matrix (tests/fault_matrix_script.py) on real gloo processes.

Layouts x fault x where x optimizer x logging step x clipping: no crash or hang, the same
decision, norm and collectives on every rank, a skip that changes nothing, the documented
decision, and one-process parity without a fault. CI runs a covering subset on 2 and 4
processes; ``STABILITYKIT_FULL_MATRIX=1`` runs every cell (marked ``distributed_matrix``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.distributed_script_runner import run_world
from tests.fault_matrix_script import cells
from tests.time_limits import limit, waits_for

pytestmark = waits_for("fault_matrix_script_4")  # the larger world's launch

SCRIPT = Path(__file__).parent / "fault_matrix_script.py"
FULL = os.environ.get("STABILITYKIT_FULL_MATRIX") == "1"


def _failures(ranks: list[dict]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rank in ranks:
        for name, failures in rank["cells"].items():
            if failures:
                out.setdefault(name, []).extend(f"rank {rank['rank']}: {f}" for f in failures)
    return out


def _run(world: int, which: str, tmp: Path, timeout: float) -> None:
    os.environ["STABILITYKIT_RECORD_COLLECTIVES"] = "1"  # inherited by the processes
    try:
        ranks = run_world(SCRIPT, world, tmp, which, timeout=timeout)
    finally:
        os.environ.pop("STABILITYKIT_RECORD_COLLECTIVES", None)
    expected = {cell.name for cell in cells(world, which)}
    for rank in ranks:
        assert set(rank["cells"]) == expected, "a rank did not run every cell"
    failures = _failures(ranks)
    shown = "\n".join(f"{name}: {msgs[0]}" for name, msgs in list(failures.items())[:10])
    assert not failures, f"{len(failures)} of {len(expected)} cells failed on {world} processes:\n{shown}"


@pytest.mark.parametrize("world", [2, 4])
def test_fault_matrix_subset(world: int, tmp_path: Path) -> None:
    _run(world, "ci", tmp_path, timeout=limit(f"fault_matrix_script_{world}"))


@pytest.mark.distributed_matrix
@pytest.mark.timeout(5600)  # longer than the suite's 300 s: the 4-process matrix runs for several minutes
@pytest.mark.skipif(not FULL, reason="the whole fault matrix runs with STABILITYKIT_FULL_MATRIX=1")
@pytest.mark.parametrize("world", [2, 4])
def test_fault_matrix_every_cell(world: int, tmp_path: Path) -> None:
    _run(world, "all", tmp_path, timeout=5400)
