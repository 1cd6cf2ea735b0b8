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
``quantize_many(xs, name, imatrices=None)``: the same for several tensors in one pass of the
codec (their blocks side by side), for accelerators, where a codec's cost is its op count
``dequantize(raw, name)``: uint8 [..., n_bytes] -> float32 [..., n]
``get(name)``: the :class:`GGMLType` record.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import common, processes
from .common import fdiv, seq_sum0
from .registry import GGMLType, get, names, register  # noqa: F401 - the package's API

# elements processed per chunk by quantize()/dequantize() off the CPU: bounds the temporaries
# of the search-based K-quants (a handful of float32 copies of the chunk) independently of
# the tensor size. On the CPU the codecs cut their input into cache-sized slices themselves
# (common.map_block_slices), so a tensor is one chunk there (its slices then share out evenly
# over the threads). Every block is quantized on its own, so results do not depend on the
# chunking. On a GPU a K-quant's time is its op count (thousands of small kernels, about the
# same time per call whatever the size up to 4M elements: figures and the command in
# docs/benchmarks.md, "Figures behind the code", ``quantize/ggml/__init__.py``), so the
# chunks are large and quantize_many() fills them with the blocks of several tensors.
CHUNK_ELEMENTS = 1 << 22
#: :data:`CHUNK_ELEMENTS` for quantize()/quantize_many() on an accelerator
ACCEL_CHUNK_ELEMENTS = 1 << 25


#: on the CPU quantize_many() hands blocks with importance weights to the codec this many
#: codec slices per lane at a time (the GGUF writer's windows, ``convert.gguf_file.
#: CPU_WINDOW_ROUNDS``, hold as many: it is this value), so that the
#: weights, expanded to one float32 per weight for the codec, are made for that many blocks
#: only (the 554M random llama's 75M-value output head would need 302 MB of them at once)
CPU_WEIGHTED_ROUNDS = 16


def _blocks_per_chunk(nb: int, block_size: int, device: torch.device, weighted: bool = False) -> int:
    """Blocks per codec call of quantize_many(): all ``nb`` on the CPU (``weighted``:
    :data:`CPU_WEIGHTED_ROUNDS` slices per lane, a lane being the calling thread and each
    codec process, or each codec thread), else :data:`ACCEL_CHUNK_ELEMENTS` worth."""
    if device.type != "cpu":
        return max(1, ACCEL_CHUNK_ELEMENTS // block_size)
    if not weighted:
        return max(1, nb)
    lanes = max(len(processes.codec_process_ids()) + 1, min(torch.get_num_threads(), common.CPU_CODEC_THREADS))
    return max(1, CPU_WEIGHTED_ROUNDS * lanes * common.CPU_SLICE_ELEMENTS // block_size)


def _rows_per_chunk(n: int, rows: int, device: torch.device) -> int:
    if device.type == "cpu":
        return max(1, rows)
    return max(1, CHUNK_ELEMENTS // max(1, n))


def row_sigma2(rows: torch.Tensor) -> torch.Tensor:
    """C's ``sum_x2 = 0; for (j = 0; j < n_per_row; ++j) sum_x2 += x[j]*x[j];
    sigma2 = sum_x2/n_per_row;`` per row (``quantize_row_q4_0_impl`` …): float [r, n] (any
    float dtype, widened to float32 exactly) -> float32 [r, 1], sequential with one rounding
    per step. On the CPU in groups of about ``common.CPU_SLICE_ELEMENTS`` values (at least
    ``common.SEQ_SUM_NUMPY_MIN`` rows, so that each group's sums are one NumPy call), so that
    its float32 copies stay that size; elsewhere all rows at once (one add per position,
    whatever the row count)."""
    r, n = rows.shape
    step = r if rows.device.type != "cpu" else max(common.SEQ_SUM_NUMPY_MIN, common.CPU_SLICE_ELEMENTS // max(1, n))
    out = torch.empty((r, 1), dtype=torch.float32, device=rows.device)
    with common.quiet_floats():                 # (C's sum overflows silently too)
        for r0 in range(0, r, step):
            part = rows[r0:r0 + step].to(torch.float32)
            sq = (part * part).t().contiguous()    # positions first: each step one contiguous row
            out[r0:r0 + step, 0] = fdiv(seq_sum0(sq), float(n))
    return out


def _row_sigma2_by_width(xs: list[torch.Tensor], block_size: int) -> list[torch.Tensor]:
    """:func:`row_sigma2` of every row of each tensor [..., n_i], repeated for each of the
    row's blocks (float32 [rows_i · n_i / block_size, 1] per tensor): one sequential pass per
    width over the rows of all tensors of that width (n_i ops each, not n_i per tensor)."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    by_width: dict[int, list[int]] = {}
    for i, x in enumerate(xs):
        by_width.setdefault(x.shape[-1], []).append(i)
    for n, group in by_width.items():
        rows = [xs[i].reshape(-1, n) for i in group]
        s2 = row_sigma2(torch.cat(rows) if len(rows) > 1 else rows[0])
        for i, part in zip(group, torch.split(s2, [r.shape[0] for r in rows])):
            out[i] = part.repeat_interleave(n // block_size, 0)
    return out


def _weights_of_blocks(patterns: list[torch.Tensor], nb: list[int], b0: int, b1: int) -> torch.Tensor:
    """The importance weights of blocks ``b0:b1`` of tensors laid end to end (tensor ``i``:
    ``nb[i]`` blocks, each of its rows the blocks of ``patterns[i]``, float32 [n_i / bs, bs]):
    float32 [b1 - b0, bs]."""
    parts, start = [], 0
    for pattern, count in zip(patterns, nb):
        lo, hi = max(b0, start), min(b1, start + count)
        if lo < hi:
            pos = torch.arange(lo - start, hi - start, device=pattern.device) % pattern.shape[0]
            parts.append(pattern.index_select(0, pos))
        start += count
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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
    return quantize_many([x], name, [imatrix])[0]


def quantize_many(xs: Sequence[torch.Tensor], name: str,
                  imatrices: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """:func:`quantize` of several tensors at once: ``[quantize(x, name, w) for x, w in
    zip(xs, imatrices)]``, byte for byte, with the blocks of all tensors passed through the
    codec together, in chunks of :data:`ACCEL_CHUNK_ELEMENTS` elements off the CPU (one call
    for the whole set on the CPU, which slices for its threads itself). On a GPU the codecs
    are bound by their op count, not by the data (a K-quant issues thousands of small
    kernels), so quantizing a layer's tensors in one pass costs about what one tensor did.

    ``xs``: float tensors [..., n_i] (any float dtype, widths may differ) on one device;
    ``imatrices``: None, or one float32 [n_i] or None per tensor (as :func:`quantize`; a
    type that ignores importance weights ignores them). Returns uint8 tensors
    [..., n_i // block_size * type_size] on that device, in the order of ``xs``. Raises
    ValueError when a width is not a multiple of the block size, an imatrix is not [n_i],
    the lists differ in length, or the tensors are on different devices."""
    t = get(name)
    if imatrices is None:
        imatrices = [None] * len(xs)
    if len(imatrices) != len(xs):
        raise ValueError(f"{name}: {len(xs)} tensors but {len(imatrices)} imatrices")
    if not xs:
        return []
    device = xs[0].device
    if any(x.device != device for x in xs):
        raise ValueError(f"{name}: quantize_many needs its tensors on one device")
    bs = t.block_size
    weighted = t.quantize_blocks_weighted is not None
    outs: list[torch.Tensor | None] = [None] * len(xs)
    # the weighted and the plain path are separate codecs: one pass of each
    for use_w in (False, True):
        idx = [i for i, w in enumerate(imatrices) if (weighted and w is not None) == use_w]
        if not idx:
            continue
        blocks, patterns, s2s = [], [], []
        for i in idx:
            n = xs[i].shape[-1]
            t.row_bytes(n)                                  # raises for a bad width
            rows = xs[i].reshape(-1, n)
            blocks.append(rows.reshape(-1, bs))
            if use_w:
                w = imatrices[i]
                if w.shape != (n,):
                    raise ValueError(f"{name}: imatrix has shape {tuple(w.shape)}, expected ({n},)")
                # one row's blocks of weights: block b of the tensor takes row b % (n / bs)
                patterns.append(w.to(device=device, dtype=torch.float32).reshape(-1, bs))
        if use_w and t.weighted_uses_row_sigma2:
            s2s = _row_sigma2_by_width([xs[i] for i in idx], bs)
        nb = [b.shape[0] for b in blocks]
        x = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        s2 = None if not s2s else (s2s[0] if len(s2s) == 1 else torch.cat(s2s))
        del blocks, s2s
        q = torch.empty((x.shape[0], t.type_size), dtype=torch.uint8, device=device)
        step = _blocks_per_chunk(x.shape[0], bs, device, weighted=use_w)
        for b0 in range(0, x.shape[0], step):
            # (on the CPU the codecs widen each slice to float32 themselves, so that no float32
            # copy of the whole input is made: the 554M random llama's 75M-value output head
            # is 302 MB in float32)
            chunk = x[b0:b0 + step] if device.type == "cpu" else x[b0:b0 + step].to(torch.float32)
            if use_w:
                w = _weights_of_blocks(patterns, nb, b0, b0 + chunk.shape[0])
                q[b0:b0 + step] = t.quantize_blocks_weighted(
                    chunk, w, None if s2 is None else s2[b0:b0 + step])
                del w
            else:
                q[b0:b0 + step] = t.quantize_blocks(chunk)
            del chunk
        for i, part in zip(idx, torch.split(q, nb)):
            outs[i] = part.reshape(*xs[i].shape[:-1], t.row_bytes(xs[i].shape[-1]))
    return outs


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
    step = _rows_per_chunk(n, rows.shape[0], raw.device)
    if step >= rows.shape[0]:
        # one chunk (always on the CPU): the codec's result as it is, not copied into ``out``
        # (the copy was a sizeable part of every type's dequantization: figures and the
        # command in docs/benchmarks.md, "Figures behind the code",
        # ``quantize/ggml/__init__.py``), unless it is a view of ``raw`` (F32): the result is
        # always the caller's own
        y = t.dequantize_blocks(rows.reshape(-1, t.type_size))
        if y.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr():
            return y.reshape(*raw.shape[:-1], n)
    out = torch.empty((rows.shape[0], n), dtype=torch.float32, device=raw.device)
    for r0 in range(0, rows.shape[0], step):
        chunk = rows[r0:r0 + step].reshape(-1, t.type_size)
        out[r0:r0 + step] = t.dequantize_blocks(chunk).reshape(-1, n)
    return out.reshape(*raw.shape[:-1], n)


# codec modules register themselves on import
from . import floats as _floats  # noqa: E402,F401
from . import legacy as _legacy  # noqa: E402,F401
from . import kquants as _kquants  # noqa: E402,F401
from . import iquants as _iquants  # noqa: E402,F401
