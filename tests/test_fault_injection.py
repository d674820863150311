"""Kill a training process (SIGINT, SIGKILL) at 20 seeded random moments; its log must stay readable,
the report must draw it, and a resume from the last checkpoint must end with the uninterrupted run's counters.

The runs are forked from a forkserver that has torch and stabilitykit imported already, so each
start costs milliseconds, not an interpreter start-up: the whole test takes some seconds.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import signal
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from stabilitykit.sinks import read_jsonl
from tests import fault_train_script as script

STEPS = 150
KILLS = 20


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # torch imports torch._dynamo (and sympy) lazily on the first optimizer step: import it once, here
    preload = ["torch._dynamo", "torch.utils.serialization", "tests.fault_train_script", "stabilitykit.report_plot"]
    ctx.set_forkserver_preload([*preload, "matplotlib.figure", "matplotlib.backends.backend_agg"])
    return ctx


def _run(ctx: Any, workdir: Path, target: Any, args: tuple, kill_after: float | None = None, sig: int = 0) -> int:
    """``target(*args)`` in a forked process; killed with ``sig`` after ``kill_after`` s, else run to its end."""
    proc = ctx.Process(target=target, args=args)
    proc.start()
    if kill_after is not None:
        started = workdir / "started"  # the child's SIGINT handler is in place: time the kill from here
        deadline = time.monotonic() + 60
        while not started.exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.join(kill_after)
        if proc.is_alive():
            os.kill(proc.pid, sig)
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"training in {workdir} did not end within 60 s")
    return int(proc.exitcode)


def _check_lines(log: Path) -> list[dict[str, Any]]:
    """Every line is one JSON object; only the last may be cut short (and the reader skips it, warning)."""
    if not log.exists():
        return []
    raw = log.read_bytes()
    lines = raw.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail: b"" when the file ends with a newline
    for number, line in enumerate(complete, start=1):
        assert isinstance(json.loads(line), dict), f"{log}:{number}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows, _events = read_jsonl(log)
    truncated = [w for w in caught if "truncated last line" in str(w.message)]
    assert len(truncated) == (1 if tail else 0)
    return rows


def _kill_and_resume(ctx: Any, workdir: Path, sig: signal.Signals, delay: float, reference: dict[str, Any]) -> tuple:
    """Kill a run after ``delay`` s, check its log, resume it from the checkpoint, check counters and log, draw it."""
    workdir.mkdir()
    killed = _run(ctx, workdir, script.train, (str(workdir), STEPS), kill_after=delay, sig=sig) != 0
    _check_lines(workdir / "run.jsonl")
    ckpt = workdir / "ckpt.pt"
    saved = torch.load(ckpt, weights_only=False)["step"] if ckpt.exists() else None

    code = _run(ctx, workdir, script.resume_and_draw, (str(workdir), STEPS))
    # 255 is multiprocessing's "could not read the exit status from the forkserver" (the child's own
    # status never got through, seen once in many runs). The resume's work is then judged by what it
    # wrote: the report is its last act, and everything below checks its results.
    assert code == 0 or (code == 255 and (workdir / "report.png").exists()), code
    result = json.loads((workdir / "result.json").read_text())
    assert result["resumed_from"] == saved
    if saved is not None:  # the restored guard counts exactly what happened before the checkpoint
        assert result["at_resume"] == {"steps": saved, "skipped": sum(script.poisoned(s) for s in range(saved))}
    keys = ("steps", "skipped", "clipped", "nonfinite_steps")
    assert {k: result["final"][k] for k in keys} == {k: reference["final"][k] for k in keys}
    rows = _check_lines(workdir / "run.jsonl")
    rewinds = [j for j in range(1, len(rows)) if rows[j]["step"] <= rows[j - 1]["step"]]
    resumed_rows = [r for r in rows[rewinds[-1] if rewinds else 0 :] if r["step"] >= (saved or 0)]
    # every logging step, then close()'s final row for the steps after the last one (none when the
    # checkpoint was the run's last step: the resumed run has no step left to take)
    final_row = [STEPS - 1] if (saved or 0) < STEPS else []
    assert [r["step"] for r in resumed_rows] == [*range(saved or 0, STEPS, 2), *final_row]
    for row in resumed_rows:  # the resumed segment logs what the uninterrupted run logged
        ref = reference["rows"][row["step"]]
        assert row["stability/skipped/total"] == ref["stability/skipped/total"], (workdir, row["step"])
        norm, ref_norm = row["stability/grad_norm/total"], ref["stability/grad_norm/total"]
        assert math.isclose(norm, ref_norm, rel_tol=1e-5) or (math.isnan(norm) and math.isnan(ref_norm))
    assert (workdir / "report.png").stat().st_size > 20_000  # the report drew the killed-and-resumed log
    return sig.name, round(delay, 2), killed, saved


@pytest.mark.timeout(180)
def test_kills_leave_valid_logs_drawable_reports_and_exact_resumes(tmp_path: Path) -> None:
    ctx = _context()
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    assert _run(ctx, reference_dir, script.train, (str(reference_dir), STEPS)) == 0
    reference = json.loads((reference_dir / "result.json").read_text())
    assert reference["final"]["steps"] == STEPS
    assert reference["final"]["skipped"] == sum(script.poisoned(s) for s in range(STEPS))
    reference["rows"] = {r["step"]: r for r in read_jsonl(reference_dir / "run.jsonl")[0]}

    rng = random.Random(20)
    duration = reference["seconds"]  # the training itself, not the forkserver's start
    plan = [(signal.SIGINT if i % 2 else signal.SIGKILL, rng.uniform(0.0, duration)) for i in range(KILLS)]
    with ThreadPoolExecutor(max_workers=2) as pool:  # two runs at a time: one per core
        futures = [
            pool.submit(_kill_and_resume, ctx, tmp_path / f"kill{i:02d}", sig, delay, reference)
            for i, (sig, delay) in enumerate(plan)
        ]
        outcomes = [f.result() for f in futures]

    killed_runs = [o for o in outcomes if o[2]]
    assert len(killed_runs) >= KILLS // 2, outcomes  # most kills landed mid-run
    assert {o[0] for o in killed_runs} == {"SIGINT", "SIGKILL"}, outcomes
