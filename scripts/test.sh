#!/usr/bin/env bash
# Install everything, then lint, type-check and run the whole test suite (CPU only).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PAGEDLLM_CACHE=${PAGEDLLM_CACHE:-$HOME/.cache/pagedllm}
.venv/bin/python -m pagedllm.prepare >/dev/null  # SmolLM2, converted once and cached
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest "$@"
