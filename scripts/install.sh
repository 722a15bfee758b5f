#!/usr/bin/env bash
# Create .venv and install Flywheel with everything its tests need.
# torch==2.13.0 goes first: a plain `torch` requirement resolved by pip alone would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet torch==2.13.0
# constraints.txt: the versions the tests last passed with (its header says how to refresh it).
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
