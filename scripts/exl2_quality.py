#!/usr/bin/env python3
"""EXL2 quality on SmolLM2-135M: KL divergence and perplexity against bits per weight, and
against our own Q4_K_M GGUF at the same decoder bits per weight.

Steps, each a command of this checkout (printed as it runs):

1. the measurement, once: ``quantize exl2 MODEL --measure-only OUT/measurement.json`` (or
   ``--measurement FILE``: reuse one, e.g. a measurement written by exllamav2);
2. the GGUF: ``convert hf-to-gguf MODEL --policy Q4_K_M -o OUT/…gguf``; its **decoder bpw**
   is the bits of the decoder layers' seven linear weights (attn_q/k/v/output,
   ffn_gate/up/down of every ``blk.N``) over their parameter count — what EXL2's ``--bpw``
   budgets (exllamav2's ``bits``: the decoder linears only; norms, embedding and head
   excluded); the table also gives both formats' **whole-file bpw** (8 · tensor bytes /
   parameters of the source checkpoint, embeddings, norms and head included);
3. ``quantize exl2 MODEL --measurement M --bpw T --objective O -o OUT/…`` for every target T
   (default 3.0, 4.0, 5.0, 6.0 and the GGUF's decoder bpw, rounded down to 4 decimals) and
   every objective O (default: the allocator's default);
4. ``quantize eval MODEL OUT/… GGUF --ctx C --chunks N --device D --json`` on the held-out
   split of exllamav2's wiki.utf8 (articles 1800–2348).

Prints a Markdown table (target, achieved decoder bpw, whole-file bpw, PPL, KLD mean, KLD
99th percentile, top-1 agreement; the GGUF row last) and two checks: KLD falls as the target
rises (per objective), and EXL2 at the GGUF's decoder bpw has a lower KLD than the GGUF. Writes
every command's JSON next to the outputs (``OUT/*.summary.json``, ``OUT/eval.json``,
``OUT/table.md``). Exit status 1 when a check fails.

Usage::

    OMP_NUM_THREADS=1 python scripts/exl2_quality.py [--measurement FILE] [--targets 3,4,5,6]
        [--objectives rel,sum] [--samples 8 --seqlen 256] [--chunks 8 --ctx 256]
        [--out out/exl2-quality] [--reuse] [--no-gguf]

Time on 2 shared CPU cores (SmolLM2-135M, 8 × 256 calibration tokens): measurement about
23 min (skipped with ``--measurement``), 2–3 min per target, GGUF conversion under a minute,
the evaluation about 45 s per model for 8 chunks of 256.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from bench_common import REPO, add_model_arg, model_dir

#: the decoder-layer linear weights of a llama-family GGUF (what EXL2's bpw budgets)
GGUF_DECODER_LINEARS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                        "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def run_cli(args: list[str], capture: bool = False) -> str:
    """Run ``python -m <args>`` in the checkout (printed first); return stdout when
    ``capture``. Exits with the command's status when it fails."""
    cmd = [sys.executable, "-m", *args]
    print("$", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE if capture else None, text=True)
    if p.returncode != 0:
        sys.exit(f"command failed with status {p.returncode}: {' '.join(cmd)}")
    return p.stdout if capture else ""


def source_parameters(model: Path) -> int:
    """Parameter count of the source checkpoint (every tensor of its safetensors files)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            n += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
    return n


def gguf_bpw(path: Path, parameters: int) -> dict:
    """``{"decoder_bpw", "decoder_numel", "file_bpw", "types"}`` of a GGUF file: decoder bpw =
    8 · bytes / numel over the decoder layers' linear weights (:data:`GGUF_DECODER_LINEARS`),
    whole-file bpw = 8 · all tensor bytes / ``parameters`` (the source checkpoint's), ``types``
    the tensor type counts of those linears (e.g. ``{"attn_q.weight Q5_0": 30}``)."""
    from quantpress.convert.gguf_inspect import inspect_gguf

    info = inspect_gguf(path)
    bits = numel = 0
    types: dict[str, int] = {}
    for t in info["tensors"]:
        parts = t["name"].split(".", 2)
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in GGUF_DECODER_LINEARS:
            bits += 8 * t["bytes"]
            numel += math.prod(t["shape"])
            key = f"{parts[2]} {t['type']}"
            types[key] = types.get(key, 0) + 1
    if numel == 0:
        sys.exit(f"{path}: no decoder linear weights (blk.N.attn_q.weight, …) found")
    total = sum(t["bytes"] for t in info["tensors"])
    return {"decoder_bpw": bits / numel, "decoder_numel": numel,
            "file_bpw": 8 * total / parameters, "types": types}


def main() -> int:
    from quantpress.calibration.exl2_alloc import DEFAULT_OBJECTIVE, OBJECTIVE_MODES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--measurement", help="reuse this measurement.json (default: measure once "
                                          "into OUT/measurement.json)")
    ap.add_argument("--targets", default="3.0,4.0,5.0,6.0", help="decoder bpw targets, comma-separated")
    ap.add_argument("--objectives", default=DEFAULT_OBJECTIVE,
                    help=f"allocation objectives, comma-separated ({', '.join(OBJECTIVE_MODES)})")
    ap.add_argument("--policy", default="Q4_K_M", help="GGUF policy to compare with (default Q4_K_M)")
    ap.add_argument("--no-gguf", action="store_true", help="no GGUF row and no target at its bpw")
    ap.add_argument("--samples", type=int, default=8, help="calibration rows (default 8)")
    ap.add_argument("--seqlen", type=int, default=256, help="tokens per calibration row (default 256)")
    ap.add_argument("--chunks", type=int, default=8, help="eval chunks (default 8)")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per eval chunk (default 256)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="out/exl2-quality", help="where the outputs go")
    ap.add_argument("--reuse", action="store_true",
                    help="keep outputs that already exist (measurement, GGUF, EXL2 directories "
                         "with their summary); re-run the evaluation only")
    args = ap.parse_args()

    model = model_dir(args.model)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    bad = [o for o in objectives if o not in OBJECTIVE_MODES]
    if bad or not objectives:
        sys.exit(f"--objectives {args.objectives!r}: choose among {', '.join(OBJECTIVE_MODES)}")
    try:
        targets = [float(t) for t in args.targets.split(",") if t.strip()]
    except ValueError:
        sys.exit(f"--targets {args.targets!r}: expected comma-separated numbers")
    cal = ["--samples", str(args.samples), "--seqlen", str(args.seqlen), "--device", args.device]

    # 1. measurement
    if args.measurement:
        meas = Path(args.measurement).expanduser().resolve()
    else:
        meas = out / "measurement.json"
        if not (args.reuse and meas.is_file()):
            run_cli(["quantpress", "exl2", str(model), "--measure-only", str(meas), *cal,
                     "--quiet", "--force"])

    # 2. the GGUF and its decoder bpw
    params = source_parameters(model)
    gguf = None
    if not args.no_gguf:
        gguf = out / f"{model.name}-{args.policy}.gguf"
        if not (args.reuse and gguf.is_file()):
            run_cli(["quantpress", "hf-to-gguf", str(model), "-o", str(gguf), "--policy",
                     args.policy, "--device", args.device, "--quiet", "--force"])
        g = gguf_bpw(gguf, params)
        g_target = math.floor(g["decoder_bpw"] * 1e4) / 1e4
        if g_target not in targets:
            targets.append(g_target)

    # 3. EXL2 outputs
    runs = []           # (objective, target, directory, summary)
    for obj in objectives:
        for t in targets:
            d = out / f"exl2-{obj}-{t:g}bpw"
            sfile = out / f"{d.name}.summary.json"
            if not (args.reuse and sfile.is_file() and (d / "config.json").is_file()):
                text = run_cli(["quantpress", "exl2", str(model), "--measurement", str(meas),
                                "--bpw", repr(t), "--objective", obj, "-o", str(d), *cal,
                                "--quiet", "--force", "--json"], capture=True)
                sfile.write_text(text)
            runs.append((obj, t, d, json.loads(sfile.read_text())))

    # 4. evaluation
    paths = [str(d) for _, _, d, _ in runs] + ([str(gguf)] if gguf else [])
    text = run_cli(["quantpress", "eval", str(model), *paths, "--ctx", str(args.ctx),
                    "--chunks", str(args.chunks), "--device", args.device, "--quiet", "--json"],
                   capture=True)
    (out / "eval.json").write_text(text)
    rep = json.loads(text)
    by_path = {m["path"]: m for m in rep["models"]}
    base = rep["models"][0]

    lines = [f"{model.name}; measurement {meas.name} ({args.samples} x {args.seqlen} calibration "
             f"tokens, wiki.utf8 articles 0-1799); eval: {rep['n_chunks']} chunks of {rep['n_ctx']} "
             f"tokens (held-out articles 1800-2348), base PPL {base['ppl']:.4f}",
             "decoder bpw: bits of the decoder layers' linear weights / their count (EXL2 --bpw, "
             "exllamav2's `bits`); file bpw: 8 x all tensor bytes / source parameters",
             "",
             "| model | objective | target bpw | decoder bpw | file bpw | PPL | KLD mean | KLD 99% | top-1 |",
             "|---|---|---|---|---|---|---|---|---|"]

    def row(name, obj, target, dec, fbpw, m):
        kl = m["kl"]
        return (f"| {name} | {obj} | {target} | {dec:.4f} | {fbpw:.3f} | {m['ppl']:.4f} | "
                f"{kl['kld_mean']:.5f} | {kl['kld_p99']:.4f} | {100 * kl['same_top']:.2f}% |")

    for obj, t, d, s in sorted(runs, key=lambda r: (r[0], r[1])):
        lines.append(row("EXL2", obj, f"{t:g}", s["details"]["decoder_bpw"], s["bpw"], by_path[str(d)]))
    if gguf:
        lines.append(row(f"GGUF {args.policy}", "llama.cpp policy", "", g["decoder_bpw"],
                         g["file_bpw"], by_path[str(gguf)]))
        lines.append("")
        lines.append(f"GGUF {args.policy} decoder linears: "
                     + ", ".join(f"{k} x{v}" for k, v in sorted(g["types"].items())))
        numels = sorted({s["details"]["decoder_numel"] for _, _, _, s in runs})
        lines.append(f"decoder weights counted: GGUF {g['decoder_numel']:,}, EXL2 "
                     f"{', '.join(f'{n:,}' for n in numels)} (EXL2 pads out_features to 32)")

    ok = True
    lines.append("")
    for obj in objectives:
        r = sorted((t, by_path[str(d)]["kl"]["kld_mean"]) for o, t, d, _ in runs if o == obj)
        falls = all(b[1] < a[1] for a, b in zip(r, r[1:]))
        ok &= falls
        lines.append(f"check [{obj}]: KLD falls as bpw rises over "
                     f"{', '.join(f'{t:g}' for t, _ in r)}: {'yes' if falls else 'NO'} "
                     f"({' > '.join(f'{k:.4f}' for _, k in r)})")
        if gguf:
            k_exl2 = next(by_path[str(d)]["kl"]["kld_mean"] for o, t, d, _ in runs
                          if o == obj and t == g_target)
            k_gguf = by_path[str(gguf)]["kl"]["kld_mean"]
            better = k_exl2 < k_gguf
            ok &= better
            lines.append(f"check [{obj}]: EXL2 at the GGUF's decoder bpw {g_target:g} has lower KLD "
                         f"than GGUF {args.policy}: {'yes' if better else 'NO'} "
                         f"({k_exl2:.5f} vs {k_gguf:.5f})")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print()
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
