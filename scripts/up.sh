#!/usr/bin/env bash
# Set up (first run only takes a few minutes) and run the whole loop: flywheel up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/flywheel up "$@"
