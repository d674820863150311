"""Launch a distributed test script in real gloo processes, with a hard timeout that kills them all.

Used on both sides: tests call ``run_world`` (a subprocess in its own session, so a hang is killed
with every child), and scripts call ``launch`` (``mp.spawn`` + gloo with a collective timeout),
so no multi-process test can hang the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

#: A collective that waits longer than this fails the worker instead of hanging.
COLLECTIVE_TIMEOUT_S = 90


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_world(script: Path, world: int, out: Path, *args: str, timeout: float) -> list[dict[str, Any]]:
    """Run ``script WORLD OUT PORT *args`` and return each rank's JSON results (rank order). ``timeout``:
    ``tests.time_limits.limit`` of the launch."""
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(world), str(out), str(free_port()), *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _wait(proc, timeout, f"{script.name} on {world} processes")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def run_torchrun(script: Path, world: int, out: Path, timeout: float, **env: str) -> list[dict[str, Any]]:
    """Run ``script`` under ``torchrun`` on ``world`` local processes (gloo, ``SK_OUT=out``, ``env`` added)
    and return each rank's JSON results (``out/rank<r>.json``, rank order)."""
    full_env = {**os.environ, "SK_OUT": str(out), "PYTHONPATH": str(script.parent.parent)}
    full_env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", TMPDIR=str(out), **env)  # torchrun's temp dirs go here
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr", "127.0.0.1"]
    cmd += ["--master_port", str(free_port()), str(script)]
    proc = subprocess.Popen(
        cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _wait(proc, timeout, f"{script.name} under torchrun on {world} processes")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _wait(proc: subprocess.Popen[str], timeout: float, what: str) -> None:
    """Wait for ``proc``; on a timeout kill it with every process it spawned. Fails naming ``what``."""
    from tests.time_limits import measured  # here: the scripts import this module without the tests package

    try:
        with measured(what):
            _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it spawned
        _, err = proc.communicate()
        raise AssertionError(f"{what} did not finish in {timeout}s:\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"{what} failed:\n{err[-4000:]}"


def _bootstrap(rank: int, worker: Callable[[int, int], dict[str, Any]], world: int, out: str, port: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    results = worker(rank, world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads racing C++ destructors at exit have
    # aborted a worker whose results were already written ("terminate called without an active
    # exception", SIGABRT). The results are on disk and every rank passed the barrier.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(worker: Callable[[int, int], dict[str, Any]], argv: list[str]) -> None:
    """``argv`` = [WORLD, OUT, PORT, ...]: run ``worker(rank, world)`` on WORLD gloo processes."""
    import torch.multiprocessing as mp

    world, out, port = int(argv[0]), argv[1], argv[2]
    mp.spawn(_bootstrap, args=(worker, world, out, port), nprocs=world)
