"""Process-level settings every layer shares: the compute device and dtype by name, the
rows of one forward batch, and glibc's heap (mmap threshold, trimming).

Nothing here imports any other part of quantpress but :mod:`quantpress.errors`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import re

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


#: glibc mallopt parameter number of M_MMAP_THRESHOLD
M_MMAP_THRESHOLD = -3
#: blocks from this size up are mmapped and returned to the system when freed (bytes)
MMAP_THRESHOLD = 8 << 20


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``;
    a no-op elsewhere). Returns True when set.

    By default glibc raises the threshold each time a mapped block is freed, up to 32 MiB;
    after that, the temporaries of a quantization pass (a few MiB to tens of MiB each) live on
    the heap, and the heap keeps what they free: on the 554M llama of scripts/bench_awq.py
    the layer pass then added 866 MiB of anonymous RSS instead of 360 with a 1 MiB threshold
    (which costs ~30% more time in page faults; both reproduced by running the script with
    ``MALLOC_MMAP_THRESHOLD_=1048576``, which this function leaves alone). With a fixed
    threshold, every tensor from 8 MiB up is its own mapping, returned when freed; smaller
    ones reuse the heap, which :func:`trim_heap` returns between steps (the environment
    variable ``MALLOC_MMAP_THRESHOLD_`` sets the same, and wins when given)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    lib = _libc()
    return bool(lib is not None and lib.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim_heap(*_args) -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Usable as the calibration engine's ``on_layer`` callback: the engine frees a layer's
    weights and temporaries at every step, but glibc keeps tensors of a few MiB on its heap
    once its dynamic mmap threshold has grown, and RSS then climbs layer after layer although
    the live memory does not (scripts/bench_calibration.py measures it). Returns None (the
    engine keeps the layer's outputs)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
    return None
