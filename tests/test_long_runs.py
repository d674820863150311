"""Long runs stay flat: nothing stabilitykit allocates grows per step, through every driver.

The plain guard, a real Lightning Trainer and the real Hugging Face Trainer each run a soak
(tests/soak_runs.py: logging every 10 steps, a NaN step every 97) with tracemalloc on; the growth
of allocations made in stabilitykit's files after warm-up must stay under 64 bytes per step (the
per-step wrapper this replaced leaked about 1.1 KB a step). ``benchmarks/soak.py`` runs 100,000 steps.
"""

from __future__ import annotations

import pytest
from soak_runs import DRIVERS

STEPS = {"guard": 1000, "lightning": 500, "hf": 200}


@pytest.mark.parametrize("driver", list(STEPS))
def test_memory_is_flat_after_warmup(driver: str) -> None:
    result = DRIVERS[driver](STEPS[driver])
    assert result.ours_bytes_per_step < 64, result.line()
