"""quantpress/workers/, the one worker pool of every process-parallel job.

* a worker's exception reaches the parent as the same exception (class, message) with the
  worker's traceback as text in its ``__cause__``: from a forked call, from a codec process,
  and for exceptions that cannot be pickled (a RuntimeError naming the class) or that are bad
  input (an InputError still);
* every worker is recorded, and :func:`end_workers` leaves none running;
* a conversion (``convert hf-to-gguf`` of a tiny synthetic llama, codec processes forced on)
  killed with SIGTERM or SIGINT while its codec processes, checker and forked call are
  running: the command exits (143 / 130), none of the children it recorded is running any
  more, and neither the output nor its temporary file exists.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import procs
import pytest
import torch

from quantpress import workers
from quantpress.errors import InputError
from quantpress.quantize.ggml import common


def raises_value_error(n: int) -> int:
    """Fails in the worker (module level: a forked call pickles nothing but its answer)."""
    if n > 0:
        raise ValueError(f"bad n={n} in worker {os.getpid()}")
    return n


class Unpicklable(Exception):
    """An exception whose instances cannot be pickled (a lock among its arguments)."""

    def __init__(self, message: str):
        super().__init__(message, threading.Lock())

    def __str__(self) -> str:
        return str(self.args[0])


def raises_unpicklable() -> None:
    raise Unpicklable("cannot travel")


def raises_input_error() -> None:
    raise InputError("model.safetensors: expected a file")


def test_a_forked_calls_error_carries_the_workers_traceback():
    call = workers.fork_call(raises_value_error, 3)
    assert call.pid != os.getpid()
    with pytest.raises(ValueError, match=r"bad n=3 in worker (\d+)") as info:
        call.result()
    assert int(info.value.args[0].rsplit(" ", 1)[1]) == call.pid       # raised over there
    cause = info.value.__cause__
    assert isinstance(cause, workers.WorkerTraceback)
    text = str(cause)
    assert f"(pid {call.pid})" in text and "quantpress-call" in text
    assert "in raises_value_error" in text and 'raise ValueError(f"bad n={n}' in text
    assert workers.fork_call(raises_value_error, 0).result() == 0


def test_errors_that_cannot_travel_become_runtime_errors_with_the_traceback():
    with pytest.raises(RuntimeError, match="^Unpicklable: cannot travel$") as info:
        workers.fork_call(raises_unpicklable).result()
    assert "in raises_unpicklable" in str(info.value.__cause__)
    with pytest.raises(InputError, match="model.safetensors: expected a file") as info:
        workers.fork_call(raises_input_error).result()
    assert "in raises_input_error" in str(info.value.__cause__)


def test_a_codec_processs_error_carries_its_traceback(monkeypatch):
    with procs.codec_processes(monkeypatch) as pids:
        assert len(pids) == 2 and set(pids) <= set(workers.worker_ids())
        x = torch.ones(256, 256)
        assert torch.equal(common.map_block_slices(procs.failing_codec, x, search=True), x * 2)  # (all ready)
        x[0, 0] = 7.0           # slices of 16 rows: this thread takes them from the end, the workers from the front
        with pytest.raises(ValueError, match="slice starting with 7") as info:
            common.map_block_slices(procs.failing_codec, x, search=True)
        text = str(info.value.__cause__)
        assert "in failing_codec" in text and "quantpress-codec-" in text
        assert any(f"(pid {p})" in text for p in pids), text


def sleeper(conn) -> None:
    time.sleep(60)


def test_end_workers_leaves_none_running():
    started = [workers.start_worker(sleeper, name=f"quantpress-test-{i}") for i in range(2)]
    pids = [w.pid for w in started]
    assert set(pids) <= set(workers.worker_ids()) and procs.running(pids) == pids
    if sys.platform.startswith("linux"):    # named for ps and scripts/trace_memory.py
        for i, pid in enumerate(pids):
            for _ in range(100):            # the child names itself first thing after its start
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                if comm == f"qp-test-{i}":
                    break
                time.sleep(0.05)
            assert comm == f"qp-test-{i}", comm
    workers.end_workers()
    assert not procs.running(pids) and not set(pids) & set(workers.worker_ids())


SCRIPT = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal
    import torch
    from quantpress import workers
    from quantpress.cli.convert_main import main
    from quantpress.convert import gguf_file
    from quantpress.quantize.ggml import common, processes
    from quantpress.targets import gguf

    # codec processes forced on: three torch threads (two codec processes), the codecs keep
    # every core, slices shared from any size; the command stalls after its first window of
    # tensors written (the temporary output exists), its slices dealt to the codec processes
    torch.set_num_threads(3)
    gguf.codecs_leave_a_core = gguf_file.codecs_leave_a_core = lambda files, tensors: False
    common.CPU_SLICE_ELEMENTS = 1 << 15
    common.CPU_PARALLEL_ELEMENTS_SEARCH = 0
    real_run, real_trim, dealt = processes._run, gguf_file.trim_heap, []

    def counted(*args):
        dealt.append(1)
        return real_run(*args)

    def stalled(*args, **kw):
        if dealt:
            print("children", *workers.worker_ids(), flush=True)
            for _ in range(600):      # the signal comes here
                time.sleep(0.1)
        return real_trim(*args, **kw)
    processes._run, gguf_file.trim_heap = counted, stalled
    sys.exit(main(["hf-to-gguf", sys.argv[1], "--policy", "Q4_K_M", "-o", sys.argv[2], "--quiet"]))
""")


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_killed_conversion_leaves_no_child_and_no_file(sig, code, tiny_llama_dir, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "model.gguf"
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    p = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_llama_dir), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("children"), (line, p.stderr.read() if p.poll() is not None else "")
        pids = [int(v) for v in line.split()[1:]]
        # the codec processes, the round trip's checker and the metadata's forked call, all
        # children of the command and running
        assert len(pids) >= 3 and procs.running(pids) == pids, pids
        assert {procs.parent(pid) for pid in pids} == {p.pid}
        assert [f.name for f in out_dir.iterdir()] == [f".model.gguf.partial-{p.pid}"]  # being written
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err
    assert not procs.running(pids), pids            # gone when the command ended, not later
    assert list(out_dir.iterdir()) == []
