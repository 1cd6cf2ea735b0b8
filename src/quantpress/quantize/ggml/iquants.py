"""4-bit non-linear ggml types: IQ4_NL (32 elements per block) and IQ4_XS (256 per super-block).

Vectorized torch reproductions of llama.cpp's ``quantize_iq4_nl`` / ``quantize_iq4_xs``
(both through ``quantize_row_iq4_nl_impl`` with ``ntry = 7``, the path
``ggml_quantize_chunk`` takes with and without an importance matrix) and of
``dequantize_row_iq4_nl`` / ``dequantize_row_iq4_xs`` (``ggml/src/ggml-quants.c`` at
llama.cpp 0c1e570, as vendored in llama-cpp-python 0.3.36). All blocks are processed at once
on the input's device; every float32 operation is rounded as in C (no FMA, no float64).

Quant values are indices into the non-linear grid ``kvalues_iq4nl`` (16 sorted int8).
Block layouts (little-endian, fp16 scales):

* IQ4_NL (18 B): d, qs[16]                                 x = d * kv[q]
* IQ4_XS (136 B): d, u16 scales_h, scales_l[4], qs[128]    x = d * (ls - 32) * kv[q]

The 6-bit scale ``ls`` of sub-block ib (of 8) has its low 4 bits in nibble ib % 2 of
``scales_l[ib / 2]`` and its high 2 bits at bit 2*ib of ``scales_h``. In each 32-element
(sub-)block the low nibble of ``qs[j]`` holds element j, the high nibble element j + 16.
"""
from __future__ import annotations

import torch

from .registry import GGMLType, register
from .common import all_finite, bytes_fp16, f32, fdiv, first_absmax, fp16_bytes, nearest_int, seq_sum0, sliced, sqrtf

QK4_NL = 32
QK_K = 256
NTRY = 7
GROUP_MAX_EPS = f32(1e-15)          # C's 1e-15f

# ggml-common.h kvalues_iq4nl
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# Twice the midpoints of neighbouring grid values: integers.
_MIDS2 = tuple(a + b for a, b in zip(KVALUES_IQ4NL[:-1], KVALUES_IQ4NL[1:]))
_LO, _HI = _MIDS2[0] - 1, _MIDS2[-1]            # floor(2*x) outside [_LO, _HI] saturates


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kvalues float32 [16], index table int64 [_HI - _LO + 1], value table float32 [same])
    on ``device``; the tables map ``floor(2*x) - _LO`` to best_index_int8(x) and to
    kvalues[best_index_int8(x)]."""
    t = _TABLES.get(device)
    if t is None:
        k = torch.arange(_LO, _HI + 1, dtype=torch.int64)
        idx = (k.unsqueeze(1) >= torch.tensor(_MIDS2, dtype=torch.int64)).sum(1)
        kv = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32)
        t = tuple(v.to(device) for v in (kv, idx, kv[idx]))
        _TABLES[device] = t
    return t


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _table_pos(x: torch.Tensor, finite: bool) -> torch.Tensor:
    """int32 positions ``floor(2*x) - _LO`` clamped to the tables (flattened). ``2*x`` is exact
    (or overflows to inf, which saturates like any |x| > 113); ``finite=False`` maps NaN to
    the top (C's 15) and must be used unless x is known to be NaN-free."""
    y = x * 2.0
    if not finite:
        y.nan_to_num_(nan=float(_HI))
    return y.clamp_(_LO, _HI).floor_().sub_(_LO).to(torch.int32).reshape(-1)


def best_index_int8(x: torch.Tensor) -> torch.Tensor:
    """ggml ``best_index_int8(16, kvalues_iq4nl, x)``: float32 (any shape) -> int64 in [0, 16).

    C clamps to 0 / 15 at the ends, binary-searches the neighbours ``val[mu-1] <= x <
    val[mu]`` and returns ``x - val[mu-1] < val[mu] - x ? mu-1 : mu`` in float32. For the
    kvalues grid both differences are exact whenever they are within rounding of each
    other (|x| >= 4.5 near every midpoint and the differences are < 24), so the result is
    exactly the number of midpoints m <= x. The midpoints are multiples of 1/2, so that
    count is a function of ``floor(2*x)``: one table lookup. NaN gives 15, as in C (every
    comparison fails).
    """
    _, idx, _ = _tables(x.device)
    return idx.index_select(0, _table_pos(x, False)).view(x.shape)


def _block_scales(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The per-block scale search of ``quantize_row_iq4_nl_impl`` (``ntry = 7``).

    ``x``, ``w``: float32 [32, nb], positions first (block b is column b), ``w`` the
    weights (``x*x`` or ``qw * sqrtf(sigma2 + x*x)``). Returns float32 [nb]: ``scales[ib]``,
    0 for blocks with max |x| < GROUP_MAX_EPS.

    One pass with ``d = -max/values[0]`` gives the starting least-squares scale; then for
    itry in -7..7 the candidate ``id = (itry + values[0])/max`` replaces it when
    ``sumq2 > 0 && sumqx*sumqx > best*sumq2``. sumqx/sumq2 are C's sequential float32 sums
    of ``w*q*x`` and ``w*q*q`` over the block.
    """
    _, _, qtab = _tables(x.device)
    finite = all_finite(x)     # NaN-free products in the search (else sanitized)
    mx, amax = first_absmax(x, 0)
    small = amax < GROUP_MAX_EPS
    mx = torch.where(small, 1.0, mx)           # dummy for skipped blocks (scale forced to 0)
    nb = x.shape[1]
    pp = torch.empty((x.shape[0], 2, nb), dtype=torch.float32, device=x.device)

    def sums(idv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = qtab.index_select(0, _table_pos(idv * x, finite)).view(x.shape)
        wq = w * q
        torch.mul(wq, x, out=pp[:, 0])
        torch.mul(wq, q, out=pp[:, 1])
        s = seq_sum0(pp)
        return s[0], s[1]

    d = fdiv(-mx, float(KVALUES_IQ4NL[0]))
    sumqx, sumq2 = sums(fdiv(1.0, d))
    d = torch.where(sumq2 > 0, fdiv(sumqx, sumq2), 0.0)
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = sums(fdiv(float(itry + KVALUES_IQ4NL[0]), mx))
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        dn = fdiv(sumqx, sumq2)
        d = torch.where(better, dn, d)
        best = torch.where(better, dn * sumqx, best)
    return torch.where(small, 0.0, d)


def _weights(xs: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """Weights of ``quantize_row_iq4_nl_impl`` for super-blocks ``xs`` float32 [S, nsb]
    (positions first): ``x*x`` without ``qw``, else ``qw * sqrtf(sigma2 + x*x)`` with
    ``sigma2 = (sequential sum of x*x) * (2.f/S)``. Returns float32 [S, nsb]."""
    x2 = xs * xs
    if qw is None:
        return x2
    sigma2 = seq_sum0(x2) * f32(2.0 / xs.shape[0])
    return qw * sqrtf(sigma2 + x2)


def _nibbles(L: torch.Tensor) -> torch.Tensor:
    """int64 [nb, k*32] grid indices -> uint8 [nb, k*16]: per 32-block
    ``q4[16*i + j] = L[32*i + j] | L[32*i + 16 + j] << 4``."""
    Lb = L.reshape(L.shape[0], -1, 2, 16)
    return (Lb[:, :, 0] | (Lb[:, :, 1] << 4)).to(torch.uint8).reshape(L.shape[0], -1)


# ----------------------------------------------------------------------------- IQ4_NL

def _quantize_iq4_nl(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    xt = x.t().contiguous()
    w = _weights(xt, None if qw is None else qw.t().contiguous())
    s = _block_scales(xt, w)
    ids = torch.where(s != 0, fdiv(1.0, s), 0.0)
    L = best_index_int8(ids.unsqueeze(1) * x)
    return torch.cat([fp16_bytes(s.unsqueeze(1)), _nibbles(L)], dim=1)


@sliced(search=True)
def quantize_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_iq4_nl`` without imatrix (``quantize_row_iq4_nl_impl``, ntry 7,
    weights x*x): float32 [nb, 32] -> uint8 [nb, 18].

    d = the block's searched scale (fp16), q = best_index_int8(x / d) on the kvalues grid.
    """
    return _quantize_iq4_nl(x, None)


@sliced(search=True)
def quantize_iq4_nl_weighted(x: torch.Tensor, qw: torch.Tensor, extra=None) -> torch.Tensor:
    """llama.cpp ``quantize_iq4_nl`` with imatrix: float32 x [nb, 32], qw [nb, 32] (the
    imatrix entries of each block's columns; ``extra`` ignored) -> uint8 [nb, 18].

    As :func:`quantize_iq4_nl` with weights ``qw * sqrtf(sigma2 + x*x)``,
    ``sigma2 = 2/32 * sum(x*x)`` over the block.
    """
    return _quantize_iq4_nl(x, qw)


@sliced
def dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_iq4_nl``: uint8 [nb, 18] -> float32 [nb, 32], d * kv[q]."""
    kv, _, _ = _tables(b.device)
    d = bytes_fp16(b[:, 0:2])
    q = b[:, 2:18].to(torch.int64)
    return torch.cat([kv[q & 0x0F], kv[q >> 4]], dim=1) * d


# ----------------------------------------------------------------------------- IQ4_XS

def _quantize_iq4_xs(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    nsb = x.shape[0]
    xt = x.t().contiguous()                                          # [256, nsb]
    w = _weights(xt, None if qw is None else qw.t().contiguous())
    # sub-blocks as columns: [32, nsb*8], column = sb*8 + ib
    xb = xt.reshape(8, 32, nsb).permute(1, 2, 0).reshape(32, nsb * 8)
    wb = w.reshape(8, 32, nsb).permute(1, 2, 0).reshape(32, nsb * 8)
    scales = _block_scales(xb, wb).reshape(nsb, 8)
    max_scale, _ = first_absmax(scales, 1)
    d = fdiv(-max_scale, 32.0)                                       # -max_scale/32
    idd = torch.where(d != 0, fdiv(1.0, d), 0.0)
    ls = nearest_int(idd.unsqueeze(1) * scales).clamp_(-32, 31)      # [nsb, 8] int32
    dl = d.unsqueeze(1) * ls.to(torch.float32)
    idl = torch.where(dl != 0, fdiv(1.0, dl), 0.0)
    L = best_index_int8(idl.unsqueeze(2) * x.reshape(nsb, 8, 32)).reshape(nsb, QK_K)
    ls = ls + 32
    lo = ls & 0x0F
    scales_l = (lo[:, 0::2] | (lo[:, 1::2] << 4)).to(torch.uint8)
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=x.device)
    sh = ((ls >> 4) << shifts).sum(1, dtype=torch.int32)
    scales_h = torch.stack([sh & 0xFF, sh >> 8], dim=1).to(torch.uint8)
    return torch.cat([fp16_bytes(d.unsqueeze(1)), scales_h, scales_l, _nibbles(L)], dim=1)


@sliced(search=True)
def quantize_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_iq4_xs`` without imatrix (``quantize_row_iq4_nl_impl``, ntry 7,
    weights x*x): float32 [nb, 256] -> uint8 [nb, 136].

    Each 32-element sub-block gets a searched float scale; the super-block scale is
    ``d = -max_scale/32`` (max_scale: the first sub-block scale of largest |.|), the 6-bit
    sub-block scales ``l = clamp(nearest_int(scale/d), -32, 31)``, and
    q = best_index_int8(x / (d*l)).
    """
    return _quantize_iq4_xs(x, None)


@sliced(search=True)
def quantize_iq4_xs_weighted(x: torch.Tensor, qw: torch.Tensor, extra=None) -> torch.Tensor:
    """llama.cpp ``quantize_iq4_xs`` with imatrix: float32 x [nb, 256], qw [nb, 256] (the
    imatrix entries of each super-block's columns; ``extra`` ignored) -> uint8 [nb, 136].

    As :func:`quantize_iq4_xs` with weights ``qw * sqrtf(sigma2 + x*x)``,
    ``sigma2 = 2/256 * sum(x*x)`` over the super-block.
    """
    return _quantize_iq4_xs(x, qw)


@sliced
def dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_iq4_xs``: uint8 [nb, 136] -> float32 [nb, 256],
    ``(d * (ls - 32)) * kv[q]`` per 32-element sub-block."""
    kv, _, _ = _tables(b.device)
    nb = b.shape[0]
    d = bytes_fp16(b[:, 0:2])                                        # [nb, 1]
    sh = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    sl = b[:, 4:8].to(torch.int32)
    ib = torch.arange(8, device=b.device, dtype=torch.int32)
    lo = (sl.repeat_interleave(2, dim=1) >> (4 * (ib % 2))) & 0x0F
    hi = (sh.unsqueeze(1) >> (2 * ib)) & 3
    dl = d * ((lo | (hi << 4)) - 32).to(torch.float32)               # [nb, 8]
    q = b[:, 8:136].to(torch.int64).reshape(nb, 8, 16)
    v = torch.cat([kv[q & 0x0F], kv[q >> 4]], dim=2)                 # [nb, 8, 32]
    return (dl.unsqueeze(2) * v).reshape(nb, QK_K)


IQ4_NL = register(GGMLType("IQ4_NL", QK4_NL, 18, quantize_iq4_nl, dequantize_iq4_nl,
                           quantize_blocks_weighted=quantize_iq4_nl_weighted))
IQ4_XS = register(GGMLType("IQ4_XS", QK_K, 136, quantize_iq4_xs, dequantize_iq4_xs,
                           quantize_blocks_weighted=quantize_iq4_xs_weighted))
