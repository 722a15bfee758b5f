#!/usr/bin/env bash
# Create .venv and install Flywheel with everything its tests need.
# torch==2.13.0 goes first: a plain `torch` requirement resolved by pip alone would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
.venv/bin/python -m pip install --quiet -e ".[dev]"
