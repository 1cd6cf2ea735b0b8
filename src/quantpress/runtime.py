"""Process-level settings every layer shares: the compute device and dtype by name, the
rows of one forward batch, glibc's heap (mmap threshold, trimming), and what a worker
process needs (dying with its parent, sending its errors back, a memory area shared with
the process that forks it).

Nothing here imports any other part of quantpress but :mod:`quantpress.errors`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import multiprocessing
import os
import pickle
import re
import signal
import sys

import torch

from quantpress.errors import InputError

#: compute dtypes by name (``--dtype``)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: tokens per forward batch unless ``--batch-tokens`` says otherwise
DEFAULT_BATCH_TOKENS = 4096

_DEVICE_NAME = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(name: str | None) -> None:
    """Validate a ``--device`` value without creating anything: ``auto``, ``cpu``, ``cuda`` or
    ``cuda:N``, and for CUDA a machine where torch sees a GPU (and GPU N exists). Raises
    InputError naming the option and what was expected."""
    if name is None or name == "auto":
        return
    if not isinstance(name, str) or not _DEVICE_NAME.match(name):
        raise InputError(f"--device {name}: expected auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"--device {name}: CUDA is not available on this machine "
                             f"(torch {torch.__version__} sees no GPU); use --device cpu")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise InputError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")


def pick_device(name: str | None = "auto") -> torch.device:
    """``auto`` (or None) → the first CUDA device when torch sees one, else the CPU; otherwise
    the named device after :func:`check_device` (InputError for a bad name or a missing GPU)."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(name)
    return torch.device(name)


def pick_dtype(name: str | None) -> torch.dtype:
    """Compute dtype by name (None/"auto" → float32: statistics and KL want full precision).
    Raises InputError for a name not in :data:`DTYPES`."""
    if name in (None, "auto"):
        return torch.float32
    if name not in DTYPES:
        raise InputError(f"--dtype {name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def rows_per_batch(batch_tokens: int, seqlen: int) -> int:
    """Rows of ``seqlen`` tokens in one forward batch of at most ``batch_tokens`` tokens (at
    least one row). Raises InputError when ``batch_tokens`` is not positive."""
    if not isinstance(batch_tokens, int) or batch_tokens < 1:
        raise InputError(f"--batch-tokens {batch_tokens}: must be a positive number of tokens")
    return max(1, batch_tokens // max(1, int(seqlen)))


# --------------------------------------------------------------------------------------------
# glibc's heap

_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


#: glibc mallopt parameter numbers (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: blocks from this size up are mmapped and returned to the system when freed (bytes)
MMAP_THRESHOLD = 64 << 20
#: free memory at the top of the heap that free() leaves in place (bytes); :func:`trim_heap`
#: returns it between layers
TRIM_THRESHOLD = 1 << 30


def bound_heap() -> bool:
    """Fix glibc's heap policy for a streamed pass (``mallopt``; a no-op elsewhere): blocks of
    :data:`MMAP_THRESHOLD` and more are their own mappings, returned when freed; smaller ones
    live on the heap, and free() gives the heap's top back only above
    :data:`TRIM_THRESHOLD`, so the temporaries of one step are reused by the next instead of
    being unmapped and faulted in again; :func:`trim_heap` returns the heap at the end of
    each layer. Returns True when both were set.

    Measured with ``quantize awq`` of SmolLM2-135M, w4 g64, 8 x 128 calibration tokens, 2
    cores (``/usr/bin/time``): glibc's defaults (a sliding mmap threshold, and a trim
    threshold of twice it) or an 8 MiB threshold with a trim after every step spent 33 s of
    a 90 s run in the kernel (9.7 million page faults); 64 MiB and 1 GiB with one trim per
    layer: 1 s, 0.16 million faults, 15% less wall time, peak RSS 987 MiB instead of 903.
    (``scripts/bench_awq.py --sizes 8x128`` prints system time and page faults.)
    The environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set
    the same and win when given."""
    lib = _libc()
    if lib is None:
        return False
    ok = True
    for env, param, value in (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                              ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if os.environ.get(env):
            ok = False
        else:
            ok = bool(lib.mallopt(param, value)) and ok
    return ok


#: growth of the anonymous RSS since the last trim below which :func:`trim_heap` leaves the
#: freed heap in place (bytes): returning it would only fault it in again at the next layer
TRIM_KEEP = 256 << 20
_LAST_TRIM: list[int] = []


def _proc_kib(path: str, key: str) -> int | None:
    """The ``key:  N kB`` line of a /proc file, in bytes (None without the file or the line)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def anon_rss() -> int | None:
    """The process's anonymous resident memory (``RssAnon`` of /proc/self/status, bytes; None
    where there is no such file)."""
    return _proc_kib("/proc/self/status", "RssAnon")


def available_memory() -> int | None:
    """Memory the system can give without swapping (``MemAvailable`` of /proc/meminfo, bytes;
    None where there is no such file)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def trim_heap(*_args, force: bool = False) -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Usable as the calibration engine's ``on_layer`` callback: the engine frees a layer's
    weights and temporaries at every step, but glibc keeps freed blocks below the mmap
    threshold on its heap (:func:`bound_heap` lets it keep up to 1 GiB at the top), so RSS
    would climb layer after layer although the live memory does not
    (scripts/bench_calibration.py measures it). Trims only when the anonymous RSS grew by more
    than :data:`TRIM_KEEP` since the last trim (:func:`anon_rss`; always where that is
    unknown): a layer's temporaries below it are reused by the next layer instead of being
    returned and faulted in again (``quantize gptq`` of SmolLM2, 16 x 256 tokens: 1.4 million
    page faults and 10% of the wall time in the kernel with a trim after every layer;
    ``scripts/bench_gptq.py --vs-llm-compressor`` prints the system time).
    The reference point follows the RSS down (a freed mapping lowers it), so at most
    :data:`TRIM_KEEP` of freed heap stays resident. ``force``: trim whatever the growth.
    Returns None (the engine keeps the layer's outputs)."""
    lib = _libc()
    if lib is None:
        return None
    rss = anon_rss()
    if _LAST_TRIM and rss is not None and rss < _LAST_TRIM[0]:
        _LAST_TRIM[0] = rss
    if force or rss is None or not _LAST_TRIM or rss - _LAST_TRIM[0] > TRIM_KEEP:
        lib.malloc_trim(0)
        after = anon_rss()
        _LAST_TRIM[:] = [] if after is None else [after]
    return None


def die_with_parent() -> None:
    """Have the calling process killed (SIGKILL) when its parent dies, so that a worker
    process does not outlive a killed command (Linux ``prctl(PR_SET_DEATHSIG)``; elsewhere a
    no-op)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def sendable(e: BaseException) -> BaseException:
    """``e`` itself when it pickles (to be sent to another process), else a RuntimeError
    with its type and first line."""
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - any unpicklable exception
        return RuntimeError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")


class SharedArea:
    """An anonymous ``MAP_SHARED`` mapping of ``nbytes`` that a process forked after its
    creation shares with the creator (the forked workers of the GGUF round trip and of the
    codecs), with ``bytes``, a uint8 tensor over it, and :meth:`view`.

    A forked worker touches it and says so before it answers anything (:func:`announce_ready`),
    so that the area's pages exist before the creator copies into them; the creator must not
    write into the area before reading that first answer (:func:`wait_ready`) (the worker's touch would zero what it wrote: a worker slow to
    start, such as one left unscheduled on a busy machine, made the round trip fail on
    zeros, tests/test_gguf_many.py)."""

    def __init__(self, nbytes: int):
        self.size = nbytes
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def touch(self) -> None:
        """Fault in every page (zero-filling the area)."""
        self.bytes.fill_(0)

    def view(self, start: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` lying at byte ``start`` of the area."""
        return self.bytes[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def close(self) -> None:
        """Unmap the area (left mapped while a view of it is still alive)."""
        self.bytes = None
        try:
            self.map.close()
        except BufferError:
            pass


def can_fork_workers() -> bool:
    """Whether this process may start worker processes (:mod:`multiprocessing` forbids a
    daemonic process children; the batch's side lane is one)."""
    return not multiprocessing.current_process().daemon


def announce_ready(conn, area: SharedArea) -> None:
    """In a forked worker: touch ``area`` (:meth:`SharedArea.touch`), then send ``("ready",)``
    over ``conn``; the process that forked it writes nothing into the area before reading it
    (:func:`wait_ready`)."""
    area.touch()
    conn.send(("ready",))


def wait_ready(conn) -> bool:
    """Read a forked worker's ``("ready",)`` (:func:`announce_ready`) from ``conn``: True, or
    False when the worker ended first (its pipe closed)."""
    try:
        return conn.recv() == ("ready",)
    except (EOFError, OSError):
        return False


def fork_worker(target, area: SharedArea, inherited: list, name: str):
    """Fork a daemonic worker process running ``target(conn, area, ends)``: ``conn`` its end
    of a new pipe, ``area`` shared with it, ``ends`` the pipe ends of this process that it
    inherits and must close first (``inherited`` and the other end of its own pipe), so that
    this process's death, however it ends, closes every worker's pipe. Forked, not spawned:
    the worker starts at once as a copy of this process, importing nothing. Returns (the
    process, this process's end of the pipe); OSError when it cannot be started."""
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, area, list(inherited) + [parent]), daemon=True, name=name)
    proc.start()
    child.close()
    return proc, parent


class ForkedCall:
    """``fn(*args)`` computed in a forked process while this one goes on (:func:`fork_call`).

    :meth:`ready` polls without blocking; :meth:`result` waits and returns the value, or
    raises the call's exception: as it was when it survives pickling unchanged (class and
    message), else an :class:`~quantpress.errors.InputError` with its message for bad input,
    a RuntimeError for anything else; a RuntimeError when the process ended without an
    answer (killed, out of memory)."""

    def __init__(self, proc, conn):
        self._proc, self._conn, self._answer = proc, conn, None

    @property
    def pid(self) -> int:
        """The forked process's id."""
        return self._proc.pid

    def ready(self) -> bool:
        """Whether :meth:`result` would return at once."""
        if self._answer is None:
            try:
                if not self._conn.poll():
                    return False
            except (EOFError, OSError):
                pass
            self._receive()
        return True

    def _receive(self) -> None:
        try:
            self._answer = self._conn.recv()
        except (EOFError, OSError):
            self._answer = ("err", RuntimeError(
                f"the forked {self._proc.name} ended without an answer (exit code {self._proc.exitcode})"))
        self._conn.close()
        self._proc.join()

    def close(self) -> None:
        """End the process if it has not answered (its answer is not wanted); idempotent."""
        if self._answer is None:
            self._proc.terminate()
            self._answer = ("err", RuntimeError(f"the forked {self._proc.name} was ended unanswered"))
            self._conn.close()
            self._proc.join()

    def result(self):
        """The call's value (waits for it); its exception is raised here."""
        if self._answer is None:
            self._receive()
        kind, value = self._answer
        if kind == "err":
            raise value
        return value


def _run_call(conn, fn, args) -> None:
    try:
        answer = ("ok", fn(*args))
    except BaseException as e:              # noqa: BLE001 -- every failure goes back
        try:
            same = pickle.loads(pickle.dumps(e))
            ok = type(same) is type(e) and str(same) == str(e)
        except Exception:                   # noqa: BLE001
            ok = False
        if not ok:
            e = (InputError if isinstance(e, InputError) else RuntimeError)(str(e))
        answer = ("err", e)
    conn.send(answer)
    conn.close()


def fork_call(fn, *args, name: str = "quantpress-call") -> ForkedCall:
    """Compute ``fn(*args)`` in a forked daemonic process (a copy of this one: it imports
    nothing it does not need) and return its :class:`ForkedCall`; the value and any exception
    come back pickled through a pipe. For work that holds the interpreter (imports, parsing)
    while this process computes with torch: fork it only while this process runs no other
    thread. OSError when the process cannot be started (also in a daemonic process, which
    :mod:`multiprocessing` does not let have children)."""
    if multiprocessing.current_process().daemon:
        raise OSError("a daemonic process cannot start one")
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_call, args=(child, fn, args), daemon=True, name=name)
    proc.start()
    child.close()
    return ForkedCall(proc, parent)
