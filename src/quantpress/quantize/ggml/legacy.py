"""Legacy ggml block types (32 elements per block): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Vectorized torch reproductions of llama.cpp's ``quantize_row_q*_ref`` and
``dequantize_row_q*`` (``ggml/src/ggml-quants.c`` at llama.cpp 0c1e570, as vendored in
llama-cpp-python 0.3.36). All blocks are processed at once on the input's device; every
float32 operation is rounded as in C (no FMA, no float64).

Block layouts (little-endian, fp16 scales):

* Q4_0 (18 B): d, qs[16]           x = (q - 8) * d
* Q4_1 (20 B): d, m, qs[16]        x = q * d + m
* Q5_0 (22 B): d, qh[4], qs[16]    x = (q - 16) * d, bit 4 of q[j] in bit j of qh
* Q5_1 (24 B): d, m, qh[4], qs[16] x = q * d + m
* Q8_0 (34 B): d, int8 qs[32]      x = q * d

The low nibble of ``qs[j]`` holds element j, the high nibble element j + 16.

With an importance matrix (``quantize_row_q*_impl``) Q4_0/Q5_0 use K-quants'
``make_qx_quants`` and Q4_1/Q5_1 ``make_qkx3_quants``, weighted by
``qw * sqrt(sigma2 + x²)`` with the row's sigma2 = mean x²; Q8_0 ignores the imatrix.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .registry import GGMLType, register
from .common import (ROUNDF_SMALL, bytes_fp16, c_float_to_int, fdiv, first_absmax, fp16_bytes, roundf,
                     roundf_small, sliced, sqrtf, to_int8)

QK = 32


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """C ``d ? 1.0f/d : 0.0f``."""
    return torch.where(d != 0, fdiv(1.0, d), 0.0)


def _first_min_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block min and max as C's ``if (v < min) min = v; if (v > max) max = v;`` scan from
    ±FLT_MAX: the first element equal to the extreme (this fixes the sign of a zero).
    float32 [nb, k] -> ([nb, 1], [nb, 1]).

    The extremes' values are ``amin``/``amax``'s (plain reductions); only where one is a zero
    (whose sign is the first zero's) or not finite is the element itself taken, by
    argmin/argmax (costly per row on the CPU). On the CPU the per-row tests and those rows'
    scans are NumPy's, whose cost per call on such rows is lower than torch's
    (``scripts/micro_figures.py --numpy-searches`` and ``--first-extremes``; figures in
    docs/benchmarks.md)."""
    mn, mx = x.amin(1), x.amax(1)
    if x.device.type == "cpu":
        a, b = mn.numpy(), mx.numpy()       # views: the odd rows are written through them
        odd = np.isfinite(a)
        odd &= np.isfinite(b)
        odd &= a != 0
        odd &= b != 0
        np.logical_not(odd, out=odd)
        if odd.any():
            rows = np.flatnonzero(odd)
            sub = x.numpy()[rows]
            k = np.arange(rows.size)
            a[rows] = sub[k, sub.argmin(1)]
            b[rows] = sub[k, sub.argmax(1)]
        return mn.unsqueeze(1), mx.unsqueeze(1)
    return _first_min_max_torch(x, mn, mx)


def _first_min_max_torch(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_first_min_max`'s per-row tests in torch (devices other than the CPU), given
    ``x``'s ``amin(1)`` and ``amax(1)``."""
    odd = ~(torch.isfinite(mn) & torch.isfinite(mx)) | (mn == 0) | (mx == 0)
    if bool(odd.any()):
        rows = odd.nonzero().squeeze(1)
        sub = x.index_select(0, rows)
        mn[rows] = sub.gather(1, sub.argmin(1, keepdim=True)).squeeze(1)
        mx[rows] = sub.gather(1, sub.argmax(1, keepdim=True)).squeeze(1)
    return mn.unsqueeze(1), mx.unsqueeze(1)


def _int8_level(v: torch.Tensor, hi: int | None) -> torch.Tensor:
    """C's ``MIN(hi, (int8_t)v)`` of a float32 ``v`` (``(int8_t)`` of the float's int
    conversion; ``hi`` None: ``(uint8_t)v``, no MIN) as int32, any shape.

    Where every value lies in (-1, 128) (one ``aminmax``; NaN fails it) the conversion is a
    plain truncation and the byte casts change nothing, so one cast does; otherwise C's
    conversion of out-of-range values and NaN (:func:`c_float_to_int`) and the byte wrap."""
    lo, top = torch.aminmax(v)
    if bool((lo > -1.0) & (top < 128.0)):
        q = v.to(torch.int32)
    elif hi is None:
        return c_float_to_int(v) & 0xFF
    else:
        q = to_int8(c_float_to_int(v))
    return q if hi is None else q.clamp_max_(hi)


def _nibbles(q: torch.Tensor, masked: bool) -> torch.Tensor:
    """int32 [nb, 32] -> uint8 [nb, 16]: ``qs[j] = q[j] | q[j+16] << 4`` truncated to a
    byte as C stores it; ``masked`` applies C's ``& 0x0F`` to both halves first (Q5_*),
    otherwise the bytes are OR-ed unmasked (Q4_0/Q4_1). The byte arithmetic is done on uint8
    (the same low bits as C's int arithmetic, four times less memory)."""
    b = q.to(torch.uint8)               # low byte, as C's stores keep it
    lo, hi = b[:, :16], b[:, 16:]
    if masked:
        lo, hi = lo & 0x0F, hi & 0x0F
    return lo | (hi << 4)


#: bit j of a byte of qh: 2**j, as the float weights of a matrix product (exact: sums <= 255)
_BIT_WEIGHTS = [float(1 << j) for j in range(8)]


def _qh_bits(q: torch.Tensor) -> torch.Tensor:
    """int32 [nb, 32] -> uint8 [nb, 4]: bit 4 of q[j] into bit j of a little-endian u32.
    (Each byte as a product of the 0/1 bits with 1, 2, ..., 128: exact in float32, and
    faster on CPU than broadcast shifts.)"""
    bits = ((q >> 4) & 1).to(torch.float32).view(q.shape[0], 4, 8)
    w = torch.tensor(_BIT_WEIGHTS, dtype=torch.float32, device=q.device)
    return (bits @ w).to(torch.uint8)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, 16] -> uint8 [nb, 32]: low nibbles then high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


#: row v: the 8 bits of the byte v, low bit first, each as 0 or 16 (bit 4 of a 5-bit level)
_QH_TABLE = torch.tensor([[16 * ((v >> j) & 1) for j in range(8)] for v in range(256)], dtype=torch.uint8)


@functools.lru_cache(maxsize=None)
def _qh_table(device: torch.device) -> torch.Tensor:
    """:data:`_QH_TABLE` on ``device``, copied there once."""
    return _QH_TABLE.to(device)


def _unpack_qh(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, 4] -> uint8 [nb, 32] of 0/16: bit j of the u32 -> 16 for element j.
    (Each byte's row of a 256 x 8 table, gathered with int32 indices: faster than masks on
    the bytes and a bool -> uint8 view, ``scripts/micro_figures.py --dequantize``; figures in
    docs/benchmarks.md.)"""
    rows = torch.index_select(_qh_table(qh.device), 0, qh.reshape(-1).to(torch.int32))
    return rows.reshape(qh.shape[0], 32)


# ----------------------------------------------------------------------------- Q4_0

@sliced
def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q4_0_ref``: float32 [nb, 32] -> uint8 [nb, 18].

    d = m / -8 where m is the first element of largest |x|; q = MIN(15, (int8)(x/d + 8.5)).
    """
    m, _ = first_absmax(x, 1)
    d = fdiv(m, -8.0).unsqueeze(1)
    idd = _inverse(d)
    q = _int8_level(x * idd + 8.5, 15)
    return torch.cat([fp16_bytes(d), _nibbles(q, False)], dim=1)


@sliced
def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q4_0``: uint8 [nb, 18] -> float32 [nb, 32], (q - 8) * d."""
    d = bytes_fp16(b[:, 0:2])
    q = _unpack_nibbles(b[:, 2:18]).to(torch.float32) - 8.0     # (int)q - 8, exact
    return q * d


# ----------------------------------------------------------------------------- Q4_1

@sliced
def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q4_1_ref``: float32 [nb, 32] -> uint8 [nb, 20].

    d = (max - min) / 15, m = min; q = MIN(15, (int8)((x - min)/d + 0.5)).
    """
    mn, mx = _first_min_max(x)
    d = fdiv(mx - mn, 15.0)
    idd = _inverse(d)
    q = _int8_level((x - mn) * idd + 0.5, 15)
    return torch.cat([fp16_bytes(d), fp16_bytes(mn), _nibbles(q, False)], dim=1)


@sliced
def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q4_1``: uint8 [nb, 20] -> float32 [nb, 32], q * d + m."""
    d = bytes_fp16(b[:, 0:2])
    m = bytes_fp16(b[:, 2:4])
    q = _unpack_nibbles(b[:, 4:20])
    return q.to(torch.float32) * d + m


# ----------------------------------------------------------------------------- Q5_0

@sliced
def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q5_0_ref``: float32 [nb, 32] -> uint8 [nb, 22].

    d = m / -16 (m: first element of largest |x|); q = MIN(31, (int8)(x/d + 16.5)).
    """
    m, _ = first_absmax(x, 1)
    d = fdiv(m, -16.0).unsqueeze(1)
    idd = _inverse(d)
    q = _int8_level(x * idd + 16.5, 31)
    return torch.cat([fp16_bytes(d), _qh_bits(q), _nibbles(q, True)], dim=1)


@sliced
def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q5_0``: uint8 [nb, 22] -> float32 [nb, 32], (q - 16) * d."""
    d = bytes_fp16(b[:, 0:2])
    q = (_unpack_nibbles(b[:, 6:22]) | _unpack_qh(b[:, 2:6])).to(torch.float32) - 16.0
    return q * d


# ----------------------------------------------------------------------------- Q5_1

@sliced
def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q5_1_ref``: float32 [nb, 32] -> uint8 [nb, 24].

    d = (max - min) / 31, m = min; q = (uint8)((x - min)/d + 0.5), no clamp.
    """
    mn, mx = _first_min_max(x)
    d = fdiv(mx - mn, 31.0)
    idd = _inverse(d)
    q = _int8_level((x - mn) * idd + 0.5, None)
    return torch.cat([fp16_bytes(d), fp16_bytes(mn), _qh_bits(q), _nibbles(q, True)], dim=1)


@sliced
def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q5_1``: uint8 [nb, 24] -> float32 [nb, 32], q * d + m."""
    d = bytes_fp16(b[:, 0:2])
    m = bytes_fp16(b[:, 2:4])
    q = _unpack_nibbles(b[:, 8:24]) | _unpack_qh(b[:, 4:8])
    return q.to(torch.float32) * d + m


# ----------------------------------------------------------------------------- Q8_0

@sliced
def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q8_0_ref``: float32 [nb, 32] -> uint8 [nb, 34].

    d = max|x| / 127; q = (int8)roundf(x/d) (round half away from zero).
    """
    amax = x.abs().amax(1, keepdim=True)
    d = fdiv(amax, 127.0)
    idd = _inverse(d)
    v = x * idd
    lo, hi = torch.aminmax(v)
    if bool((lo > -ROUNDF_SMALL) & (hi < ROUNDF_SMALL)):    # NaN fails it
        q = roundf_small(v).to(torch.int32)
    else:
        q = c_float_to_int(roundf(v))
    return torch.cat([fp16_bytes(d), q.to(torch.uint8)], dim=1)       # (int8_t) store


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q8_0``: uint8 [nb, 34] -> float32 [nb, 32], q * d."""
    d = bytes_fp16(b[:, 0:2])
    q = b[:, 2:34].contiguous().view(torch.int8)
    return q.to(torch.float32) * d


# ----------------------------------------------------------------------------- imatrix paths

def _weighted_inputs(x: torch.Tensor, qw: torch.Tensor,
                     row_sigma2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and their weights ``weight[j] = qw[j] * sqrtf(sigma2 + x[j]*x[j])`` positions
    first: float32 [nb, 32] (and ``row_sigma2`` [nb, 1]) -> ([32, nb], [32, nb])."""
    xs = x.t().contiguous()
    w = xs * xs
    w += row_sigma2.reshape(1, -1)
    w = sqrtf(w)
    w *= qw.t()
    return xs, w


def _weighted_symmetric(x: torch.Tensor, qw: torch.Tensor, row_sigma2: torch.Tensor,
                        nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_row_q4_0_impl / q5_0_impl core: make_qx_quants(32, nmax, rmse_type 1, weights)
    per block. Returns (d float32 [nb, 1], q int32 [nb, 32] of 0..2*nmax-1)."""
    from .kquants import make_qx_quants    # (imported here: kquants registers after this module)

    xs, w = _weighted_inputs(x, qw, row_sigma2)
    d, L = make_qx_quants(xs, nmax, w)
    # (the transpose as a contiguous float32 copy: a strided int32 one would make every op of
    # the packing strided)
    return d.unsqueeze(1), L.t().contiguous().to(torch.int32)


def _weighted_affine(x: torch.Tensor, qw: torch.Tensor, row_sigma2: torch.Tensor,
                     nmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_row_q4_1_impl / q5_1_impl core: make_qkx3_quants(32, nmax, weights, rmin
    -0.9, rdelta 0.05, 36 steps, MSE) per block. Returns (d, m float32 [nb, 1] with
    x ≈ d*q + m, q int32 [nb, 32] of 0..nmax)."""
    from .kquants import make_qkx2_quants  # (same computation as make_qkx3_quants here)

    xs, w = _weighted_inputs(x, qw, row_sigma2)
    xmin, _ = _first_min_max(x)
    d, the_min, L = make_qkx2_quants(xs, w, nmax, -0.9, 0.05, 36, False, xmin=xmin.reshape(-1))
    return d.unsqueeze(1), (-the_min).unsqueeze(1), L.t().contiguous().to(torch.int32)


@sliced(search=True)
def quantize_q4_0_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q4_0_impl`` with ``quant_weights``: float32 [nb, 32], the
    blocks' importance weights ``qw`` float32 [nb, 32] and their rows' ``sum_x2/n_per_row``
    ``row_sigma2`` float32 [nb, 1] -> uint8 [nb, 18].

    d and q from make_qx_quants(nmax 8) weighted by qw*sqrt(sigma2 + x²); no requantization.
    """
    d, q = _weighted_symmetric(x, qw, row_sigma2, 8)
    return torch.cat([fp16_bytes(d), _nibbles(q, False)], dim=1)


@sliced(search=True)
def quantize_q4_1_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q4_1_impl`` with ``quant_weights``: float32 [nb, 32],
    ``qw`` float32 [nb, 32], ``row_sigma2`` float32 [nb, 1] -> uint8 [nb, 20].

    d, m and q from make_qkx3_quants(nmax 15) weighted by qw*sqrt(sigma2 + x²).
    """
    d, m, q = _weighted_affine(x, qw, row_sigma2, 15)
    return torch.cat([fp16_bytes(d), fp16_bytes(m), _nibbles(q, False)], dim=1)


@sliced(search=True)
def quantize_q5_0_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q5_0_impl`` with ``quant_weights``: float32 [nb, 32],
    ``qw`` float32 [nb, 32], ``row_sigma2`` float32 [nb, 1] -> uint8 [nb, 22].

    d and q from make_qx_quants(nmax 16) weighted by qw*sqrt(sigma2 + x²).
    """
    d, q = _weighted_symmetric(x, qw, row_sigma2, 16)
    return torch.cat([fp16_bytes(d), _qh_bits(q), _nibbles(q, True)], dim=1)


@sliced(search=True)
def quantize_q5_1_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q5_1_impl`` with ``quant_weights``: float32 [nb, 32],
    ``qw`` float32 [nb, 32], ``row_sigma2`` float32 [nb, 1] -> uint8 [nb, 24].

    d, m and q from make_qkx3_quants(nmax 31) weighted by qw*sqrt(sigma2 + x²).
    """
    d, m, q = _weighted_affine(x, qw, row_sigma2, 31)
    return torch.cat([fp16_bytes(d), fp16_bytes(m), _qh_bits(q), _nibbles(q, True)], dim=1)


Q4_0 = register(GGMLType("Q4_0", QK, 18, quantize_q4_0, dequantize_q4_0,
                          quantize_blocks_weighted=quantize_q4_0_weighted, weighted_uses_row_sigma2=True))
Q4_1 = register(GGMLType("Q4_1", QK, 20, quantize_q4_1, dequantize_q4_1,
                          quantize_blocks_weighted=quantize_q4_1_weighted, weighted_uses_row_sigma2=True))
Q5_0 = register(GGMLType("Q5_0", QK, 22, quantize_q5_0, dequantize_q5_0,
                          quantize_blocks_weighted=quantize_q5_0_weighted, weighted_uses_row_sigma2=True))
Q5_1 = register(GGMLType("Q5_1", QK, 24, quantize_q5_1, dequantize_q5_1,
                          quantize_blocks_weighted=quantize_q5_1_weighted, weighted_uses_row_sigma2=True))
Q8_0 = register(GGMLType("Q8_0", QK, 34, quantize_q8_0, dequantize_q8_0))
