#!/usr/bin/env python3
"""Peak memory and throughput of calibration: the layer-streaming engine against a plain
transformers forward of the whole model, on the same token rows, capturing the same
statistics (Σx² of every decoder-layer linear input, what ``quantize imatrix`` collects).

Each mode runs in a fresh subprocess (so peak RSS is its own):

- ``stream``: ``calibration.engine.run(StreamingModel(dir), rows, StatsCollector(kinds={"sq"}))``
  (``keep_inputs=False``, as ``quantize imatrix`` runs it) — one decoder layer's weights at a
  time, the hidden states of all rows held once (each batch's outputs written over its inputs);
- ``plain``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)``, the decoder
  (``model.model``, no lm_head: calibration needs no logits) over the same rows in the same
  batches, with the same forward hooks.

Reported per mode: wall time of the pass (the streaming pass includes reading and converting
every layer's weights; the plain figure is the forward alone, its load time is shown apart),
tokens/s, peak RSS (``VmHWM``, which includes the page cache of the memory-mapped safetensors
file) and peak anonymous RSS (``RssAnon`` sampled every 5 ms: the memory the process owns),
both also above the baseline of the interpreter with torch, transformers and the token rows.

Each mode runs with glibc's default allocator settings and with
``MALLOC_MMAP_THRESHOLD_=131072``; the streaming pass also with ``malloc_trim(0)`` after every
layer, which is what ``quantize imatrix`` and ``quantize eval`` do (``quantpress.memory.trim_heap``). By default glibc raises its mmap threshold (up to 32 MiB)
after large blocks are freed, so later tensors of a few MiB come from the heap, and the heap
keeps freed memory that RSS still counts: the streaming engine, which frees a layer's weights
and temporaries at every step, then shows RSS growing over the layers although what is live
does not. A fixed threshold returns large blocks to the system on free, so the RSS peak is the
live peak, which the formula predicts (a fixed threshold costs ≈30% of the speed: every large
temporary is a fresh mmap; trimming once per layer costs nothing and removes most of the
growth):

    M_stream ≈ M_base + max(W_embed + H,  W_layer + H + A)
    W_embed  = vocab × hidden × bytes(dtype)              (step 0: the embedding, then freed)
    W_layer  = params of one decoder layer × bytes(dtype) (the layer being run)
    H        = rows × seqlen × hidden × bytes(dtype)      (the hidden states, held once)
    A        ≈ batch_rows × seqlen × (3·ffn + 4·hidden) × bytes(dtype)
               (one batch's temporaries: MLP gate/up/product, attention projections; SDPA
               does not materialize the seqlen² scores)
    M_plain  ≈ M_base + W_model + A                      (the whole model in float32)

The throughput ratio stream/plain (target ≥ 0.8) is printed from the default-allocator runs
(streaming with per-layer trimming).
Usage::

    OMP_NUM_THREADS=1 python scripts/bench_calibration.py [--rows 32 --seqlen 512 --batch-rows 8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_common import PeakSampler, add_model_arg, model_dir, status


def _rows(model_dir: Path, rows: int, seqlen: int, seed: int):
    from transformers import AutoTokenizer

    from quantpress import assets
    from quantpress.calibration import data

    tok = AutoTokenizer.from_pretrained(model_dir)
    return data.token_rows(tok, data.calibration_articles(assets.standard_cal_data())[:400],
                           rows, seqlen, seed=seed)


def child(mode: str, model_dir: Path, rows: int, seqlen: int, batch_rows: int, seed: int,
          trim: bool = False) -> dict:
    import importlib

    import torch

    importlib.import_module("transformers")    # loaded before the baseline is read: part of it

    from quantpress.calibration import engine
    from quantpress.calibration.stats import StatsCollector

    toks = _rows(model_dir, rows, seqlen, seed)
    base_rss, base_anon = status("VmRSS"), status("RssAnon")
    peak = PeakSampler()
    load = 0.0
    if mode == "stream":
        t0 = time.perf_counter()
        sm = engine.StreamingModel(model_dir, "cpu", torch.float32)
        col = StatsCollector(kinds={"sq"}, prefix=sm.layer_prefix)
        from quantpress.memory import trim_heap

        engine.run(sm, toks, hooks_factory=col, batch_size=batch_rows, hidden_device="cpu", progress=False,
                   on_layer=trim_heap if trim else None, keep_inputs=False)
        secs = time.perf_counter() - t0
    else:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.eval()
        load = time.perf_counter() - t0
        col = StatsCollector(kinds={"sq"}, prefix="model.layers.")
        handles = [col(i, layer) for i, layer in enumerate(model.model.layers)]
        t0 = time.perf_counter()
        with torch.no_grad():
            for a in range(0, rows, batch_rows):
                model.model(toks[a:a + batch_rows], use_cache=False)
        secs = time.perf_counter() - t0
        for h in handles:
            h.remove()
    anon = peak.stop()
    n_stats = len(col.stats)
    return {"mode": mode, "seconds": secs, "load_seconds": load, "tokens": rows * seqlen,
            "tokens_per_s": rows * seqlen / secs, "peak_rss": status("VmHWM"), "peak_anon": anon,
            "base_rss": base_rss, "base_anon": base_anon, "linears": n_stats,
            "threads": torch.get_num_threads()}


def expected(model_dir: Path, rows: int, seqlen: int, batch_rows: int, bytes_per: int = 4) -> dict:
    """The terms of the formula in the module doc, in bytes, from config.json and the
    safetensors headers."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    h, ffn, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    layer0 = total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                total += n
                if k.startswith("model.layers.0."):
                    layer0 += n
    terms = {"W_layer": layer0 * bytes_per, "W_embed": vocab * h * bytes_per,
             "H": rows * seqlen * h * bytes_per,
             "A": batch_rows * seqlen * (3 * ffn + 4 * h) * bytes_per,
             "W_model": total * bytes_per}
    terms["stream"] = max(terms["W_embed"] + terms["H"], terms["W_layer"] + terms["H"] + terms["A"])
    terms["plain"] = terms["W_model"] + terms["A"]
    return terms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap, help="HF model directory (default: the cached FP16 SmolLM2-135M)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures to this JSON file")
    ap.add_argument("--child", choices=("stream", "plain"), help=argparse.SUPPRESS)
    ap.add_argument("--trim", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    model = model_dir(args.model)
    if args.child:
        print(json.dumps(child(args.child, model, args.rows, args.seqlen, args.batch_rows, args.seed,
                               args.trim)))
        return 0

    fixed = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    runs = [("glibc default", "plain", {}, False), ("glibc default", "stream", {}, False),
            ("malloc_trim per layer", "stream", {}, True),
            ("MALLOC_MMAP_THRESHOLD_=131072", "plain", fixed, False),
            ("MALLOC_MMAP_THRESHOLD_=131072", "stream", fixed, False)]
    res = {}
    for label, mode, env, trim in runs:
        cmd = [sys.executable, __file__, "--child", mode, "--model", str(model), "--rows", str(args.rows),
               "--seqlen", str(args.seqlen), "--batch-rows", str(args.batch_rows), "--seed", str(args.seed)]
        cmd += ["--trim"] if trim else []
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **env}).stdout
        res[(label, mode)] = json.loads(out.strip().splitlines()[-1])
    exp = expected(model, args.rows, args.seqlen, args.batch_rows)
    mib = 2 ** 20
    s, p = res[("malloc_trim per layer", "stream")], res[("glibc default", "plain")]
    print(f"model {model.name}: {args.rows} rows x {args.seqlen} tokens = {s['tokens']:,} tokens, "
          f"batches of {args.batch_rows} rows, float32 on CPU, {s['threads']} thread(s)")
    print(f"{'allocator':<30} {'mode':<7} {'pass s':>7} {'tokens/s':>9} {'peak RSS':>9} {'peak anon':>10} "
          f"{'anon above base':>16}  (MiB)")
    for (label, mode), r in res.items():
        extra = f"  (+{r['load_seconds']:.1f} s load)" if r["load_seconds"] else ""
        print(f"{label:<30} {mode:<7} {r['seconds']:>7.1f} {r['tokens_per_s']:>9.0f} {r['peak_rss'] / mib:>9.0f} "
              f"{r['peak_anon'] / mib:>10.0f} {(r['peak_anon'] - r['base_anon']) / mib:>16.0f}{extra}")
    ratio = s["tokens_per_s"] / p["tokens_per_s"]
    fs, fp = res[("MALLOC_MMAP_THRESHOLD_=131072", "stream")], res[("MALLOC_MMAP_THRESHOLD_=131072", "plain")]
    mem = (fs["peak_anon"] - fs["base_anon"]) / max(1, fp["peak_anon"] - fp["base_anon"])
    print(f"throughput ratio stream/plain: {ratio:.2f} (target >= 0.8); live memory above baseline, "
          f"stream/plain: {mem:.2f}")
    print("expected above baseline: stream max(W_embed {W_embed_m:.0f} + H {H_m:.0f}, W_layer {W_layer_m:.1f} "
          "+ H + A {A_m:.0f}) = {stream_m:.0f} MiB; plain W_model {W_model_m:.0f} + A = {plain_m:.0f} MiB"
          .format(**{k + "_m": v / mib for k, v in exp.items()}))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [{"allocator": k[0], **v} for k, v in res.items()],
                                               "ratio": ratio, "expected": exp}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
