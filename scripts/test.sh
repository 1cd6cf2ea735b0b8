#!/usr/bin/env bash
# README command 2: set up (runtime + test stack) and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
# two workers (pytest-xdist): a module, or the SmolLM2 group, runs whole on one worker, longest
# first (tests/conftest.py), each worker with one thread (two workers with torch's default
# thread count oversubscribe a 2-core machine: slower than one process);
# QUANTPRESS_TEST_WORKERS=0 runs in one process with the default threads
workers=${QUANTPRESS_TEST_WORKERS:-2}
[ "$workers" != 0 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q --durations=25 -n "$workers" --no-loadscope-reorder "$@"
