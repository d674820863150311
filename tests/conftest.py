"""Shared fixtures: a tiny GPT, its data, and a training-loop helper."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stabilitykit.testing import char_batches, tiny_gpt

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# DeepSpeed's comm op, built once per venv by scripts/setup.sh: every test process (and the ranks they
# launch) loads it from there instead of compiling it inside a test's time limit
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
torch.set_num_threads(1)

#: A build lock older than this was left by a build that was killed: torch's extension loader would wait
#: on it forever, and every DeepSpeed launch would run into its time limit with no word of why.
STALE_BUILD_LOCK_S = 600


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop at once, naming the file, when a killed op build left its lock in the extensions folder."""
    import time

    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    for lock in folder.glob("*/lock") if folder.is_dir() else ():
        age = time.time() - lock.stat().st_mtime
        if age > STALE_BUILD_LOCK_S:
            pytest.exit(
                f"{lock} is {age / 60:.0f} minutes old: a DeepSpeed op build was killed while holding it, "
                "and every DeepSpeed launch would wait on it until its time limit. Remove the file (and its "
                "folder, to rebuild the op) and run again.",
                returncode=3,
            )


@pytest.fixture(autouse=True)
def _no_leaked_process_state() -> Iterator[None]:
    """Every test leaves the environment and torch.distributed as it found them.

    Lightning's strategies and DeepSpeed set ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK`` and
    ``NODE_RANK`` in this process when a fit starts (and keep them when it raises); a later test's
    subprocesses would inherit them (Accelerate then wraps a one-process model in DDP, a DDP script
    binds a port in use), and a default process group left behind refuses the next one.
    """
    import torch.distributed as dist

    env = dict(os.environ)
    had_group = dist.is_available() and dist.is_initialized()
    yield
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if dict(os.environ) != env:
        os.environ.clear()
        os.environ.update(env)


@pytest.fixture
def gpt() -> torch.nn.Module:
    return tiny_gpt(seed=0)


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = char_batches(seed=seed)
    return [next(data) for _ in range(n)]


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Deep copy of parameters and optimizer state for bitwise comparisons."""
    state = optimizer.state_dict()["state"]
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "opt": {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()} for k, v in state.items()},
    }


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name, tensor in a["params"].items():
        assert torch.equal(tensor, b["params"][name]), f"parameter {name} changed"
    assert a["opt"].keys() == b["opt"].keys()
    for key, state in a["opt"].items():
        for field, value in state.items():
            other = b["opt"][key][field]
            if torch.is_tensor(value):
                assert torch.equal(value, other), f"optimizer state {key}.{field} changed"
            else:
                assert value == other


LossFn = Callable[[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], int], torch.Tensor]


def default_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], step: int) -> torch.Tensor:
    return model.loss(*batch)  # type: ignore[operator]


@pytest.fixture
def fresh_accelerate() -> Iterator[None]:
    """Accelerate keeps process-wide singletons: every test starts (and leaves) them unset."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
