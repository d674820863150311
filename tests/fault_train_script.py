"""A plain training loop with the guard and a JsonlSink, checkpointing atomically: the process the
fault-injection test kills (SIGINT, SIGKILL) and resumes.

    python tests/fault_train_script.py WORKDIR [--steps 300] [--resume]

Every ``CKPT_EVERY`` steps it saves model, optimizer and ``guard.state_dict()`` with ``torch.save``
to a temporary file and ``os.replace``s it over ``WORKDIR/ckpt.pt`` (atomic). Batches depend only
on the step, and steps ``POISON_EVERY * k + 5`` have a NaN loss, so a resumed run must end with
exactly the counters of an uninterrupted one. At the end it writes ``WORKDIR/result.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import stabilitykit as sk

CKPT_EVERY = 10
POISON_EVERY = 17


def poisoned(step: int) -> bool:
    """Steps whose loss is NaN (and so skipped)."""
    return step % POISON_EVERY == 5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # readers see the old checkpoint or the new one, never half of one


def train(workdir: str, steps: int = 300, resume: bool = False) -> dict[str, Any]:
    """Train to ``steps`` (from the checkpoint when ``resume``); returns (and saves) the counters.

    It first restores Python's SIGINT handler (a forkserver child starts with SIGINT ignored) and
    then touches ``WORKDIR/started``, so a killer can time its signal from the training's start.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    began = time.perf_counter()
    torch.set_num_threads(1)
    folder = Path(workdir)
    (folder / "started").touch()
    ckpt = folder / "ckpt.pt"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = sk.StabilityConfig(log_every_n_steps=2, clip=sk.ClipConfig(mode="fixed", max_norm=0.5))
    guard = sk.StabilityGuard(model, opt, cfg, sinks=[sk.sinks.JsonlSink(folder / "run.jsonl")])
    start, resumed_from = 0, None
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        guard.load_state_dict(state["guard"])
        start = resumed_from = int(state["step"])
    at_resume = {"steps": guard.step_count, "skipped": guard.summary()["skipped"]}
    try:
        for step in range(start, steps):
            x, y = _batch(step)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            guard.backward(loss * float("nan") if poisoned(step) else loss)
            guard.step()
            guard.zero_grad()
            if (step + 1) % CKPT_EVERY == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "guard": guard.state_dict()}
                _save(ckpt, {**state, "step": step + 1})
    finally:
        guard.close()
    seconds = time.perf_counter() - began
    result = {
        "resumed_from": resumed_from,
        "at_resume": at_resume,
        "final": guard.summary().to_dict(),
        "seconds": seconds,
    }
    (folder / "result.json").write_text(json.dumps(result))
    return result


def resume_and_draw(workdir: str, steps: int = 300) -> None:
    """Resume to the end, then draw the report of the whole log (the killed part and the resumed one)."""
    from stabilitykit.report_plot import draw_report

    train(workdir, steps, resume=True)
    draw_report(Path(workdir) / "run.jsonl", Path(workdir) / "report.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(train(args.workdir, args.steps, args.resume)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
