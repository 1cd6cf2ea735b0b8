"""Helpers for the tests of forked worker processes (checkers, codec processes)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie waits for its reaper, but has ended)."""
    out = []
    for p in pids:
        try:
            if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(p)
        except OSError:
            pass
    return out


def left_by_killed_writer(code: str, count: int, seconds: float = 20) -> list[int]:
    """Run Python ``code`` in a fresh interpreter; it prints the process ids of the workers
    it started (``count`` of them) and kills itself with SIGKILL. Returns those still running
    ``seconds`` later (asserting the count and the kill)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == count and out.returncode == -signal.SIGKILL, out
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and running(pids):
        time.sleep(0.1)
    return running(pids)
