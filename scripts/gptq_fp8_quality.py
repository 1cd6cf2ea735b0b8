#!/usr/bin/env python3
"""GPTQ and FP8 quality on SmolLM2-135M: FP16, GPTQ's round-to-nearest baseline (same groups
and packing), GPTQ, GPTQ with act-order, and FP8 dynamic / static / block, evaluated with
``quantize eval`` on the held-out split of exllamav2's wiki.utf8 (articles 1800–2348).

Prints a Markdown table (bits per weight of the files, PPL, ΔPPL, KL divergence mean / 99th
percentile, top-1 agreement, time) and writes the JSON next to the outputs.

Usage::

    python scripts/gptq_fp8_quality.py [--samples 16 --seqlen 256] [--group-size 64] [--chunks 20] [--out DIR]
"""
from __future__ import annotations

import argparse


def main() -> None:
    from bench_common import (add_calibration_args, add_output_args, evaluate_into, held_out, print_table,
                              quality_setup, timed_produce)
    from quantpress.targets import FP8Options, GPTQOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_calibration_args(ap, samples=16, seqlen=256)
    ap.add_argument("--group-size", type=int, default=64)
    add_output_args(ap, "out/gptq-fp8-quality")
    args = ap.parse_args()
    model, out, compute, src = quality_setup(args)
    g = args.group_size
    variants = {f"GPTQ w4g{g} --rtn": GPTQOptions(group_size=g, rtn=True),
                f"GPTQ w4g{g}": GPTQOptions(group_size=g),
                f"GPTQ w4g{g} --act-order": GPTQOptions(group_size=g, act_order=True),
                "FP8 dynamic": FP8Options("dynamic"), "FP8 static": FP8Options("static"),
                "FP8 block": FP8Options("block")}
    dirs, times, bpw = {}, {}, {}
    for name, opts in variants.items():
        d = out / name.replace(" --", "-").replace(" ", "-")
        times[name], s = timed_produce(opts, src, d)
        bpw[name], dirs[name] = s.bpw, d
    rep = evaluate_into(out, model, list(dirs.values()), args.chunks, compute)
    print()
    print(f"SmolLM2-135M-Instruct, calibration {args.samples} x {args.seqlen} tokens of wiki.utf8 "
          f"(articles 0-1799); {held_out(rep)}")
    print()
    print_table(rep, list(variants), bpw, times)

if __name__ == "__main__":
    main()
