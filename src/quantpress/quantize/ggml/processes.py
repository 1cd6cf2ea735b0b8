"""Codec processes: forked workers that run the CPU slices of the search-based block codecs
(K-quants, i-quants) beside the calling thread, without sharing its GIL.

The codecs are thousands of small torch ops per slice, and each op's dispatch holds the GIL,
so two threads of one process gain less than a thread and a process
(``scripts/micro_figures.py --lanes 1,2`` compares them). :func:`start_codec_processes` forks the workers (a GGUF
target calls it once its plan is made, where its codecs keep every core); :func:`map_slices` then
deals a codec's slices to the calling thread, which takes them from the end of the tensor,
and to the workers, which a feeder thread serves from the front as their answers come. Each
worker has a shared area (``workers.SharedArea``, which the worker touches and then answers
``("ready",)``, before anything is copied into it) of two slots: a slice's tensors are copied into a free slot, the worker
runs the codec there and writes the result back into the slot after them. A worker has a
second slice waiting while many remain, one near the end (so that the lanes finish together).

The codecs are the plain functions of ``quantize.ggml``, found again in the worker by module
and name (as the fork left them); every block is quantized on its own, so the bytes do not
depend on which process quantized which slice. A codec's exception in a worker is raised in
the caller with the worker's traceback in its ``__cause__``; a worker that dies fails the call
with RuntimeError naming it (the next GGUF target forks a new one). The workers are
:mod:`quantpress.workers`' (its protocol, shared areas and shutdown: they end when this
process closes their pipes, exits or is killed, or receives SIGINT or SIGTERM).

This module builds on :mod:`.common` and registers :func:`map_slices` there at its import
(``common.use_codec_processes``), so that the codecs reach the workers without importing
this module.
"""
from __future__ import annotations

import collections
import math
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading

import torch

from quantpress.workers import SharedArea, Worker, announce_ready, can_fork_workers, sendable, start_worker, wait_ready

from . import common

# Why processes: on two cores, two threads of one process quantize Q4_K only modestly faster
# than one thread (and spend more CPU time), the calling thread and one codec process clearly
# faster than both (figures and the command in docs/benchmarks.md, "Figures behind the code",
# ``quantize/ggml/processes.py``)

#: False: never use codec processes (the codecs then share slices over threads only)
USE_PROCESSES = True
#: bytes of each worker's shared area (two slots): a slice's input and result must fit in
#: one slot (a slice's 2^18 float32 elements and their importance weights take 2 MiB of the 16)
AREA_BYTES = 32 << 20
#: most workers started
MAX_WORKERS = 15


class _Worker:
    def __init__(self, worker: Worker, area: SharedArea):
        self.worker, self.area = worker, area
        self.proc, self.conn = worker.proc, worker.conn
        self.ready = False                  # its ("ready",) was read: its area may be written
        self.slot = AREA_BYTES // 2
        self.free = [0, 1]
        self.pending: collections.deque = collections.deque()    # (slice index, slot)


_lock = threading.Lock()
_workers: list[_Worker] = []
_owner = [0]            # the pid that started them (a fork's copy of the list is not its own)


def _reference(fn) -> tuple[str, str, bool] | None:
    # (module, qualified name, whether fn is that object's __wrapped__), when the worker can find
    # fn again by name; None for closures and other unnamed functions
    obj = sys.modules.get(getattr(fn, "__module__", None) or "")
    for part in getattr(fn, "__qualname__", "<>").split("."):
        obj = getattr(obj, part, None)
    if obj is fn:
        return fn.__module__, fn.__qualname__, False
    if obj is not None and getattr(obj, "__wrapped__", None) is fn:
        return fn.__module__, fn.__qualname__, True
    return None


def _resolve(ref: tuple[str, str, bool]):
    module, name, wrapped = ref
    obj = sys.modules[module]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj.__wrapped__ if wrapped else obj


def _serve(conn, area: SharedArea) -> None:
    """A worker's loop: touches its area, answers ``("ready",)``; then requests: ``(fn reference, args, slot start, slot end)``, ``args`` the
    codec's arguments with each tensor replaced by ``("area", start, dtype, shape)``, the first
    being the codec's input slice, which it is given in float32 when floating
    (``common.map_block_slices`` sends it as it is, e.g. float16). Answers
    ``("area", start, dtype, shape)`` (the result, written into the slot after the inputs),
    ``("value", ndarray)`` (a result larger than what the slot has left) or ``("error", e)``.
    Ends when the pipe closes (:func:`quantpress.workers.start_worker` closed its siblings'
    ends, so this process's death closes it)."""
    torch.set_num_threads(1)
    common.serial_codecs().__enter__()      # a codec calling another runs its slices here
    if not announce_ready(conn, area):
        return
    while True:
        try:
            ref, args, start, end = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = _resolve(ref)
            real = [area.view(*a[1:]) if isinstance(a, tuple) and a[:1] == ("area",) else a
                    for a in args]
            real[0] = common.widened(real[0])       # the input slice, in float32
            with torch.no_grad(), common.quiet_floats():
                out = fn(*real).contiguous()
            at = -(-max(a[1] + math.prod(a[3]) * a[2].itemsize for a in args
                        if isinstance(a, tuple) and a[:1] == ("area",)) // 64) * 64
            n = out.numel() * out.element_size()
            if at + n <= end:
                area.bytes[at:at + n].copy_(out.reshape(-1).view(torch.uint8))
                answer = ("area", at, out.dtype, tuple(out.shape))
            else:
                answer = ("value", out.numpy())
        except BaseException as e:  # noqa: BLE001 - sent back, raised in the caller
            answer = ("error", sendable(e))
        try:
            conn.send(answer)
        except (EOFError, OSError):
            return


def start_codec_processes(n: int | None = None) -> int:
    """Have ``n`` live codec workers (default: torch's thread count less one, at most
    :data:`MAX_WORKERS`), forking the missing ones; returns how many live. Starts none (and
    returns 0) where they cannot run: :data:`USE_PROCESSES` False, a daemonic process
    (:mod:`multiprocessing` forbids it children), or a fork that fails (OSError)."""
    if not USE_PROCESSES or not can_fork_workers():
        return 0
    n = min(MAX_WORKERS, torch.get_num_threads() - 1 if n is None else n)
    with _lock:
        if _owner[0] != os.getpid():
            _workers.clear()
            _owner[0] = os.getpid()
        _workers[:] = [w for w in _workers if w.proc.is_alive()]
        try:
            while len(_workers) < n:
                area = SharedArea(AREA_BYTES)
                _workers.append(_Worker(start_worker(_serve, (area,), f"quantpress-codec-{len(_workers)}"), area))
        except OSError:
            pass
        return len(_workers)


def close_codec_processes() -> None:
    """End the codec workers (each at its next request, or killed after 5 s)."""
    with _lock:
        for w in _workers:
            w.worker.forget()
        for w in _workers:
            w.worker.close()
            w.area.close()
        _workers.clear()


def codec_process_ids() -> list[int]:
    """Process ids of the live codec workers started by this process."""
    return [w.proc.pid for w in _workers if w.proc.is_alive()] if _owner[0] == os.getpid() else []


def _bury(w: _Worker) -> RuntimeError:
    if w in _workers:
        _workers.remove(w)
    error = w.worker.died("codec process")
    w.area.close()
    return error


def map_slices(fn, part, nb: int, per: int, lanes: int, x: torch.Tensor,
               more: tuple) -> list[torch.Tensor] | None:
    """Run a block codec over the ``nb`` rows of ``x`` in slices, on the calling thread and up
    to ``lanes - 1`` codec workers: a slice of ``n`` rows from row ``s`` is
    ``fn(x[s:s + n], *more sliced alike)`` (``part(s, n)`` computes it here), with ``per``
    rows (the last may have fewer). Returns the results in row order, or None when the call
    cannot go to workers (none started by this process, one slice only, another thread using
    them, ``fn`` not findable by name, or a slice that does not fit a slot): the caller then
    shares the slices out itself. Raises what ``fn`` raised (in a
    worker too), RuntimeError when a worker dies."""
    if not _workers or _owner[0] != os.getpid() or lanes < 2:
        return None
    ref = _reference(fn)
    if ref is None:
        return None
    if nb <= per:
        return None
    tensors = [x] + [m for m in more if isinstance(m, torch.Tensor)]
    need = sum(-(-per * (t.numel() // max(1, t.shape[0])) * t.element_size() // 64) * 64 for t in tensors)
    if 2 * need > AREA_BYTES // 2 or not _lock.acquire(blocking=False):
        return None
    try:
        workers = [w for w in _workers if w.proc.is_alive()][:lanes - 1]
        if not workers:
            return None
        return _run(fn, ref, part, [(s, per) for s in range(0, nb, per)], x, more, workers)
    finally:
        _lock.release()


def _run(fn, ref, part, pieces, x, more, workers) -> list[torch.Tensor]:
    # the calling thread takes slices from the end of the list; a feeder thread hands the
    # workers theirs from the front as answers come
    outs: list[torch.Tensor | None] = [None] * len(pieces)
    todo = collections.deque(range(len(pieces)))
    failures: list[BaseException] = []

    def send(w: _Worker) -> None:
        if not w.ready:                     # its area is touched only once it says so
            if not wait_ready(w.conn):
                raise OSError("ended")
            w.ready = True
        try:
            j = todo.popleft()
        except IndexError:
            return
        s, step = pieces[j]
        slot = w.free.pop()
        base = at = slot * w.slot
        args = []
        for a in (x, *more):
            if isinstance(a, torch.Tensor):
                piece = a[s:s + step]
                w.area.view(at, piece.dtype, tuple(piece.shape)).copy_(piece)
                args.append(("area", at, piece.dtype, tuple(piece.shape)))
                at += -(-piece.numel() * piece.element_size() // 64) * 64
            else:
                args.append(a)
        w.pending.append((j, slot))
        w.conn.send((ref, args, base, base + w.slot))

    def receive(w: _Worker) -> None:
        try:
            kind, *answer = w.conn.recv()
        except (EOFError, OSError):
            w.pending.clear()
            failures.append(_bury(w))
            return
        j, slot = w.pending.popleft()
        w.free.append(slot)
        if kind == "area":
            outs[j] = w.area.view(*answer).clone()
        elif kind == "value":
            outs[j] = torch.from_numpy(answer[0])
        else:
            failures.append(answer[0])

    def top_up(w: _Worker) -> None:
        # a second slice waits in the worker (hiding this thread's wake-up, which the GIL
        # can delay by its switch interval) while enough remain for the calling thread
        depth = 2 if len(todo) > 2 * (len(workers) + 1) else 1
        while len(w.pending) < depth and todo and not failures and w in _workers:
            try:
                send(w)
            except OSError:                         # the worker is gone
                w.pending.clear()
                failures.append(_bury(w))

    def feed() -> None:
        # after a failure no more is sent, but every answer still coming is taken in, so that
        # the next call reads only its own
        try:
            torch.set_num_threads(1)
            for w in workers:
                top_up(w)
            while True:
                busy = [w for w in workers if w.pending]
                if not busy:
                    return
                for conn in multiprocessing.connection.wait([w.conn for w in busy]):
                    w = next(w for w in busy if w.conn is conn)
                    receive(w)
                    top_up(w)
        except BaseException as e:  # noqa: BLE001 - raised by the caller
            failures.append(e)
            for w in workers:       # their answers could be read by the next call: end them
                if w in _workers:
                    w.worker.kill()
                    _bury(w)

    feeder = threading.Thread(target=feed, name="quantpress-codec-feeder", daemon=True)
    feeder.start()
    try:
        while not failures:
            try:
                j = todo.pop()
            except IndexError:
                break
            outs[j] = part(*pieces[j])
    finally:
        todo.clear()
        feeder.join()
    if failures:
        raise failures[0]
    return outs


def _slices_here_or_there(*args):
    # common.map_block_slices's way to the codec processes (looked up at each call)
    return map_slices(*args)


common.use_codec_processes(_slices_here_or_there)
