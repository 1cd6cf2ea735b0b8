#!/usr/bin/env bash
# Set up .venv: quantpress and its runtime dependencies (the README's first command), and with
# --test also the test stack (the README's second command). Idempotent: a second run with the
# same pyproject.toml, constraints and this script does nothing (stamp files); llama.cpp's
# build (--test) is kept in quantpress's cache (~/.cache/quantpress) for later runs. Its times:
# docs/benchmarks.md ("The test suite"; "Figures behind the code", scripts/setup.sh).
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
want_build=0
[ "$want_test" = 1 ] && [ "$(cat .venv/.quantpress-test 2>/dev/null)" != "$key" ] && want_build=1
build=

# llama.cpp's shared libraries and tools (llama-quantize, llama-imatrix, llama-perplexity) for
# the test stack, built once into the cache (its log is build.log there). Started as soon as
# its script can run (quantpress from src/, filelock from torch's dependencies), in the
# background and in a process group of its own (killed with the script if a step fails), so
# that its source download and compilation run beside pip's installs, which keep about one
# core busy: the whole set-up takes less time than with the build after the installs
# (docs/benchmarks.md, "Figures behind the code", scripts/setup.sh)
start_build() {
  [ "$want_build" = 1 ] && [ -z "$build" ] || return 0
  PYTHONPATH=src setsid .venv/bin/python scripts/llamacpp_tools.py > /dev/null &
  build=$!
  trap 'kill -- -"$build" 2>/dev/null || true' EXIT
}

if [ "$(cat .venv/.quantpress-runtime 2>/dev/null)" != "$key" ]; then
  pip install -q --upgrade pip
  # the CPU wheel first: a plain "torch" would pull several GB of CUDA packages
  pip install -q -c scripts/constraints.txt torch==2.13.0
  start_build
  pip install -q -c scripts/constraints.txt -e .
  echo "$key" > .venv/.quantpress-runtime
fi

if [ "$want_build" = 1 ]; then
  start_build
  # llama.cpp reference, pytest, and gptqmodel's dependencies: the [test] extra. llama-cpp-python
  # comes without its own build of llama.cpp (CMAKE_ARGS=-DLLAMA_BUILD=OFF: Python only; its
  # own build would compile most of llama.cpp a second time, docs/benchmarks.md); llama.cpp is
  # compiled once (start_build), from the same vendored source, for both the tools and the
  # bindings' libraries
  CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}" pip install -q -c scripts/constraints.txt -e ".[test]"
  # transformers' AWQ loader for the consumer test: gptqmodel declares torch>=2.14.1, so it
  # comes without its dependencies (the extra above installs them, pinned)
  pip install -q --no-deps gptqmodel==7.7.0
  # Triton, for its interpreter alone (tests/test_triton_searches.py runs the CUDA searches'
  # kernels on the CPU): beside the environment, not in it, where nothing else imports it;
  # the version of the CUDA machines' torch 2.11 images
  pip install -q --no-deps --upgrade --target .venv/triton-interp triton==3.6.0
  wait "$build"
  trap - EXIT
  # the built libraries copied into the llama_cpp package, where its own build would have put them
  .venv/bin/python scripts/llamacpp_tools.py --install-libs > /dev/null
  echo "$key" > .venv/.quantpress-test
fi

# quantpress's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set, Python would
# otherwise compile every quantpress module in memory at each start of each process; stale
# files are recompiled in memory as usual (checked against the source's mtime)
.venv/bin/python -m compileall -q src/quantpress > /dev/null
