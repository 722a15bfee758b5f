#!/usr/bin/env bash
# Set up if needed, then run the test suite (real broker, Redis or Valkey, MLflow, tiny torch models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# .venv-vllm: the vLLM serving back end runs from its own venv (its pins conflict with .venv's), so its conformance
# tests run too. `flywheel up` never needs it (scripts/up.sh does not install it). Where it cannot be installed its
# tests skip and say why, unless FLYWHEEL_REQUIRE_VLLM=1 (CI) makes that a failure.
if ! bash scripts/install_vllm.sh; then
  [ "${FLYWHEEL_REQUIRE_VLLM:-0}" = 1 ] && { echo "could not install .venv-vllm (FLYWHEEL_REQUIRE_VLLM=1)" >&2; exit 1; }
  echo "could not install .venv-vllm: the vLLM back end's tests will be skipped" >&2
fi
# Two workers by default (pytest-xdist; FLYWHEEL_TEST_WORKERS=0 runs in this process), each test file on one worker
# so a module's shared fixtures (a vLLM engine, a trained model) are built once; a later -n in "$@" wins.
exec .venv/bin/python -m pytest -n "${FLYWHEEL_TEST_WORKERS:-2}" --dist loadfile "$@"
