#!/usr/bin/env bash
# README command 2: set up and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"
