#!/usr/bin/env bash
# Set up (first run only) and run the test suite (real Trainer, real wandb offline runs, real processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}"  # the ops setup.sh built
export WANDB_MODE=offline WANDB_SILENT=true
exec .venv/bin/python -m pytest "$@"
