"""Time limits of the suite's long launches: a measured quiet-machine time times a wide factor.

A limit exists to end a hang, not to judge speed, so it must hold on a loaded 2-core machine (a
fresh clone's first run beside other work). Each entry below is what the launch cost on a quiet
machine, taken as its CPU time (user + system, every process it started): the wall time it needs
when it has the cores to itself. ``limit`` multiplies it by ``STABILITYKIT_TIME_FACTOR`` (default 20:
a load of 15 on 2 cores, seen on the machine these were measured on, slowed them about 12x).
"""

from __future__ import annotations

import os

#: Seconds each launch needs on a quiet machine (CPU time, all its processes), measured 2026-11-27
#: with DeepSpeed's comm op already built (scripts/setup.sh builds it).
QUIET_S = {
    # examples/demo.py --steps 210, in the test process: 24.7 s user + 0.4 s system
    "demo": 25.0,
    # tests/deepspeed_script.py on 2 gloo processes (every ZeRO stage x precision case): 30.5 s user + 2.6 s system
    "deepspeed_script": 33.0,
    # tests/hf_deepspeed_script.py under torchrun on 2 processes (the covering cells): 32.6 s user + 1.9 s system
    "hf_deepspeed_script": 35.0,
}

#: How many times the quiet time a launch may take before it is called hung.
FACTOR = float(os.environ.get("STABILITYKIT_TIME_FACTOR", "20"))


def limit(name: str) -> float:
    """The wall-clock limit of launch ``name``: its quiet time times ``FACTOR`` (at least 60 s)."""
    return max(60.0, QUIET_S[name] * FACTOR)


def timeout_for(name: str) -> float:
    """The pytest-timeout of the test that waits for launch ``name`` (the launch's own limit, plus a minute
    for the test around it), so that the launch's limit, which names what hung, is the one that fires."""
    return limit(name) + 60.0
