"""Working memory of each stage of ``quantize batch`` against its ``--dry-run`` estimate.

Runs the batch of a job file in this process under :class:`bench_common.PhaseWatch` (anonymous
RSS sampled every 5 ms, per runner stage: the peak above the level at the stage's start) and
prints, beside it, :func:`quantpress.batch.jobfile.estimate`'s figure for the same stage
(the estimate's stages group the runner's: ``gguf`` = quantize+write, ``calibration pass`` =
reference pass, ``EXL2 passes`` = quantization, ``EXL2 head`` = head, ``evaluation`` = the
batch's evaluation, watched here as one more stage).
A job file of one model (the stages of several would mix); without one: SmolLM2 with the job
of ``scripts/bench_batch.py``.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/batch_memory.py [--samples 4 --seqlen 128 --chunks 4] [JOBS.toml]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench_common import PhaseWatch, libraries_baseline, model_dir, status

#: runner stage -> estimate stage
SAME = {"quantize+write": "gguf", "reference pass": "calibration pass", "quantization": "EXL2 passes",
        "head": "EXL2 head", "evaluation": "evaluation"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", nargs="?", help="job file (default: SmolLM2, the bench_batch job)")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=4)
    a = ap.parse_args()
    from quantpress.batch.jobfile import estimate, read_jobs
    from quantpress.cli.quantize_main import main as quantize_main

    work = Path(tempfile.mkdtemp(prefix="batch_memory-"))
    job = Path(a.job) if a.job else work / "jobs.toml"
    if not a.job:
        from bench_batch import job_text
        job.write_text(job_text(model_dir(None), "smollm2", a.samples, a.seqlen, a.chunks))
    jobs = read_jobs(job, work / "out")
    est = [estimate(j) for j in jobs]
    base = libraries_baseline(jobs[0].source)
    watch = PhaseWatch(0.005).start()
    from quantpress.batch import stage_work
    run_eval = stage_work.run_eval

    def watched_eval(*args, **kw):
        watch.observe("evaluation", "start")
        try:
            return run_eval(*args, **kw)
        finally:
            watch.observe("evaluation", "end")

    stage_work.run_eval = watched_eval
    try:
        code = quantize_main(["batch", str(job), "-o", str(work / "out"), "--quiet", "--force"])
    except SystemExit as e:
        code = e.code
    r = watch.stop()
    mib = 1 / 2 ** 20
    print(f"exit {code}; libraries' baseline {base * mib:.0f} MiB anonymous; peak RSS (VmHWM) "
          f"{status('VmHWM') * mib:.0f} MiB")
    print(f"{'stage':<16} {'measured above its start':>26} {'estimate (--dry-run)':>22}")
    stages = est[0]["stages"]
    for k, peak in r["phases"].items():
        if k in SAME:
            e = stages.get(SAME[k])
            print(f"{k:<16} {(peak - r['starts'][k]) * mib:>22.0f} MiB "
                  f"{'' if e is None else f'{e * mib:.0f} MiB':>22}  ({SAME[k]})")
    print(f"dry-run's largest stage: {est[0]['peak_stage']}, {est[0]['peak_memory'] * mib:.0f} MiB")


if __name__ == "__main__":
    main()
