"""``quantize batch`` against the same outputs made one by one, on SmolLM2-135M-Instruct.

The batch: GGUF Q4_K_M and Q8_0, AWQ w4g64, EXL2 4.0 and 5.0 bpw, evaluation. One by one, as
a careful user makes them: two ``convert hf-to-gguf``, one ``quantize awq``, ``quantize exl2
--bpw 4.0`` (which keeps measurement.json in its directory), ``quantize exl2 --bpw 5.0
--measurement`` that file, one ``quantize eval`` of the four models. Prints both wall times,
their ratio, the peak RSS (of one process) and the peak PSS of the process tree (one by one:
of its largest step; the batch's side lanes are processes of their own), the seconds of each
output of the batch (from its manifest), and whether every output is byte-identical between
the two ways. ``--ray`` also runs the batch with ``--ray``
on a local Ray instance (each stage a Ray task with one CPU: the GGUF policies beside the
calibrated pass, the EXL2 targets beside each other) and prints its wall time and ratio (its
peak RSS is not measured: Ray's workers are not this script's children). ``--layers N``:
the model's first N decoder layers (``bench_common.truncated_model``), for short runs.

    .venv/bin/python scripts/bench_batch.py --samples 8 --seqlen 256 --chunks 8 [--ray]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench_common import digests, measure, model_dir, truncated_model

BIN = Path(sys.executable).parent


def job_text(model: Path, name: str, samples: int, seqlen: int, chunks: int) -> str:
    """The bench's job file: GGUF Q4_K_M and Q8_0, AWQ w4g64, EXL2 4.0 and 5.0, evaluation on
    ``chunks`` chunks, on CPU with ``samples`` x ``seqlen`` calibration tokens."""
    return f"""[defaults]
device = "cpu"
calib = {{ samples = {samples}, seqlen = {seqlen} }}

[[model]]
source = "{model}"
name = "{name}"
gguf = ["Q4_K_M", "Q8_0"]
awq = [{{ group_size = 64 }}]
exl2 = [{{ bpw = 4.0 }}, {{ bpw = 5.0 }}]
eval = {{ chunks = {chunks} }}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8, help="evaluation chunks of 512 tokens")
    ap.add_argument("--work", help="working directory (default: a temporary one)")
    ap.add_argument("--ray", action="store_true", help="also the batch with --ray (local Ray instance)")
    ap.add_argument("--layers", type=int, help="only the first N decoder layers of the model")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench_batch-"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(None)
    if a.layers:
        model = truncated_model(model, a.layers, work)
    cal = ["--samples", str(a.samples), "--seqlen", str(a.seqlen), "--device", "cpu", "--quiet"]
    name = "smollm2"

    job = work / "jobs.toml"
    job.write_text(job_text(model, name, a.samples, a.seqlen, a.chunks))
    batch_wall, batch_rss, batch_pss = measure([str(BIN / "quantize"), "batch", str(job), "-o",
                                                str(work / "batch"), "--quiet", "--force"])
    if a.ray:
        ray_wall, _, _ = measure([str(BIN / "quantize"), "batch", str(job), "-o", str(work / "ray"),
                               "--quiet", "--force", "--ray"])

    one = work / "one"
    one.mkdir(exist_ok=True)
    o = {k: one / f"{name}-{k}" for k in ("Q4_K_M.gguf", "Q8_0.gguf", "AWQ-w4g64", "EXL2-4.0bpw", "EXL2-5.0bpw")}
    steps = [
        [str(BIN / "convert"), "hf-to-gguf", str(model), "--policy", "Q4_K_M", "-o", str(o["Q4_K_M.gguf"]), "--quiet", "--force"],
        [str(BIN / "convert"), "hf-to-gguf", str(model), "--policy", "Q8_0", "-o", str(o["Q8_0.gguf"]), "--quiet", "--force"],
        [str(BIN / "quantize"), "awq", str(model), "--group-size", "64", "-o", str(o["AWQ-w4g64"]), "--force", *cal],
        [str(BIN / "quantize"), "exl2", str(model), "--bpw", "4.0", "-o", str(o["EXL2-4.0bpw"]), "--force", *cal],
        [str(BIN / "quantize"), "exl2", str(model), "--bpw", "5.0", "-o", str(o["EXL2-5.0bpw"]), "--force",
         "--measurement", str(o["EXL2-4.0bpw"] / "measurement.json"), *cal],
        [str(BIN / "quantize"), "eval", str(model), *(str(p) for p in o.values()), "--chunks", str(a.chunks),
         "--device", "cpu", "--quiet"],
    ]
    walls, rsss, psss = [], [], []
    for cmd in steps:
        w, r, ps = measure(cmd)
        walls.append(w)
        rsss.append(r)
        psss.append(ps)
        print(f"  {w:7.1f} s {r:7.0f} MiB RSS {ps:7.0f} MiB PSS  "
              f"{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd[:4]))}")
    one_wall, one_rss, one_pss = sum(walls), max(rsss), max(psss)

    same = all(digests(work / "batch" / name / p.name) == digests(p) for p in o.values())
    print(f"model {model.name}, calibration {a.samples} x {a.seqlen} tokens, eval {a.chunks} "
          f"chunks of 512, CPU, {os.environ.get('OMP_NUM_THREADS', 'default')} threads")
    print(f"batch       {batch_wall:7.1f} s  peak RSS {batch_rss:7.0f} MiB, PSS of its process tree "
          f"{batch_pss:7.0f} MiB")
    manifest = json.loads((work / "batch" / name / "manifest.json").read_text())
    print("  its outputs' seconds (shared stages counted in each): " + ", ".join(
        f"{o['kind']} {o['target']} {o['seconds']:.1f}" for o in manifest["outputs"]))
    if a.ray:
        same_ray = all(digests(work / "ray" / name / p.name) == digests(p) for p in o.values())
        print(f"batch --ray {ray_wall:7.1f} s  ({ray_wall / one_wall:.2f}x of one by one; outputs "
              f"byte-identical: {'yes' if same_ray else 'NO'})")
    print(f"one by one  {one_wall:7.1f} s  peak RSS {one_rss:7.0f} MiB, PSS {one_pss:7.0f} MiB (largest process)")
    print(f"ratio       {batch_wall / one_wall:.2f}x time, {batch_rss / one_rss:.2f}x peak RSS, "
          f"{batch_pss / one_pss:.2f}x PSS; "
          f"outputs byte-identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
