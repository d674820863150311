#!/usr/bin/env bash
# Create .venv (once) and install stabilitykit with every extra. Torch comes from torch==2.13.0
# (a CPU build pip finds locally where one is provided) before anything else can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
DEEPSPEED_SPEC=${DEEPSPEED_SPEC:-deepspeed>=0.16}
say() { echo "stabilitykit setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $PY (first run only)"
  "$PY" -m venv .venv
fi
stamp=.venv/.stabilitykit-setup
want="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC $DEEPSPEED_SPEC"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  began=$SECONDS
  say "installing $TORCH_SPEC into .venv (first run, or pyproject.toml changed; a few minutes)"
  .venv/bin/python -m pip install -q --disable-pip-version-check "$TORCH_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
  say "installing stabilitykit with every extra (.[all]: lightning, transformers, wandb, plots, docs, dev)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[all]" 2>&1 | grep -v "^WARNING: Location" || true
  # DeepSpeed ships as an sdist: built against the torch above (--no-build-isolation), or pip's
  # isolated build would pull a multi-GB CUDA torch first; no ops are compiled at install
  say "installing deepspeed (stabilitykit[deepspeed]; built against the installed torch, no ops compiled)"
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation "$DEEPSPEED_SPEC" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, stabilitykit, lightning, wandb"
  if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
    say "WARNING: deepspeed did not install (see pip's output above): the DeepSpeed tests will be skipped"
  fi
  echo "$want" > "$stamp"
  say "ready in $((SECONDS - began)) s; later runs skip this step"
fi
# DeepSpeed compiles its CPU comm op (deepspeed_shm_comm) the first time a process group starts: minutes
# on a busy machine, inside whichever test or example comes first. Build it here once, into this venv's
# own TORCH_EXTENSIONS_DIR (test.sh, demo.sh and the tests use the same folder).
ops=.venv/torch_extensions
ops_stamp="$ops/.stabilitykit-built"
if [ ! -f "$ops_stamp" ] || [ "$(cat "$ops_stamp")" != "$want" ]; then
  if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('deepspeed') is None)"; then
    began=$SECONDS
    say "building DeepSpeed's CPU comm op once into $ops (a minute or two; later runs skip this step)"
    mkdir -p "$ops"
    if TORCH_EXTENSIONS_DIR="$PWD/$ops" .venv/bin/python scripts/build_deepspeed_ops.py; then
      echo "$want" > "$ops_stamp"
      say "DeepSpeed's comm op built in $((SECONDS - began)) s"
    else
      say "WARNING: building DeepSpeed's comm op failed (output above): the first DeepSpeed test will build it"
    fi
  fi
fi
