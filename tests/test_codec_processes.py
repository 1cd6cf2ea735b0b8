"""quantize/ggml/processes.py: the search-based codecs' CPU slices dealt to forked codec
processes beside the calling thread.

* every K-quant and i-quant, with and without importance weights, gives the same bytes with
  the workers as on one thread and as over the thread pool, and the workers did take slices;
* a codec's exception in a worker is raised in the caller; a worker killed during a call
  fails it with RuntimeError naming it, and the next call still quantizes;
* a codec that the worker cannot find by name (a closure) runs over the threads;
* ``quantize gguf`` writes the same bytes with and without the workers, which took slices;
* a writer killed with SIGKILL leaves no codec process behind.

CPU only; slices are made small (``CPU_SLICE_ELEMENTS``) so that small tensors have many.
"""
from __future__ import annotations

import hashlib
import os
import signal
import time

import procs
import pytest
import torch

from quantpress.quantize import ggml
from quantpress.quantize.ggml import common, processes

SEARCH_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def _count_calls(monkeypatch) -> list[int]:
    """The number of slices of each codec call that goes to the codec processes, as calls come."""
    taken = []
    real = processes._run

    def counting(fn, ref, part, pieces, *rest):
        taken.append(len(pieces))
        return real(fn, ref, part, pieces, *rest)
    monkeypatch.setattr(processes, "_run", counting)
    return taken


@pytest.fixture
def lanes(monkeypatch):
    """Three lanes (this thread and two workers), slices of 4,096 elements, sharing from any
    size; the workers are ended afterwards."""
    with procs.codec_processes(monkeypatch):
        yield _count_calls(monkeypatch)


def _blocks(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g) * 3
    x[5] = 0.0                                   # an all-zero block
    x[9, 17] = 1e4                               # a single huge weight
    x[13] = 0.25                                 # all equal
    return x


def _one_thread(fn):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", SEARCH_TYPES)
def test_workers_give_the_bytes_of_one_thread(name, lanes, monkeypatch):
    x = _blocks(1)
    qw = torch.rand(256, generator=torch.Generator().manual_seed(2)) + 0.01
    qw[:7] = 0.0
    for imatrix in (None, qw):
        lanes.clear()
        with_workers = ggml.quantize(x, name, imatrix=imatrix)
        assert lanes and lanes[0] >= 3, lanes              # the call went to the workers
        alone = _one_thread(lambda: ggml.quantize(x, name, imatrix=imatrix))
        with monkeypatch.context() as m:
            m.setattr(processes, "map_slices", lambda *a: None)    # as where none were started
            threads = ggml.quantize(x, name, imatrix=imatrix)
        assert torch.equal(with_workers, alone) and torch.equal(threads, alone), (name, imatrix is None)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_widened_per_slice(dtype, lanes, monkeypatch):
    """A float16/bfloat16 input goes to the codecs as it is and is widened slice by slice (in
    the workers too): the bytes equal those of the same values given in float32, with the
    workers, over the threads and on one thread, for a search codec with and without an
    imatrix, a plain one (Q8_0) and a float type (BF16 from float16: via float32, as ggml)."""
    x = _blocks(3).to(dtype)
    wide = x.to(torch.float32)
    qw = torch.rand(256, generator=torch.Generator().manual_seed(4)) + 0.01
    for name, imatrix in (("Q4_K", None), ("Q4_K", qw), ("Q5_0", qw), ("Q8_0", None), ("BF16", None), ("F16", None)):
        want = _one_thread(lambda: ggml.quantize(wide, name, imatrix=imatrix))
        lanes.clear()
        got = ggml.quantize(x, name, imatrix=imatrix)
        if name in ("Q4_K", "Q5_0"):
            assert lanes and lanes[0] >= 3, (name, lanes)      # the workers took slices
        alone = _one_thread(lambda: ggml.quantize(x, name, imatrix=imatrix))
        with monkeypatch.context() as m:
            m.setattr(processes, "map_slices", lambda *a: None)
            threads = ggml.quantize(x, name, imatrix=imatrix)
        for out in (got, alone, threads):
            assert torch.equal(out, want), (name, imatrix is None, dtype)


def test_workers_slow_to_start(monkeypatch):
    """Workers that wait a second before touching their shared areas (as processes left
    unscheduled on a busy machine): nothing is copied into an area before its worker says
    it is ready (touching it afterwards would zero the slices), so the bytes stay right."""
    real = processes._serve

    def slow(*args):
        time.sleep(1.0)
        real(*args)
    monkeypatch.setattr(processes, "_serve", slow)
    with procs.codec_processes(monkeypatch):
        taken = _count_calls(monkeypatch)
        x = _blocks(5)
        out = ggml.quantize(x, "Q4_K")
        assert taken and torch.equal(out, _one_thread(lambda: ggml.quantize(x, "Q4_K")))


def sleeping_codec(x: torch.Tensor) -> torch.Tensor:
    """A block codec that takes 0.2 s per slice."""
    time.sleep(0.2)
    return x + 1


def test_a_codec_error_in_a_worker_is_raised_here(lanes):
    x = torch.ones(64, 256)
    x[16, 0] = 7.0              # slices of 16 rows: this thread takes the last, the workers the first two
    with pytest.raises(ValueError, match="slice starting with 7"):
        common.map_block_slices(procs.failing_codec, x, search=True)
    x[16, 0] = 1.0
    assert torch.equal(common.map_block_slices(procs.failing_codec, x, search=True), x * 2)


def test_a_worker_killed_during_a_call_fails_it(lanes):
    x = torch.zeros(128, 256)       # 8 slices of 0.2 s: each worker has two waiting at the start
    pids = processes.codec_process_ids()
    assert len(pids) == 2

    def kill_soon():
        time.sleep(0.3)
        os.kill(pids[0], signal.SIGKILL)
    import threading
    threading.Thread(target=kill_soon).start()
    with pytest.raises(RuntimeError, match=r"codec process quantpress-codec-\d died"):
        common.map_block_slices(sleeping_codec, x, search=True)
    assert pids[0] not in processes.codec_process_ids()
    y = _blocks(3)
    assert torch.equal(ggml.quantize(y, "Q4_K"), _one_thread(lambda: ggml.quantize(y, "Q4_K")))


def test_a_closure_runs_over_the_threads(lanes):
    x = _blocks(4)
    scale = 3.0

    def closure(b):
        return b * scale
    out = common.map_block_slices(closure, x, search=True)
    assert torch.equal(out, x * 3.0) and not lanes


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_quantize_gguf_writes_the_same_bytes_with_the_workers(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    from quantpress.cli.convert_main import main as convert_main
    from quantpress.convert import gguf_file

    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 1 << 15)
    monkeypatch.setattr(common, "CPU_PARALLEL_ELEMENTS_SEARCH", 0)
    monkeypatch.setattr(gguf_file, "codecs_leave_a_core", lambda files, tensors: False)
    taken = _count_calls(monkeypatch)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = {}
        for use in (True, False):
            taken.clear()
            monkeypatch.setattr(processes, "USE_PROCESSES", use)
            if not use:
                processes.close_codec_processes()
            out = tmp_path / f"{use}.gguf"
            code = convert_main(["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q4_K_M", "-o", str(out), "--quiet"])
            assert code == 0, capsys.readouterr().err
            outs[use] = _sha(out)
            assert bool(taken) == use, taken
    finally:
        torch.set_num_threads(before)
        processes.close_codec_processes()
    assert outs[True] == outs[False]


def test_codec_processes_end_with_a_killed_writer():
    """A writer killed (SIGKILL) leaves neither codec nor checker processes, whichever were
    forked first (a GGUF target starts the checkers, then the codec processes once its plan
    is made; the next target may need new checkers): each child closes its siblings' pipe
    ends that it inherits (a checker also the codec processes'), and a codec process forked
    after a checker ends with the writer, closing its copy of the checker's end."""
    code = ("import os, signal\n"
            "from quantpress.quantize.ggml import processes\n"
            "from quantpress.convert import gguf_roundtrip as r\n"
            "c = r.checker_processes(1).pids()\n"
            "processes.start_codec_processes(2)\n"
            "c += r.checker_processes(2).pids()[1:]\n"
            "print(*processes.codec_process_ids(), *c, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert not procs.left_by_killed_writer(code, 4)
