"""Time and peak memory of ``stabilitykit report`` on a long JSONL log (default 200k lines).

    python benchmarks/report_large_log.py [--lines 200000] [--layers 8] [--keep]

The log is made from a real guard run of the tiny GPT (a NaN batch every 97 steps, so skips and
events are in it), its rows repeated with the steps renumbered and the values jittered until the
file has ``--lines`` lines; ``--layers`` more than the model's 8 adds per-layer keys. The report
runs in a fresh process (``python -m stabilitykit.cli report``) so its wall time and peak RSS
(``ru_maxrss`` of the child) are the command's own.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import stabilitykit as sk
from stabilitykit.testing import char_batches, tiny_gpt


def _template(folder: Path) -> list[dict[str, object]]:
    """Records of a real 200-step guard run with a skip every 97 steps."""
    torch.set_num_threads(1)
    path = folder / "template.jsonl"
    model = tiny_gpt()
    guard = sk.StabilityGuard(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), sk.StabilityConfig(), sinks=[sk.sinks.JsonlSink(path)]
    )
    data = char_batches(seed=0)
    for step in range(200):
        x, y = next(data)
        guard.backward(model.loss(x, y) * (float("nan") if step % 97 == 50 else 1.0))
        guard.step()
        guard.zero_grad()
    guard.close()
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_log(path: Path, lines: int, layers: int) -> None:
    """``lines`` records: the template's rows and events, repeated with steps moving on."""
    records = [r for r in _template(path.parent) if int(r["step"]) >= 100]  # past the first fast drop of the loss
    rng = random.Random(0)
    with path.open("w") as out:
        written, offset = 0, 0
        while written < lines:
            for record in records:
                if written >= lines:
                    break
                row = dict(record)
                row["step"] = int(row["step"]) - 100 + offset
                if "event" not in row:
                    for key, value in list(row.items()):
                        if isinstance(value, float):
                            row[key] = value * (1 + 0.05 * rng.random())
                    for i in range(8, layers):
                        row[f"stability/grad_norm/extra.{i}"] = rng.random()
                out.write(json.dumps(row) + "\n")
                written += 1
            offset += 100


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the log and picture (prints where)")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="sk-report-"))
    log = folder / "long.jsonl"
    write_log(log, args.lines, args.layers)
    size = log.stat().st_size / 2**20
    subprocess.run([sys.executable, "-c", "import matplotlib.figure, numpy, stabilitykit.report_plot"], check=True)
    imports = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far: imports only
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "stabilitykit.cli", "report", str(log), "-o", str(folder / "long.png")]
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(f"{args.lines} lines ({size:.0f} MiB, {args.layers} layers): {wall:.1f} s, peak RSS {peak / 1024:.0f} MiB")
    print(f"(a process that only imports matplotlib, numpy and stabilitykit peaks at {imports / 1024:.0f} MiB)")
    if args.keep:
        print("log and picture in", folder)
    else:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


if __name__ == "__main__":
    main()
