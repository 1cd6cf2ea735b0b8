"""Compute device and dtype by name (``--device``, ``--dtype``) and the rows of one forward
batch (``--batch-tokens``), shared by every layer that runs a model.

Nothing here imports any other part of quantpress but :mod:`quantpress.errors`.
"""
from __future__ import annotations

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
