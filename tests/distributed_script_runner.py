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


def run_world(script: Path, world: int, out: Path, *args: str, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``script WORLD OUT PORT *args`` and return each rank's JSON results (rank order)."""
    env = {**os.environ, "PYTHONPATH": str(script.parent.parent), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), str(world), str(out), str(free_port()), *args]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it spawned
        _, err = proc.communicate()
        message = f"{script.name} on {world} processes did not finish in {timeout}s:\n{err[-3000:]}"
        raise AssertionError(message) from None
    assert proc.returncode == 0, f"{script.name} on {world} processes failed:\n{err[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


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
