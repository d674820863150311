"""Time limits of the suite's launches: a measured quiet-machine time times a wide factor.

A limit exists to end a hang, not to judge speed, so it must hold on a loaded 2-core machine (a
fresh clone's first run beside other work). Each entry below is what the launch cost on a quiet
machine, taken as its CPU time (user + system, every process it started): the wall time it needs
when it has the cores to itself. ``limit`` multiplies it by ``STABILITYKIT_TIME_FACTOR`` (default 20:
a load of 15 on 2 cores, seen on the machine these were measured on, slowed them about 12x).

To measure them again, run the tests with ``STABILITYKIT_TIME_LOG=<file>``: every launch that goes
through ``run`` or ``tests.distributed_script_runner`` appends its name and CPU time to that file.
"""

from __future__ import annotations

import os
import resource
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

#: Seconds each launch needs on a quiet machine (CPU time, all its processes), measured 2026-11-27
#: with DeepSpeed's comm op already built (scripts/setup.sh builds it).
QUIET_S = {
    # examples/demo.py --steps 210, in the test process: 24.7 s user + 0.4 s system
    "demo": 25.0,
    # tests/deepspeed_script.py on 2 gloo processes (every ZeRO stage x precision case): 30.5 s user + 2.6 s system
    "deepspeed_script": 33.0,
    # tests/hf_deepspeed_script.py under torchrun on 2 processes (the covering cells): 32.6 s user + 1.9 s system
    "hf_deepspeed_script": 35.0,
    # The rest measured 2026-11-28 with STABILITYKIT_TIME_LOG on a shared machine (CPU time is what the
    # sharing does not inflate), rounded up to the next second. Several gloo worlds had fixed limits of
    # only 3.7-6.5 times their quiet time: the ones a busy machine ran out of.
    # console scripts and small subprocesses (one interpreter each)
    "cli_bad_model": 5.0,  # stabilitykit precision --model os:path: 4.1 s
    "cli_precision": 6.0,  # stabilitykit precision on tiny_gpt, bf16: 5.4 s
    # import stabilitykit with deepspeed hidden (alone: 4.1 s), then a 2-step HF Trainer with stabilize()
    "deepspeed_imports": 12.0,  # 11.0 s (apart they took 4.1 s and 8.7 s)
    "setup_script": 1.0,  # scripts/setup.sh with a stand-in python: 0.0 s
    "killed_after_snapshots": 4.0,  # a guard writing snapshots, then SIGKILL: 3.8 s
    "cuda_collect": 11.0,  # pytest collecting tests/cuda: 10.4 s
    "mkdocs_build": 12.0,  # mkdocs build --strict: 11.8 s
    # examples started as their own processes
    "example_recovery_ddp": 19.0,  # 18.4 s
    "example_deepspeed_loop": 23.0,  # 22.5 s
    "example_deepspeed_hf_trainer": 32.0,  # 31.5 s
    "example_rerun_and_replicas": 16.0,  # 15.6 s
    # 2-process Lightning and Fabric scripts (the slowest of their scenarios)
    "fabric_ddp_script": 11.0,  # 10.2 s
    "lightning_ddp_script": 12.0,  # ddp 8.8-11.1 s, fsdp2 11.1 s
    # gloo worlds (tests/distributed_script_runner.run_world and run_torchrun)
    "distributed_per_tensor_script": 17.0,  # 2 processes: 16.4 s
    "distributed_qk_clip_script": 15.0,  # 2 processes: 14.5 s
    "distributed_update_script": 18.0,  # 2 processes: 17.7 s
    "distributed_extension_script": 29.0,  # 2 processes, the guard's cell: 28.7 s
    "distributed_fsdp_clip_script": 37.0,  # 2 processes, the CI cells: 36.8 s (the former fixed limit: 240 s)
    "distributed_parity_script_2": 43.0,  # 2 processes: 42.5 s (the former fixed limit: 240 s)
    "distributed_recovery_script": 57.0,  # 2 processes: 56.8 s (the former fixed limit: 240 s, 4.2x)
    "distributed_parity_script_3": 65.0,  # 3 processes: 64.3 s (the former fixed limit: 240 s, 3.7x)
    "hf_ddp_recovery_script": 21.0,  # the HF Trainer under torchrun, 2 processes: 20.9 s (the former: 240 s)
    "distributed_layouts_script": 52.0,  # 4 processes, the CI cells: 51.9 s (the former fixed limit: 280 s)
    "fault_matrix_script_2": 30.0,  # 2 processes, the CI cells: 29.2 s (the former fixed limit: 280 s)
    "fault_matrix_script_4": 58.0,  # 4 processes, the CI cells: 57.8 s (the former fixed limit: 280 s)
    # rerun: the DDP, FSDP2 (and FSDP1 on 2) fault runs and replica cells; 2 processes with 500 clean DDP steps, 4
    # with HSDP 2 x 2 (STABILITYKIT_TIME_LOG on the shared machine, 2026-11-28; 19.7 s and 30.4 s before FSDP2 and
    # FSDP1 joined and the DDP fault cells were merged into one run)
    "distributed_rerun_script_2": 22.0,  # 21.3 s
    "distributed_rerun_script_4": 31.0,  # 31.0 s
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


@contextmanager
def measured(name: str) -> Iterator[None]:
    """Record the CPU time of the child processes reaped inside the block under ``name`` (user + system,
    grandchildren included once their parent is reaped) when ``STABILITYKIT_TIME_LOG`` names a file."""
    log = os.environ.get("STABILITYKIT_TIME_LOG")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    yield
    if log:
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        with open(log, "a") as f:
            f.write(f"{name}\t{cpu:.1f}\t{os.environ.get('PYTEST_CURRENT_TEST', '')}\n")


def waits_for(name: str) -> pytest.MarkDecorator:
    """The pytest-timeout mark of a test (or a module of tests sharing a launch fixture) that waits for
    launch ``name``: ``timeout_for(name)``, never below the suite's own 300 s."""
    return pytest.mark.timeout(max(300.0, timeout_for(name)))


def run(cmd: list[str], name: str, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run(cmd, **kwargs)`` under launch ``name``'s limit, its CPU time recorded (``measured``)."""
    with measured(name):
        return subprocess.run(cmd, timeout=limit(name), **kwargs)
