#!/usr/bin/env python3
"""Wall time per stage and peak memory of ``quantize awq`` on SmolLM2-135M (CPU; CUDA with
``--device cuda``), for one or more calibration sizes, each in a fresh subprocess.

Stages (from the command's own summary): tokenize (calibration rows), calibration (streamed
layer forwards with input capture), search (scale grid + folding), clip (clipping search),
quantize+pack, write (parts → shards, config, tokenizer files), verify (round trip).

Peak memory is the child's ``VmHWM`` and its peak anonymous RSS (``RssAnon`` sampled every
5 ms), both also above the baseline of an interpreter that has imported torch and
transformers. The expected live peak follows one decoder layer plus the activations, not the
model:

    M ≈ M_base + W_layer + C + H + A
    W_layer = params of one decoder layer × (4 + 2) bytes (float32 compute copy + float16 master)
    C       = tokens × (3·hidden + ffn) × 4 bytes   (captured inputs of q, o, gate and down)
    H       = 2 × tokens × hidden × 4 bytes          (the layer's inputs and outputs)
    A       ≈ tokens × (3·ffn + 4·hidden) × 4 bytes   (one grid point's forward temporaries and y0/y)

against the whole model in float32 (513 MiB for SmolLM2). There is no reference tool to run beside it:
AutoAWQ 0.2.9 (deprecated) needs torch 2.6 / transformers 4.51 and a CUDA GPU
(shared/specs/awq.md §0).

Usage::

    python scripts/bench_awq.py [--sizes 8x128,16x256] [--group-size 64] [--device cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

CHILD = r"""
import json, sys, time, tempfile, os
sys.path.insert(0, sys.argv[1])
import torch, transformers  # the baseline includes these
from pathlib import Path
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base_hwm, base_anon = status("VmHWM"), status("RssAnon")
print("BASE", json.dumps({"hwm": base_hwm, "anon": base_anon}), flush=True)
from cli.awq_pipeline import quantize_awq
samples, seqlen, gs, device = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
with tempfile.TemporaryDirectory() as tmp:
    s = quantize_awq(sys.argv[2], Path(tmp) / "out", group_size=gs, samples=samples, seqlen=seqlen,
                     device=device, progress=False)
print("RESULT", json.dumps({**s.to_json(), "hwm": status("VmHWM")}), flush=True)
"""


def _run(model: Path, samples: int, seqlen: int, gs: int, device: str) -> dict:
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(REPO), str(model), str(samples),
                          str(seqlen), str(gs), device], stdout=subprocess.PIPE, text=True)
    peak_anon = [0]
    stop = threading.Event()

    def sample():
        path = f"/proc/{p.pid}/status"
        while not stop.is_set():
            try:
                for line in open(path):
                    if line.startswith("RssAnon"):
                        peak_anon[0] = max(peak_anon[0], int(line.split()[1]) * 1024)
            except OSError:
                break
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    base, result = None, None
    for line in p.stdout:
        if line.startswith("BASE "):
            base = json.loads(line[5:])
        elif line.startswith("RESULT "):
            result = json.loads(line[7:])
    p.wait()
    stop.set()
    th.join()
    if p.returncode or result is None:
        raise SystemExit(f"child failed with exit code {p.returncode}")
    result["base"] = base
    result["peak_anon"] = peak_anon[0]
    return result


def expected_bytes(model: Path, tokens: int) -> int:
    """The formula of the module docstring, from config.json."""
    cfg = json.loads((model / "config.json").read_text())
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", h // heads)
    layer = h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * f + 2 * h
    return layer * 6 + tokens * (3 * h + f) * 4 + 2 * tokens * h * 4 + tokens * (3 * f + 4 * h) * 4


def main() -> None:
    import assets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory (default: SmolLM2-135M-Instruct from the cache)")
    ap.add_argument("--sizes", default="8x128,16x256", help="calibration rows x seqlen, comma-separated")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model = Path(args.model) if args.model else assets.smollm2_dir()
    mib = 1 / 2 ** 20
    print(f"model {model.name}, w4 g{args.group_size}, device {args.device}, "
          f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'calibration':>12} {'total s':>8}  stages (s)")
    rows = []
    for size in args.sizes.split(","):
        n, L = (int(v) for v in size.lower().split("x"))
        r = _run(model, n, L, args.group_size, args.device)
        rows.append((n, L, r))
        st = ", ".join(f"{k} {v:.1f}" for k, v in r["stages"].items())
        print(f"{n:>5} x {L:<5} {r['seconds']:>8.1f}  {st}")
    print()
    print(f"{'calibration':>12} {'tokens':>7} {'peak RSS':>9} {'above base':>10} {'anon above':>10} {'expected':>9}  (MiB)")
    for n, L, r in rows:
        b = r["base"]
        exp = expected_bytes(model, n * L)
        print(f"{n:>5} x {L:<5} {n * L:>7} {r['hwm'] * mib:>9.0f} {(r['hwm'] - b['hwm']) * mib:>10.0f} "
              f"{(r['peak_anon'] - b['anon']) * mib:>10.0f} {exp * mib:>9.0f}")
    params = rows[0][2]["parameters"]
    print(f"(the whole model in float32: {params * 4 * mib:.0f} MiB; calibration tokens per second "
          f"of the scale search: "
          + ", ".join(f"{n * L / max(1e-9, r['stages'].get('search', 0)):.0f}" for n, L, r in rows) + ")")


if __name__ == "__main__":
    main()
