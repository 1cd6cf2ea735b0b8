"""``quantize batch`` as the resume tests run it (tests/test_batch.py, tests/test_resume_safety.py):
a job file of one model on 2 x 32 calibration tokens, and the command in a subprocess with the
checkpoints' kill hook, so that a pass can be killed (SIGKILL) between two layers."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from quantpress.calibration.checkpoint import KILL_HOOK


def one_model_job(path: Path, source: Path, outputs: str, samples: int = 2) -> Path:
    """A job file at ``path``: model ``m`` from ``source`` (CPU, ``samples`` x 32 calibration
    tokens) with the TOML lines ``outputs``; ``path``."""
    path.write_text(f"""
[defaults]
device = "cpu"
calib = {{ samples = {samples}, seqlen = 32 }}
[[model]]
source = "{source}"
name = "m"
{outputs}
""")
    return path


def batch_process(job: Path, out: Path, kill: str | None = None) -> subprocess.CompletedProcess:
    """``quantize batch JOB -o OUT --quiet --json`` in a subprocess (one thread), with the
    checkpoints' kill hook set to ``kill`` ("<pass>:<layer>") or unset."""
    env = {k: v for k, v in os.environ.items() if k != KILL_HOOK}
    env.update(OMP_NUM_THREADS="1", **({KILL_HOOK: kill} if kill else {}))
    quantize = Path(sys.executable).parent / "quantize"
    return subprocess.run([str(quantize), "batch", str(job), "-o", str(out), "--quiet", "--json"],
                          env=env, capture_output=True, text=True, timeout=900)
