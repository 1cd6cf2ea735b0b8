"""GGUF round trips: re-reading a written file with gguf-py's GGUFReader and checking every
tensor against its source (:func:`verify_gguf`), or checking each tensor as soon as the
writer has put it on disk (:func:`watch_round_trip`).

The checks beside the writing run in checker processes of their own where they can
(:class:`RoundTripProcessWatch`, on :mod:`quantpress.convert.gguf_checkers`), else in threads
(:class:`RoundTripWatch`): gguf-py's dequantization and our codecs are many numpy and torch
calls issued from Python, each holding the interpreter lock while it is dispatched, so a
check in a thread slows the quantization beside it even on idle cores, and several threads
of checks serialize (``scripts/bench_gguf.py`` prints the round trip's share of the stage).
Off the CPU the writer computes our half of each check on its device (our dequantization of
the bytes it wrote, the error against the source, checksums of each row of our values) and the
checkers only re-read the file, dequantize it with gguf-py and compare the rows' checksums
(:func:`figures_on_writer`, :func:`writer_figures`).

The checks themselves are :mod:`quantpress.convert.gguf_checks`'; gguf-py's reading,
:mod:`quantpress.convert.gguf_reading`.
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from quantpress.convert.gguf_checkers import CheckerProcesses, checker_limit, checker_processes, close_checkers
from quantpress.convert.gguf_checks import (RoundTrip, RowChecksums, SourceTensor, check_parts, check_tensor, conclude,
                                            tensor_index, tensor_report, writer_figures)
from quantpress.convert.gguf_reading import GGUFTensorsReader, drop_pages
from quantpress.quantize.ggml.common import serial_codecs, single_threaded_ops
from quantpress.workers import can_fork_workers

__all__ = ["RoundTrip", "SourceTensor", "close_checkers", "checker_processes", "verify_gguf", "watch_round_trip",
           "start_checkers", "RoundTripWatch", "RoundTripProcessWatch"]


def verify_gguf(path: Path, tensors: list[SourceTensor], types: dict[str, str],
                device: torch.device,
                progress: Callable[[Iterable], Iterable] = lambda it: it) -> RoundTrip:
    """Re-read ``path`` with gguf-py's GGUFReader and check every tensor.

    For each tensor: name, ggml type and shape must be as planned; gguf-py's independent
    dequantizer (``gguf.quants.dequantize``) must equal ours (``quantize.ggml.dequantize``)
    bit for bit; and the result is compared with the source tensor: RMSE, max |error| and
    SNR in dB (10 log10 Σx²/Σ(x−x̂)², float32 sums), which must reach :data:`MIN_SNR_DB` (the
    bytes are this tensor's, in their place). Works through each tensor in row chunks
    of about VERIFY_CHUNK_ELEMENTS, so memory follows that, not the tensor or the file.
    Returns a :class:`RoundTrip`; its ``mismatches`` lists every failure.
    (:class:`RoundTripWatch` runs the same checks while the file is being written.)
    """
    t0 = time.perf_counter()
    rep = RoundTrip()
    try:
        reader = GGUFTensorsReader(str(path))
    except Exception as e:
        rep.mismatches.append(f"gguf-py cannot read the file ({e})")
        return rep
    by_name = tensor_index(reader, tensors, rep)
    for st in progress(tensors):
        rt = by_name.get(st.name)
        if rt is None:
            rep.mismatches.append(f"{st.name}: missing from the file")
            continue
        check_tensor(rt, st, types[st.name], None, device, rep)
        drop_pages(reader, rt)
    rep.seconds = time.perf_counter() - t0
    return rep


class RoundTripWatch:
    """The round trip of :func:`verify_gguf`, run on a GGUF file while it is being written,
    in a thread of its own (checking tensor i while the writer quantizes tensor i + 1), where
    no checker process can be started (:class:`RoundTripProcessWatch` is the rule).

    ``path``: the file, whose header, metadata and tensor infos are on disk and which has been
    given its final ``size`` (zero-filled: the writer then fills it in order), so gguf-py's
    reader (:class:`GGUFFileReader`) parses it once, at :meth:`start`, with every tensor's
    offset where it will be; ``tensors`` / ``types``: the plan. :meth:`written` hands over
    tensor ``index`` once its bytes are flushed to the file, with the source tensor just read
    (checked as :func:`verify_gguf` checks it: gguf-py's and our dequantization bit for bit,
    and the error against that source); at most ``workers`` wait, so the writer is held back
    when the checks fall behind. :meth:`finish` waits for the last check, verifies the file's size
    and returns the :class:`RoundTrip` (``seconds``: the wall time during which a check ran;
    ``tensors`` in plan order). ``workers`` threads check tensors side by side (one on the
    CPU; several when the quantization runs on an accelerator and the cores are idle). The threads quantize nothing: their dequantization runs on each alone
    (:func:`quantpress.quantize.ggml.common.serial_codecs`), one torch thread each."""

    def __init__(self, path: Path, tensors: list[SourceTensor], types: dict[str, str],
                 device: torch.device, size: int, workers: int = 1):
        self.path, self.tensors, self.types, self.device, self.size = Path(path), tensors, types, device, size
        self.workers = max(1, workers)
        self.checkers: list = []        # checker processes: none, the checks run in threads
        self.rep = RoundTrip()
        self._queue: queue.Queue = queue.Queue(maxsize=self.workers)
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._checked: set[str] = set()
        self._parsed = threading.Event()
        self._lock = threading.Lock()
        self._busy, self._busy_since = 0, 0.0
        self._reader = self._by_name = None

    def start(self) -> None:
        """Start the threads: the first parses the file, then all check tensors as they are
        handed over."""
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"quantpress-roundtrip-{i}",
                                          daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def written(self, index: int, source: torch.Tensor, raw: np.ndarray | None = None,
                on_device: torch.Tensor | None = None) -> None:
        """Tensor ``tensors[index]`` is on disk; ``source`` is what it was quantized from
        (``raw`` and ``on_device``, :meth:`RoundTripProcessWatch.written`'s, are not used: the
        threads check the file against the source)."""
        self._queue.put((index, source))

    def _run(self, worker: int) -> None:
        # on a GPU each thread queues its work on a stream of its own, so that its syncs do not
        # wait for the quantization kernels queued by the writer
        own = contextlib.nullcontext()
        if self.device.type == "cuda":
            try:
                own = torch.cuda.stream(torch.cuda.Stream(self.device))
            except RuntimeError:            # no stream of its own: the default stream serves
                pass
        with own, single_threaded_ops(), serial_codecs(), torch.no_grad():
            if worker == 0:
                self._parse()
            self._parsed.wait()
            self._check_all()

    def _timed(self, begin: bool) -> None:
        # seconds during which at least one thread was checking (wall time, not thread time)
        with self._lock:
            now = time.perf_counter()
            if begin:
                if self._busy == 0:
                    self._busy_since = now
                self._busy += 1
            else:
                self._busy -= 1
                if self._busy == 0:
                    self.rep.seconds += now - self._busy_since

    def _parse(self) -> None:
        self._timed(True)
        try:
            self._reader = GGUFTensorsReader(str(self.path))
            self._by_name = tensor_index(self._reader, self.tensors, self.rep)
        except Exception as e:  # gguf-py cannot parse what was written: the round trip fails
            self.rep.mismatches.append(f"gguf-py cannot read the file ({e})")
            self._reader = None
        finally:
            self._timed(False)
            self._parsed.set()

    def _check_all(self) -> None:
        reader, by_name = self._reader, self._by_name
        while (item := self._queue.get()) is not None:
            if reader is None or self._error is not None:
                continue                        # keep taking what the writer hands over
            self._timed(True)
            index, source = item
            item = None
            try:
                st = self.tensors[index]
                rt = by_name.get(st.name)
                if rt is None:
                    self.rep.mismatches.append(f"{st.name}: missing from the file")
                else:
                    check_tensor(rt, st, self.types[st.name], source, self.device, self.rep)
                    drop_pages(reader, rt)
                    self._checked.add(st.name)
            except BaseException as e:  # reported by finish()
                self._error = e
            finally:
                del source
                self._timed(False)

    def stop(self) -> None:
        """End the threads (after the last checks they were handed); idempotent."""
        alive = [t for t in self._threads if t.is_alive()]
        for _ in alive:
            self._queue.put(None)
        for t in alive:
            t.join()
        self._threads = []

    def finish(self) -> RoundTrip:
        """Wait for the checks, then check the file's size and that every planned tensor was
        checked; returns the :class:`RoundTrip`. Re-raises an error of the thread."""
        self.stop()
        if self._error is not None:
            raise self._error
        return conclude(self.rep, self.path, self.size, self.tensors, self._checked)


# ---------------------------------------------------------------- checks in processes

#: most checkers (processes, or threads where no process can be started) of one file's round
#: trip when quantizing off the CPU
VERIFY_WORKERS = 8
#: False: round trips beside the writing run in threads (:class:`RoundTripWatch`) even where
#: processes can be started
USE_PROCESSES = True


def checkers_for(device: torch.device) -> int:
    """Checkers of one file's round trip when quantizing on ``device``: one on the CPU (the
    codecs use the other cores), else up to :data:`VERIFY_WORKERS` of the idle cores (all
    but one), since gguf-py's dequantization runs on the CPU and would hold back a GPU's
    writing."""
    return 1 if device.type == "cpu" else min(VERIFY_WORKERS, checker_limit())


#: whether the writer computes our half of the round trip (our dequantization, the error against
#: the source) where it quantizes and hands the checker processes only checksums
#: (:class:`RoundTripProcessWatch`'s ``figures_on``): None, off the CPU (whose cores are the
#: checkers'; on the CPU the writer's cores are the codecs'); True / False, on every device /
#: on none
FIGURES_ON_WRITER: bool | None = None


def figures_on_writer(device: torch.device) -> torch.device | None:
    """The device on which the writer computes our half of the round trip
    (:data:`FIGURES_ON_WRITER`): ``device``, or None (the checkers compute it)."""
    on = device.type != "cpu" if FIGURES_ON_WRITER is None else FIGURES_ON_WRITER
    return device if on else None

def cores_taken(watches: list) -> int:
    """The cores these watches' checker processes take (their ``checkers``: empty for a
    :class:`RoundTripWatch`, whose checks run in threads), which the writer's torch ops on the
    CPU may leave them (:func:`quantpress.convert.gguf_file.write_gguf_many`). Watches of
    several files may share checkers (counted once)."""
    return len({id(c) for w in watches for c in w.checkers})


def checker_processes_usable() -> bool:
    """Whether round trips may run in checker processes: :data:`USE_PROCESSES` and this
    process is not daemonic (:mod:`multiprocessing` forbids a daemonic process children; the
    batch's side lane is one)."""
    return USE_PROCESSES and can_fork_workers()


def start_checkers(device: torch.device) -> None:
    """Start, ahead of a GGUF write on ``device``, the checker processes its round trip will
    use (:func:`checkers_for`): forked from this process while it is still small, their
    start overlapping the work before the write. A
    no-op where they cannot run (:func:`checker_processes_usable`, or a process cannot be
    started: the round trip then runs in threads)."""
    if checker_processes_usable():
        try:
            checker_processes(checkers_for(device))
        except OSError:
            pass


@dataclass
class _Parts:
    # a tensor's checks handed over and not yet all answered (RoundTripProcessWatch)
    count: int                              # parts handed over
    left: int                               # parts not answered
    results: dict = field(default_factory=dict)     # r0 -> the checker's result
    found: bool = True                      # every part found the tensor in the file
    figures: list | None = None             # the writer's figures (writer_figures), if it made them


class RoundTripProcessWatch:
    """:class:`RoundTripWatch`'s checks (the same interface, the same checks of
    :func:`verify_gguf`, the same :class:`RoundTrip`) run in ``workers`` checker processes of
    ``pool`` (:class:`CheckerProcesses`) instead of threads: they neither hold back the
    quantization in this process nor each other. Each process parses the file as soon as it
    is announced (:meth:`start`). :meth:`written` copies the source tensor into checkers'
    staging areas (:data:`STAGING_BYTES`) and hands it over, a large one in parts of rows
    (:func:`check_parts`) that several checkers take side by side; the tensor's report is
    made from its parts' figures in row order, so it is the one a single check makes. Our
    dequantization runs on the checker's CPU, whatever the writer's device (the codecs' bytes
    and values are the same on every device: ``scripts/gpu_checks.py``).

    With ``figures_on`` (a device: :func:`figures_on_writer`) the writer computes our half
    itself, there (:func:`writer_figures`: our dequantization of the bytes it wrote, the error
    against the source, :func:`row_checksums` of our values), and hands the checkers only the
    checksums (:class:`RowChecksums`): each re-reads its rows from the file, dequantizes them
    with gguf-py and compares their checksums; a row that differs fails the round trip as
    values that differ do. The checkers then do gguf-py's half alone and no source is copied.
    ``seconds``: the wall time during which any checker was checking this file."""

    def __init__(self, path: Path, tensors: list[SourceTensor], types: dict[str, str],
                 size: int, pool: CheckerProcesses, workers: int = 1,
                 figures_on: torch.device | None = None):
        self.path, self.tensors, self.types, self.size = Path(path), tensors, types, size
        self.pool, self.workers, self.figures_on = pool, max(1, workers), figures_on
        self.rep = RoundTrip()
        self.key, self.pending, self.checkers = 0, 0, []
        self.error: BaseException | None = None
        self._checked: set[str] = set()
        self._spans: list[tuple[float, float]] = []
        self._pids: set[int] = set()
        self._parts: dict[int, _Parts] = {}

    def start(self) -> None:
        """Announce the file to the checkers (each parses it at once)."""
        self.checkers = self.pool.open(self, self.workers)

    def written(self, index: int, source: torch.Tensor, raw: np.ndarray | None = None,
                on_device: torch.Tensor | None = None) -> None:
        """Tensor ``tensors[index]`` is on disk; ``source`` is what it was quantized from (CPU),
        ``raw`` the bytes written (uint8 [rows, row_bytes]; used with ``figures_on``, there
        from ``on_device``, the source's copy on that device, when given). Raises the error of
        an earlier check (a checker died or raised)."""
        if self.error is not None:
            raise self.error
        st = self.tensors[index]
        rows, cols = st.numel // st.shape[-1], st.shape[-1]
        parts = list(check_parts(rows, cols))
        self._parts[index] = _Parts(len(parts), len(parts))
        if self.figures_on is not None:
            self._parts[index].figures, sums = writer_figures(
                raw, self.types[st.name], source if on_device is None else on_device, self.figures_on)
            for r0, r1 in parts:
                self.pool.submit(self, index, (r0, r1), RowChecksums(sums[r0:r1]))
            return
        source = source.detach().reshape(rows, cols)
        for r0, r1 in parts:
            self.pool.submit(self, index, (r0, r1), source[r0:r1])

    def answered(self, index: int, r0: int, result: tuple | None, mismatches: list[str], found: bool,
                 spans: list[tuple[float, float]], error: BaseException | None, pid: int) -> None:
        """A checker's answer for the part of tensor ``index`` from row ``r0``
        (:func:`serve_checks`); the tensor's report once all of its parts are answered."""
        self.pending -= 1
        self.rep.mismatches.extend(m for m in mismatches if m not in self.rep.mismatches)
        part = self._parts[index]
        part.left -= 1
        part.found = part.found and found
        if result is not None:
            part.results[r0] = result
        if part.left == 0:
            del self._parts[index]
            st, results = self.tensors[index], [part.results[r] for r in sorted(part.results)]
            if part.found:
                self._checked.add(st.name)
            if len(results) == part.count:      # (else a mismatch or an error says why)
                tname, n_bytes, _ = results[0]
                if part.figures is None:
                    tensor_report(st, tname, n_bytes, [f for *_, fs in results for f in fs], self.rep)
                else:                           # the rows whose checksums differ, then the writer's sums
                    rows = sum(r[2] for r in results)
                    tensor_report(st, tname, n_bytes, [(rows, 0.0, 0.0, 0.0)] + part.figures, self.rep,
                                   unit="rows")
        if error is not None and self.error is None:
            self.error = error
        self._spans.extend(spans)
        self._pids.add(pid)
        self.rep.checker_processes = len(self._pids)

    def stop(self) -> None:
        """Wait for the checks handed over, then have the checkers forget the file; idempotent."""
        if self.checkers:
            try:
                self.pool.wait(self)
            finally:
                self.pool.forget(self)
                self.checkers = []

    def finish(self) -> RoundTrip:
        """Wait for the checks, then check the file's size and that every planned tensor was
        checked; returns the :class:`RoundTrip`. Raises what a check raised, or RuntimeError
        when a checker process died."""
        self.stop()
        if self.error is not None:
            raise self.error
        busy, end = 0.0, -math.inf
        for t0, t1 in sorted(self._spans):
            busy += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
        self.rep.seconds = busy
        return conclude(self.rep, self.path, self.size, self.tensors, self._checked)


def watch_round_trip(path: Path, tensors: list[SourceTensor], types: dict[str, str],
                     device: torch.device, size: int) -> RoundTripWatch | RoundTripProcessWatch:
    """The round trip beside the writing of ``path`` (not started): a
    :class:`RoundTripProcessWatch` on :func:`checkers_for` ``(device)`` checker processes, or
    where none can be started (:func:`checker_processes_usable`, OSError) a
    :class:`RoundTripWatch` with as many threads."""
    n = checkers_for(device)
    if checker_processes_usable():
        try:
            return RoundTripProcessWatch(path, tensors, types, size, checker_processes(n), n,
                                         figures_on_writer(device))
        except OSError:
            pass
    return RoundTripWatch(path, tensors, types, device, size, n)
