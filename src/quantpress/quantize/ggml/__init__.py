"""Registry of ggml tensor types: block geometry plus vectorized quantize/dequantize.

One :class:`GGMLType` per type, keyed by its ggml name (``"Q4_K"``). Codecs work on whole
tensors at once (all blocks of all rows in one set of torch ops) on the tensor's device,
and reproduce llama.cpp's reference quantizers bit for bit (``ggml/src/ggml-quants.c`` at
llama.cpp 0c1e570, as vendored in llama-cpp-python 0.3.36).

Public API
----------
``quantize(x, name, imatrix=None)``: float tensor [..., n] -> uint8 [..., n // block_size * type_size],
with importance weights ``imatrix`` float32 [n] (one per column, as ``ggml_quantize_chunk``'s
``imatrix`` argument) for the types that use them
``dequantize(raw, name)``: uint8 [..., n_bytes] -> float32 [..., n]
``get(name)``: the :class:`GGMLType` record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGMLQuantizationType

from .common import fdiv

# elements processed per chunk by quantize()/dequantize() off the CPU: bounds the temporaries
# of the search-based K-quants (a handful of float32 copies of the chunk) independently of
# the tensor size. On the CPU the codecs cut their input into cache-sized slices themselves
# (common.map_block_slices), so a tensor is one chunk there (its slices then share out evenly
# over the threads). Whole rows only, so results do not depend on the chunking.
CHUNK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class GGMLType:
    """One ggml type.

    ``block_size`` is elements per block, ``type_size`` bytes per block.
    ``quantize_blocks``: float32 [nb, block_size] -> uint8 [nb, type_size].
    ``dequantize_blocks``: uint8 [nb, type_size] -> float32 [nb, block_size].
    ``quantize_blocks_weighted``: the path ``ggml_quantize_chunk`` takes with an importance
    matrix (``quantize_row_<type>_impl``), or None when the type ignores it (Q8_0, F16 …):
    ``(x float32 [nb, block_size], qw float32 [nb, block_size], row_sigma2 float32 [nb, 1] or
    None) -> uint8 [nb, type_size]``, where ``qw`` holds the imatrix entries of each block's
    columns and ``row_sigma2`` C's ``sum_x2/n_per_row`` of the block's whole row (sequential
    float32 sum, one division; only computed for types with ``weighted_uses_row_sigma2``:
    the legacy types' sigma² is per row, the others' per super-block).
    ``needs_imatrix``: llama.cpp refuses the type without one (the very low-bit i-quants).
    """

    name: str
    block_size: int
    type_size: int
    quantize_blocks: Callable[[torch.Tensor], torch.Tensor]
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]
    quantize_blocks_weighted: Callable[..., torch.Tensor] | None = None
    weighted_uses_row_sigma2: bool = False
    needs_imatrix: bool = False

    @property
    def type_id(self) -> int:
        """ggml_type enum value (``gguf.GGMLQuantizationType``)."""
        return int(GGMLQuantizationType[self.name])

    @property
    def bpw(self) -> float:
        """Bits per weight of the encoding (``8 * type_size / block_size``)."""
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` elements; raises ValueError if n % block_size != 0."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: row length {n} is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size


_REGISTRY: dict[str, GGMLType] = {}


def register(t: GGMLType) -> GGMLType:
    """Add a type to the registry (called by the codec modules at import)."""
    _REGISTRY[t.name] = t
    return t


def get(name: str) -> GGMLType:
    """The :class:`GGMLType` called ``name`` (e.g. ``"Q4_K"``); KeyError names the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown ggml type {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def names() -> list[str]:
    """Names of all registered types."""
    return list(_REGISTRY)


def _rows_per_chunk(n: int, rows: int, device: torch.device) -> int:
    if device.type == "cpu":
        return max(1, rows)
    return max(1, CHUNK_ELEMENTS // max(1, n))


def row_sigma2(rows: torch.Tensor) -> torch.Tensor:
    """C's ``sum_x2 = 0; for (j = 0; j < n_per_row; ++j) sum_x2 += x[j]*x[j];
    sigma2 = sum_x2/n_per_row;`` per row (``quantize_row_q4_0_impl`` …): float32 [r, n] ->
    float32 [r, 1], sequential with one rounding per step."""
    sq = (rows * rows).t().contiguous()        # positions first: each step one contiguous row
    acc = sq[0].clone()
    for j in range(1, sq.shape[0]):
        acc.add_(sq[j])
    return fdiv(acc, float(rows.shape[1])).unsqueeze(1)


def quantize(x: torch.Tensor, name: str, imatrix: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``x`` (any float dtype, [..., n]) row-wise to ggml type ``name``.

    Computation is float32 on ``x.device``. Returns uint8 [..., n // block_size * type_size]
    with the bytes of llama.cpp's ``ggml_quantize_chunk(type, x, ..., imatrix)``: without
    ``imatrix`` the ``quantize_row_<type>_ref`` path (IQ4_NL / IQ4_XS: ``quantize_iq4_nl`` /
    ``quantize_iq4_xs`` with weights x², the ``ntry = 7`` search); with ``imatrix`` (float32 [n], the
    importance of each column, e.g. one tensor's entry of an imatrix file) the
    ``quantize_row_<type>_impl`` path of the types that use it (ignored by the others, as
    llama.cpp ignores it). Raises ValueError when n is not a multiple of the block size or
    ``imatrix`` is not [n].
    """
    t = get(name)
    n = x.shape[-1]
    rb = t.row_bytes(n)
    rows = x.reshape(-1, n)
    out = torch.empty((rows.shape[0], rb), dtype=torch.uint8, device=x.device)
    weighted = imatrix is not None and t.quantize_blocks_weighted is not None
    if weighted:
        if imatrix.shape != (n,):
            raise ValueError(f"{name}: imatrix has shape {tuple(imatrix.shape)}, expected ({n},)")
        qw = imatrix.to(device=x.device, dtype=torch.float32).reshape(1, n)
    step = _rows_per_chunk(n, rows.shape[0], x.device)
    bpr = n // t.block_size
    for r0 in range(0, rows.shape[0], step):
        chunk = rows[r0:r0 + step].to(torch.float32)
        if weighted:
            r = chunk.shape[0]
            w = qw.expand(r, n).reshape(-1, t.block_size)
            s2 = row_sigma2(chunk).repeat_interleave(bpr, 0) if t.weighted_uses_row_sigma2 else None
            q = t.quantize_blocks_weighted(chunk.reshape(-1, t.block_size), w, s2)
        else:
            q = t.quantize_blocks(chunk.reshape(-1, t.block_size))
        out[r0:r0 + step] = q.reshape(-1, rb)
    return out.reshape(*x.shape[:-1], rb)


def dequantize(raw: torch.Tensor, name: str) -> torch.Tensor:
    """Dequantize uint8 ``raw`` [..., n_bytes] of ggml type ``name`` to float32 [..., n].

    Reproduces ggml's ``dequantize_row_<type>``. Raises ValueError when n_bytes is not a
    multiple of the type size.
    """
    t = get(name)
    nbytes = raw.shape[-1]
    if nbytes % t.type_size:
        raise ValueError(f"{name}: {nbytes} bytes per row is not a multiple of the block size {t.type_size}")
    n = nbytes // t.type_size * t.block_size
    rows = raw.reshape(-1, nbytes)
    out = torch.empty((rows.shape[0], n), dtype=torch.float32, device=raw.device)
    step = _rows_per_chunk(n, rows.shape[0], raw.device)
    for r0 in range(0, rows.shape[0], step):
        chunk = rows[r0:r0 + step].reshape(-1, t.type_size)
        out[r0:r0 + step] = t.dequantize_blocks(chunk).reshape(-1, n)
    return out.reshape(*raw.shape[:-1], n)


# codec modules register themselves on import
from . import floats as _floats  # noqa: E402,F401
from . import legacy as _legacy  # noqa: E402,F401
from . import kquants as _kquants  # noqa: E402,F401
from . import iquants as _iquants  # noqa: E402,F401
