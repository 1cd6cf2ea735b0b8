#!/usr/bin/env bash
# One-command GPU check suite: quantpress on the CPU against the same work on CUDA.
#
#   bash scripts/gpu_suite.sh [OUT.json] [gpu_checks.py options...]
#
# Writes OUT.json (default gpu_report.json) with scripts/gpu_checks.py: every ggml type on the
# CPU and on CUDA (bytes must be identical), AWQ g64 and EXL2 4.0 bpw made on both devices and
# compared (dequantized weights, per-layer allocation, stage timings), and the batch of
# tests/test_batch.py run with device cpu and with device cuda (exit codes, rows, times).
# Takes a few minutes on a tiny random 2-layer llama; no network is needed.
#
# What it expects on the machine (a CUDA box with no network):
#   - python3 with torch (a CUDA build), transformers and safetensors already installed;
#   - the project's other runtime dependencies (gguf, numpy, scipy, tqdm, sentencepiece,
#     datasets and theirs, and setuptools for the editable install) as wheels in the directory
#     named by $QUANTPRESS_WHEELS; without that variable they are assumed installed;
#   - the SmolLM2 tokenizer in quantpress's cache (~/.cache/quantpress/models/SmolLM2-135M-Instruct,
#     or $QUANTPRESS_CACHE), or pass --tokenizer DIR, or --model DIR to use a given HF model;
#   - the calibration text: exllamav2's standard_cal_data in the same cache (fill it with
#     `python -m quantpress.assets cal-data` where the network is reachable), or --calib FILE;
#     without either gpu_checks.py stops with an error saying so.
#
# Python: .venv/bin/python when the checkout has a .venv (used as it is); otherwise $PYTHON
# (default python3), into which the wheels (if any) are installed with
#   pip install --no-index --find-links "$QUANTPRESS_WHEELS" <dependencies of pyproject.toml>
# and quantpress itself with
#   pip install --no-deps --no-build-isolation -e .
#
# Exit status: that of gpu_checks.py: 0 report written (differences are recorded in it, not
# fatal), 1 a check crashed (the report says which), 2 CUDA not available.
# Example: bash scripts/gpu_suite.sh gpu_report.json --model /data/SmolLM2-135M-Instruct
set -euo pipefail
cd "$(dirname "$0")/.."

OUT="gpu_report.json"
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    OUT="$1"
    shift
fi

if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY="${PYTHON:-python3}"
    if [ -n "${QUANTPRESS_WHEELS:-}" ]; then
        # the runtime dependencies declared in pyproject.toml (torch, transformers and
        # safetensors are already installed, so pip keeps them), plus the build backend
        mapfile -t DEPS < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
        "$PY" -m pip install --no-index --find-links "$QUANTPRESS_WHEELS" "${DEPS[@]}" "setuptools>=77"
    fi
    "$PY" -m pip install --no-deps --no-build-isolation -e .
fi

exec "$PY" scripts/gpu_checks.py --out "$OUT" "$@"
