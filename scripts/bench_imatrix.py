#!/usr/bin/env python3
"""Benchmark ``quantize imatrix`` against llama.cpp's ``llama-imatrix`` on the same model,
machine and number of calibration tokens: ``--samples`` rows of ``--seqlen`` tokens for ours,
``--chunks`` of ``-c`` tokens for llama-imatrix (built from llama-cpp-python 0.3.36's vendored
source, ``scripts/llamacpp_tools.py``), both on exllamav2 0.3.2's ``wiki.utf8`` (ours draws its
rows from the calibration split, llama-imatrix reads the file from its start: the same count
of tokens, not the same tokens), with as many threads as cores, ``--no-ppl`` (llama-imatrix
then computes no logits, as ours never does) on llama.cpp's own F16 conversion
(``convert_hf_to_gguf.py --outtype f16``, timed apart: llama.cpp's way from a Hugging Face
directory to an imatrix needs it first). Each step runs in its own process; wall time, peak
RSS and the peak PSS of its process tree (``bench_common.measure``). Prints both, the ratios
(ours against llama-imatrix alone and against conversion + llama-imatrix), and the
importances' agreement (``gpu_checks.compare_imatrix``: the same tensors and counts; their
values differ, the tokens being others).

    .venv/bin/python scripts/bench_imatrix.py [--model smollm2|synth4x|DIR] [--samples 16]
        [--seqlen 512] [--repeat 2]

``--repeat N`` runs the sequence N times, the tools alternating, and reports each step's
shortest wall time (with its largest peaks) and each run's ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import gpu_checks
import llamacpp_tools
from bench_common import PY, best_step, llamacpp_convert_cmd, measure, named_model, offline_env
from quantpress import assets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, synth4x, or a model directory")
    ap.add_argument("--samples", type=int, default=16, help="rows (llama-imatrix: chunks) (default 16)")
    ap.add_argument("--seqlen", type=int, default=512, help="tokens per row (llama-imatrix: -c) (default 512)")
    ap.add_argument("--repeat", type=int, default=1, metavar="N", help="runs, alternating (default 1)")
    args = ap.parse_args()
    model = named_model(args.model)
    text = assets.standard_cal_data() / "wiki.utf8"
    nthread = str(os.cpu_count() or 1)
    tool = llamacpp_tools.tool("llama-imatrix")
    env = offline_env()
    runs = []
    for _ in range(max(1, args.repeat)):
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            f16, theirs, ours = d / "f16.gguf", d / "llama.imatrix.gguf", d / "ours.imatrix.gguf"
            r = {"conv": measure(llamacpp_convert_cmd(model, f16), env)}
            r["theirs"] = measure([str(tool), "-m", str(f16), "-f", str(text), "-c", str(args.seqlen),
                                   "--chunks", str(args.samples), "-t", nthread, "--no-ppl", "-o", str(theirs)])
            r["ours"] = measure([PY, "-m", "quantpress", "quantize", "imatrix", str(model), "-o", str(ours),
                                 "--samples", str(args.samples), "--seqlen", str(args.seqlen), "--quiet"])
            c = gpu_checks.compare_imatrix(ours, theirs)
            r["agree"] = c["names_equal"] and c["counts_equal"]
            runs.append(r)

    conv, theirs, ours = best_step(runs, "conv"), best_step(runs, "theirs"), best_step(runs, "ours")
    print(f"model {model} ({args.samples} x {args.seqlen} tokens, {nthread} threads, best of {len(runs)})")
    print(f"  llama.cpp  convert f16 {conv[0]:6.1f} s {conv[1]:6.0f} MiB RSS | llama-imatrix --no-ppl "
          f"{theirs[0]:6.1f} s {theirs[1]:6.0f} MiB RSS {theirs[2]:6.0f} MiB PSS | total {conv[0] + theirs[0]:6.1f} s")
    print(f"  quantpress quantize imatrix {ours[0]:6.1f} s {ours[1]:6.0f} MiB RSS {ours[2]:6.0f} MiB PSS")
    each = ", ".join(f"{r['ours'][0] / r['theirs'][0]:.2f}x" for r in runs)
    print(f"  ratio ours/llama-imatrix {ours[0] / theirs[0]:.2f}x (runs: {each}); ours/(convert + llama-imatrix) "
          f"{ours[0] / (conv[0] + theirs[0]):.2f}x; memory {ours[1] / theirs[1]:.2f}x RSS; "
          f"same tensors and counts: {all(r['agree'] for r in runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
