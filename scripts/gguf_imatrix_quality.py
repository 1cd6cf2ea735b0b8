#!/usr/bin/env python3
"""GGUF quality with and without an importance matrix on SmolLM2-135M: ``quantize imatrix``
on the calibration split, then ``convert hf-to-gguf`` for each policy with and without
``--imatrix``, evaluated with ``quantize eval`` on the held-out split of exllamav2's
wiki.utf8 (articles 1800–2348).

Prints a Markdown table (bits per weight, PPL, ΔPPL, KL divergence mean / 99th percentile,
top-1 agreement, time) and writes the JSON next to the outputs.

Usage::

    python scripts/gguf_imatrix_quality.py [--samples 32 --seqlen 512] [--policies Q4_K_M IQ4_XS Q4_K_S]
                                           [--chunks 20] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    from quantpress import assets
    from quantpress.targets import CalibOptions, ComputeOptions, GGUFOptions, ImatrixOptions, Source, produce
    from quantpress.targets.eval import EvalOptions, evaluate
    from quality_table import print_table

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory (default: SmolLM2-135M-Instruct from the cache)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--policies", nargs="+", default=["Q4_K_M", "Q4_K_S", "IQ4_XS", "IQ4_NL", "Q3_K_M", "Q2_K"])
    ap.add_argument("--chunks", type=int, default=None, help="eval chunks of 512 (default: all)")
    ap.add_argument("--out", default="out/gguf-imatrix-quality", help="where the files go")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = Path(args.model) if args.model else assets.smollm2_dir()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    compute = ComputeOptions(device=args.device)
    src = Source(model, compute, CalibOptions(samples=args.samples, seqlen=args.seqlen))
    im = out / "smollm2.imatrix.gguf"
    t0 = time.perf_counter()
    produce(ImatrixOptions(), src, im, force=True)
    t_im = time.perf_counter() - t0
    files, times, bpw = {}, {}, {}
    for policy in args.policies:
        for with_im in (False, True):
            name = f"{policy} --imatrix" if with_im else policy
            f = out / f"smollm2-{policy}{'-imatrix' if with_im else ''}.gguf"
            t0 = time.perf_counter()
            s = produce(GGUFOptions(policy, imatrix=str(im) if with_im else None), Source(model, compute), f,
                        force=True)
            times[name], bpw[name], files[name] = time.perf_counter() - t0, s.bpw, f
            print(s.text(), flush=True)
    rep = evaluate(model, list(files.values()), EvalOptions(ctx=512, chunks=args.chunks), compute)
    (out / "eval.json").write_text(json.dumps(rep.to_json(), indent=1))
    print()
    print(f"SmolLM2-135M-Instruct, imatrix from {args.samples} x {args.seqlen} tokens of wiki.utf8 "
          f"(articles 0-1799, {t_im:.0f} s); eval: {rep.n_chunks} chunks of {rep.n_ctx} "
          f"(held-out articles 1800-2348)")
    print()
    print_table(rep, list(files), bpw, times, first="file")


if __name__ == "__main__":
    main()
