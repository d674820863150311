"""Run the whole distributed matrix (CI runs a subset) and print errors against DDP and timings.

    PYTHONPATH=. python benchmarks/distributed_matrix.py [--only layouts|fsdp_clip|parity]

* layouts: 4 processes, FSDP1 hybrid strategies, FSDP2 HSDP 2x2, FSDP2 + TP, TP + DP, 2 pipeline
  stages x FSDP2: every norm type x max_norm 1 and 2.5, NaN and Inf skips for every norm type;
* fsdp_clip: PyTorch's FSDP1 clip-grad-norm tests ported (2 processes), every subtest;
* parity: DDP / FSDP1 / FSDP2 / HSDP W x 1 and 1 x W on 2 and 3 processes.

Prints, per layout and norm type, the largest relative error of the total norm against DDP +
``torch.nn.utils.clip_grad_norm_`` over every rank and iteration, whether every skip held, and
the wall time of each run. Exits non-zero when any error exceeds 1.3e-6 or any skip failed.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.distributed_script_runner import run_world  # noqa: E402

RTOL = 1.3e-6


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def layouts(out: Path) -> bool:
    start = time.perf_counter()
    ranks = run_world(ROOT / "tests" / "distributed_layouts_script.py", 4, out, "all", timeout=1800)
    took = time.perf_counter() - start
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for rank in ranks:
        for key, case in rank["parity"].items():
            layout, p = key.split("|")[0] + (" " + key.split("|")[1] if "orig" in key else ""), key.split("|")[-2]
            for a, b in zip(case["got"]["norms"], case["ref"]["norms"], strict=True):
                worst[(layout, p)] = max(worst[(layout, p)], _rel(a, b))
    skips: dict[tuple[str, str], bool] = defaultdict(lambda: True)
    for key in ranks[0]["skip"]:
        parts = key.split("|")
        layout, p = " ".join(parts[:-2]), parts[-2]
        ok = all(
            r["skip"][key]["skipped"] == 1
            and r["skip"][key]["unchanged"]
            and not math.isfinite(r["skip"][key]["grad_norm"])
            for r in ranks
        )
        skips[(layout, p)] &= ok
    print(f"\n## 4-process layouts ({took:.0f} s)\n")
    print("| layout | p | max rel. error vs DDP | NaN and Inf on rank 3 skip everywhere, state bitwise kept |")
    print("| --- | --- | --- | --- |")
    for (layout, p), err in sorted(worst.items()):
        print(f"| {layout} | {p} | {err:.1e} | {'yes' if skips[(layout, p)] else 'NO'} |")
    placements = max(_rel(g, r) for rank in ranks for g, r in rank["placements"].values())
    print(f"\nDTensor grads, every pair of Shard/Replicate/Partial on 2 x 2: max rel. error {placements:.1e}")
    return max(worst.values()) <= RTOL and all(skips.values()) and placements <= RTOL


def fsdp_clip(out: Path) -> bool:
    start = time.perf_counter()
    ranks = run_world(ROOT / "tests" / "distributed_fsdp_clip_script.py", 2, out, "all", timeout=1800)
    took = time.perf_counter() - start
    worst = max(_rel(a, b) for r in ranks for c in r["ddp_parity"].values() for a, b in c["norms"])
    ok = all(c["clipped"] and c["params_equal"] for r in ranks for c in r["ddp_parity"].values())
    low = max(_rel(c["total"], c["exact"]) for r in ranks for c in r["low_precision"].values())
    n = len(ranks[0]["ddp_parity"])
    print(f"\n## PyTorch's FSDP1 clip tests, ported ({took:.0f} s)\n")
    print(f"ddp parity: {n} subtests x 4 iterations, max rel. error {worst:.1e}, clipped and params equal: {ok}")
    print(f"low-precision grads: {len(ranks[0]['low_precision'])} subtests, max rel. error vs exact {low:.1e}")
    return worst <= RTOL and ok


def parity(out: Path) -> bool:
    good = True
    for world in (2, 3):
        start = time.perf_counter()
        ranks = run_world(ROOT / "tests" / "distributed_parity_script.py", world, out / str(world), timeout=900)
        took = time.perf_counter() - start
        results = ranks[0]
        worst: dict[str, float] = defaultdict(float)
        for rank in ranks:
            for key, case in rank.items():
                if key.startswith(("ddp|", "nan|", "no_grad")):
                    continue
                ref = results[f"ddp|{key.split('|')[-2]}|{key.split('|')[-1]}"]
                for a, b in zip(case["norms"], ref["norms"], strict=True):
                    worst[key.split("|")[0]] = max(worst[key.split("|")[0]], _rel(a, b))
        print(f"\n## {world} processes ({took:.0f} s)\n")
        for kind, err in sorted(worst.items()):
            print(f"- {kind}: max rel. error {err:.1e}")
        good &= max(worst.values()) <= RTOL
    return good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["layouts", "fsdp_clip", "parity"])
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, run in (("layouts", layouts), ("fsdp_clip", fsdp_clip), ("parity", parity)):
            if args.only in (None, name):
                out = Path(tmp, name)
                out.mkdir()
                (out / "2").mkdir()
                (out / "3").mkdir()
                ok &= run(out)
    print("\nall within tolerance" if ok else "\nFAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
