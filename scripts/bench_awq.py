#!/usr/bin/env python3
"""Wall time per stage and peak memory of ``quantize awq`` on SmolLM2-135M (CPU; CUDA with
``--device cuda``), for one or more calibration sizes, each in a fresh subprocess.

Stages (from the command's own summary): tokenize (calibration rows), calibration (streamed
layer forwards with input capture), search (scale grid + folding), clip (clipping search),
quantize+pack (these four make the runner's "layers" stage), write (parts → shards, config,
tokenizer files), verify (round trip).

Peak memory: the child's ``VmHWM`` and its peak anonymous RSS (``RssAnon`` sampled every
2 ms), above a baseline taken after the libraries are loaded (torch, transformers' model
classes and everything they import, the tokenizer; no weights, no calibration data), and
per phase: tokenize, layers (the streamed pass with search, clip, quantize, pack and the
part files), write (parts → shards), verify (round trip). The layer phase's growth above its
own start should follow one decoder layer plus the activations, not the model:

    W = params of one decoder layer × (4 + 2) bytes (float32 compute copy + float16 master)
    C = tokens × (3·hidden + ffn) × 4        (captured inputs of q, o, gate and down)
    H = 2 × tokens × hidden × 4              (the layer's inputs and outputs)
    F = min(tokens, 4096) × (4·ffn + 4·hidden) × 4   (one forward batch's temporaries)
    K = 3 × groups × clip tokens × rows × 4  (the clipping search's partial dot products,
        clip tokens ≤ 1023, at most 2^23 products per tensor: bounded, whatever the model)

against the whole model in float32 (513 MiB for SmolLM2). There is no reference tool to run beside it:
AutoAWQ 0.2.9 (deprecated) needs torch 2.6 / transformers 4.51 and a CUDA GPU
(AutoAWQ 0.2.9's README and PyPI metadata).

Side by side with llm-compressor (``--vs-llm-compressor``): for each size, ``quantize awq``
with clipping and with ``--no-clip`` (each in a fresh process, ``--threads`` torch threads),
then llm-compressor 0.14.0.1's AWQ (``AWQModifier`` + a 4-bit asymmetric group
``QuantizationModifier``: llm-compressor has no clipping search) on the same token rows and
the same threads, in its own cached environment (scripts/llmcompressor_ref.py, which says what
it disables on a CPU-only torch: ``Tensor.pin_memory``, which its sequential pipeline calls).
Printed per run: wall, user and system seconds of the quantization (llm-compressor:
``oneshot`` alone; ours: the whole command, model reading, writing and round trip included),
peak RSS, held-out PPL and mean KLD (the same chunks and formulas on both sides), and the
ratios ours / llm-compressor.

Usage::

    python scripts/bench_awq.py [--sizes 8x128,16x256] [--group-size 64] [--device cpu]
    python scripts/bench_awq.py --vs-llm-compressor --sizes 16x256 [--threads 2] [--chunks 8]
    python scripts/bench_awq.py --sizes 128x512 --layers 2 --no-memory   # the default calibration
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from bench_common import add_model_arg, cpu_line, model_dir, model_shape, parse_sizes, run_child, truncated_model

#: the child of :func:`_run` (argv: model, samples, seqlen, group size, device, spec JSON, keep)
CHILD = r"""
import json, sys
import tempfile
from pathlib import Path
from bench_common import CPUClock, PhaseWatch, libraries_baseline, status
from quantpress.targets import AWQOptions, CalibOptions, ComputeOptions, GPTQOptions, Source, produce
base_anon = libraries_baseline(sys.argv[1])
print("BASE", json.dumps({"hwm": status("VmHWM"), "anon": base_anon}), flush=True)
samples, seqlen, gs, device = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
spec, keep = json.loads(sys.argv[6]), sys.argv[7]
kind, watch = spec.pop("kind", "awq"), spec.pop("watch", True)
opts = (AWQOptions if kind == "awq" else GPTQOptions)(group_size=gs, **spec)
src = Source(sys.argv[1], ComputeOptions(device=device), CalibOptions(samples=samples, seqlen=seqlen),
             progress=False)
w = PhaseWatch().start() if watch else None
clock = CPUClock()
with tempfile.TemporaryDirectory() as tmp:
    s = produce(opts, src, Path(keep or tmp) / "out", progress=False)
cpu = clock.read()
print("RESULT", json.dumps({**s.to_json(), "hwm": status("VmHWM"), "cpu": cpu, **(w.stop() if w else {})}), flush=True)
"""


def _run(model: Path, samples: int, seqlen: int, gs: int, device: str, spec: dict | None = None,
         keep: str = "", threads: int | None = None) -> dict:
    """``produce`` of ``spec`` (``{"kind": "awq"|"gptq", **options}``; default AWQ) in a fresh
    process: its summary, peak memory (``hwm``, ``peak_anon``, per phase) and CPU times.
    ``"watch": False`` in ``spec``: no RSS sampling (its 2 ms polling of /proc costs system
    time), only VmHWM."""
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    tags, peak_anon = run_child(CHILD, [str(model), str(samples), str(seqlen), str(gs), device,
                                        json.dumps(spec or {}), keep], env,
                                sample_anon=(spec or {}).get("watch", True))
    return {**tags["RESULT"], "base": tags.get("BASE"), "peak_anon": peak_anon}


def expected_layer_bytes(model: Path, tokens: int, group_size: int,
                         batch_tokens: int = 4096) -> dict[str, int]:
    """The terms of the layer phase's expected peak (module docstring), from config.json."""
    h, f, heads, kv, hd = model_shape(model)
    layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * f + 2 * h
    bt = min(tokens, batch_tokens)
    t_clip = tokens // max(1, tokens // 512)
    clip = 0
    for cin, out in ((heads * hd, h), (h, f), (f, h), (h, kv * hd)):  # o, gate/up, down, v
        g = cin // group_size
        r = min(out, max(1, (1 << 23) // max(1, g * t_clip)))
        clip = max(clip, 3 * g * t_clip * r * 4)
    return {"W": layer * (4 + 2), "C": tokens * (3 * h + f) * 4, "H": 2 * tokens * h * 4,
            "F": bt * (4 * f + 4 * h) * 4, "K": clip}


#: our runs beside llm-compressor's, per method: (label, child spec)
OURS = {"awq": [("quantpress", {"kind": "awq", "watch": False}),
                ("quantpress --no-clip", {"kind": "awq", "clip": False, "watch": False})],
        "gptq": [("quantpress", {"kind": "gptq", "watch": False})]}


def add_side_by_side_args(ap: argparse.ArgumentParser) -> None:
    """The options of :func:`vs_llm_compressor` that this script and bench_gptq.py share."""
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads, both sides")
    ap.add_argument("--ctx", type=int, default=512, help="evaluation tokens per chunk")
    ap.add_argument("--chunks", type=int, default=8, help="evaluation chunks")


def vs_llm_compressor(model: Path, sizes: list[tuple[int, int]], gs: int, threads: int,
                      ctx: int, chunks: int, method: str = "awq") -> None:
    """Ours (:data:`OURS`) and llm-compressor's ``method`` ("awq" or "gptq": 4-bit symmetric,
    no activation order on both sides) on the same rows and threads: times, memory,
    held-out quality and ratios (module docstring)."""
    import llmcompressor_ref as ref
    from quantpress.targets import ComputeOptions
    from quantpress.targets.eval import EvalOptions, evaluate

    ref.ensure_env()
    held = ref.project_chunks(model, ctx, chunks)
    print(f"model {model.name}, {method} w4 g{gs}, {threads} torch threads on both sides; "
          f"evaluation {held.shape[0]} chunks x {ctx} tokens of the held-out split")
    head = (f"{'calibration':>12} {'run':<26} {'wall s':>8} {'user s':>8} {'sys s':>7} {'sys %':>6} "
            f"{'peak RSS':>9} {'PPL':>8} {'KLD':>8} {'wall ratio':>10}")
    print(head)
    for n, L in sizes:
        rows = ref.project_rows(model, n, L)
        theirs = ref.run(method, model, rows, held, group_size=gs, threads=threads,
                         options={"actorder": None} if method == "gptq" else None)
        res = []
        for label, spec in OURS[method]:
            with tempfile.TemporaryDirectory() as tmp:
                r = _run(model, n, L, gs, "cpu", spec=spec, keep=tmp, threads=threads)
                rep = evaluate(model, [Path(tmp) / "out"], EvalOptions(ctx=ctx, chunks=chunks),
                               ComputeOptions(device="cpu"), progress=False)
            m = rep.models[1]
            res.append((label, r["cpu"]["wall_s"], r["cpu"]["user_s"],
                        r["cpu"]["sys_s"], r["hwm"], m.ppl["ppl"], m.kl["kld_mean"]))
        res.append((f"llm-compressor 0.14 {method}", theirs["wall_s"], theirs["user_s"], theirs["sys_s"],
                    theirs["vmhwm_bytes"], theirs["ppl"], theirs["kld"]))
        for name, wall, user, sys_s, peak, ppl, kld in res:
            print(f"{n:>5} x {L:<5} {name:<26} {wall:>8.1f} {user:>8.1f} {sys_s:>7.1f} "
                  f"{sys_s / wall:>6.1%} {peak / 2 ** 20:>7.0f} Mi {ppl:>8.4f} {kld:>8.5f} "
                  f"{wall / theirs['wall_s']:>10.2f}", flush=True)
        print(f"{'':>12} (base PPL {rep.models[0].ppl['ppl']:.4f} ours, {theirs['ppl_base']:.4f} "
              f"llm-compressor's; llm-compressor on CPU: {theirs['patched']})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--sizes", default="8x128,16x256", help="calibration rows x seqlen, comma-separated")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vs-llm-compressor", action="store_true",
                    help="side by side with llm-compressor 0.14.0.1's AWQ (CPU)")
    add_side_by_side_args(ap)
    ap.add_argument("--layers", type=int, help="only the first N decoder layers (a truncated copy "
                    "of the model: the default calibration's per-layer costs in minutes)")
    ap.add_argument("--no-memory", action="store_true",
                    help="no RSS sampling (its 2 ms polling of /proc adds system time): times only")
    args = ap.parse_args()
    model = model_dir(args.model)
    tmp = tempfile.TemporaryDirectory()
    if args.layers:
        model = truncated_model(model, args.layers, tmp.name)
    if args.vs_llm_compressor:
        vs_llm_compressor(model, parse_sizes(args.sizes), args.group_size, args.threads, args.ctx, args.chunks)
        return
    mib = 1 / 2 ** 20
    print(f"model {model.name}, w4 g{args.group_size}, device {args.device}, "
          f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'calibration':>12} {'total s':>8}  stages (s)")
    rows = []
    for n, L in parse_sizes(args.sizes):
        r = _run(model, n, L, args.group_size, args.device, spec={"watch": not args.no_memory})
        rows.append((n, L, r))
        st = ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items())
        print(f"{n:>5} x {L:<5} {r['seconds']:>8.1f}  {st}; {cpu_line(r['cpu'])}", flush=True)
    if args.no_memory:
        return
    print()
    print("peak anonymous RSS above the baseline (libraries loaded: torch, transformers' model classes,")
    print("the tokenizer; no weights, no data), per phase, MiB;")
    print("'layers +' = the layer phase's peak above its own start (what the layers add), against")
    print("the expected W + C + H + F + K:")
    print(f"{'calibration':>12} {'tokens':>7} {'VmHWM':>6} {'anon':>6} {'tokenize':>8} {'layers':>7} "
          f"{'layers +':>8} {'expected':>8} {'write':>6} {'verify':>6}")
    for n, L, r in rows:
        b, ph, st = r["base"]["anon"], r["phases"], r["starts"]
        e = expected_layer_bytes(model, n * L, args.group_size)
        print(f"{n:>5} x {L:<5} {n * L:>7} {(r['hwm'] - r['base']['hwm']) * mib:>6.0f} "
              f"{(r['peak_anon'] - b) * mib:>6.0f} {(ph.get('tokenize', b) - b) * mib:>8.0f} "
              f"{(ph['layers'] - b) * mib:>7.0f} {(ph['layers'] - st['layers']) * mib:>8.0f} "
              f"{sum(e.values()) * mib:>8.0f} {(ph['write'] - b) * mib:>6.0f} {(ph['verify'] - b) * mib:>6.0f}")
    for n, L, r in rows:
        e = expected_layer_bytes(model, n * L, args.group_size)
        print(f"{n:>5} x {L:<5} expected terms: " + ", ".join(f"{k} {v * mib:.0f}" for k, v in e.items())
              + f"; layer phase peaked in {' <- '.join(reversed(r['where'].get('layers', []))) or '?'}")
    params = rows[0][2]["parameters"]
    e = expected_layer_bytes(model, 0, args.group_size)
    print(f"(one decoder layer in float32 + float16: {e['W'] * mib:.0f} MiB; the whole model in "
          f"float32: {params * 4 * mib:.0f} MiB; calibration tokens per second of the scale search: "
          + ", ".join(f"{n * L / max(1e-9, r['stages'].get('search', 0)):.0f}" for n, L, r in rows) + ")")


if __name__ == "__main__":
    main()
