#!/usr/bin/env bash
# Set up if needed, then run the test suite (real broker, Redis or Valkey, MLflow, tiny torch models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
