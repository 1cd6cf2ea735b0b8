#!/usr/bin/env python3
"""User time, system time and page faults of every calibrated verb, each run as a user runs
it (the ``quantize`` or ``convert`` command in a fresh process), at the default calibration
(128 x 512).

A calibrated pass costs the same per decoder layer whatever the depth, so the model is cut to
its first ``--layers`` decoder layers (config.json's ``num_hidden_layers`` and a
model.safetensors without the later layers' tensors: ``bench_common.truncated_model``); the
per-layer temporaries ([rows, seqlen, hidden] float32: 151 MB for SmolLM2 at 128 x 512, above
glibc's mmap threshold of 64 MiB that ``quantpress.memory.bound_heap`` sets) are full size.
Each verb's times are the child's ``getrusage(RUSAGE_CHILDREN)`` difference: wall, user and
system seconds, minor page faults, and the system share of wall time (the bound: under 10%).
Verbs:

    imatrix    quantize imatrix MODEL -o M.imatrix.gguf
    gguf       convert hf-to-gguf MODEL --policy Q4_K_M --imatrix auto -o M.gguf
    awq        quantize awq MODEL --group-size 64 -o AWQ
    gptq       quantize gptq MODEL --group-size 64 -o GPTQ
    fp8        quantize fp8 MODEL --scheme static -o FP8      (calibrated input scales)
    exl2       quantize exl2 MODEL --measure-only measurement.json   (the measurement pass)
    eval       quantize eval MODEL AWQ GPTQ --ctx SEQLEN --chunks SAMPLES

(eval needs the awq and gptq outputs; it is skipped when they were not asked for.)

Usage::

    python scripts/bench_systime.py [--layers 2] [--samples 128] [--seqlen 512] [--threads 2]
                                    [--verbs imatrix,gguf,awq,gptq,fp8,exl2,eval]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import CPUClock, add_model_arg, model_dir, truncated_model

VERBS = ("imatrix", "gguf", "awq", "gptq", "fp8", "exl2", "eval")


def commands(model: Path, out: Path, samples: int, seqlen: int, verbs: list[str]) -> list[tuple[str, list[str]]]:
    """(verb, argv) for each verb asked for, in :data:`VERBS` order (module docstring)."""
    quantize = [sys.executable, "-m", "quantpress.cli.quantize_main"]
    convert = [sys.executable, "-m", "quantpress.cli.convert_main"]
    cal = ["--samples", str(samples), "--seqlen", str(seqlen), "--quiet"]
    table = {
        "imatrix": quantize + ["imatrix", str(model), "-o", str(out / "m.imatrix.gguf"), *cal],
        "gguf": convert + ["hf-to-gguf", str(model), "--policy", "Q4_K_M", "--imatrix", "auto",
                           "-o", str(out / "m-Q4_K_M.gguf"), *cal],
        "awq": quantize + ["awq", str(model), "--group-size", "64", "-o", str(out / "awq"), *cal],
        "gptq": quantize + ["gptq", str(model), "--group-size", "64", "-o", str(out / "gptq"), *cal],
        "fp8": quantize + ["fp8", str(model), "--scheme", "static", "-o", str(out / "fp8"), *cal],
        "exl2": quantize + ["exl2", str(model), "--measure-only", str(out / "measurement.json"), *cal],
        "eval": quantize + ["eval", str(model), str(out / "awq"), str(out / "gptq"), "--ctx",
                            str(seqlen), "--chunks", str(samples), "--quiet"],
    }
    if "eval" in verbs and not {"awq", "gptq"} <= set(verbs):
        print("eval skipped: it evaluates the awq and gptq outputs (add both to --verbs)")
        verbs = [v for v in verbs if v != "eval"]
    return [(v, table[v]) for v in VERBS if v in verbs]


def timed(argv: list[str], env: dict) -> dict:
    """Run ``argv``; its wall, user and system seconds and minor page faults. SystemExit with
    the command's output when it fails."""
    clock = CPUClock(resource.RUSAGE_CHILDREN)
    p = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(argv[2:])} failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
    return clock.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("--layers", type=int, default=2, help="decoder layers kept (0: all)")
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--verbs", default=",".join(VERBS))
    args = ap.parse_args()
    verbs = [v.strip() for v in args.verbs.split(",") if v.strip()]
    bad = [v for v in verbs if v not in VERBS]
    if bad:
        raise SystemExit(f"--verbs: unknown {', '.join(bad)}; choose from {', '.join(VERBS)}")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model)
        if args.layers:
            model = truncated_model(model, args.layers, tmp)
        out = Path(tmp) / "out"
        out.mkdir()
        print(f"model {model.name}, calibration {args.samples} x {args.seqlen}, {args.threads} torch "
              f"threads; each verb a fresh `quantize` or `convert` process")
        print(f"{'verb':<8} {'wall s':>8} {'user s':>8} {'sys s':>7} {'sys %':>6} {'faults M':>9} "
              f"{'CPU / wall':>10}")
        for verb, argv in commands(model, out, args.samples, args.seqlen, verbs):
            c = timed(argv, env)
            print(f"{verb:<8} {c['wall_s']:>8.1f} {c['user_s']:>8.1f} {c['sys_s']:>7.1f} "
                  f"{c['sys_s'] / c['wall_s']:>6.1%} {c['minflt'] / 1e6:>9.2f} "
                  f"{(c['user_s'] + c['sys_s']) / c['wall_s']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
