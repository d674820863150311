"""Build the DeepSpeed op a CPU process group loads at its start (``deepspeed_shm_comm``), as DeepSpeed
itself would, into ``$TORCH_EXTENSIONS_DIR``. Run by ``scripts/setup.sh`` once per venv, so that no
test or example compiles it on a busy machine. Exits 0 where the accelerator has no such op."""

from __future__ import annotations

import sys

import deepspeed.ops
from deepspeed.accelerator import get_accelerator


def main() -> int:
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        print("stabilitykit setup: this accelerator has no DeepSpeed comm op to build", file=sys.stderr)
        return 0
    builder.load()
    return 0


if __name__ == "__main__":
    sys.exit(main())
