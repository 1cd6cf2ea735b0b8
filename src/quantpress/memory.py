"""glibc's heap policy for streamed passes (mmap threshold, trimming) and the memory figures
read from /proc that decide it (anonymous RSS, available memory).

Nothing here imports any other part of quantpress.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os


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

    ``scripts/bench_awq.py --sizes 8x128`` prints the system time and page faults that
    these settings save (docs/benchmarks.md).
    The environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set
    the same and win when given."""
    # why not glibc's defaults (a sliding mmap threshold, a trim threshold of twice it), or an
    # 8 MiB threshold with a trim after every step: ``quantize awq`` of SmolLM2-135M, w4 g64,
    # 8 x 128 calibration tokens on 2 cores spent much of its wall time in the kernel,
    # faulting in pages freed by the step before; these thresholds with one trim per layer
    # took that to a small fraction (scripts/bench_awq.py; figures in docs/benchmarks.md,
    # "Figures behind the code", ``memory.py``)
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
    returned and faulted in again (``scripts/bench_gptq.py --vs-llm-compressor`` prints the
    system time a trim after every layer costs).
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
