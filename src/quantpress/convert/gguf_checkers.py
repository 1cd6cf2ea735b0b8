"""Checker processes of GGUF round trips (:class:`CheckerProcesses`): forked workers of
:mod:`quantpress.workers`, each with a staging area of shared memory through which the writer
hands it the sources of the tensors it has written (:class:`StagingArea`), each parsing the
file once and answering the checks of :mod:`quantpress.convert.gguf_checks` for the parts of
tensors it is handed (:func:`serve_checks`). :class:`quantpress.convert.gguf_roundtrip.RoundTripProcessWatch`
is the writer's side of one file."""
from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import os
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensors' memory

from quantpress.convert.gguf_checks import (RoundTrip, RowChecksums, SourceTensor, chunk_figures, layout_mismatch,
                                            rows_differing, tensor_index)
from quantpress.convert.gguf_reading import GGUFTensorsReader, drop_pages
from quantpress.workers import SharedArea, Worker, announce_ready, sendable, start_worker, wait_ready


#: bytes of the staging areas of several checkers started together (off the CPU), split evenly
#: among them (each at least a quarter of it: a GPU box's eight checkers then hold two of a 554M
#: model's float32 feed-forward matrices each); a checker started alone (the CPU's one) has
#: :data:`SOLE_STAGING_BYTES`. Each checker process has one: shared memory that it and this
#: process map (inherited when it is forked), through which the writer hands it its source
#: tensors: one copy into pages that stay once the first copies made them, not a new
#: shared-memory segment per tensor (whose fresh pages each source would fault in). It is also the
#: backlog: the writer waits while no checker's area can hold the next source. Checks cost
#: unlike their quantization. A larger source goes alone, in shared memory of its own, at most
#: one per checker at a time. (An area shared by several checkers would free its room in
#: order, so a slow check would hold back the room of the checks after it.)
STAGING_BYTES = 1 << 28
#: bytes of the staging area of a checker started alone (the CPU's one checker,
#: :func:`~quantpress.convert.gguf_roundtrip.checkers_for`). Once the writer's copies have
#: gone round it, the area is memory of the process tree for the rest of the conversion:
#: 64 MiB rather than 256 lowered SmolLM2's Q4_K_M peak by about 180 MiB, at no measured cost
#: in time since the checks no longer wait for a slow parse of the file (figures and commands
#: in docs/benchmarks.md, "Where the peak goes" and "Figures behind the code",
#: ``convert/gguf_roundtrip.py``).
SOLE_STAGING_BYTES = 1 << 26


def checker_limit() -> int:
    """Most checker processes that files written side by side get together: all cores but
    one (at least one each, :func:`~quantpress.convert.gguf_roundtrip.checkers_for`)."""
    return max(1, (os.cpu_count() or 2) - 1)


class StagingArea(SharedArea):
    """A checker's staging area (:data:`STAGING_BYTES`): a :class:`SharedArea` used as a ring
    of byte ranges handed out in order and reclaimed from the oldest as their checks are
    answered."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self._live: collections.deque = collections.deque()    # [start, end, answered]
        self._head = 0

    def take(self, nbytes: int) -> list | None:
        """A range of ``nbytes`` (rounded up to 64) as ``[start, end, answered]``, or None
        while the area cannot hold it."""
        n = -(-nbytes // 64) * 64
        if not self._live:
            self._head = 0
        tail = self._live[0][0] if self._live else 0
        if not self._live or self._head > tail:     # free: [head, size) and [0, tail)
            start = self._head if self._head + n <= self.size else (0 if n <= tail else None)
        elif self._head < tail:                     # free: [head, tail)
            start = self._head if self._head + n <= tail else None
        else:                                       # full
            start = None
        if start is None or n > self.size:
            return None
        entry = [start, start + n, False]
        self._live.append(entry)
        self._head = start + n
        return entry

    def give_back(self, entry: list) -> None:
        """The check of ``entry``'s source was answered."""
        entry[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()


def serve_checks(conn, staging: StagingArea) -> None:
    """A checker process's loop (:func:`quantpress.workers.start_worker`, which closed the
    pipe ends of its siblings): answers ``("ready",)`` (the writer copies nothing into
    ``staging`` before), leaving the area's pages to the writer's first copies. Requests: ``("open", key, path, [(name, shape)], types)``
    (a file to check, whose header is on disk: parsed at once), ``("check", key, index, (r0,
    r1), source)`` (rows ``[r0, r1)`` of tensor ``index``, a part of :func:`check_parts`;
    ``source``: those rows of its source, a CPU float tensor in shared memory, or ``(start,
    dtype, shape)``: where they lie in ``staging``; or the writer's :class:`RowChecksums` of
    those rows) and ``("close", key)`` (forget the file, unmapping it). Each check is answered
    ``("checked", key, index, r0, result, mismatches, found, spans, error, pid)``: ``(ggml
    type, bytes in the file, the chunks' figures of :func:`chunk_figures`)``, or for
    checksums ``(ggml type, bytes, rows whose checksums differ)``, or None (the tensor's
    layout is not as planned, or it is not in the file: ``mismatches`` says which), whether
    the tensor was in the file, the check's (t0, t1) span in ``time.monotonic`` seconds (the
    first check of a file also the parse's), the exception it raised (or None) and the
    process id. Ends when the pipe closes (the writer's exit, however it ends, closes it) or
    with the writer (:mod:`quantpress.workers`' shutdown)."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    # the area is left untouched: its pages come as the writer first copies sources into it,
    # after the header, and not while the metadata is computed beside the first tensors (then
    # the process tree's peak: docs/benchmarks.md, "Where the peak goes")
    if not announce_ready(conn, staging, touch=False):
        return
    files: dict[int, dict] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        kind, key = request[0], request[1]
        if kind == "open":
            _, _, path, plan, types = request
            f = files[key] = {"tensors": [SourceTensor(n, tuple(s), None) for n, s in plan], "types": types,
                              "reader": None, "mismatches": []}
            t0 = time.monotonic()
            try:
                f["reader"] = GGUFTensorsReader(path)
                f["by_name"] = tensor_index(f["reader"], f["tensors"], rep := RoundTrip())
                f["mismatches"] = rep.mismatches
            except Exception as e:  # gguf-py cannot parse what was written: the round trip fails
                f["mismatches"] = [f"gguf-py cannot read the file ({e})"]
            f["parse"] = (t0, time.monotonic())
            continue
        if kind == "close":
            files.pop(key, None)
            continue
        _, _, index, (r0, r1), source = request
        request = None
        if isinstance(source, tuple):
            source = staging.view(*source)
        t0 = time.monotonic()
        mismatches, result, found, error, spans = [], None, False, None, []
        try:
            f = files[key]
            spans = [f.pop("parse")] if "parse" in f else []
            mismatches.extend(f["mismatches"])
            if f["reader"] is not None:
                st = f["tensors"][index]
                rt = f["by_name"].get(st.name)
                if rt is None:
                    mismatches.append(f"{st.name}: missing from the file")
                else:
                    found = True
                    planned = f["types"][st.name]
                    bad = layout_mismatch(rt, st, planned)
                    if bad is not None:
                        mismatches.append(bad)
                    elif isinstance(source, RowChecksums):
                        result = (planned, int(rt.n_bytes), rows_differing(rt, source.sums, r0, r1))
                    else:
                        with torch.no_grad():
                            figures = chunk_figures(rt, source.reshape(r1 - r0, -1), r0, r1, cpu)
                        result = (planned, int(rt.n_bytes), figures)
                    drop_pages(f["reader"], rt, (r0, r1))
        except Exception as e:  # noqa: BLE001 - the check's failure, sent back
            error, found = sendable(e), False
        del source
        spans.append((t0, time.monotonic()))
        conn.send(("checked", key, index, r0, result, mismatches, found, spans, error, os.getpid()))


@dataclass
class _Checker:
    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    staging: StagingArea
    pending: list = field(default_factory=list)    # (watch, staging range / None / False) per check waiting
    ready: bool = False                             # its ("ready",) was read: its area may be written
    worker: Worker | None = None                    # the pool's handle (proc and conn are its)


class CheckerProcesses:
    """Checker processes (forked, one torch thread each, ending when this process closes their
    pipes or dies) shared by every :class:`~quantpress.convert.gguf_roundtrip.RoundTripProcessWatch` of this process. Forked, not spawned: a checker
    starts at once as a copy of this process (nothing to import, nothing of the caller's
    main module to run again) and uses no GPU; they are forked early, when a GGUF target is
    prepared (:func:`~quantpress.convert.gguf_roundtrip.start_checkers`), and kept. Each check goes to the watch's checker
    with the fewest checks waiting whose staging area (:data:`STAGING_BYTES`) can hold its
    source, copied there; the writer waits while none can. Answers are taken in whenever the
    writer hands over a check or waits. A checker that dies fails the watches that were waiting on it (RuntimeError with
    its exit code), not the others; the next watch starts a new one."""

    def __init__(self):
        self._checkers: list[_Checker] = []
        self._keys = 0
        self._open: dict[int, object] = {}      # watches started, not stopped

    def grow(self, n: int) -> None:
        """Have at least ``n`` live checkers (forking the missing ones, each with its staging
        area). Raises OSError when a process cannot be started."""
        self._checkers = [c for c in self._checkers if c.proc.is_alive() or c.pending]
        while len(self._checkers) < n:
            size = SOLE_STAGING_BYTES if n == 1 else max(64, STAGING_BYTES // n, STAGING_BYTES // 4)
            staging = StagingArea(size)
            w = start_worker(serve_checks, (staging,), f"quantpress-check-{len(self._checkers)}")
            self._checkers.append(_Checker(w.proc, w.conn, staging, worker=w))

    def open(self, watch, n: int) -> list[_Checker]:
        """Give ``watch`` a key and announce its file to ``n`` checkers, those serving the
        fewest open files (files written side by side get checkers of their own, up to
        :func:`checker_limit` in all); returns them."""
        serving = {id(c): 0 for c in self._checkers}
        for other in self._open.values():
            for c in other.checkers:
                if id(c) in serving:
                    serving[id(c)] += 1
        free = sum(1 for v in serving.values() if v == 0)
        self.grow(min(max(n, checker_limit()), len(self._checkers) + max(0, n - free)))
        self._keys += 1
        watch.key = self._keys
        self._open[watch.key] = watch
        plan = [(st.name, tuple(st.shape)) for st in watch.tensors]
        members = sorted(self._checkers, key=lambda c: serving.get(id(c), 0))[:n]
        for c in members:
            self._send(c, ("open", watch.key, str(watch.path), plan, watch.types))
        return [c for c in members if c in self._checkers]

    def submit(self, watch, index: int, rows: tuple[int, int],
               source: torch.Tensor) -> None:
        """Hand rows ``[r0, r1)`` of ``watch``'s tensor ``index`` and their source to the one
        of its checkers with the fewest checks waiting that can take it: copied into that
        checker's staging area, or if larger than the area, alone in shared memory of its
        own, at most one such waiting per checker; :class:`RowChecksums` in the request
        itself. Waits (taking answers in) while none can."""
        self._take(0)
        sums = isinstance(source, RowChecksums)
        if not sums:
            source = source.detach()
            nbytes = source.numel() * source.element_size()
        while True:
            live = [c for c in watch.checkers if c in self._checkers]
            if not live:
                raise watch.error or RuntimeError(f"round trip of {watch.path.name}: its checker "
                                                  f"processes died")
            for c in sorted(live, key=lambda c: len(c.pending)):
                if not self._ready(c):
                    break               # that checker is gone: look again
                if sums:
                    entry, request = False, source      # (in the request itself: nothing held)
                elif nbytes > c.staging.size:
                    if any(entry is None for _, entry in c.pending):
                        continue
                    entry, request = None, _own_shared_memory(source)
                else:
                    entry = c.staging.take(nbytes)
                    if entry is None:
                        continue
                    request = (entry[0], source.dtype, tuple(source.shape))
                    c.staging.view(*request).copy_(source)
                if self._send(c, ("check", watch.key, index, rows, request)):
                    c.pending.append((watch, entry))
                    watch.pending += 1
                    return
                break                   # that checker is gone: look again
            else:
                self._take(None)

    def wait(self, watch) -> None:
        """Take in answers until every check of ``watch`` is answered (or its checkers died)."""
        while watch.pending > 0:
            self._take(None)

    def forget(self, watch) -> None:
        """Have ``watch``'s checkers forget its file (unmapping it)."""
        self._open.pop(watch.key, None)
        for c in watch.checkers:
            if c in self._checkers:
                self._send(c, ("close", watch.key))

    def pids(self) -> list[int]:
        """Process ids of the live checkers."""
        return [c.proc.pid for c in self._checkers if c.proc.is_alive()]

    def close(self) -> None:
        """End the checkers (each at its next request, or killed after 5 s) and unmap their
        staging areas; the object is unusable afterwards."""
        for c in self._checkers:
            c.worker.forget()
        for c in self._checkers:
            c.worker.close()
        for c in self._checkers:
            c.staging.close()
        self._checkers = []

    def _ready(self, c: _Checker) -> bool:
        # wait for the checker's ("ready",): its staging area may be written from then on;
        # False when it died first (buried)
        if not c.ready:
            c.ready = wait_ready(c.conn)
            if not c.ready:
                self._bury(c)
        return c.ready

    def _send(self, c: _Checker, request: tuple) -> bool:
        # False when the checker is gone (buried)
        try:
            c.conn.send(request)
            return True
        except OSError:
            self._bury(c)
            return False

    def _bury(self, c: _Checker) -> None:
        # a checker died: fail the watches waiting on it, forget it
        c.proc.join(5)
        dead = RuntimeError(f"round trip: checker process {c.proc.name} died (exit code "
                            f"{c.proc.exitcode}) with {len(c.pending)} checks unanswered")
        for watch, entry in c.pending:
            watch.pending -= 1
            watch.error = watch.error or dead
            if entry:
                c.staging.give_back(entry)
        c.pending = []
        if c in self._checkers:
            self._checkers.remove(c)
        c.worker.forget()
        c.staging.close()

    def _take(self, timeout: float | None) -> None:
        # receive what the checkers answered (waiting up to ``timeout`` for one, None: until one
        # answers or dies); a dead checker fails the watches waiting on it
        busy = [c for c in self._checkers if c.pending]
        if not busy:
            return
        ready = multiprocessing.connection.wait([c.conn for c in busy], timeout)
        for c in busy:
            if c.conn not in ready:
                continue
            try:
                while c.pending and c.conn.poll():
                    _, key, index, r0, result, mismatches, found, spans, error, pid = c.conn.recv()
                    watch, entry = c.pending.pop(0)
                    if entry:                   # (None: shared memory of its own; False: nothing held)
                        c.staging.give_back(entry)
                    watch.answered(index, r0, result, mismatches, found, spans, error, pid)
            except (EOFError, OSError):
                self._bury(c)


_PROCESSES: CheckerProcesses | None = None


def checker_processes(n: int) -> CheckerProcesses:
    """This process's :class:`CheckerProcesses`, grown to ``n`` live checkers. OSError when
    a process cannot be started."""
    global _PROCESSES
    if _PROCESSES is None:
        _PROCESSES = CheckerProcesses()
    _PROCESSES.grow(n)
    return _PROCESSES


def close_checkers() -> None:
    """End this process's checker processes, if any (the next round trip starts new ones,
    with the :data:`STAGING_BYTES` then in force)."""
    global _PROCESSES
    if _PROCESSES is not None:
        _PROCESSES.close()
        _PROCESSES = None


def _own_shared_memory(t: torch.Tensor) -> torch.Tensor:
    # a CPU tensor owning exactly its storage, which sending moves into shared memory (a
    # view would share the whole storage it is cut from)
    t = t.cpu()
    if (not t.is_contiguous() or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    return t
