#!/usr/bin/env python3
"""Time the EXL2 measurement's GPTQ work for SmolLM2-135M's linear shapes: every linear
quantized under each distinct setting of exllamav2's option table, as
``calibration/exl2_measure.py`` ``Measurer.measure_module`` needs it.

For each linear (q/k/v/o_proj 576→576/192/192/576, gate/up_proj 576→1536, down_proj
1536→576; weight [N, K] = [out, in]) the settings are the distinct ``opt[name]`` of
:func:`quantize.exl2.attn_options` / :func:`quantize.exl2.mlp_options` in first-use order (q, k,
o 14, v 15, gate/up 13, down 14, as exllamav2 0.3.2's ``get_qparams_reduced`` counts them).
Inputs are random but shaped like real
ones: activations X [tokens, K] from K/8 latent factors plus noise with uneven channel
energy (a few channels 20x), H = XᵀX / tokens (float32), and a float16 weight ~N(0, 0.02²)
with a few outlier inputs. Timed per linear, best of ``--repeat``, in wall seconds and in
process CPU seconds (the steadier figure on a shared machine: the runs are single-threaded):

* ``single``: the old way, one call per setting: ``gptq_quantize_many(w, H, [qp])`` for each
  qp (= ``gptq_quantize``, the same code);
* ``many``: one ``gptq_quantize_many(w, H, settings)`` call;
* ``--against REV``: also ``gptq_quantize`` of ``gptq.py`` as committed at git
  revision REV (e.g. the commit before gptq_quantize_many), one call per setting.

The many-call's results are checked equal to the single calls' (weights bit for bit).
Output: one line per linear with the ratios single/many (and REV/many), the sums for one
decoder layer, and those times 30 layers (SmolLM2) in minutes.
Run single-threaded on a shared machine (``OMP_NUM_THREADS=1``; the CPU path sets torch to
one intra-op thread anyway).

``--vs-llm-compressor``: instead, ``quantize gptq`` (w4, ``--group-size``, no act-order) beside
llm-compressor 0.14.0.1's ``GPTQModifier`` (the same scheme, ``actorder=None``) on the same token
rows and threads, as ``scripts/bench_awq.py --vs-llm-compressor`` does for AWQ (that script's
docstring says what is timed and compared).

Usage::

    python scripts/bench_gptq.py --vs-llm-compressor [--sizes 16x256] [--group-size 64] [--threads 2]
    OMP_NUM_THREADS=1 python scripts/bench_gptq.py [--linears q_proj,down_proj] [--repeat 1]
        [--tokens 4096] [--device cpu] [--against 21d4784]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import bench_awq
from bench_common import REPO, add_model_arg, best_of, model_dir, parse_sizes
from quantpress.quantize import exl2
from quantpress.quantize.gptq import gptq_quantize_many

#: SmolLM2-135M: name -> (K, N) = (in_features, out_features); 30 decoder layers
SMOL_LINEARS = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192),
                "o_proj": (576, 576), "gate_proj": (576, 1536), "up_proj": (576, 1536),
                "down_proj": (1536, 576)}
SMOL_LAYERS = 30


def settings(name: str) -> list[exl2.QParams]:
    """The distinct settings of linear ``name`` over its module's options, in first-use order
    (the (linear, QParams) keys Measurer.measure_module quantizes)."""
    opts = exl2.attn_options() if name in ("q_proj", "k_proj", "v_proj", "o_proj") else exl2.mlp_options()
    return list(dict.fromkeys(opt[name] for opt in opts))


def inputs(K: int, N: int, tokens: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float16 [N, K], Hessian float32 [K, K]) on ``device``, see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, K // 8, generator=g) @ torch.randn(K // 8, K, generator=g) / math.sqrt(K // 8)
    energy = torch.rand(K, generator=g).add_(0.1)
    energy[torch.randperm(K, generator=g)[:4]] *= 20.0
    x = (z + 0.3 * torch.randn(tokens, K, generator=g)) * energy
    h = x.T @ x / tokens
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, torch.randperm(K, generator=g)[:4]] *= 8.0
    return w.to(torch.float16).to(device), h.to(device)


def module_at(rev: str):
    """``gptq.py`` as committed at git revision ``rev`` (``src/quantpress/quantize/gptq.py``, or
    ``quantize/gptq.py`` before the package moved under src/; its imports of the old top-level
    packages are pointed at ``quantpress``), imported as a lone module."""
    for path in ("src/quantpress/quantize/gptq.py", "quantize/gptq.py"):
        p = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True)
        if p.returncode == 0:
            break
    else:
        raise SystemExit(f"no gptq.py at revision {rev}")
    src = p.stdout.replace("from quantize.", "from quantpress.quantize.")
    path = Path(tempfile.mkdtemp()) / f"gptq_at_{rev.replace('/', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod                  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linears", default=",".join(SMOL_LINEARS),
                    help="comma-separated subset of " + ", ".join(SMOL_LINEARS))
    ap.add_argument("--repeat", type=int, default=1, help="runs per measurement (best kept)")
    ap.add_argument("--tokens", type=int, default=4096, help="activation rows behind each Hessian")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--against", metavar="REV", help="also time gptq_quantize of quantize/gptq.py at this git revision")
    ap.add_argument("--vs-llm-compressor", action="store_true",
                    help="quantize gptq beside llm-compressor 0.14.0.1's GPTQ on SmolLM2 (CPU)")
    add_model_arg(ap, help="HF directory for --vs-llm-compressor (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--sizes", default="16x256", help="calibration rows x seqlen (--vs-llm-compressor)")
    ap.add_argument("--group-size", type=int, default=64)
    bench_awq.add_side_by_side_args(ap)
    args = ap.parse_args()
    if args.vs_llm_compressor:
        bench_awq.vs_llm_compressor(model_dir(args.model), parse_sizes(args.sizes), args.group_size, args.threads, args.ctx, args.chunks,
                                    method="gptq")
        return 0
    names = [n.strip() for n in args.linears.split(",") if n.strip()]
    bad = [n for n in names if n not in SMOL_LINEARS]
    if bad:
        ap.error(f"unknown linear(s) {bad}")
    old = module_at(args.against) if args.against else None

    print(f"torch {torch.__version__}, device {args.device}, intra-op threads on CPU: 1, "
          f"tokens {args.tokens}, repeat {args.repeat}; seconds per linear, wall / process CPU")
    cols = ["single", "many"] + ([args.against] if old else [])
    print(f"{'linear':<10} {'K x N':>9} {'S':>3} " + " ".join(f"{c + ' wall/cpu':>17}" for c in cols)
          + "  single/many" + (f"  {args.against}/many" if old else "") + "  (ratios of wall / cpu)")
    tot = {c: [0.0, 0.0] for c in cols}

    def row(label: str, shape: str, S: str, t: dict) -> str:
        line = f"{label:<10} {shape:>9} {S:>3} " + " ".join(f"{t[c][0]:>8.2f} /{t[c][1]:>7.2f}" for c in cols)
        for c in cols[::2]:                      # single, and the revision
            line += f"  {t[c][0] / t['many'][0]:>5.2f} / {t[c][1] / t['many'][1]:.2f}"
        return line

    for i, name in enumerate(names):
        K, N = SMOL_LINEARS[name]
        qps = settings(name)
        w, h = inputs(K, N, args.tokens, seed=i, device=args.device)
        t = {}
        *t["single"], singles = best_of(lambda: [gptq_quantize_many(w, h, [qp])[0] for qp in qps],
                                        args.repeat, args.device)
        *t["many"], many = best_of(lambda: gptq_quantize_many(w, h, qps), args.repeat, args.device)
        for a, b in zip(singles, many):
            if not torch.equal(a.weight.view(torch.int16), b.weight.view(torch.int16)):
                raise SystemExit(f"{name} {a.qparams}: gptq_quantize_many differs from the single-setting call")
        if old:
            *t[args.against], _ = best_of(lambda: [old.gptq_quantize(w, h, qp) for qp in qps],
                                          args.repeat, args.device)
        for c in cols:
            tot[c][0] += t[c][0]
            tot[c][1] += t[c][1]
        print(row(name, f"{K}x{N}", str(len(qps)), t), flush=True)
    print(row("layer", "", "", tot))
    if names == list(SMOL_LINEARS):
        print(f"x {SMOL_LAYERS} layers (min, wall / cpu): " + ", ".join(
            f"{c} {tot[c][0] * SMOL_LAYERS / 60:.1f} / {tot[c][1] * SMOL_LAYERS / 60:.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
