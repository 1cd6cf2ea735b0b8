#!/usr/bin/env bash
# Set up .venv with the project and its pinned test stack. Idempotent: a second run with
# the same pyproject.toml and this script does nothing (stamp file), and pip's wheel cache
# keeps llama-cpp-python's ~5 min source build for later runs.
#   bash scripts/setup.sh          # runtime + test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.quantpress-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
# the CPU wheel: a plain "torch" would pull several GB of CUDA packages
pip install -q torch==2.13.0
# pinned versions tested together (shared/specs/data.md §4); pyproject declares ranges
pip install -q transformers==5.23.0 gguf==0.19.0 safetensors==0.8.0 datasets==5.2.0 \
  accelerate==1.15.0 sentencepiece==0.2.3 scipy tqdm pytest
# llama.cpp reference for the tests (builds from source once, then comes from the wheel cache)
pip install -q llama-cpp-python==0.3.36
# transformers' AWQ loader for the consumer test (shared/specs/awq.md §3): gptqmodel declares
# torch>=2.14.1, so it comes without its dependencies, which are installed pinned after it
pip install -q --no-deps gptqmodel==7.7.0 compressed-tensors==0.20.0
pip install -q loguru==0.7.3 pypcre==0.6.4 logbar==0.4.15 tokenicer==0.0.14 device-smi==0.5.7 \
  threadpoolctl==3.8.0 defuser==0.0.28 pillow==13.0.0
pip install -q --no-deps -e .
echo "$want" > "$stamp"
