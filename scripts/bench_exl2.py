#!/usr/bin/env python3
"""Time per stage and peak memory of ``quantize exl2`` on SmolLM2-135M (CPU; CUDA with
``--device cuda``), each run in a fresh subprocess:

1. ``--measure-only M``: the measurement pass alone (every option of every module);
2. ``--measurement M --bpw A``: allocation + quantization reusing that measurement;
3. ``--measurement M --bpw B``: a second target from the same file: it costs only the
   allocation and the quantization pass (run 2's stages again, no measurement).

Stages come from the command's own summary (tokenize = the calibration rows, measurement,
allocation — with the ``content`` objective and a reused measurement it includes one
unquantized forward pass for the token-norm shares —, quantization (the decoder layers),
head, write, verify).

Peak memory: the child's peak anonymous RSS (``RssAnon`` sampled every 2 ms) above a
baseline taken after the libraries are loaded (torch, transformers' model classes and
everything they import, the tokenizer; no weights, no data), per phase. The measurement and
quantization phases should follow one decoder layer plus the activations, not the model:

    W = params of one decoder layer × (4 + 2) bytes (float32 compute copy + float16 weights)
    X = Σ over the 4 input sets (q/k/v, o, gate/up, down) of K² × 4 bytes (the Hessians)
    H = 3 × tokens × hidden × 4    (layer input, reference output, quantized output)
    F = min(tokens, 4096) × (4·ffn + 4·hidden) × 4   (one forward batch's temporaries)
    S = 64 MiB + 3·hidden·ffn × 2 × 2 bytes  (measurement: one batched GPTQ call's working
        memory, calibration.exl2_measure.GPTQ_BATCH_BYTES, and fake-quantized MLP weights)

The head (lm_head, quantized after the layers; SmolLM2's tied 49,152 × 576 embedding) is the
largest single linear: its phase holds it in float32 plus the GPTQ working memory
(≈ 4 + 11 bytes per weight), i.e. it follows the largest tensor.

The measurement's time per decoder layer (from the summary's ``measurement_layers``):
GPTQ of every candidate setting, module forwards (the reference and each candidate), and
Hessian accumulation (XᵀX in the reference forward's hooks), and how fast its matrix work
runs against ``torch.mm`` of two 2048 × 2048 float32 matrices on the same cores (measured
here first), from these floating-point operation counts (T = calibration tokens, per layer):

    Hessians  2·T·K² per input set (q/k/v, o, gate/up, down)
    forwards  (1 + options) × 2·T·(module parameters), attention scores 4·T·seqlen·heads·head_dim
    GPTQ      N·K² per linear [N, K] and distinct setting (the blocked error updates
              W[:, j:] −= E·H⁻¹[b, j:], summed over the blocks), rated over GPTQ's time
              without its scale searches

The scale searches (exllamav2's ``quantize_err_kernel``: every weight of a group at 97 scales,
about ten elementwise passes each) are not matrix work; their seconds, share of GPTQ and rate
in weight × grid-point evaluations per second are printed beside.

exllamav2 0.3.2 itself needs a CUDA GPU (its extension has no CPU path), so the side-by-side
run is for a machine with one (``--device cuda``; exllamav2's ``convert.py`` on the same
model and calibration sizes); on CPU there is no reference to compare with.

Usage::

    python scripts/bench_exl2.py [--samples 8] [--seqlen 256] [--bpw 4.0,5.0] [--device cpu]
    python scripts/bench_exl2.py --samples 128 --seqlen 512 --layers 2 --measure-only --no-memory
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench_common import (add_model_arg, best_ms, cpu_line, model_dir, model_shape, run_child, sync,
                          truncated_model)

#: the child of :func:`_run` (argv: its options as JSON)
CHILD = r"""
import json, sys
from pathlib import Path
from bench_common import CPUClock, PhaseWatch, libraries_baseline
from quantpress.targets import (CalibOptions, ComputeOptions, EXL2MeasurementOptions, EXL2Options,
                                Source, produce)
args = json.loads(sys.argv[1])
base = libraries_baseline(args["model"])
src = Source(args["model"], ComputeOptions(device=args["device"]),
             CalibOptions(samples=args["samples"], seqlen=args["seqlen"]), progress=False)
if "measure_only" in args:
    opts, out = EXL2MeasurementOptions(), args["measure_only"]
else:
    opts, out = EXL2Options(bpw=args["bpw"], measurement=args["measurement"]), args["out"]
w = PhaseWatch().start() if args["memory"] else None
clock = CPUClock()
s = produce(opts, src, Path(out), progress=False)
cpu = clock.read()
print("RESULT", json.dumps({**s.to_json(), "base": base, "cpu": cpu, **(w.stop() if w else {})}), flush=True)
"""


def _run(model: Path, **kw) -> dict:
    """``produce`` of the measurement (``measure_only=PATH``) or of a target (``bpw``,
    ``measurement``, ``out``) of ``model`` in a fresh process: its summary, the baseline
    (``base``), CPU times and, with ``memory=True``, the per-phase peaks."""
    return run_child(CHILD, [json.dumps({"model": str(model), **kw})])[0]["RESULT"]


def expected(model: Path, tokens: int) -> dict[str, int]:
    """The terms of the module docstring, from config.json (bytes)."""
    h, f, heads, kv, hd = model_shape(model)
    layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * f + 2 * h
    return {"W": layer * 6, "X": (h * h + (heads * hd) ** 2 + h * h + f * f) * 4,
            "H": 3 * tokens * h * 4, "F": min(tokens, 4096) * (4 * f + 4 * h) * 4,
            "S": (64 << 20) + 3 * h * f * 2 * 2}


def mm_flops_per_second(device: str, n: int = 2048, repeat: int = 5) -> float:
    """Best-of-``repeat`` rate of ``torch.mm`` on two float32 [n, n] matrices (flop/s), after
    one untimed product."""
    import torch

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def mm():
        torch.mm(a, b)
        sync(device)
    sync(device)
    return 2 * n ** 3 / (best_ms(mm, repeat) / 1e3)


def measurement_flops(model: Path, samples: int, seqlen: int) -> dict[str, float]:
    """Floating-point operations of one decoder layer's measurement, by part (module
    docstring)."""
    from quantpress.quantize import exl2 as qexl2
    from quantpress.quantize.gptq import P_GRID

    h, f, heads, kv, hd = model_shape(model)
    T = samples * seqlen
    shapes = {"q_proj": (heads * hd, h), "k_proj": (kv * hd, h), "v_proj": (kv * hd, h),
              "o_proj": (h, heads * hd), "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    hess = 2 * T * (h * h + (heads * hd) ** 2 + h * h + f * f)
    attn = qexl2.attn_options()
    mlp = qexl2.mlp_options()
    attn_fwd = 2 * T * sum(n * k for name, (n, k) in shapes.items() if name in attn[0]) \
        + 4 * T * seqlen * heads * hd
    mlp_fwd = 2 * T * sum(n * k for name, (n, k) in shapes.items() if name in mlp[0])
    fwd = (1 + len(attn)) * attn_fwd + (1 + len(mlp)) * mlp_fwd
    gptq = search = 0
    for opts in (attn, mlp):
        for name in opts[0]:
            n, k = shapes[name]
            gptq += len({repr(o[name]) for o in opts}) * n * k * k
            search += len({repr(o[name]) for o in opts}) * n * k * (P_GRID + 1)
    return {"gptq": gptq, "forward": fwd, "hessian": hess, "search": search}


def print_measurement_layers(r: dict, flops: dict[str, float], mm: float) -> None:
    """Seconds per part for a few decoder layers and the sum; each matrix part's rate as a
    fraction of ``mm`` (flop/s), GPTQ's without its scale searches (elementwise work, rated in
    weight × grid-point evaluations per second)."""
    layers = r["details"]["measurement_layers"]
    cols = ("gptq", "search", "forward", "hessian")
    print(f"{'layer':>6} " + " ".join(f"{p:>9}" for p in cols) + "  (seconds; search is part of gptq)")
    show = sorted({0, 1, len(layers) // 2, len(layers) - 1} & set(range(len(layers))))   # --layers 1: one
    for i in show:
        print(f"{i:>6} " + " ".join(f"{layers[i][p]:>9.2f}" for p in cols))
    tot = {p: sum(x[p] for x in layers) for p in cols}
    print(f"{'all':>6} " + " ".join(f"{tot[p]:>9.2f}" for p in cols))
    n = len(layers)
    secs = {"gptq": tot["gptq"] - tot["search"], "forward": tot["forward"], "hessian": tot["hessian"]}
    rates = {p: flops[p] * n / max(secs[p], 1e-9) for p in secs}
    mat = sum(flops[p] for p in secs) * n
    print(f"torch.mm 2048² float32 here: {mm / 1e9:.1f} GFLOP/s; measurement's matrix work: "
          + ", ".join(f"{p} {rates[p] / 1e9:.1f} GFLOP/s ({rates[p] / mm:.2f})" for p in secs)
          + f" (GPTQ without its scale searches); all {mat / sum(secs.values()) / 1e9:.1f} "
          f"GFLOP/s = {mat / sum(secs.values()) / mm:.2f} of torch.mm; with the scale searches' "
          f"time {mat / (tot['gptq'] + tot['forward'] + tot['hessian']) / mm:.2f}")
    print(f"scale searches: {tot['search']:.1f} s = {tot['search'] / max(tot['gptq'], 1e-9):.0%} "
          f"of GPTQ, {flops['search'] * n / max(tot['search'], 1e-9) / 1e9:.2f} G weight x grid "
          f"evaluations/s (each ~10 elementwise passes; counted per setting, though settings with the "
          f"same first group share its search)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--bpw", default="4.0,5.0", help="two targets, comma-separated")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, help="only the first N decoder layers (a truncated copy "
                    "of the model: the default calibration's per-layer costs in minutes)")
    ap.add_argument("--measure-only", action="store_true", help="only run 1 (the measurement)")
    ap.add_argument("--no-memory", action="store_true",
                    help="no RSS sampling (its 2 ms polling of /proc adds system time): times only")
    args = ap.parse_args()
    model = model_dir(args.model)
    targets = [] if args.measure_only else [float(v) for v in args.bpw.split(",")]
    mib = 1 / 2 ** 20
    common = dict(samples=args.samples, seqlen=args.seqlen, device=args.device, memory=not args.no_memory)
    mm = mm_flops_per_second(args.device)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.layers:
            model = truncated_model(model, args.layers, tmp)
        print(f"model {model.name}, calibration {args.samples} x {args.seqlen}, device {args.device}, "
              f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}", flush=True)
        meas = Path(tmp) / "measurement.json"
        runs.append(("measure-only", _run(model, measure_only=str(meas), **common)))
        print(f"  measure-only: {runs[-1][1]['seconds']:.1f} s; {cpu_line(runs[-1][1]['cpu'])}", flush=True)
        for t in targets:
            runs.append((f"--measurement, bpw {t}", _run(model, out=str(Path(tmp) / f"q{t}"), bpw=t,
                                                         measurement=str(meas), **common)))
            print(f"  bpw {t} from the measurement: {runs[-1][1]['seconds']:.1f} s; "
                  f"{cpu_line(runs[-1][1]['cpu'])}", flush=True)
        flops = measurement_flops(model, args.samples, args.seqlen)
        e = expected(model, args.samples * args.seqlen)
    names = ["tokenize", "measurement", "allocation", "quantization", "head", "write", "verify"]
    print()
    print(f"{'run':<26} {'total':>7} " + " ".join(f"{n:>12}" for n in names) + "  (seconds)")
    for name, r in runs:
        st = r["stages"]
        print(f"{name:<26} {r['seconds']:>7.1f} "
              + " ".join(f"{st[n]:>12.1f}" if n in st else f"{'':>12}" for n in names))
    print()
    print("measurement per decoder layer:")
    print_measurement_layers(runs[0][1], flops, mm)
    if args.no_memory:
        return
    print()
    print("peak anonymous RSS above the baseline (libraries loaded; no weights, no data), MiB; "
          "'+' = above the phase's own start")
    print(f"{'run':<26} {'peak':>6} " + " ".join(f"{n:>12}" for n in
                                                    ["tokenize", "measurement +", "allocation +",
                                                     "quantization +", "head +", "write", "verify"]))
    for name, r in runs:
        b, ph, stt = r["base"], r["phases"], r["starts"]

        def plus(k):
            return f"{(ph[k] - stt[k]) * mib:>12.0f}" if k in ph and k in stt else f"{'':>12}"

        def above(k):
            return f"{(ph[k] - b) * mib:>12.0f}" if k in ph else f"{'':>12}"

        print(f"{name:<26} {(max(ph.values()) - b) * mib:>6.0f} {above('tokenize')} {plus('measurement')} "
              f"{plus('allocation')} {plus('quantization')} {plus('head')} {above('write')} "
              f"{above('verify')}")
    print(f"expected per layer: measurement ≈ W + X + H + F + S = {(sum(e.values())) * mib:.0f} MiB, "
          f"quantization ≈ W + X + H + F = {(sum(e.values()) - e['S']) * mib:.0f} MiB ("
          + ", ".join(f"{k} {v * mib:.0f}" for k, v in e.items()) + ")")
    if runs[-1][1].get("parameters"):
        print(f"(the whole model in float32: {runs[-1][1]['parameters'] * 4 * mib:.0f} MiB)")
    for name, r in runs[1:]:
        print(f"{name}: decoder {r['details']['decoder_bpw']:.3f} bpw, file {r['bpw']:.3f} bpw, "
              f"objective {r['details']['objective']}, {r['roundtrip']}")


if __name__ == "__main__":
    main()
