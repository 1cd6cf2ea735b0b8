#!/usr/bin/env python3
"""AWQ quality on SmolLM2-135M at w4 g64: FP16, plain round-to-nearest (same quantizer and
packing), AWQ, and the ablations ``--no-clip`` and ``--no-duo-scaling``, evaluated with
``quantize eval`` on the held-out split of exllamav2's wiki.utf8 (articles 1800–2348).

Prints a Markdown table (PPL, ΔPPL, KL divergence mean / 99th percentile, top-1 agreement,
and the share of round-to-nearest's perplexity gap to FP16 that each variant closes) and
writes the JSON next to the outputs.

Usage::

    python scripts/awq_quality.py [--samples 32 --seqlen 512] [--chunks 40] [--out DIR]
"""
from __future__ import annotations

import argparse


def main() -> None:
    from bench_common import (add_calibration_args, add_output_args, evaluate_into, held_out, quality_setup,
                              timed_produce)
    from quantpress.targets import AWQOptions

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_calibration_args(ap, samples=32, seqlen=512)
    ap.add_argument("--group-size", type=int, default=64)
    add_output_args(ap, "out/awq-quality")
    ap.add_argument("--reuse", action="store_true",
                    help="keep output directories that already exist (re-run the evaluation only)")
    args = ap.parse_args()
    model, out, compute, src = quality_setup(args)
    variants = {"rtn": dict(rtn=True), "awq": {}, "awq --no-clip": dict(clip=False),
                "awq --no-duo-scaling": dict(duo_scaling=False)}
    dirs, times = {}, {}
    for name, kw in variants.items():
        d = out / f"{name.replace(' --', '-').replace(' ', '')}-g{args.group_size}"
        dirs[name] = d
        if args.reuse and (d / "config.json").is_file():
            times[name] = float("nan")
            continue
        times[name], _ = timed_produce(AWQOptions(group_size=args.group_size, **kw), src, d)
    rep = evaluate_into(out, model, list(dirs.values()), args.chunks, compute)
    base = rep.models[0].ppl["ppl"]
    rtn = rep.models[1].ppl["ppl"]
    print()
    print(f"SmolLM2-135M-Instruct, w4 g{args.group_size}, calibration {args.samples} x {args.seqlen} "
          f"tokens of wiki.utf8 (articles 0-1799); {held_out(rep)}")
    print()
    print("| model | PPL | ΔPPL | KLD mean | KLD 99% | top-1 | gap to FP16 closed | time |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| FP16 | {base:.4f} | | | | | | |")
    for (name, _), m in zip(variants.items(), rep.models[1:]):
        p = m.ppl["ppl"]
        closed = "" if name == "rtn" else f"{100 * (rtn - p) / (rtn - base):.0f}%"
        print(f"| {name} | {p:.4f} | {p - base:+.4f} | {m.kl['kld_mean']:.5f} | {m.kl['kld_p99']:.4f} "
              f"| {100 * m.kl['same_top']:.2f}% | {closed} | {times[name]:.0f} s |")


if __name__ == "__main__":
    main()
