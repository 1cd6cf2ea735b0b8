#!/usr/bin/env bash
# Set up .venv: quantpress and its runtime dependencies (the README's first command), and with
# --test also the test stack (the README's second command). Idempotent: a second run with the
# same pyproject.toml, constraints and this script does nothing (stamp files); pip's wheel
# cache keeps llama-cpp-python's ~4 min source build for later runs.
#   bash scripts/setup.sh           # runtime: torch (CPU), transformers, ..., quantpress (editable)
#   bash scripts/setup.sh --test    # + pytest, llama-cpp-python (llama.cpp, the reference), gptqmodel,
#                                   #   Triton's interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
key=$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1)

if [ "$(cat .venv/.quantpress-runtime 2>/dev/null)" != "$key" ]; then
  pip install -q --upgrade pip
  # the CPU wheel first: a plain "torch" would pull several GB of CUDA packages
  pip install -q -c scripts/constraints.txt torch==2.13.0
  pip install -q -c scripts/constraints.txt -e .
  echo "$key" > .venv/.quantpress-runtime
fi

if [ "$want_test" = 1 ] && [ "$(cat .venv/.quantpress-test 2>/dev/null)" != "$key" ]; then
  # llama.cpp reference (llama-cpp-python builds from source once, then comes from the wheel
  # cache), pytest, and gptqmodel's dependencies: the [test] extra. Its multimodal library
  # (mtmd, which llama_cpp imports only for its image chat handler) is not built: 222 s
  # against 275 s on 2 idle cores, timing `CMAKE_ARGS=-DLLAVA_BUILD=OFF .venv/bin/python -m pip
  # wheel --no-cache-dir --no-deps -w /tmp/w llama-cpp-python==0.3.36` with and without CMAKE_ARGS
  CMAKE_ARGS="-DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" pip install -q -c scripts/constraints.txt -e ".[test]"
  # transformers' AWQ loader for the consumer test: gptqmodel declares torch>=2.14.1, so it
  # comes without its dependencies (the extra above installs them, pinned)
  pip install -q --no-deps gptqmodel==7.7.0
  # Triton, for its interpreter alone (tests/test_triton_searches.py runs the CUDA searches'
  # kernels on the CPU): beside the environment, not in it, where nothing else imports it;
  # the version of the CUDA machines' torch 2.11 images
  pip install -q --no-deps --upgrade --target .venv/triton-interp triton==3.6.0
  echo "$key" > .venv/.quantpress-test
fi

# quantpress's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set, Python would
# otherwise compile every quantpress module in memory at each start of each process; stale
# files are recompiled in memory as usual (checked against the source's mtime)
.venv/bin/python -m compileall -q src/quantpress > /dev/null
