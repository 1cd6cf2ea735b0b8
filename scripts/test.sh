#!/usr/bin/env bash
# README command 2: set up (runtime + test stack) and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec .venv/bin/python -m pytest -q --durations=25 "$@"
