"""Merge traces files written by ``train.py --out`` into one (later runs win on equal keys).

    python benchmarks/instability/merge_traces.py OUT IN [IN ...]

Lets several ``train.py`` processes (arms or seeds) run side by side, each to its own file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def merge(out: Path, inputs: list[Path]) -> int:
    """Write every run of ``inputs`` (and of ``out`` when it exists) to ``out``; the number of runs."""
    runs: dict[str, Any] = {}
    meta: dict[str, Any] | None = None
    for path in ([out] if out.exists() else []) + inputs:
        with np.load(path) as npz:
            part = json.loads(str(npz["meta"]))
            if meta is None:
                meta = part
            elif part["columns"] != meta["columns"] or part["steps"] != meta["steps"]:
                raise SystemExit(f"{path}: columns or steps differ from the first file")
            for key, info in part["runs"].items():
                meta["runs"][key] = info
                runs[key] = npz[key]
    if meta is None:
        raise SystemExit("nothing to merge")
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **runs)
    return len(runs)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    print(f"{merge(Path(sys.argv[1]), [Path(a) for a in sys.argv[2:]])} runs in {sys.argv[1]}")
