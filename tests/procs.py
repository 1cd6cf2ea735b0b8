"""Helpers for the tests of forked worker processes (checkers, codec processes): which are
still running and whose children they are (read from ``/proc``), what a killed writer leaves
behind, and codec processes forced on for a test (:func:`codec_processes`, with a codec that
fails in a worker, :func:`failing_codec`)."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import torch

from quantpress.quantize.ggml import common, processes


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name: state, parent, ..."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (a zombie waits for its reaper, but has ended)."""
    out = []
    for p in pids:
        try:
            if _stat(p)[0] != "Z":
                out.append(p)
        except OSError:
            pass
    return out


def parent(pid: int) -> int:
    """The process id of ``pid``'s parent."""
    return int(_stat(pid)[1])


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


@contextlib.contextmanager
def codec_processes(monkeypatch, count: int = 2, slice_elements: int = 1 << 12):
    """Codec processes forced on: ``count`` of them beside this thread (``count + 1`` torch
    threads), CPU slices of ``slice_elements`` shared from any tensor size; yields their
    process ids. Afterwards the thread count is restored and the processes are ended."""
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", slice_elements)
    monkeypatch.setattr(common, "CPU_PARALLEL_ELEMENTS_SEARCH", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(count + 1)
    try:
        assert processes.start_codec_processes(count) == count
        yield processes.codec_process_ids()
    finally:
        torch.set_num_threads(before)
        processes.close_codec_processes()


def failing_codec(x: torch.Tensor) -> torch.Tensor:
    """A block codec that fails on a slice whose first value is exactly 7, else doubles it
    (module level: a codec process finds it by name)."""
    if float(x[0, 0]) == 7.0:
        raise ValueError("slice starting with 7")
    return (x * 2).to(torch.float32)
