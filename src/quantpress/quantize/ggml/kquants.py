"""K-quant ggml types (super-blocks of 256): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Vectorized torch reproductions of llama.cpp's ``quantize_row_qX_K_ref`` (the path taken by
``ggml_quantize_chunk`` without an importance matrix), ``quantize_row_qX_K_impl`` (the path
with one: ``quantize_qX_k_weighted``) and ``dequantize_row_qX_K`` (``ggml/src/ggml-quants.c``
at llama.cpp 0c1e570, as vendored in llama-cpp-python 0.3.36).

Bit-exactness rules followed throughout:

* float32 only, one rounding per C operation in C's left-to-right order, no fused
  multiply-add; divisions go through :func:`common.fdiv` (true division).
* C's sequential ``for`` sums are reproduced by a Python loop over the (16 or 32)
  positions of a sub-block, each step one vectorized op over all sub-blocks.
* the scales ``d``/``dmin`` are stored as fp16 (RNE) and read back through fp16 for the
  requantization, as C does.
* the searches made of many operations on small arrays (``make_qp_quants``,
  ``make_q3_quants``' coordinate descent, ``make_qkx2_quants``' acceptance test) are written
  once over :class:`_TorchOps` / :class:`_NumpyOps` and run in NumPy on the CPU, where
  torch's per-operation dispatch would dominate; float32 NumPy operations round once each,
  as torch's.

Internally sub-blocks are laid out "positions first": ``X[i, s]`` is element ``i`` of
sub-block ``s`` (``s = superblock * n_sub + j``), so that one position of all sub-blocks is
a contiguous row.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from . import compiled_searches, triton_searches
from .registry import GGMLType, register
from .common import all_finite, bytes_fp16, f32, fdiv, first_absmax, fp16_bytes, fp16_round, nearest_int, seq_sum0, sliced, sqrtf, to_int8

QK_K = 256
GROUP_MAX_EPS = f32(1e-15)


# ============================================================================ helpers

def _positions_first(x: torch.Tensor, n: int) -> torch.Tensor:
    """float32 [nb, 256] -> [n, nb * (256 // n)]: sub-blocks of n elements as columns."""
    # an explicit copy (a 2-D transpose, which torch blocks for the cache): a view would
    # make every later per-position row access strided
    return x.reshape(-1, n).t().contiguous()


def _positive_max(s: torch.Tensor) -> torch.Tensor:
    """C ``max = 0; for j: if (s[j] > max) max = s[j];`` over the last axis: [..., k] -> [...]
    (+0.0 when nothing is > 0; NaN ignored)."""
    return torch.where(s > 0, s, 0.0).amax(-1)


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """int32 or uint8 [nb, 256] of 0..3 -> uint8 [nb, 64]:
    ``qs[32h + l] = L[128h+l] | L[128h+l+32] << 2 | L[128h+l+64] << 4 | L[128h+l+96] << 6``."""
    q = L.reshape(-1, 2, 4, 32)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return (out & 0xFF).to(torch.uint8).reshape(-1, 64)


def _unpack_2bit(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, 64] -> int32 [nb, 256], inverse of :func:`_pack_2bit`."""
    q = qs.to(torch.int32).reshape(-1, 2, 1, 32)
    shifts = torch.arange(0, 8, 2, device=qs.device, dtype=torch.int32).reshape(1, 1, 4, 1)
    return ((q >> shifts) & 3).reshape(-1, QK_K)


def _pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales and mins int32 [nb, 8] -> uint8 [nb, 12] (Q4_K/Q5_K packing)."""
    lo_s, hi_s = ls[:, :4], ls[:, 4:]
    lo_m, hi_m = lm[:, :4], lm[:, 4:]
    out = torch.cat([lo_s | ((hi_s >> 4) << 6),
                     lo_m | ((hi_m >> 4) << 6),
                     (hi_s & 0xF) | ((hi_m & 0xF) << 4)], dim=1)
    return (out & 0xFF).to(torch.uint8)


def _unpack_scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [nb, 12] -> (scales, mins) int32 [nb, 8]; ggml ``get_scale_min_k4`` for j = 0..7."""
    q = sc.to(torch.int32)
    a, b, c = q[:, 0:4], q[:, 4:8], q[:, 8:12]
    ls = torch.cat([a & 63, (c & 0xF) | ((a >> 6) << 4)], dim=1)
    lm = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return ls, lm


class _RowSelect:
    """``state = where(take, new, state)`` in place, bit for bit (NaN payloads and the sign
    of zero kept), for float32 ``state``/``new`` [k, S] and bool ``take`` [S]: through the
    int32 bits, ``state ^= (new ^ state) & -take``. On the CPU the three bitwise ops cost less
    than torch.where on the searches' [5, 8192] state (``scripts/micro_figures.py --select``;
    figures in docs/benchmarks.md). Buffers are allocated once per search."""

    def __init__(self, state: torch.Tensor, new: torch.Tensor):
        self.state = state.view(torch.int32)
        self.new = new.view(torch.int32)
        self.diff = torch.empty_like(self.state)
        self.mask = torch.empty(state.shape[-1], dtype=torch.int32, device=state.device)

    def __call__(self, take: torch.Tensor) -> None:
        self.mask.copy_(take).neg_()                        # 0 or all ones
        torch.bitwise_xor(self.new, self.state, out=self.diff)
        self.diff.bitwise_and_(self.mask)
        self.state.bitwise_xor_(self.diff)


# ============================================================================ shared routines

def _ni_clamp_(v: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
    """``out = MAX(lo, MIN(hi, nearest_int(v)))`` as float32, in place: ``v`` (a float32
    workspace) is clobbered, ``out`` float32 of the same shape is returned."""
    v.add_(12582912.0)
    vi = v.view(torch.int32)
    vi.bitwise_and_(0x7FFFFF).sub_(0x400000).clamp_(lo, hi)
    return out.copy_(vi)


# make_qkx2_quants may round with float ops on CPU after a range check (exact, ~10% faster);
# tests switch this off to exercise C's integer path, which other devices always take.
FAST_ROUNDING_ON_CPU = True

_MAGIC = 12582912.0     # 1.5 * 2**23: nearest_int's shift constant
#: |v| up to this: nearest_int(v) == (v + _MAGIC) - _MAGIC == round(v), exactly (the fast
#: rounding's range; also the compiled search steps' range check, :mod:`compiled_searches`)
NI_SAFE = 4194303.0


def _round_clamp_(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """In place ``v = MAX(lo, MIN(hi, nearest_int(v)))`` in float32, valid (bit-exact with C)
    only where |v| <= 4194303: there ``v + 12582912.0f`` lands in [2**23, 2**24), whose
    spacing is 1, so C's mantissa read equals ``(v + 12582912) - 12582912``. Callers prove
    or check that bound; elsewhere use :func:`_ni_clamp_`."""
    return v.add_(_MAGIC).sub_(_MAGIC).clamp_(lo, hi)


def _requant_bytes(x: torch.Tensor, xs: torch.Tensor, mj: torch.Tensor | None, dj: torch.Tensor,
                   lo: int, hi: int, L: torch.Tensor) -> torch.Tensor:
    """Requantization with the stored scales, in block order: ``MAX(lo, MIN(hi,
    nearest_int((x + m_j)/d_j))) - lo`` (``x/d_j`` when ``mj`` is None) as uint8 [nb, 256],
    and the search's levels ``L`` kept in sub-blocks with ``d_j == 0`` (C skips them).
    ``x`` float32 [nb, 256] (the blocks as the codec got them) and ``xs``, the same values
    positions first [n, S] (S = nb * 256 // n; their extremes per sub-block are quicker to
    find there: along rows of 16 torch's amin and amax are an order of magnitude slower,
    ``scripts/micro_figures.py --levels``, docs/benchmarks.md); ``mj``,
    ``dj`` float32 [1, S] per sub-block; ``L`` float32 [n, S] positions first, integers
    lo..hi shifted by -lo.

    Elementwise ops, so the values do not depend on the layout; in block order the levels
    need no transpose back (about half the time of positions first,
    ``scripts/micro_figures.py --levels``), and the bytes come through
    int32 (torch 2.13's float32 -> uint8 is three times slower on the CPU).

    On the CPU, (x + m_j)/d_j, rounded after each op, is monotonic in x, so when its values
    at each sub-block's smallest and largest x are within ±4194303 (checked on the host) the
    float rounding path (round half to even, exact there) is used; otherwise C's integer path.
    """
    S = dj.shape[-1]
    xb = x.reshape(S, -1)                       # [S, n]: a sub-block per row
    zero_dj = dj == 0
    any_zero = bool(zero_dj.any())
    fast = False
    if FAST_ROUNDING_ON_CPU and x.device.type == "cpu":
        e = torch.stack([xs.amin(0), xs.amax(0)])     # (aminmax over dim 0 is slow)
        if mj is not None:
            e += mj
        e.div_(dj).abs_()
        if any_zero:
            e.masked_fill_(zero_dj, 0.0)
        fast = bool(e.amax() <= NI_SAFE)       # NaN -> False
    dc = dj.reshape(S, 1)
    if mj is not None:
        t = torch.add(xb, mj.reshape(S, 1)).div_(dc)
    else:
        t = torch.div(xb, dc)
    if fast:
        t.round_().clamp_(lo, hi)
    else:
        t = _ni_clamp_(t, lo, hi, torch.empty_like(t))
    if lo:
        t.sub_(lo)
    if any_zero:
        t = torch.where(zero_dj.reshape(S, 1), L.t(), t)
    return t.to(torch.int32).to(torch.uint8).reshape(x.shape[0], QK_K)


def make_qx_quants(x: torch.Tensor, nmax: int,
                   w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp ``make_qx_quants(n, nmax, x, L, rmse_type=1, qw)`` over many sub-blocks.

    ``x``: float32 [n, S] (element i of sub-block s at ``x[i, s]``); ``w``: the weights
    ``qw``, float32 [n, S], or None for C's ``qw = NULL`` (weights x²). Tries the inverse
    scale -nmax/max, then -(nmax + 0.1*t)/max for t = -9..9, keeping the best weighted
    least-squares fit. Returns (scale float32 [S], L float32 [n, S] holding integers
    0..2*nmax-1). Sub-blocks whose largest |x| is below 1e-15 give scale 0, L = 0.
    On a CUDA device one Triton kernel (:func:`triton_searches.qx`), the same bits.
    """
    if triton_searches.available(x):
        with contextlib.suppress(triton_searches.KernelUnavailable):
            return triton_searches.qx(x, nmax, w, GROUP_MAX_EPS)
    n, S = x.shape
    dev = x.device
    mx, amax = first_absmax(x, 0)
    zero = amax < GROUP_MAX_EPS
    any_zero = bool(zero.any())
    weighted = w is not None
    # iscale*x is NaN only where x is not finite (a weighted call's x may be scales that
    # overflowed): C's nearest_int(NaN) is 0
    fix_nan = weighted and not all_finite(x)
    if not weighted:
        w = x * x
    wx = w * x
    # the products' planes: p[:, 0] holds the levels l, then (w*x)*l; p[:, 1] (w*l)*l
    p = torch.empty((n, 2, S), dtype=x.dtype, device=dev)
    pl, pl2 = p.unbind(1)
    # ST = [sel (the inverse scale whose L is kept), scale, best]; NEW: the step's candidate
    ST = torch.empty((3, S), dtype=torch.float32, device=dev)
    NEW = torch.empty((3, S), dtype=torch.float32, device=dev)
    sel, scale, best = ST.unbind(0)
    iscale, this_scale, this_best = NEW.unbind(0)
    s = torch.empty((2, S), dtype=torch.float32, device=dev)
    sumlx, suml2 = s.unbind(0)
    take = torch.empty(S, dtype=torch.bool, device=dev)
    pos = torch.empty(S, dtype=torch.bool, device=dev)
    t2 = torch.empty(S, dtype=torch.float32, device=dev)
    t3 = torch.empty(S, dtype=torch.float32, device=dev)
    keep = _RowSelect(ST, NEW)

    def sums(iscale: torch.Tensor) -> None:
        # |iscale*x| <= (nmax + 1)*(1 + eps) in every sub-block with max|x| >= 1e-15 (the
        # others are masked at the end), so rounding with round() (half to even) is exact
        # (-0.0 for C's 0 only flips the sign of zero terms, which a sum started at +0,
        # as C's, does not see; a zero sumlx, e.g. from underflowing w*x, has scale +0)
        torch.mul(x, iscale, out=pl)        # iscale*x
        pl.round_().clamp_(-nmax, nmax - 1)  # l
        if fix_nan:
            pl.masked_fill_(pl.isnan(), 0.0)
        torch.mul(w, pl, out=pl2)           # w*l
        pl2.mul_(pl)                        # (w*l)*l
        pl.mul_(wx)                         # l*(w*x) = (w*x)*l (one rounded product)
        seq_sum0(p, s)

    torch.div(torch.full_like(mx, float(-nmax)), mx, out=sel)
    sums(sel)
    torch.div(sumlx, suml2, out=scale)
    scale.masked_fill_(suml2 == 0, 0.0)
    torch.mul(scale, sumlx, out=best)
    # the acceptance test on these [S] rows: NumPy's operations on the CPU, on views of the
    # same memory (on rows this small NumPy's dispatch is cheaper than torch's:
    # ``scripts/micro_figures.py --numpy-searches``, docs/benchmarks.md), torch's elsewhere
    sm = _NumpyOps if NUMPY_SEARCHES_ON_CPU and dev.type == "cpu" else _TorchOps
    sumlx_, suml2_, t2_, t3_, take_, pos_, this_scale_, this_best_, best_ = map(
        sm.view, (sumlx, suml2, t2, t3, take, pos, this_scale, this_best, best))
    for step in range(-9, 10):
        if step == 0:
            continue
        # C: -(nmax + 0.1f*is) / max
        num = f32(nmax + f32(f32(0.1) * step))
        iscale.fill_(-num).div_(mx)
        sums(iscale)
        sm.mul(sumlx_, sumlx_, out=t2_)
        sm.greater(t2_, sm.mul(best_, suml2_, out=t3_), out=take_)
        sm.logical_and(take_, sm.greater(suml2_, 0, out=pos_), out=take_)
        sm.div(sumlx_, suml2_, out=this_scale_)
        sm.mul(this_scale_, sumlx_, out=this_best_)
        keep(take)
    # L of the kept inverse scale (elementwise, so recomputing it gives the same values)
    la = torch.mul(x, sel)
    L = la.round_().clamp_(-nmax, nmax - 1).add_(nmax)
    if fix_nan:
        L.masked_fill_(L.isnan(), float(nmax))
    if any_zero:
        scale = torch.where(zero, 0.0, scale)
        L.masked_fill_(zero, 0.0)
    return scale, L


class _TorchOps:
    """The array operations of the searches written for torch tensors and NumPy arrays alike
    (:func:`make_qp_quants`, :func:`make_q3_quants`' coordinate descent, the acceptance tests
    of :func:`make_qkx2_quants`' and :func:`make_qx_quants`' steps), on torch tensors (any
    device)."""
    where = staticmethod(torch.where)
    zeros_like = staticmethod(torch.zeros_like)
    #: the Q3_K descent's test goes on with the few changing sub-blocks' values gathered
    #: (a host synchronization per position: not on an accelerator)
    GATHERS = False
    nearest_int = staticmethod(nearest_int)

    @staticmethod
    def div(a, b, out=None):
        """C's ``a / b`` (one rounding; ``a`` may be a Python float: :func:`fdiv`), into ``out``."""
        return fdiv(a, b) if out is None else torch.div(a, b, out=out)
    seq_sum = staticmethod(seq_sum0)
    clip = staticmethod(torch.clamp)

    @staticmethod
    def cap(a, hi: int):
        return a.clamp_max(hi)

    @staticmethod
    def float32(a):
        return a.to(torch.float32)

    @staticmethod
    def false_like(a):
        return torch.zeros_like(a, dtype=torch.bool)

    @staticmethod
    def flatnonzero(a):
        return torch.nonzero(a).squeeze(1)

    @staticmethod
    def take_cols(a, idx):
        return a.index_select(1, idx)

    mul = staticmethod(torch.mul)
    greater = staticmethod(torch.gt)
    less = staticmethod(torch.lt)
    logical_and = staticmethod(torch.logical_and)

    @staticmethod
    def put(dst, mask, src) -> None:
        """``dst[mask] = src`` in place (``src`` a number or an array of ``dst``'s shape)."""
        if isinstance(src, float):
            dst.masked_fill_(mask, src)
        else:
            torch.where(mask, src, dst, out=dst)

    @staticmethod
    def view(t: torch.Tensor):
        """``t`` as this kind of array, sharing its memory (here: itself)."""
        return t


class _NumpyOps:
    """The same on NumPy arrays: float32 ops with one rounding each (NumPy >= 2 keeps a
    Python scalar in the array's dtype), C's ``nearest_int`` through the int32 bits, row sums
    by ``np.add.reduce(axis=0)`` (row by row from +0, as :func:`common.seq_sum0`)."""
    where = staticmethod(np.where)
    zeros_like = staticmethod(np.zeros_like)
    GATHERS = True
    cap = staticmethod(np.minimum)

    # (np.clip and np.flatnonzero are Python wrappers, about twice these ufuncs' cost a call
    # on [512], the size of the descents' later passes, ``scripts/micro_figures.py
    # --numpy-searches``; Q3_K's descent calls each ~80 times per codec slice)
    @staticmethod
    def clip(a, lo: int, hi: int):
        return np.minimum(np.maximum(a, lo), hi)

    @staticmethod
    def flatnonzero(a):
        """The indices of the true values of the 1-D ``a``."""
        return a.nonzero()[0]

    @staticmethod
    def nearest_int(a):
        return ((a + np.float32(12582912.0)).view(np.int32) & 0x7FFFFF) - 0x400000

    div = staticmethod(np.divide)       # (a Python float numerator stays float32: NEP 50)

    @staticmethod
    def seq_sum(a):
        return np.add.reduce(a, axis=0)

    @staticmethod
    def float32(a):
        return a.astype(np.float32)

    @staticmethod
    def false_like(a):
        return np.zeros_like(a, dtype=bool)

    @staticmethod
    def take_cols(a, idx):
        return np.take(a, idx, axis=1)

    mul = staticmethod(np.multiply)
    greater = staticmethod(np.greater)
    less = staticmethod(np.less)
    logical_and = staticmethod(np.logical_and)

    @staticmethod
    def put(dst, mask, src) -> None:
        np.copyto(dst, src, where=mask)

    @staticmethod
    def view(t: torch.Tensor):
        return t.numpy()


#: the searches written for both (:class:`_TorchOps`) run in NumPy on the CPU, where their
#: many operations on small arrays cost torch's dispatch (tests switch this off to check the
#: torch operations, which other devices run, against llama.cpp's bytes)
NUMPY_SEARCHES_ON_CPU = True


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` over many sub-blocks.

    ``x``: float32 [n, S]. Weights are x². Up to 5 coordinate-descent passes; a sub-block
    stops after the first pass in which nothing changed (masks reproduce C's per-block
    ``break``). Returns (scale float32 [S], L float32 [n, S] with integers 0..2*nmax-1;
    all-zero sub-blocks give scale 0 and L = 0). On a CUDA device one Triton kernel
    (:func:`triton_searches.q3`), the same bits.
    """
    if triton_searches.available(x):
        with contextlib.suppress(triton_searches.KernelUnavailable):
            return triton_searches.q3(x, nmax, GROUP_MAX_EPS)
    n = x.shape[0]
    mx, amax = first_absmax(x, 0)
    zero = amax < GROUP_MAX_EPS
    # |iscale*x| <= nmax*(1 + eps) unless the sub-block is all zero (masked at the end)
    L = _round_clamp_(x * fdiv(float(-nmax), mx), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    p = torch.empty((n, 2) + x.shape[1:], dtype=x.dtype, device=x.device)
    torch.mul(wx, L, out=p[:, 0])
    torch.mul(w, L, out=p[:, 1])
    p[:, 1].mul_(L)
    s = seq_sum0(p)
    sumlx, suml2 = s[0], s[1]
    del p

    if NUMPY_SEARCHES_ON_CPU and x.device.type == "cpu":
        sums = _q3_descent(_NumpyOps, x.numpy(), w.numpy(), wx.numpy(), L.numpy(),
                           sumlx.numpy(), suml2.numpy(), (~zero).numpy(), nmax)
        sumlx, suml2 = (torch.from_numpy(v) for v in sums)
    else:
        sumlx, suml2 = _q3_descent(_TorchOps, x, w, wx, L, sumlx, suml2, ~zero, nmax)
    scale = torch.where(suml2 > 0, fdiv(sumlx, suml2), 0.0)
    L.add_(nmax)
    if bool(zero.any()):                # (a broadcast masked_fill_ is cheap: --levels)
        scale.masked_fill_(zero, 0.0)
        L.masked_fill_(zero, 0.0)
    return scale, L


def _q3_descent(xp, x, w, wx, L, sumlx, suml2, act, nmax: int):
    """:func:`make_q3_quants`' coordinate descent on arrays (torch tensors or NumPy arrays,
    operations of ``xp``: :class:`_TorchOps` or :class:`_NumpyOps`): ``x``, ``w`` = x²,
    ``wx`` = w*x float32 [n, S]; ``L`` float32 [n, S] (levels -nmax..nmax-1, updated in
    place); ``sumlx``, ``suml2`` float32 [S] (their sums); ``act`` bool [S] (False: an
    all-zero sub-block, left as it is). Returns the final (sumlx, suml2) (the arrays given
    may be overwritten).

    Pass 1 runs on all sub-blocks; later passes on a shrinking working set: the sub-blocks
    that changed something in the previous pass (C's per-block ``if (!n_changed) break``;
    most stop after one or two passes: of 16,384 Gaussian sub-blocks 3,264 go on to a second
    pass, 836 to a third). On the CPU these are NumPy's operations: the later passes' arrays
    are small, and a pass is 16 positions of ~12 operations on the row, then C's test on the
    few sub-blocks whose level would change (``xp.GATHERS``; torch's path tests whole rows
    and selects, as a device must without a synchronization). NumPy's descent takes about
    half the time of torch's operations, and gathering beats testing whole rows (one thread,
    ``scripts/micro_figures.py --numpy-searches``, figures in docs/benchmarks.md); the passes
    run in :func:`_descent_passes`."""
    def position(i, cols, La, slx_a, sl2_a, changed, first):
        xi, wi, wxi = (c[i] for c in cols)
        li = La[i]
        a = act if first else None                      # (only pass 1 holds all-zero ones)
        slx = slx_a - wxi * li
        wl = wi * li
        sl2 = sl2_a - wl * li
        t = xi * sl2
        t /= slx                                        # x*sl2/slx
        new_l = xp.float32(xp.clip(xp.nearest_int(t), -nmax, nmax - 1))
        if xp.GATHERS:
            # C goes on only where slx > 0 and the level changes: a few sub-blocks per
            # position, so the test runs on those alone, gathered (a select of a whole row
            # costs several products: scripts/micro_figures.py --numpy-searches)
            k = new_l != li
            k &= slx > 0
            if a is not None:
                k &= a
            k = xp.flatnonzero(k)
            if k.shape[0]:
                nl = new_l[k]
                slx2, sl22, accept = _q3_test(nl, slx[k], sl2[k], wi[k], wxi[k], slx_a[k], sl2_a[k])
                kk = k[accept]
                li[kk] = nl[accept]
                slx_a[kk] = slx2[accept]
                sl2_a[kk] = sl22[accept]
                changed[kk] = True
            return slx_a, sl2_a
        slx2, sl22, accept = _q3_test(new_l, slx, sl2, wi, wxi, slx_a, sl2_a)
        accept &= slx > 0
        accept &= new_l != li
        if a is not None:
            accept &= a
        La[i] = xp.where(accept, new_l, li)
        changed |= accept
        return xp.where(accept, slx2, slx_a), xp.where(accept, sl22, sl2_a)

    return _descent_passes(xp, (x, w, wx), L, sumlx, suml2, position)


def _descent_passes(xp, cols, L, sumlx, suml2, position):
    """Up to 5 passes over the n positions of many groups' coordinate descent, as C's
    make_q3_quants and make_qp_quants run theirs for one group, stopping after a pass that
    changed nothing: the first pass on every group, each later one only on the groups that
    changed something in the pass before (a group that changed nothing stays where it is, as
    its next pass would repeat the same operations on the same state).

    ``cols``: float32 arrays [n, S] the passes read (torch tensors or NumPy arrays, ``xp``'s
    kind); ``L`` [n, S] the levels, updated in place; ``sumlx``, ``suml2`` [S] the sums (the
    arrays given may be overwritten). ``position(i, cols, L, sumlx, suml2, changed, first)``
    runs position i of a pass on the working set (its columns of each array: [n, S'] and
    [S']), updates the levels of row i, marks the groups it changed in the bool [S']
    ``changed`` (in place) and returns the new (sumlx, suml2); ``first``: pass 1. Returns
    the final (sumlx, suml2)."""
    n = L.shape[0]
    idx = None                                          # None: the full set
    ca, La, slx_a, sl2_a = cols, L, sumlx, suml2
    for p in range(5):
        changed = xp.false_like(slx_a)
        for i in range(n):
            slx_a, sl2_a = position(i, ca, La, slx_a, sl2_a, changed, p == 0)
        if idx is None:
            sumlx, suml2 = slx_a, sl2_a                 # L was updated in place
        else:
            L[:, idx] = La
            sumlx[idx] = slx_a
            suml2[idx] = sl2_a
        keep = xp.flatnonzero(changed)
        if keep.shape[0] == 0:
            break
        idx = keep if idx is None else idx[keep]
        ca = tuple(xp.take_cols(a, keep) for a in ca)
        La = xp.take_cols(La, keep)
        slx_a, sl2_a = slx_a[keep], sl2_a[keep]
    return sumlx, suml2


def _q3_test(new_l, slx, sl2, w, wx, slx_a, sl2_a):
    """C's test in make_q3_quants' descent for a level ``new_l`` at one position: with
    ``slx``, ``sl2`` the sums without the position, the sums with the new level and whether
    ``sl2 > 0 && slx*slx*suml2 > sumlx*sumlx*sl2`` (``slx_a``, ``sl2_a``: the sums now).
    All arrays [k] of one kind (torch or NumPy); returns (slx2, sl22, accept bool [k])."""
    slx2 = wx * new_l
    slx2 += slx
    wl = w * new_l
    wl *= new_l
    sl22 = sl2 + wl
    lhs = slx2 * slx2
    lhs *= sl2_a
    rhs = slx_a * slx_a
    rhs *= sl22
    accept = lhs > rhs                                  # (s*s)*Sl2 > (Slx*Slx)*t
    accept &= sl22 > 0
    return slx2, sl22, accept


def make_qkx2_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float,
                     nstep: int, use_mad: bool,
                     xmin: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp ``make_qkx2_quants`` over many sub-blocks (affine scale + min search); also
    ``make_qkx3_quants`` with weights and ``nstep >= 1`` (the importance-matrix paths), which
    is the same computation (its ``max <= min`` test equals ``max == min``, as min <= max).

    ``x``, ``w``: float32 [n, S] (values and weights). Tries ``nstep + 1`` inverse scales
    ``(rmin + rdelta*k + nmax) / (max - min)``, each followed by a weighted least-squares fit
    of scale and min, keeping the lowest weighted error (|e| if ``use_mad`` else e²); as in
    C, an accepted fit's min is used by the following steps. Returns (scale [S],
    the_min [S] >= 0, L float32 [n, S] of integers 0..nmax), so that x ≈ scale*L - the_min.
    Constant sub-blocks (max == min after min is capped at 0) give scale 0, L 0 and
    the_min = -min. ``xmin`` float32 [S]: each sub-block's minimum as C's scan finds it (the
    first of equal values, which fixes the sign of a zero minimum; it matters where the_min
    is stored as it is, as in Q4_1/Q5_1); None: ``x.amin(0)``. On a CUDA device one Triton
    kernel (:func:`triton_searches.qkx2`); on the CPU, once enabled, the steps are compiled
    loops (:mod:`compiled_searches`): the same bits.
    """
    if triton_searches.available(x):
        with contextlib.suppress(triton_searches.KernelUnavailable):
            return triton_searches.qkx2(x, w, nmax, rmin, rdelta, nstep, use_mad, xmin)
    n, S = x.shape
    dev = x.device
    ends = torch.stack([x.amin(0) if xmin is None else xmin, x.amax(0)])    # [xmin, max] per sub-block
    xmin, mx = ends[0], ends[1]
    # per-sub-block scalars live in rows of small buffers, so that one op updates several
    V = torch.empty((5, S), dtype=torch.float32, device=dev)     # sum_x, sum_w, then the step's sum_l2, sum_l, sum_xl
    sum_x, sum_w = V[0], V[1]
    # C starts these two with the first term: sum_w = weights[0], sum_x = sum_w*x[0]
    seq_sum0(w, sum_w, from_first=True)
    wx = w * x
    seq_sum0(wx, sum_x, from_first=True)
    del wx
    mn0 = torch.where(xmin > 0, 0.0, xmin)
    degenerate = mx == mn0
    dead = degenerate if bool(degenerate.any()) else None

    fast_ok = FAST_ROUNDING_ON_CPU and x.device.type == "cpu"
    T = None if fast_ok else torch.empty_like(x)
    E = torch.empty_like(x)
    p = torch.empty((n, 3, S), dtype=x.dtype, device=dev)      # w*l*l, w*l, w*l*x
    chk = torch.empty((2, S), dtype=torch.float32, device=dev)

    def quant(iscale: torch.Tensor, mn: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        nonlocal T
        if fast_ok:
            # x -> iscale*(x - min), rounded after each op, is monotonic in x, so every value
            # lies between those at the block's smallest and largest x: if both ends are within
            # the exact range of the float rounding path for every live sub-block (a host
            # check, CPU only), use it; otherwise (never seen in practice) C's integer path.
            # There round() (half to even) equals nearest_int; it may give -0.0 where C has
            # +0, which changes no sum or error (only the sign of an all-zero sum, for which
            # D = 0 and the fit is not taken) and no integer level.
            torch.sub(ends, mn, out=chk)
            chk.mul_(iscale).abs_()
            if dead is not None:
                chk.masked_fill_(dead, 0.0)
            if bool(chk.amax() <= NI_SAFE):            # NaN -> False
                torch.sub(x, mn, out=out)
                out.mul_(iscale)            # iscale*(x - min)
                return out.round_().clamp_(0, nmax)
            if T is None:
                T = torch.empty_like(x)
        torch.sub(x, mn, out=T)
        T.mul_(iscale)                      # iscale*(x - min)
        return _ni_clamp_(T, 0, nmax, out)

    def error(scale: torch.Tensor, mn: torch.Tensor, la: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        torch.mul(la, scale, out=E)         # scale*L
        E.add_(mn)                          # + min
        E.sub_(x)                           # - x
        if use_mad:
            E.abs_()
        else:
            E.mul_(E)
        E.mul_(w)
        return seq_sum0(E, out)

    # state: ST = [sel_iscale, sel_shift, best, scale, min]; the step's candidate
    # NEW = [iscale, min used, error, this_scale, this_min]; an accepted step copies NEW
    # into ST (the L kept is recomputed at the end from its inverse scale and shift)
    ST = torch.empty((5, S), dtype=torch.float32, device=dev)
    NEW = torch.empty((5, S), dtype=torch.float32, device=dev)
    sel_iscale, sel_shift, best, scale, mn = ST.unbind(0)
    iscale, mn_used, cur, this_scale, this_min = NEW.unbind(0)
    Q = torch.empty((6, S), dtype=torch.float32, device=dev)
    R = torch.empty((3, S), dtype=torch.float32, device=dev)     # D, D*this_scale, D*this_min numerators
    den = torch.empty(S, dtype=torch.float32, device=dev)
    alt = torch.empty(S, dtype=torch.float32, device=dev)
    pos = torch.empty(S, dtype=torch.bool, device=dev)
    take = torch.empty(S, dtype=torch.bool, device=dev)
    keep = _RowSelect(ST, NEW)

    mn.copy_(mn0)
    sel_shift.copy_(mn0)
    torch.sub(mx, mn, out=den)
    torch.div(torch.full_like(den, float(nmax)), den, out=sel_iscale)
    torch.div(torch.ones_like(den), sel_iscale, out=scale)
    la = torch.empty_like(x)
    error(scale, mn, quant(sel_iscale, mn, la), best)
    # the loop's operands as views bound once (each indexing is a dispatch of its own)
    p_l2, p_l, p_xl = p.unbind(1)
    sums, sum_l, sum_xl, sum_l2 = V[2:5], V[3], V[4], V[2]
    l2_xl, l2_l, l_xl = V[2::2], V[2:4], V[3:5]
    q_w, q_x, q_l, q_a, q_b = Q[0:2], Q[2::2], Q[3::2], Q[0:3], Q[3:6]
    fit_num, fit_d, fit = R[1:3], R[0], NEW[3:5]
    lt = torch.empty(S, dtype=torch.bool, device=dev)
    # the acceptance test's operations on these [S] rows: NumPy's on the CPU, on views of the
    # same memory (NumPy's comparisons and masked writes cost less per call on rows this
    # small: ``scripts/micro_figures.py --numpy-searches``, docs/benchmarks.md), torch's
    # elsewhere
    sm = _NumpyOps if NUMPY_SEARCHES_ON_CPU and dev.type == "cpu" else _TorchOps
    (pos_, take_, lt_, this_min_, this_scale_, alt_, sum_xl_, sum_l2_, fit_d_, cur_,
     best_) = map(sm.view, (pos, take, lt, this_min, this_scale, alt, sum_xl, sum_l2, fit_d, cur, best))
    # C: rmin + rdelta*is + nmax with float parameters rmin, rdelta (e.g. 0.1f)
    nums = [f32(f32(f32(rmin) + f32(f32(rdelta) * k)) + nmax) for k in range(nstep + 1)]
    k0 = 0
    if fast_ok and compiled_searches.enabled():
        # the steps as compiled loops (the same bits), up to a step outside the fast
        # rounding's range, from which the steps below go on
        k0 = compiled_searches.run_steps(x, w, ends, dead, ST, sum_w, sum_x, nmax, nums, use_mad,
                                         NI_SAFE)
    for num in nums[k0:]:
        torch.sub(mx, mn, out=den)
        iscale.fill_(num).div_(den)         # num / (max - min)
        mn_used.copy_(mn)
        quant(iscale, mn, la)
        torch.mul(w, la, out=p_l)           # w*l
        torch.mul(p_l, la, out=p_l2)        # (w*l)*l
        torch.mul(p_l, x, out=p_xl)         # (w*l)*x
        seq_sum0(p, sums)                   # sum_l2, sum_l, sum_xl
        torch.mul(l2_xl, sum_w, out=q_w)    # sum_w*sum_l2, sum_w*sum_xl
        torch.mul(l2_l, sum_x, out=q_x)     # sum_l2*sum_x, sum_x*sum_l (rows 2, 4)
        torch.mul(l_xl, sum_l, out=q_l)     # sum_l*sum_l, sum_l*sum_xl (rows 3, 5)
        torch.sub(q_a, q_b, out=R)          # D, sum_w*sum_xl - sum_x*sum_l, sum_l2*sum_x - sum_l*sum_xl
        torch.div(fit_num, fit_d, out=fit)  # this_scale, this_min
        sm.greater(this_min_, 0, out=pos_)
        sm.put(this_min_, pos_, 0.0)
        sm.div(sum_xl_, sum_l2_, out=alt_)  # sum_xl / sum_l2
        sm.put(this_scale_, pos_, alt_)
        error(this_scale, this_min, la, cur)
        sm.greater(fit_d_, 0, out=take_)
        sm.logical_and(take_, sm.less(cur_, best_, out=lt_), out=take_)
        keep(take)
    L = quant(sel_iscale, sel_shift, la)
    if dead is None:                    # (a broadcast masked_fill_ is cheap: --levels)
        return scale.clone(), mn.neg(), L
    scale = torch.where(degenerate, 0.0, scale)
    the_min = -torch.where(degenerate, mn0, mn)
    L.masked_fill_(degenerate, 0.0)
    return scale, the_min, L


def make_qp_quants(x: torch.Tensor, w: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp ``make_qp_quants(n, nmax, x, L, quant_weights)`` over many groups: the
    non-negative quantization of a super-block's sub-block scales (or mins) with weights.

    ``x``, ``w``: float32 [n, S] (value i of group s at ``x[i, s]``; n = 8 or 16, S groups).
    Inverse scale nmax/max, then (nmax + 0.1*t)/max for t = -4..4 if its weighted squared
    error is lower; then up to 5 coordinate-descent passes. Returns (scale float32 [S],
    L int32 [n, S] of the uint8 values C stores: 0..nmax, or wrapped modulo 256 for
    negative x), on ``x``'s device. Groups whose max is below 1e-15 give scale 0, L = 0. All
    work is on the small [n, S] arrays, with C's integer ``nearest_int`` throughout.

    These arrays are small (Q4_K: [8, 2048] per codec slice) and the search and up to 5
    passes over 8 positions of ~35 operations each are mostly the operations' dispatch: on
    the CPU they run in NumPy (:data:`NUMPY_SEARCHES_ON_CPU`: NumPy's cost per operation on
    such rows is lower than torch's; ``scripts/micro_figures.py --numpy-searches``, figures in
    docs/benchmarks.md); elsewhere in torch. Both run :func:`_qp_search`, the same operations
    in the same order; the descent's passes after the first work only on the groups that
    changed (:func:`_qp_descent`), and in NumPy C's test only on the groups whose level would
    change.
    """
    if triton_searches.available(x):      # on a CUDA device: one kernel, the same bits
        with contextlib.suppress(triton_searches.KernelUnavailable):
            return triton_searches.qp(x, w, nmax, GROUP_MAX_EPS)
    if NUMPY_SEARCHES_ON_CPU and x.device.type == "cpu":
        scale, L = _qp_search(_NumpyOps, x.contiguous().numpy(), w.contiguous().numpy(), nmax)
        return torch.from_numpy(scale), torch.from_numpy(L)
    return _qp_search(_TorchOps, x, w, nmax)


def _qp_search(xp, x, w, nmax: int):
    """:func:`make_qp_quants` on arrays ``x``, ``w`` (torch tensors or NumPy arrays) with the
    operations of ``xp`` (:class:`_TorchOps` or :class:`_NumpyOps`)."""
    n = x.shape[0]
    # C: max = MAX(max, x[i]) from 0 (the macro keeps max unless max > x[i] fails)
    mx = xp.zeros_like(x[0])
    for i in range(n):
        mx = xp.where(mx > x[i], mx, x[i])
    zero = mx < GROUP_MAX_EPS
    iscale = xp.div(float(nmax), mx)

    def mse(scale, lf):
        diff = x - scale * lf
        return xp.seq_sum(w * diff * diff)   # (w*diff)*diff, left to right

    # first estimate: L stored unclamped as uint8, and that stored value enters the error
    best = mse(xp.div(1.0, iscale), xp.float32(xp.nearest_int(iscale * x) & 0xFF))
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = xp.div(f32(f32(f32(0.1) * step) + nmax), mx)
        cur = mse(xp.div(1.0, iscale_is), xp.float32(xp.cap(xp.nearest_int(iscale_is * x), nmax)))
        take = cur < best
        best = xp.where(take, cur, best)
        iscale = xp.where(take, iscale_is, iscale)
    l = xp.cap(xp.nearest_int(iscale * x), nmax)
    wx = w * x
    lf = xp.float32(l)
    sumlx = xp.seq_sum(wx * lf)
    suml2 = xp.seq_sum(w * lf * lf)
    L = l & 0xFF                        # uint8 L[i]; the passes below read the stored value
    sumlx, suml2 = _qp_descent(xp, x, w, wx, L, sumlx, suml2, nmax)
    scale = xp.where(suml2 > 0, sumlx / suml2, 0.0)
    scale = xp.where(zero, 0.0, scale)
    return scale, xp.where(zero, 0, L)


def _qp_descent(xp, x, w, wx, L, sumlx, suml2, nmax: int):
    """:func:`_qp_search`'s coordinate descent (C's up to 5 passes over the n positions of
    each group) on arrays of ``xp``'s kind, in :func:`_descent_passes` as
    :func:`_q3_descent` runs its own: ``x``, ``w``, ``wx`` = w*x float32 [n, S]; ``L`` int32
    [n, S] (the stored uint8 levels, updated in place); ``sumlx``, ``suml2`` float32 [S].
    Returns the final (sumlx, suml2) (the arrays given may be overwritten).

    With ``xp.GATHERS`` (NumPy's, on the CPU) C's test runs only on the groups whose level
    would change at a position (with slx > 0 and sl2 > 0), gathered; torch's tests whole rows
    and selects, as a device must without a synchronization per position."""
    def position(i, cols, La, slx_a, sl2_a, changed, first):
        xi, wi, wxi = (c[i] for c in cols)
        li = xp.float32(La[i])
        slx = slx_a - wxi * li
        wl = wi * li
        sl2 = sl2_a - wl * li
        new_l = xp.cap(xp.nearest_int(xi * sl2 / slx), nmax)
        if not xp.GATHERS:
            slx2, sl22, accept = _qp_test(xp.float32(new_l), slx, sl2, wi, wxi, slx_a, sl2_a)
            accept &= (slx > 0) & (sl2 > 0) & (new_l != La[i])
            La[i] = xp.where(accept, new_l & 0xFF, La[i])
            changed |= accept
            return xp.where(accept, slx2, slx_a), xp.where(accept, sl22, sl2_a)
        k = new_l != La[i]
        k &= slx > 0
        k &= sl2 > 0
        k = xp.flatnonzero(k)
        if k.shape[0]:
            nk = new_l[k]
            slx2, sl22, accept = _qp_test(xp.float32(nk), slx[k], sl2[k], wi[k], wxi[k], slx_a[k], sl2_a[k])
            kk = k[accept]
            La[i][kk] = nk[accept] & 0xFF
            slx_a[kk] = slx2[accept]
            sl2_a[kk] = sl22[accept]
            changed[kk] = True
        return slx_a, sl2_a

    return _descent_passes(xp, (x, w, wx), L, sumlx, suml2, position)


def _qp_test(nl, slx, sl2, w, wx, slx_a, sl2_a):
    """C's test in make_qp_quants' descent for a level ``nl`` (float32) at one position: with
    ``slx``, ``sl2`` the sums without the position, the sums with the new level and whether
    ``slx*slx*suml2 > sumlx*sumlx*sl2`` (``slx_a``, ``sl2_a``: the sums now; the callers add
    C's conditions on slx, sl2 and the level). All arrays of one shape and kind (torch or
    NumPy); returns (slx2, sl22, accept bool)."""
    slx2 = slx + wx * nl
    sl22 = sl2 + w * nl * nl
    return slx2, sl22, slx2 * slx2 * sl2_a > slx_a * slx_a * sl22


# ============================================================================ Q2_K

def _q2_k_bytes(x: torch.Tensor, xs: torch.Tensor, L: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
                dmin: torch.Tensor) -> torch.Tensor:
    """Tail shared by the Q2_K quantizers: the scale bytes ``sc`` (int32 [nb, 16]: 4-bit
    scale | 4-bit min << 4) and d/dmin (float32 [nb, 1]) give the requantization of ``x``
    (float32 [nb, 256], ``xs`` the same [16, S] positions first; ``L`` float32 [16, S]
    positions first, kept where the scale is 0);
    returns the block bytes uint8 [nb, 84]."""
    dj = (fp16_round(d) * (sc & 0xF).to(torch.float32)).reshape(1, -1)
    mj = (fp16_round(dmin) * (sc >> 4).to(torch.float32)).reshape(1, -1)
    Lb = _requant_bytes(x, xs, mj, dj, 0, 3, L)
    return torch.cat([sc.to(torch.uint8), _pack_2bit(Lb), fp16_bytes(d), fp16_bytes(dmin)], dim=1)


@sliced(search=True)
def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q2_K_ref``: float32 [nb, 256] -> uint8 [nb, 84].

    16 sub-blocks of 16: make_qkx2_quants(nmax 3, w = |x|, rmin -0.5, rdelta 0.1, 15 steps,
    MAD); 4-bit scales and mins relative to fp16 d = max_scale/15, dmin = max_min/15; then
    requantization with the fp16-rounded d/dmin. Layout: scales[16], qs[64], d, dmin.
    """
    nb = x.shape[0]
    xs = _positions_first(x, 16)
    scale, the_min, L = make_qkx2_quants(xs, xs.abs(), 3, -0.5, 0.1, 15, True)
    scale = scale.reshape(nb, 16)
    the_min = the_min.reshape(nb, 16)
    max_scale = _positive_max(scale).unsqueeze(1)
    max_min = _positive_max(the_min).unsqueeze(1)

    has_s = max_scale > 0
    ls = torch.where(has_s, nearest_int(fdiv(15.0, max_scale) * scale), 0)
    d = torch.where(has_s, fdiv(max_scale, 15.0), 0.0)
    has_m = max_min > 0
    lm = torch.where(has_m, nearest_int(fdiv(15.0, max_min) * the_min), 0)
    dmin = torch.where(has_m, fdiv(max_min, 15.0), 0.0)
    sc = (ls | (lm << 4)) & 0xFF          # uint8 scales[j]
    return _q2_k_bytes(x, xs, L, sc, d, dmin)


@sliced(search=True)
def quantize_q2_k_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: None = None) -> torch.Tensor:
    """llama.cpp ``quantize_row_q2_K_impl`` (with ``quant_weights``): float32 [nb, 256] and
    the blocks' importance weights ``qw`` float32 [nb, 256] -> uint8 [nb, 84].

    sigma2 = sum(x²)/256 per super-block; make_qkx3_quants(nmax 3, rmin -0.9, rdelta 0.05,
    36 steps, MSE) of each sub-block of 16 weighted by qw*sqrt(sigma2 + x²); d and dmin from
    make_qp_quants(nmax 15) of the scales and of the mins weighted by the sub-blocks' weight
    sums; requantization with fp16 d/dmin. ``row_sigma2`` is unused (None). Layout as Q2_K.
    """
    nb = x.shape[0]
    xs = _positions_first(x, 16)
    w = _importance_weights(xs, qw, _superblock_sigma2(x, 1.0))
    sw = _by_block(seq_sum0(w), nb)
    scale, the_min, L = make_qkx2_quants(xs, w, 3, -0.9, 0.05, 36, False)
    del w
    d, ls, dmin, lm = _qp_scales_and_mins(scale, the_min, sw, 15)
    sc = (ls | (lm << 4)) & 0xFF          # uint8 scales[j] = Ls[j] | (Lm[j] << 4)
    return _q2_k_bytes(x, xs, L, sc, d.unsqueeze(1), dmin.unsqueeze(1))


@sliced
def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q2_K``: uint8 [nb, 84] -> float32 [nb, 256],
    ``(d * (sc & 15)) * q - dmin * (sc >> 4)`` per sub-block of 16."""
    nb = b.shape[0]
    sc = b[:, 0:16].to(torch.int32)
    q = _unpack_2bit(b[:, 16:80]).to(torch.float32).reshape(nb, 16, 16)
    d = bytes_fp16(b[:, 80:82])
    dmin = bytes_fp16(b[:, 82:84])
    dl = (d * (sc & 0xF).to(torch.float32)).unsqueeze(-1)
    ml = (dmin * (sc >> 4).to(torch.float32)).unsqueeze(-1)
    return (dl * q - ml).reshape(nb, QK_K)


# ============================================================================ Q3_K

#: Q3_K's slices on the CPU are this many times the other codecs' (common.CPU_SLICE_ELEMENTS):
#: make_q3_quants' descent passes after the first run ~64 positions of NumPy operations on a
#: few hundred to a few thousand sub-blocks, a cost per slice more than per value. Twice the
#: slice was the fastest of 1x, 2x and 4x, with and without an imatrix, and end to end on the
#: 554M random llama's Q3_K_M (``scripts/micro_figures.py --q3-slices``, ``scripts/bench_gguf.py
#: --model synth4x --policy Q3_K_M``; figures in docs/benchmarks.md)
Q3_K_SLICE_FACTOR = 2


def _q3_k_bytes(x: torch.Tensor, xs: torch.Tensor, L: torch.Tensor, l: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Tail shared by the Q3_K quantizers: the 6-bit scales ``l`` (int32 [nb, 16], 0..63,
    stored biased by 32) and d (float32 [nb, 1]) give the requantization of ``x`` (float32
    [nb, 256], ``xs`` the same [16, S] positions first; ``L`` float32 [16, S] of 0..7
    positions first, kept where the scale is 0);
    returns the block bytes uint8 [nb, 110]."""
    nb = d.shape[0]
    lo = l & 0xF
    hi = (l >> 4).reshape(nb, 4, 4)    # [group j//4, j%4]
    sc_hi = hi[:, 0] | (hi[:, 1] << 2) | (hi[:, 2] << 4) | (hi[:, 3] << 6)
    scales = torch.cat([lo[:, :8] | (lo[:, 8:] << 4), sc_hi], dim=1)

    # requantize: sc = stored 6-bit scale - 32
    dj = (fp16_round(d) * (l - 32).to(torch.float32)).reshape(1, -1)
    Lb = _requant_bytes(x, xs, None, dj, -4, 3, L)
    return torch.cat([_q3_hmask(Lb), _pack_2bit(Lb & 3), (scales & 0xFF).to(torch.uint8), fp16_bytes(d)],
                     dim=1)


def _q3_hmask(Lb: torch.Tensor) -> torch.Tensor:
    """Q3_K's hmask: uint8 [nb, 256] levels 0..7 -> uint8 [nb, 32] whose byte m holds in bit j
    the high bit (4) of level 32j + m. By uint8 shifts and ORs: on the CPU torch's uint8
    comparison ``Lb > 3`` takes 10x ``Lb >> 2``, and int32 shifts summed over j cost more than
    these 7 ORs (``scripts/micro_figures.py --levels``, figures in docs/benchmarks.md)."""
    h = (Lb >> 2).reshape(Lb.shape[0], 8, 32)
    hmask = h[:, 0].clone()
    for j in range(1, 8):
        hmask |= h[:, j] << j
    return hmask


@sliced(search=True, slice_factor=Q3_K_SLICE_FACTOR)
def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q3_K_ref``: float32 [nb, 256] -> uint8 [nb, 110].

    16 sub-blocks of 16: make_q3_quants(nmax 4, rmse); 6-bit signed scales
    ni(iscale * s_j) with iscale = -32 / max_scale (max_scale: the sub-block scale of largest
    magnitude, first on ties) and d = fp16(1 / iscale); requantization with fp16 d.
    Layout: hmask[32], qs[64], scales[12], d.
    """
    nb = x.shape[0]
    xs = _positions_first(x, 16)
    scale, L = make_q3_quants(xs, 4)
    scale = scale.reshape(nb, 16)
    max_scale, _ = first_absmax(scale, 1)
    max_scale = max_scale.unsqueeze(1)
    nz = max_scale != 0
    iscale = fdiv(-32.0, max_scale)
    l = (to_int8(nearest_int(iscale * scale)).clamp_(-32, 31) + 32)
    l = torch.where(nz, l, 0)           # (all scales zero: stored 0, i.e. sc = -32)
    d = torch.where(nz, fdiv(1.0, iscale), 0.0)
    return _q3_k_bytes(x, xs, L, l, d)


@sliced(search=True, slice_factor=Q3_K_SLICE_FACTOR)
def quantize_q3_k_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: None = None) -> torch.Tensor:
    """llama.cpp ``quantize_row_q3_K_impl`` with ``quant_weights``: float32 [nb, 256] and
    the blocks' importance weights ``qw`` float32 [nb, 256] -> uint8 [nb, 110].

    sigma2 = 2*sum(x²)/256 per super-block; make_qx_quants(nmax 4) of each sub-block of 16
    weighted by qw*sqrt(sigma2 + x²); the 6-bit scales and d from make_qx_quants(nmax 32)
    of the 16 sub-block scales weighted by the sub-blocks' weight sums; requantization with
    fp16 d. ``row_sigma2`` is unused (None). Layout as Q3_K.
    """
    nb = x.shape[0]
    xs = _positions_first(x, 16)
    w = _importance_weights(xs, qw, _superblock_sigma2(x, 2.0))
    sw = _by_block(seq_sum0(w), nb)
    scale, L = make_qx_quants(xs, 4, w)
    del w
    d, ls = make_qx_quants(_by_block(scale, nb), 32, sw)
    return _q3_k_bytes(x, xs, L, ls.t().to(torch.int32), d.unsqueeze(1))


@sliced
def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q3_K``: uint8 [nb, 110] -> float32 [nb, 256],
    ``(d * (sc - 32)) * (q - (hmask bit ? 0 : 4))`` per sub-block of 16."""
    nb = b.shape[0]
    hm = b[:, 0:32].to(torch.int32)
    q = _unpack_2bit(b[:, 32:96])
    s = b[:, 96:108].to(torch.int32)
    d = bytes_fp16(b[:, 108:110])
    shifts = torch.arange(8, device=b.device, dtype=torch.int32).reshape(1, 8, 1)
    hbit = ((hm.unsqueeze(1) >> shifts) & 1).reshape(nb, QK_K)
    q = (q - ((1 - hbit) << 2)).to(torch.float32).reshape(nb, 16, 16)
    lo = torch.cat([s[:, :8] & 0xF, s[:, :8] >> 4], dim=1)
    sh = torch.arange(0, 8, 2, device=b.device, dtype=torch.int32).reshape(1, 4, 1)
    hi = ((s[:, 8:12].unsqueeze(1) >> sh) & 3).reshape(nb, 16)
    sc = (lo | (hi << 4)) - 32
    dl = (d * sc.to(torch.float32)).unsqueeze(-1)
    return (dl * q).reshape(nb, QK_K)


# ============================================================================ Q4_K / Q5_K

def _k4_requant(x: torch.Tensor, xs: torch.Tensor, L: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                ls: torch.Tensor, lm: torch.Tensor, nmax: int,
                read_back: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Tail shared by the Q4_K/Q5_K quantizers: pack the 6-bit scales/mins (int32 [nb, 8],
    the values C stores in uint8), requantize with fp16 d/dmin (float32 [nb, 1]) and the
    scales as ``get_scale_min_k4`` reads them back (``read_back``: values above 63, whose
    bits overlap in the packing, are possible), ``x`` float32 [nb, 256] (``xs`` the same
    [32, S] positions first, ``L`` the search's levels there). Returns (head uint8 [nb, 16]:
    d, dmin, scales[12]; L uint8 [nb, 256] of 0..nmax)."""
    packed = _pack_scale_min_k4(ls, lm)
    if read_back:
        ls, lm = _unpack_scale_min_k4(packed)
    dj = (fp16_round(d) * ls.to(torch.float32)).reshape(1, -1)
    mj = (fp16_round(dmin) * lm.to(torch.float32)).reshape(1, -1)
    head = torch.cat([fp16_bytes(d), fp16_bytes(dmin), packed], dim=1)
    return head, _requant_bytes(x, xs, mj, dj, 0, nmax, L)


def _k4_scales(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    """Shared part of quantize_row_q4_K_ref / q5_K_ref: sub-block fits, 6-bit scales/mins,
    fp16 d/dmin and the requantized L (uint8 [nb, 256], 0..nmax)."""
    nb = x.shape[0]
    xs = _positions_first(x, 32)
    sum_x2 = seq_sum0(xs * xs)
    av_x = sqrtf(fdiv(sum_x2, 32.0))
    w = xs.abs()
    w += av_x
    scale, the_min, L = make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, False)
    del w
    scale = scale.reshape(nb, 8)
    the_min = the_min.reshape(nb, 8)
    max_scale = _positive_max(scale).unsqueeze(1)
    max_min = _positive_max(the_min).unsqueeze(1)
    inv_scale = torch.where(max_scale > 0, fdiv(63.0, max_scale), 0.0)
    inv_min = torch.where(max_min > 0, fdiv(63.0, max_min), 0.0)
    ls = (nearest_int(inv_scale * scale) & 0xFF).clamp_max_(63)
    lm = (nearest_int(inv_min * the_min) & 0xFF).clamp_max_(63)
    d = fdiv(max_scale, 63.0)
    dmin = fdiv(max_min, 63.0)
    return _k4_requant(x, xs, L, d, dmin, ls, lm, nmax)


def _superblock_sigma2(x: torch.Tensor, factor: float) -> torch.Tensor:
    """C's ``sumx2 = 0; for (j = 0; j < QK_K; ++j) sumx2 += x[j]*x[j]; sigma2 =
    factor*sumx2/QK_K`` (factor 2 in Q3_K..Q5_K, 1 in Q2_K): float32 [nb, 256] -> [nb]."""
    xt = x.t().contiguous()             # positions first: the 256 steps on contiguous rows
    s = seq_sum0(xt * xt)
    if factor != 1:
        s = s * factor
    return fdiv(s, float(QK_K))


def _importance_weights(xs: torch.Tensor, qw: torch.Tensor, sigma2: torch.Tensor) -> torch.Tensor:
    """``weight[l] = qw[l] * sqrtf(sigma2 + x[l]*x[l])`` positions first: ``xs`` float32
    [n, S] (sub-blocks of n), ``qw`` float32 [nb, 256] in block order, ``sigma2`` [nb]
    (per super-block) -> float32 [n, S]."""
    n = xs.shape[0]
    t = xs * xs
    t += sigma2.repeat_interleave(QK_K // n).unsqueeze(0)
    t = sqrtf(t)
    t *= _positions_first(qw, n)
    return t


def _by_block(v: torch.Tensor, nb: int) -> torch.Tensor:
    """Per-sub-block values [nb * k] -> [k, nb] (each super-block's k values as a column)."""
    return v.reshape(nb, -1).t().contiguous()


def _qp_scales_and_mins(scale: torch.Tensor, the_min: torch.Tensor, sw: torch.Tensor, nmax: int):
    """C's ``make_qp_quants(k, nmax, scales, Ls, sw)`` and ``make_qp_quants(k, nmax, mins,
    Lm, sw)`` in one call (the same weights): ``scale``, ``the_min`` float32 [nb * k] per
    sub-block, ``sw`` float32 [k, nb] -> (d [nb], Ls int32 [nb, k], dmin [nb], Lm [nb, k])."""
    nb = sw.shape[1]
    v, L = make_qp_quants(torch.cat([_by_block(scale, nb), _by_block(the_min, nb)], 1), sw.repeat(1, 2), nmax)
    return v[:nb], L[:, :nb].t(), v[nb:], L[:, nb:].t()


def _k4_scales_weighted(x: torch.Tensor, qw: torch.Tensor, nmax: int):
    """Shared part of quantize_row_q4_K_impl / q5_K_impl (with quant_weights): weights
    qw*sqrt(sigma2 + x²), make_qkx3_quants(rmin -0.9, rdelta 0.05, 36 steps, MSE) per
    sub-block of 32, then make_qp_quants(nmax 63) of the scales and of the mins weighted by
    the sub-blocks' weight sums. Returns (head uint8 [nb, 16], L uint8 [nb, 256])."""
    nb = x.shape[0]
    xs = _positions_first(x, 32)
    w = _importance_weights(xs, qw, _superblock_sigma2(x, 2.0))
    sw = _by_block(seq_sum0(w), nb)
    scale, the_min, L = make_qkx2_quants(xs, w, nmax, -0.9, 0.05, 36, False)
    del w
    d, ls, dmin, lm = _qp_scales_and_mins(scale, the_min, sw, 63)
    if nmax == 31:                      # (Q5_K only: C's MIN(63, ls))
        ls, lm = ls.clamp_max(63), lm.clamp_max(63)
    return _k4_requant(x, xs, L, d.unsqueeze(1), dmin.unsqueeze(1), ls, lm, nmax, read_back=True)


def _q4_k_bytes(head: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Q4_K block bytes from the head [nb, 16] and the levels uint8 [nb, 256]."""
    q = L.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).to(torch.uint8).reshape(-1, 128)
    return torch.cat([head, qs], dim=1)


def _q5_k_bytes(head: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """Q5_K block bytes from the head [nb, 16] and the levels uint8 [nb, 256] (5th bit to qh)."""
    q = L.reshape(-1, 4, 2, 32)
    a, bb = q[:, :, 0], q[:, :, 1]
    ha, hb = a > 15, bb > 15
    a = a & 15
    bb = bb & 15
    qs = (a | (bb << 4)).to(torch.uint8).reshape(-1, 128)
    shifts = torch.arange(0, 8, 2, device=L.device, dtype=torch.int32).reshape(1, 4, 1)
    qh = ((ha.to(torch.int32) << shifts) | (hb.to(torch.int32) << (shifts + 1))).sum(1, dtype=torch.int32)
    return torch.cat([head, qh.to(torch.uint8), qs], dim=1)


@sliced(search=True)
def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q4_K_ref``: float32 [nb, 256] -> uint8 [nb, 144].

    8 sub-blocks of 32: weights sqrt(mean x²) + |x|, make_qkx2_quants(nmax 15, rmin -1,
    rdelta 0.1, 20 steps, MSE); 6-bit scales/mins relative to fp16 d = max_scale/63 and
    dmin = max_min/63; requantization with fp16 d/dmin. Layout: d, dmin, scales[12], qs[128].
    """
    return _q4_k_bytes(*_k4_scales(x, 15, -1.0, 20))


@sliced(search=True)
def quantize_q4_k_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: None = None) -> torch.Tensor:
    """llama.cpp ``quantize_row_q4_K_impl`` with ``quant_weights``: float32 [nb, 256] and
    the blocks' importance weights ``qw`` float32 [nb, 256] -> uint8 [nb, 144].

    sigma2 = 2*sum(x²)/256 per super-block; sub-block weights qw*sqrt(sigma2 + x²);
    make_qkx3_quants(nmax 15, rmin -0.9, rdelta 0.05, 36 steps, MSE); d and dmin from
    make_qp_quants(nmax 63) of the scales and mins weighted by the sub-blocks' weight sums;
    requantization with fp16 d/dmin. ``row_sigma2`` is unused (None). Layout as Q4_K.
    """
    return _q4_k_bytes(*_k4_scales_weighted(x, qw, 15))


@sliced
def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q4_K``: uint8 [nb, 144] -> float32 [nb, 256],
    ``(d * sc) * q - dmin * m`` per sub-block of 32."""
    nb = b.shape[0]
    d = bytes_fp16(b[:, 0:2])
    dmin = bytes_fp16(b[:, 2:4])
    ls, lm = _unpack_scale_min_k4(b[:, 4:16])
    qs = b[:, 16:144].reshape(nb, 4, 1, 32)
    # the nibbles on uint8, one conversion, then in place (through int32 the nibbles take
    # 3.3-3.5x as long: scripts/micro_figures.py --dequantize)
    q = torch.cat([qs & 0xF, qs >> 4], dim=2).to(torch.float32).reshape(nb, 8, 32)
    dl = (d * ls.to(torch.float32)).unsqueeze(-1)
    ml = (dmin * lm.to(torch.float32)).unsqueeze(-1)
    return q.mul_(dl).sub_(ml).reshape(nb, QK_K)


@sliced(search=True)
def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q5_K_ref``: float32 [nb, 256] -> uint8 [nb, 176].

    As Q4_K with make_qkx2_quants(nmax 31, rmin -0.5, rdelta 0.1, 15 steps, MSE); the 5th
    bit goes to qh. Layout: d, dmin, scales[12], qh[32], qs[128].
    """
    return _q5_k_bytes(*_k4_scales(x, 31, -0.5, 15))


@sliced(search=True)
def quantize_q5_k_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: None = None) -> torch.Tensor:
    """llama.cpp ``quantize_row_q5_K_impl`` with ``quant_weights``: float32 [nb, 256] and
    ``qw`` float32 [nb, 256] -> uint8 [nb, 176]. As :func:`quantize_q4_k_weighted` with
    make_qkx3_quants(nmax 31) and the 6-bit scales/mins capped at 63; layout as Q5_K.
    ``row_sigma2`` is unused (None).
    """
    return _q5_k_bytes(*_k4_scales_weighted(x, qw, 31))


@sliced
def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q5_K``: uint8 [nb, 176] -> float32 [nb, 256],
    ``(d * sc) * q - dmin * m`` per sub-block of 32, q with its qh bit."""
    nb = b.shape[0]
    d = bytes_fp16(b[:, 0:2])
    dmin = bytes_fp16(b[:, 2:4])
    ls, lm = _unpack_scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int32).reshape(nb, 1, 32)
    qs = b[:, 48:176].to(torch.int32).reshape(nb, 4, 1, 32)
    sh = torch.tensor([0, 4], device=b.device, dtype=torch.int32).reshape(1, 1, 2, 1)
    lo = ((qs >> sh) & 0xF).reshape(nb, 8, 32)
    hsh = torch.arange(8, device=b.device, dtype=torch.int32).reshape(1, 8, 1)
    hi = ((qh >> hsh) & 1) << 4
    q = (lo | hi).to(torch.float32)
    dl = (d * ls.to(torch.float32)).unsqueeze(-1)
    ml = (dmin * lm.to(torch.float32)).unsqueeze(-1)
    return (dl * q - ml).reshape(nb, QK_K)


# ============================================================================ Q6_K

@sliced(search=True)
def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``quantize_row_q6_K_ref``: float32 [nb, 256] -> uint8 [nb, 210].

    16 sub-blocks of 16: make_qx_quants(nmax 32, rmse_type 1); int8 scales
    MIN(127, ni(iscale * s_j)) with iscale = -128 / max_scale and d = fp16(1 / iscale);
    requantization with fp16 d. Blocks whose largest sub-block
    scale is below 1e-15 are all zero bytes. Layout: ql[128], qh[64], int8 scales[16], d.
    """
    return _q6_k(x, None)


@sliced(search=True)
def quantize_q6_k_weighted(x: torch.Tensor, qw: torch.Tensor, row_sigma2: None = None) -> torch.Tensor:
    """llama.cpp ``quantize_row_q6_K_impl`` with ``quant_weights``: float32 [nb, 256] and
    the blocks' importance weights ``qw`` float32 [nb, 256] -> uint8 [nb, 210].

    As :func:`quantize_q6_k` with make_qx_quants weighted by ``qw`` itself (C leaves its
    sigma2 weighting commented out). ``row_sigma2`` is unused (None).
    """
    return _q6_k(x, qw)


def _q6_k(x: torch.Tensor, qw: torch.Tensor | None) -> torch.Tensor:
    """quantize_row_q6_K_ref (``qw`` None) / quantize_row_q6_K_impl (``qw`` float32
    [nb, 256], passed as make_qx_quants' weights as they are)."""
    nb = x.shape[0]
    xs = _positions_first(x, 16)
    scale, L = make_qx_quants(xs, 32, None if qw is None else _positions_first(qw, 16))
    scale = scale.reshape(nb, 16)
    max_scale, max_abs = first_absmax(scale, 1)
    zero = (max_abs < GROUP_MAX_EPS).unsqueeze(1)
    iscale = fdiv(-128.0, max_scale).unsqueeze(1)
    d = fdiv(1.0, iscale)
    sc = to_int8(nearest_int(iscale * scale).clamp_max_(127))

    dj = (fp16_round(d) * sc.to(torch.float32)).reshape(1, -1)
    # the bit fields four levels at a time: each int32 lane holds four consecutive bytes
    # (levels 0..63, so no field crosses into the next byte; little-endian views)
    q = _requant_bytes(x, xs, None, dj, -32, 31, L).view(torch.int32).reshape(nb, 2, 4, 8)
    lo = q & 0x0F0F0F0F
    ql = torch.cat([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], dim=2)
    hi = (q >> 4).bitwise_and_(0x03030303)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = torch.cat([ql.reshape(nb, 32).view(torch.uint8), qh.reshape(nb, 16).view(torch.uint8),
                     (sc & 0xFF).to(torch.uint8), fp16_bytes(d)], dim=1)
    if bool(zero.any()):
        out.masked_fill_(zero, 0)
    return out


@sliced
def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """llama.cpp ``dequantize_row_q6_K``: uint8 [nb, 210] -> float32 [nb, 256],
    ``(d * sc) * (q - 32)`` per sub-block of 16."""
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 1, 64)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = bytes_fp16(b[:, 208:210])
    # bit fields on uint8, as Q4_K's nibbles (scripts/micro_figures.py --dequantize: through
    # int32 those take 3.3-3.5x as long); q - 32 is exact in float32
    lo = torch.cat([ql & 0xF, ql >> 4], dim=2).reshape(nb, 2, 4, 32)    # [h, k = 2*nibble + half, l]
    hi = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2)  # [h, k, l]
    q = (lo | (hi << 4)).to(torch.float32).sub_(32.0).reshape(nb, 16, 16)
    return q.mul_((d * sc).unsqueeze(-1)).reshape(nb, QK_K)


Q2_K = register(GGMLType("Q2_K", QK_K, 84, quantize_q2_k, dequantize_q2_k,
                          quantize_blocks_weighted=quantize_q2_k_weighted))
Q3_K = register(GGMLType("Q3_K", QK_K, 110, quantize_q3_k, dequantize_q3_k,
                          quantize_blocks_weighted=quantize_q3_k_weighted))
Q4_K = register(GGMLType("Q4_K", QK_K, 144, quantize_q4_k, dequantize_q4_k,
                          quantize_blocks_weighted=quantize_q4_k_weighted))
Q5_K = register(GGMLType("Q5_K", QK_K, 176, quantize_q5_k, dequantize_q5_k,
                          quantize_blocks_weighted=quantize_q5_k_weighted))
Q6_K = register(GGMLType("Q6_K", QK_K, 210, quantize_q6_k, dequantize_q6_k,
                          quantize_blocks_weighted=quantize_q6_k_weighted))
