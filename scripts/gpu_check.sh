#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py; docs/gpu.md): kernels, graphs, parity, server and speed
# on this machine's CUDA device, one JSON document. Skips, with its reason, without CUDA.
# Python: $PYTHON, else the project's .venv (scripts/setup.sh), else python3 (a lent GPU
# machine's own, torch >= 2.11: nothing is installed).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
