#!/usr/bin/env python3
"""GGUF quality with and without an importance matrix on SmolLM2-135M: ``quantize imatrix``
on the calibration split, then ``convert hf-to-gguf`` for each policy with and without
``--imatrix``, evaluated with ``quantize eval`` on the held-out split of exllamav2's
wiki.utf8 (articles 1800–2348).

Prints a Markdown table (bits per weight, PPL, ΔPPL, KL divergence mean / 99th percentile,
top-1 agreement, time) and writes the JSON next to the outputs.

SmolLM2's 576-wide rows take llama.cpp's fallbacks (Q4_K → Q5_0, IQ4_XS → IQ4_NL), so its
policies compare other types than their names say. ``--native T ...`` adds files where only
the 30 ``ffn_down`` tensors (1,536-wide rows: every type applies as it is) take type T
(``--tensor-type ffn_down=T``), the rest Q8_0, with and without the imatrix: the types
compared on the same weights. ``--grid T ...`` prints each type's SNR on one such tensor and
on Gaussian values of its standard deviation: the released SmolLM2 weights are dequantized
Q4_1 (llama-smollm2's GGUF), values on a 16-level grid per block of 32 that the affine
32-wide types (Q4_1, Q4_K) nearly reproduce and the non-linear i-quants do not;
``--model`` the equivalent model of ``scripts/rotate_model.py`` has its weights off that grid;
widened by it (``--hidden 768 --heads 12 --kv-heads 4``), every tensor takes its policy's
types as named (no fallback), so the whole policies compare.

Usage::

    python scripts/gguf_imatrix_quality.py [--samples 32 --seqlen 512] [--policies Q4_K_M IQ4_XS Q4_K_S]
                                           [--native Q4_K IQ4_XS] [--grid Q4_1 Q4_K IQ4_XS]
                                           [--chunks 20] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path


def main() -> None:
    from bench_common import (add_calibration_args, add_output_args, evaluate_into, held_out, print_table,
                              quality_setup, timed_produce)
    from quantpress.targets import GGUFOptions, ImatrixOptions, Source, produce

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_calibration_args(ap, samples=32, seqlen=512)
    ap.add_argument("--policies", nargs="*", default=["Q4_K_M", "Q4_K_S", "IQ4_XS", "IQ4_NL", "Q3_K_M", "Q2_K"])
    ap.add_argument("--native", nargs="*", default=[], metavar="TYPE",
                    help="also files with only ffn_down in TYPE (the rest Q8_0), with and without the imatrix")
    ap.add_argument("--grid", nargs="*", default=[], metavar="TYPE",
                    help="print each TYPE's SNR on one ffn_down tensor and on Gaussian values")
    add_output_args(ap, "out/gguf-imatrix-quality", what="files")
    ap.add_argument("--against-llamacpp", action="store_true",
                    help="also, per policy with the imatrix: llama.cpp's F16 conversion of the model, "
                         "then llama-quantize --imatrix and quantize gguf --imatrix on it; prints whether "
                         "the two files are identical")
    args = ap.parse_args()
    model, out, compute, src = quality_setup(args)
    if args.grid:
        print_grid(model, args.grid)
    stem = model.name.lower()           # the files' names: smollm2-135m-instruct-Q4_K_M.gguf, ...
    im = out / f"{stem}.imatrix.gguf"
    t0 = time.perf_counter()
    produce(ImatrixOptions(), src, im, force=True)
    t_im = time.perf_counter() - t0
    files, times, bpw = {}, {}, {}
    for policy in args.policies:
        for with_im in (False, True):
            name = f"{policy} --imatrix" if with_im else policy
            f = out / f"{stem}-{policy}{'-imatrix' if with_im else ''}.gguf"
            times[name], s = timed_produce(GGUFOptions(policy, imatrix=str(im) if with_im else None),
                                           Source(model, compute), f)
            bpw[name], files[name] = s.bpw, f
    for t in args.native:
        for with_im in (False, True):
            name = f"Q8_0, ffn_down {t}" + (" --imatrix" if with_im else "")
            f = out / f"{stem}-ffn_down-{t}{'-imatrix' if with_im else ''}.gguf"
            times[name], s = timed_produce(GGUFOptions("Q8_0", imatrix=str(im) if with_im else None,
                                                       tensor_type=(f"ffn_down={t}",)), Source(model, compute), f)
            bpw[name], files[name] = s.bpw, f
    if args.against_llamacpp:
        against_llamacpp(model, im, args.policies, out)
    rep = evaluate_into(out, model, list(files.values()), args.chunks, compute)
    print()
    print(f"{model.name}, imatrix from {args.samples} x {args.seqlen} tokens of wiki.utf8 "
          f"(articles 0-1799, {t_im:.0f} s); {held_out(rep)}")
    print()
    print_table(rep, list(files), bpw, times, first="file")


def against_llamacpp(model: Path, im: Path, policies: list[str], out: Path) -> None:
    """For each policy: ``llama-quantize --imatrix IM F16 REF POLICY 2`` and ``quantize gguf F16
    --policy POLICY --imatrix IM`` on llama.cpp's own F16 conversion of ``model``
    (``convert_hf_to_gguf.py --outtype f16``, the tools of scripts/llamacpp_tools.py); prints
    whether each pair of files is identical, byte for byte."""
    import filecmp
    import subprocess
    import sys

    import llamacpp_tools

    f16 = out / "llamacpp-f16.gguf"
    llamacpp_tools.convert_hf(model, f16)
    quantize = Path(sys.executable).parent / "quantize"
    for policy in policies:
        ref, ours = out / f"llama-quantize-{policy}-imatrix.gguf", out / f"quantize-gguf-{policy}-imatrix.gguf"
        subprocess.run([str(llamacpp_tools.tool("llama-quantize")), "--imatrix", str(im), str(f16), str(ref),
                        policy, "2"], check=True, capture_output=True)
        subprocess.run([str(quantize), "gguf", str(f16), "--policy", policy, "--imatrix", str(im), "-o", str(ours),
                        "--quiet", "--force"], check=True, stdout=subprocess.DEVNULL)
        print(f"{policy} --imatrix on llama.cpp's F16 file: quantize gguf and llama-quantize identical: "
              f"{filecmp.cmp(ref, ours, shallow=False)}", flush=True)


def print_grid(model: Path, types: list[str], layer: int = 10) -> None:
    """Each ggml type's SNR (dB) on ``model.layers.<layer>.mlp.down_proj.weight`` and on
    Gaussian values of its standard deviation (seed 0), without importance weights."""
    import torch
    from safetensors import safe_open

    from quantpress.quantize import ggml

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        w = f.get_tensor(f"model.layers.{layer}.mlp.down_proj.weight").float()
    g = torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std()

    def snr(x: torch.Tensor, t: str) -> float:
        y = ggml.dequantize(ggml.quantize(x, t), t).reshape(x.shape)
        return 10 * math.log10(float((x * x).sum() / ((x - y) ** 2).sum()))

    print(f"| type | bpw | SNR on ffn_down of layer {layer} | SNR on Gaussian values |")
    print("|---|---|---|---|")
    for t in types:
        gt = ggml.get(t)
        bpw = 8 * gt.row_bytes(w.shape[1]) / w.shape[1]
        print(f"| {t} | {bpw:.2f} | {snr(w, t):.2f} dB | {snr(g, t):.2f} dB |")
    print(flush=True)


if __name__ == "__main__":
    main()
