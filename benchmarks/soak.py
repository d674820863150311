"""Soak: 100,000 steps through the plain guard, the Lightning callback and the HF callback; memory per step.

    PYTHONPATH=.:tests python benchmarks/soak.py [--steps 100000] [--drivers guard,lightning,hf]

Each run logs every 10 steps and skips a NaN step every 97 (tests/soak_runs.py). Printed per
driver: bytes per step allocated in stabilitykit's files after warm-up (tracemalloc), bytes per
step of all Python allocations (the framework's own included), and RSS growth. The test suite
runs the same soak for a few thousand steps (tests/test_long_runs.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from soak_runs import DRIVERS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--drivers", default="guard,lightning,hf")
    args = parser.parse_args()
    for name in args.drivers.split(","):
        start = time.perf_counter()
        result = DRIVERS[name](args.steps)
        print(f"{result.line()}  ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
