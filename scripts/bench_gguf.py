#!/usr/bin/env python3
"""Benchmark `convert hf-to-gguf --policy Q4_K_M` against llama.cpp on the same model and
machine: llama.cpp's convert_hf_to_gguf.py --outtype f16 followed by llama-quantize
(llama_model_quantize from llama-cpp-python 0.3.36, the function llama-quantize calls,
with nthread = all cores). Each step runs in its own process; wall time and peak RSS
(ru_maxrss of that process, or of a child it waited for if larger) are measured with os.wait4,
and the peak memory of the whole process tree (the sum of its processes' proportional set
sizes, PSS, from /proc, sampled every 0.25 s: our round trip runs in a checker process forked
from ours, which shares most of its pages; reading a process's PSS walks its page tables, about
5 ms for a 300 MB process, which every 20 ms slowed the measured tools by a fifth). Prints both, their ratios, and
whether the two outputs carry identical tensors.

  python scripts/bench_gguf.py                       # SmolLM2-135M
  python scripts/bench_gguf.py --model synth4x       # synthetic llama ~4x SmolLM2's size
  python scripts/bench_gguf.py --device cuda         # our quantization on the GPU
  python scripts/bench_gguf.py --imatrix FILE        # both with importance weights (llama.cpp:
                                                     # the llama-quantize tool, --imatrix FILE)

The quantization step alone (`--quantize-only`): one F16 GGUF (ours, `convert hf-to-gguf
--policy F16`, or `--f16 FILE`), quantized by the llama-quantize tool on all cores and by
`quantize gguf --device D`; compares llama-quantize's own "quantize time" with our
"quantize+write" stage, and the two processes' wall times:

  python scripts/bench_gguf.py --model synth4x --quantize-only --device cuda [--imatrix FILE]

`--split` adds, in one more process, our quantize+write without the round trip
(``write_gguf_many(verify=False)`` on the same plan, the second of two runs, so that a GPU's
warm-up is left out): how much of the stage the round trip takes.

`--windows` adds, in one more process, quantize+write of the same plan with and without the
round trip under the writer's read-ahead and window settings (``gguf_file.READ_AHEAD``,
``CPU_WINDOW_ROUNDS``: on the CPU the codec processes are started, as the target does) and,
on the CPU, with the codecs forced to leave the round trip's checker its core or to keep every
core (``gguf_file.codecs_leave_a_core``'s choice), off the CPU with the writer's own CPU ops
(NaN/Inf checks, copies into the checkers' staging areas) in as many threads as there are
cores instead of leaving the checker processes theirs, each tensor's check whole in one checker
(``gguf_checks.CHECK_PART_ELEMENTS`` unbounded), up to as many checkers as idle cores
(``VERIFY_WORKERS``) and our half of the check (our dequantization, the error against the
source) in the checkers instead of on the writer's device (``FIGURES_ON_WRITER = False``: the
sources copied to them), and with the checkers' staging areas (off the CPU
``gguf_checkers.STAGING_BYTES`` together, a quarter and half their size; on the CPU the one
checker's ``SOLE_STAGING_BYTES``, twice and four times its size), each twice, alternating,
after a warm-up run: what each setting is worth on this machine.

`--stages` adds, in one more process, quantize+write of the same plan without and with the
round trip, each twice after a warm-up run, with the seconds spent in each of its parts:
``encode_many`` (moving the sources to the device, the codecs, the encoded bytes back), within
it ``ggml.quantize_many`` alone (synchronized off the CPU), the NaN/Inf checks, gguf-py's
metadata packing and tensor writes, handing each tensor to the round trip (copies into the
checkers' staging areas, waits for room) and the wait for the last checks at the end.

`--metadata-before` (end to end) also times `convert hf-to-gguf` with the metadata
(transformers' config and tokenizer) computed before any tensor is read, in the command's own
process (``targets.gguf.OVERLAP_METADATA = False``), against the default: computed in a
forked process while the first tensors are quantized.

`--repeat N` (end to end) runs the whole sequence N times, each in a fresh directory, the
tools alternating, and reports each step's shortest wall time (with its largest peaks; the
total of llama.cpp's two steps from the quicker run) and each run's ratio: on a shared, noisy
host one pair of runs swings by a tenth either way.

`--llama-quantize PATH` uses that build of the tool (a machine without quantpress's cache);
`--tokenizer DIR` gives the synthetic model its tokenizer (default: SmolLM2's, from the cache).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import llamacpp_tools
from bench_common import (PY, best_step, llama_quantize_code, llamacpp_convert_cmd, measure, named_model,
                          offline_env, same_tensors, use_tests)

use_tests()                         # tests/refs.py: tensors_of


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, synth4x, or a model directory")
    ap.add_argument("--policy", default="Q4_K_M")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--imatrix", help="an imatrix file for both quantizers (quantize imatrix's or llama-imatrix's)")
    ap.add_argument("--quantize-only", action="store_true",
                    help="time the quantization of one F16 GGUF alone: llama-quantize against quantize gguf")
    ap.add_argument("--f16", help="--quantize-only: this F16 GGUF (made from --model there when missing)")
    ap.add_argument("--llama-quantize", help="path of the llama-quantize tool (default: built in the cache)")
    ap.add_argument("--tokenizer", help="tokenizer directory for --model synth4x (default: SmolLM2's)")
    ap.add_argument("--split", action="store_true",
                    help="--quantize-only: also time quantize+write without the round trip")
    ap.add_argument("--windows", action="store_true",
                    help="--quantize-only: also time quantize+write under the read-ahead and window settings")
    ap.add_argument("--stages", action="store_true",
                    help="--quantize-only: also time the parts of quantize+write, with and without the round trip")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="end to end: run the sequence N times, the tools alternating, and report "
                         "each step's best")
    ap.add_argument("--metadata-before", action="store_true",
                    help="also time hf-to-gguf with the metadata computed before the tensors, in its own process")
    args = ap.parse_args()
    model = named_model(args.model, args.tokenizer)
    if args.quantize_only:
        return quantize_only(args, model)
    env = offline_env()
    nthread = os.cpu_count() or 1
    im = ["--imatrix", str(Path(args.imatrix).resolve())] if args.imatrix else []
    quant_code = llama_quantize_code(args.policy, nthread)

    def one_run(d: Path) -> dict:
        # the sequence once, in a fresh directory: llama.cpp's two steps, then ours
        ref_f16, ref_q, ours, ours_q = d / "ref-f16.gguf", d / "ref-q.gguf", d / "ours.gguf", d / "ours-q.gguf"
        r = {"conv": measure(llamacpp_convert_cmd(model, ref_f16), env)}
        if im:
            r["quant"] = measure([str(llamacpp_tools.tool("llama-quantize")), *im, str(ref_f16), str(ref_q),
                                  args.policy, str(nthread)])
        else:
            r["quant"] = measure([PY, "-c", quant_code, str(ref_f16), str(ref_q)])
        report = d / "report.json"
        r["mine"] = measure([PY, "-m", "quantpress", "convert", "hf-to-gguf", str(model), "--policy", args.policy,
                             "-o", str(ours), "--device", args.device, "--quiet", "--report", str(report), *im])
        r["stages"] = json.loads(report.read_text())["stages"]
        if args.metadata_before:
            argv = ["hf-to-gguf", str(model), "--policy", args.policy, "-o", str(d / "before.gguf"),
                    "--device", args.device, "--quiet", "--report", str(report), *im]
            r["before"] = measure([PY, "-c", "import quantpress.targets.gguf as g; g.OVERLAP_METADATA = False; "
                                   "from quantpress.cli import common, convert_main; "
                                   f"common.exit_with(convert_main.main({argv!r}))"])
            r["stages_before"] = json.loads(report.read_text())["stages"]
        r["mine_q"] = measure([PY, "-m", "quantpress", "quantize", "gguf", str(ref_f16), "--policy", args.policy,
                               "-o", str(ours_q), "--device", args.device, "--quiet", "--report", str(report), *im])
        r["stages_q"] = json.loads(report.read_text())["stages"]
        r["identical"] = same_tensors(ref_q, ours, ours_q)
        r["size"] = ref_q.stat().st_size
        return r

    runs = []
    for _ in range(max(1, args.repeat)):
        with tempfile.TemporaryDirectory() as d:
            runs.append(one_run(Path(d)))

    def stages_of(key: str, step: str) -> dict:
        # the stages of the run whose step was quickest
        return min(runs, key=lambda r: r[step][0])[key]

    # each step's shortest wall time over the runs, with the largest peaks
    conv, quant, mine, mine_q = (best_step(runs, k) for k in ("conv", "quant", "mine", "mine_q"))
    stages, stages_q = stages_of("stages", "mine"), stages_of("stages_q", "mine_q")
    before = best_step(runs, "before") if args.metadata_before else None
    identical = all(r["identical"] for r in runs)
    size = runs[-1]["size"]
    ref_total = min(r["conv"][0] + r["quant"][0] for r in runs)
    fig = {
        "model": str(model), "policy": args.policy, "device": args.device, "nthread_llamacpp": nthread,
        "imatrix": args.imatrix, "runs": len(runs),
        "llamacpp_convert_s": conv[0], "llamacpp_quantize_s": quant[0], "llamacpp_total_s": ref_total,
        "llamacpp_peak_rss_mib": max(conv[1], quant[1]), "llamacpp_convert_rss_mib": conv[1],
        "llamacpp_quantize_rss_mib": quant[1], "llamacpp_peak_pss_mib": max(conv[2], quant[2]),
        "ours_total_s": mine[0], "ours_peak_rss_mib": mine[1], "ours_peak_pss_mib": mine[2],
        "ours_stages_s": stages, "ours_requantize_s": mine_q[0], "ours_requantize_stages_s": stages_q,
        "ratio_total_ours_over_llamacpp": mine[0] / ref_total,
        "ratio_requantize_ours_over_llamacpp": mine_q[0] / quant[0],
        "ratio_peak_pss_ours_over_llamacpp": mine[2] / max(conv[2], quant[2]),
        "ratio_total_per_run": [r["mine"][0] / (r["conv"][0] + r["quant"][0]) for r in runs],
        "identical_tensors": identical, "output_bytes": size,
    }
    of = f", best of {len(runs)} runs" if len(runs) > 1 else ""
    print(f"model {model} ({args.policy}, ours on {args.device}, llama.cpp nthread={nthread}{of})")
    print(f"  llama.cpp  convert f16 {conv[0]:7.1f} s  {conv[1]:7.0f} MiB RSS {conv[2]:7.0f} MiB PSS | quantize "
          f"{quant[0]:7.1f} s {quant[1]:7.0f} MiB RSS {quant[2]:7.0f} MiB PSS | total {ref_total:7.1f} s")
    print(f"  quantpress hf-to-gguf  {mine[0]:7.1f} s  {mine[1]:7.0f} MiB RSS {mine[2]:7.0f} MiB PSS (process "
          f"tree); stages "
          + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    if before is not None:
        stages_before = stages_of("stages_before", "before")
        fig.update(ours_metadata_before_s=before[0], ours_metadata_before_pss_mib=before[2],
                   ours_metadata_before_stages_s=stages_before)
        print(f"  quantpress hf-to-gguf, metadata before the tensors {before[0]:7.1f} s  {before[2]:7.0f} MiB "
              f"PSS; stages " + ", ".join(f"{k} {v:.1f} s" for k, v in stages_before.items())
              + f"; beside/before {mine[0] / before[0]:.2f}x")
    print(f"  quantpress quantize gguf (llama.cpp's F16 file) {mine_q[0]:7.1f} s  {mine_q[1]:7.0f} MiB; stages "
          + ", ".join(f"{k} {v:.1f} s" for k, v in stages_q.items()))
    if len(runs) > 1:
        print("  each run, ours/llama.cpp end to end: "
              + ", ".join(f"{v:.2f}x" for v in fig["ratio_total_per_run"]))
    print(f"  ratio ours/llama.cpp end to end: {fig['ratio_total_ours_over_llamacpp']:.2f}x time; "
          f"requantizing the F16 file, quantize gguf/llama-quantize: "
          f"{fig['ratio_requantize_ours_over_llamacpp']:.2f}x; identical tensors: {identical}")
    print(f"  peak memory, ours (process tree PSS) / llama.cpp's larger step: "
          f"{fig['ratio_peak_pss_ours_over_llamacpp']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0 if identical else 1


def quantize_only(args, model: Path) -> int:
    """The quantization step alone: llama-quantize (all cores) and ``quantize gguf --device``
    on the same F16 GGUF; prints and returns 0 when both wrote identical tensors."""
    lq = Path(args.llama_quantize) if args.llama_quantize else llamacpp_tools.tool("llama-quantize")
    nthread = os.cpu_count() or 1
    im = ["--imatrix", str(Path(args.imatrix).resolve())] if args.imatrix else []
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        f16 = Path(args.f16) if args.f16 else d / "f16.gguf"
        conv = None
        if not f16.exists():
            conv = measure([PY, "-m", "quantpress", "convert", "hf-to-gguf", str(model), "--policy", "F16",
                            "-o", str(f16), "--quiet"])
        ref_q, ours_q, report = d / "ref-q.gguf", d / "ours-q.gguf", d / "report.json"
        log: list[str] = []
        quant = measure([str(lq), *im, str(f16), str(ref_q), args.policy, str(nthread)], log=log)
        m = re.search(r"quantize time\s*=\s*([0-9.]+) ms", log[-1])
        quant_step = float(m.group(1)) / 1000 if m else float("nan")
        mine = measure([PY, "-m", "quantpress", "quantize", "gguf", str(f16), "--policy", args.policy,
                        "-o", str(ours_q), "--device", args.device, "--quiet", "--report", str(report), *im])
        stages = json.loads(report.read_text())["stages"]
        from refs import tensors_of
        identical = tensors_of(ours_q) == tensors_of(ref_q)
        bare = None
        if args.split:
            log = []
            measure([PY, "-c", NO_ROUND_TRIP, str(f16), args.policy, args.device, str(d / "bare.gguf"),
                     args.imatrix or ""], log=log)
            bare = float(log[-1].split()[-1])
        if args.windows:
            subprocess.run([PY, "-c", WINDOWS, str(f16), args.policy, args.device, str(d / "win.gguf"),
                            args.imatrix or ""], check=True)
        if args.stages:
            subprocess.run([PY, "-c", STAGES, str(f16), args.policy, args.device, str(d / "stages.gguf"),
                            args.imatrix or ""], check=True)
    step = stages.get("quantize+write", float("nan"))
    fig = {
        "model": str(model), "policy": args.policy, "device": args.device, "imatrix": args.imatrix,
        "nthread_llamacpp": nthread, "f16_convert_s": conv and conv[0],
        "llamacpp_quantize_step_s": quant_step, "llamacpp_wall_s": quant[0], "llamacpp_peak_rss_mib": quant[1],
        "llamacpp_peak_pss_mib": quant[2],
        "ours_quantize_step_s": step, "ours_wall_s": mine[0], "ours_peak_rss_mib": mine[1], "ours_stages_s": stages,
        "ours_peak_pss_mib": mine[2],
        "speedup_step_llamacpp_over_ours": quant_step / step, "speedup_wall_llamacpp_over_ours": quant[0] / mine[0],
        "identical_tensors": identical, "ours_quantize_write_without_round_trip_s": bare,
    }
    print(f"model {model} ({args.policy}{', imatrix' if im else ''}; ours on {args.device}, "
          f"llama-quantize nthread={nthread})")
    print(f"  llama-quantize: quantize time {quant_step:7.2f} s, process {quant[0]:7.2f} s, {quant[1]:6.0f} MiB RSS, "
          f"{quant[2]:6.0f} MiB PSS")
    print(f"  quantize gguf:  quantize+write {step:7.2f} s, process {mine[0]:7.2f} s, {mine[1]:6.0f} MiB RSS, "
          f"{mine[2]:6.0f} MiB PSS (process tree); stages "
          + ", ".join(f"{k} {v:.2f} s" for k, v in stages.items()))
    print(f"  llama-quantize / ours: quantization step {fig['speedup_step_llamacpp_over_ours']:.2f}x, "
          f"process {fig['speedup_wall_llamacpp_over_ours']:.2f}x; identical tensors: {identical}")
    if bare is not None:
        print(f"  quantize+write without the round trip: {bare:7.2f} s (llama-quantize / that: {quant_step / bare:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0 if identical else 1


#: ``--split``: quantize+write of an F16 GGUF's plan without the round trip, twice in one
#: process; prints the second run's seconds last (argv: F16 file, policy, device, output, imatrix or "")
NO_ROUND_TRIP = """
import sys, time, torch
from pathlib import Path
from quantpress.convert import gguf_file
from quantpress.quantize.ggml.processes import start_codec_processes
from quantpress.memory import bound_heap
from quantpress.targets.gguf import GGUFOptions, plan_from_gguf
src, policy, dev, out, im = sys.argv[1:6]
dev = torch.device(dev)
bound_heap()                        # as GGUFTarget.prepare
if dev.type == "cpu":
    start_codec_processes()
plan = plan_from_gguf(Path(src), policy, GGUFOptions(policy=policy, imatrix=im or None))
for run in range(2):
    t0 = time.perf_counter()
    with torch.no_grad():
        gguf_file.write_gguf_many([(Path(out), plan.kvs, plan.types, plan.imatrix)], plan.arch, plan.tensors, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"run {run + 1}: {time.perf_counter() - t0:.3f}")
"""


#: the set-up of ``--windows`` and ``--stages`` (argv as NO_ROUND_TRIP's): as GGUFTarget.prepare,
#: the heap, the checkers, the plan, then on the CPU the codec processes (``lanes``)
WITH_CHECKERS = """
import collections, sys, time, torch
from pathlib import Path
from quantpress.convert import gguf_checkers, gguf_checks, gguf_file, gguf_roundtrip
from quantpress.quantize.ggml.processes import start_codec_processes
from quantpress.memory import bound_heap
from quantpress.targets.gguf import GGUFOptions, plan_from_gguf
src, policy, dev, out, im = sys.argv[1:6]
dev = torch.device(dev)
bound_heap()
gguf_roundtrip.start_checkers(dev)
plan = plan_from_gguf(Path(src), policy, GGUFOptions(policy=policy, imatrix=im or None))
lanes = 1 + (start_codec_processes() if dev.type == "cpu" else 0)
"""


#: ``--windows``: quantize+write of an F16 GGUF's plan under the writer's read-ahead and window
#: settings, with and without the round trip, in one process
WINDOWS = WITH_CHECKERS + """
defaults = gguf_file.READ_AHEAD, gguf_file.CPU_WINDOW_ROUNDS
staging_default = gguf_checkers.STAGING_BYTES, gguf_checkers.SOLE_STAGING_BYTES
rule, taken = gguf_file.codecs_leave_a_core, gguf_file.cores_taken
leaves = rule([(None, plan.kvs, plan.types, plan.imatrix)], plan.tensors)

def once(label, verify, ahead, rounds, leave=None):
    gguf_file.READ_AHEAD, gguf_file.CPU_WINDOW_ROUNDS = ahead, rounds
    gguf_file.codecs_leave_a_core = rule if leave is None else (lambda files, tensors: leave)
    # off the CPU, leave=False: the writer's own CPU ops keep every core's thread
    gguf_file.cores_taken = taken if leave is not False or dev.type == "cpu" else (lambda watches: 0)
    t0 = time.perf_counter()
    with torch.no_grad():
        trips = gguf_file.write_gguf_many([(Path(out), plan.kvs, plan.types, plan.imatrix)], plan.arch,
                                          plan.tensors, dev, verify=verify)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    rt = f"; checking {trips[0].seconds:.2f} s in {trips[0].checker_processes} checker(s), ok {trips[0].ok}" if trips else ""
    print(f"  {label:62s} {took:6.2f} s{rt}", flush=True)

print(f"quantize+write on {dev} ({lanes} codec lane(s)), READ_AHEAD / CPU_WINDOW_ROUNDS default {defaults}"
      + (f", the plan's codecs {'leave the checker a core' if leaves else 'keep every core'}" if dev.type == "cpu" else ""))
once("warm-up", False, *defaults)
settings = [("read-ahead", True, defaults[1]), ("no read-ahead", False, defaults[1])]
if dev.type == "cpu":
    settings += [("one tensor at a time (no window, no read-ahead)", False, 0),
                 (f"windows of {defaults[1] // 2} rounds, read-ahead", True, defaults[1] // 2),
                 (f"windows of {defaults[1] * 2} rounds, read-ahead", True, defaults[1] * 2)]
for verify in (False, True):
    for _ in range(2):
        for label, ahead, rounds in settings:
            once(("round trip, " if verify else "no round trip, ") + label, verify, ahead, rounds)
        if verify and dev.type == "cpu":
            for leave in (True, False):
                once("round trip, codecs " + ("leaving the checker a core" if leave else "keeping every core"),
                     True, *defaults, leave=leave)
        elif verify:
            once("round trip, the writer's CPU ops on every core", True, *defaults, leave=False)
        if verify:
            # the checkers' staging areas (STAGING_BYTES together off the CPU, smaller; the
            # CPU's one checker: SOLE_STAGING_BYTES, larger): new checkers
            together, sole = staging_default
            for staging in ((together // 4, together // 2) if dev.type != "cpu" else (sole * 2, sole * 4)):
                gguf_roundtrip.close_checkers()
                gguf_checkers.STAGING_BYTES, gguf_checkers.SOLE_STAGING_BYTES = \
                    (staging, sole) if dev.type != "cpu" else (together, staging)
                gguf_roundtrip.start_checkers(dev)
                once(f"round trip, staging areas of {staging >> 20} MiB together", True, *defaults)
            gguf_roundtrip.close_checkers()
            gguf_checkers.STAGING_BYTES, gguf_checkers.SOLE_STAGING_BYTES = staging_default
            gguf_roundtrip.start_checkers(dev)
        if verify and dev.type != "cpu":
            # each tensor's check whole in one checker, then as many checkers as idle cores
            part_default, workers_default = gguf_checks.CHECK_PART_ELEMENTS, gguf_roundtrip.VERIFY_WORKERS
            gguf_checks.CHECK_PART_ELEMENTS = 1 << 62
            once("round trip, each tensor whole to one checker", True, *defaults)
            gguf_checks.CHECK_PART_ELEMENTS = part_default
            gguf_roundtrip.VERIFY_WORKERS = gguf_checkers.checker_limit()
            once(f"round trip, up to {gguf_roundtrip.VERIFY_WORKERS} checkers", True, *defaults)
            gguf_roundtrip.VERIFY_WORKERS = workers_default
            # our dequantization and the error sums in the checkers, the sources copied to them
            gguf_roundtrip.FIGURES_ON_WRITER = False
            once("round trip, our half in the checkers (sources staged)", True, *defaults)
            gguf_roundtrip.FIGURES_ON_WRITER = None
"""


#: ``--stages``: quantize+write of an F16 GGUF's plan, the seconds of each part of it
STAGES = WITH_CHECKERS + """
from gguf import GGUFWriter
from quantpress.quantize import ggml
spent, labels = collections.defaultdict(float), []

def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()

def timed(owner, name, label, synced=False):
    f = getattr(owner, name)
    if label not in labels:
        labels.append(label)
    def g(*a, **k):
        if synced:
            sync()
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            if synced:
                sync()
            spent[label] += time.perf_counter() - t0
    setattr(owner, name, g)

timed(gguf_file, "encode_many", "encode_many (to the device, codecs, back)")
timed(ggml, "quantize_many", "  of which ggml.quantize_many", synced=True)
timed(gguf_file, "check_finite", "NaN/Inf checks")
timed(GGUFWriter, "write_kv_data_to_file", "gguf-py: metadata")
timed(GGUFWriter, "write_tensor_data", "gguf-py: tensor writes")
for cls in (gguf_roundtrip.RoundTripWatch, gguf_roundtrip.RoundTripProcessWatch):
    timed(cls, "written", "round trip: hand-over (staging copies, waits)")
    timed(cls, "finish", "round trip: the last checks")
print(f"quantize+write on {dev}, its parts (seconds)")
for run, verify in enumerate((False, False, False, True, True)):
    spent.clear()
    t0 = time.perf_counter()
    with torch.no_grad():
        trips = gguf_file.write_gguf_many([(Path(out), plan.kvs, plan.types, plan.imatrix)], plan.arch,
                                          plan.tensors, dev, verify=verify)
    sync()
    took = time.perf_counter() - t0
    if run == 0:
        continue                    # warm-up
    rt = f"; checking {trips[0].seconds:.2f} s in {trips[0].checker_processes} checker(s), ok {trips[0].ok}" if trips else ""
    print(f"  {'round trip' if verify else 'no round trip':14s} {took:6.2f} s{rt}")
    for label in labels:
        if label in spent:
            print(f"      {label:48s} {spent[label]:6.2f}")
"""


if __name__ == "__main__":
    sys.exit(main())
