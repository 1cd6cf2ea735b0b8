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
import json
import time
from pathlib import Path


def main() -> None:
    from quantpress import assets
    from quantpress.targets import (CalibOptions, ComputeOptions, FP8Options, GPTQOptions, Source,
                                    produce)
    from quantpress.targets.eval import EvalOptions, evaluate
    from quality_table import print_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory (default: SmolLM2-135M-Instruct from the cache)")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=None, help="eval chunks of 512 (default: all)")
    ap.add_argument("--out", default="out/gptq-fp8-quality", help="where the directories go")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = Path(args.model) if args.model else assets.smollm2_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    g = args.group_size
    variants = {f"GPTQ w4g{g} --rtn": GPTQOptions(group_size=g, rtn=True),
                f"GPTQ w4g{g}": GPTQOptions(group_size=g),
                f"GPTQ w4g{g} --act-order": GPTQOptions(group_size=g, act_order=True),
                "FP8 dynamic": FP8Options("dynamic"), "FP8 static": FP8Options("static"),
                "FP8 block": FP8Options("block")}
    compute = ComputeOptions(device=args.device)
    src = Source(model, compute, CalibOptions(samples=args.samples, seqlen=args.seqlen))
    dirs, times, bpw = {}, {}, {}
    for name, opts in variants.items():
        d = out / name.replace(" --", "-").replace(" ", "-")
        t0 = time.perf_counter()
        s = produce(opts, src, d, force=True)
        times[name], bpw[name], dirs[name] = time.perf_counter() - t0, s.bpw, d
        print(s.text(), flush=True)
    rep = evaluate(model, list(dirs.values()), EvalOptions(ctx=512, chunks=args.chunks), compute)
    (out / "eval.json").write_text(json.dumps(rep.to_json(), indent=1))
    print()
    print(f"SmolLM2-135M-Instruct, calibration {args.samples} x {args.seqlen} tokens of wiki.utf8 "
          f"(articles 0-1799); eval: {rep.n_chunks} chunks of {rep.n_ctx} (held-out articles 1800-2348)")
    print()
    print_table(rep, list(variants), bpw, times)


if __name__ == "__main__":
    main()
