#!/usr/bin/env bash
# Set up (first run only) and run the demo: a tiny GPT with an injected NaN batch and gradient spike.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
