#!/usr/bin/env bash
# On a GPU machine: set up, say which GPU and torch, run the CUDA test suite and the GPU benchmark, print both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export WANDB_MODE=offline WANDB_SILENT=true
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
.venv/bin/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
echo "== tests/cuda"
.venv/bin/python -m pytest tests/cuda -q -rs -p no:cacheprovider
echo "== benchmarks/gpu.py"
.venv/bin/python benchmarks/gpu.py "$@"
