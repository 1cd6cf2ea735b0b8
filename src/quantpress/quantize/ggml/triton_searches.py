"""The K-quants' scale searches as single Triton kernels, for CUDA tensors.

On a GPU the torch versions of :func:`kquants.make_qkx2_quants`, :func:`kquants.make_qx_quants`,
:func:`kquants.make_qp_quants` and :func:`kquants.make_q3_quants` are hundreds to thousands of
small kernels per call (each step of a search one pass over the whole chunk per operation,
the coordinate descents a host synchronization per pass), and :func:`common.seq_sum0` one
per position; here each is one kernel, one program lane per sub-block (or group, or sum),
with the same float32 operations in the same order, so the results are the same bits:

* the sequential sums of C (``for (i = 0; i < n; ++i) s += ...``) are loops over the
  sub-block's positions inside the kernel, one add per position, in C's order;
* the kernels are compiled with ``enable_fp_fusion=False`` (no multiply-add contraction);
  divisions are ``div_rn`` (IEEE round to nearest; Triton's ``/`` may be approximate);
* ``nearest_int`` is C's bit trick (``v + 12582912.0f``, the low 23 bits minus 2^22).

* the coordinate descents run all of C's 5 passes: a pass that changes nothing leaves the
  state as it was, so the passes C skips after it would change nothing either;
* a negation is ``v * -1.0``: Triton's unary minus is ``0 - v``, +0 for +0.

They reproduce llama.cpp's ``make_qkx2_quants``/``make_qkx3_quants``, ``make_qx_quants``
(rmse_type 1), ``make_qp_quants`` and ``make_q3_quants`` (do_rmse) in
``ggml/src/ggml-quants.c`` at 0c1e570 (llama-cpp-python 0.3.36), as the torch versions in
:mod:`kquants` do: tests/test_triton_searches.py runs them in Triton's interpreter against
llama.cpp's bytes and the torch searches; ``scripts/gpu_checks.py --checks ggml`` compares
their CUDA bytes with the CPU's.

Used when the tensor is on a CUDA device, Triton imports and ``QUANTPRESS_TRITON`` is not
``0``; everything else takes the torch path. A kernel that cannot be compiled or launched
(an older Triton, a GPU it does not support) raises :class:`KernelUnavailable` once, with a
warning, and turns the kernels off for the process: the callers then take the torch path,
which gives the same bytes.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

try:                                    # shipped with CUDA builds of torch; optional
    import triton
    import triton.language as tl
except ImportError:                     # pragma: no cover - depends on the installation
    triton = None

# sub-blocks (lanes) per program; the interpreter runs a program's operations one NumPy call
# each, so there one program takes them all
BLOCK = 1 << 14 if os.environ.get("TRITON_INTERPRET") == "1" else 128


class KernelUnavailable(RuntimeError):
    """A kernel could not be compiled or launched; the caller takes the torch path."""


_failure: str | None = None             # why the kernels were turned off, once one failed


def available(x: torch.Tensor) -> bool:
    """True when ``x``'s searches run as Triton kernels: ``x`` on a CUDA device (or any
    device under ``TRITON_INTERPRET=1``, the interpreter the tests use) with fewer than 2^31
    elements, Triton importable, no kernel failed before in this process, and the environment
    variable ``QUANTPRESS_TRITON`` not ``0``."""
    if (triton is None or _failure is not None or os.environ.get("QUANTPRESS_TRITON", "1") == "0"
            or x.numel() >= 1 << 31):
        return False                    # (the kernels index with int32)
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _nearest_int(v):
        # C: float val = fval + 12582912.f; memcpy(&i, &val, 4); (i & 0x007fffff) - 0x00400000
        b = (v + 12582912.0).to(tl.int32, bitcast=True)
        return (b & 0x7FFFFF) - 0x400000

    @triton.jit
    def _level(xi, mn, iscale, NMAX: tl.constexpr):
        # MAX(0, MIN(nmax, nearest_int(iscale*(x - min)))) as float32
        li = _nearest_int((xi - mn) * iscale)
        return tl.minimum(tl.maximum(li, 0), NMAX).to(tl.float32)

    @triton.jit
    def _fit_error(x_ptr, w_ptr, offs, m, S, iscale, shift, scale, mn,
                   N: tl.constexpr, NMAX: tl.constexpr, USE_MAD: tl.constexpr):
        # sum over positions (from +0) of w*|scale*l + min - x| or w*(scale*l + min - x)^2,
        # l the levels of (iscale, shift)
        acc = tl.zeros_like(scale)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
            e = _level(xi, shift, iscale, NMAX) * scale + mn - xi
            if USE_MAD:
                e = tl.abs(e)
            else:
                e = e * e
            acc = acc + e * wi
        return acc

    @triton.jit
    def _seq_sum_kernel(p_ptr, out_ptr, S, N: tl.constexpr, FROM_FIRST: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < S
        acc = tl.load(p_ptr + offs, mask=m, other=0.0)
        if not FROM_FIRST:
            acc = tl.zeros_like(acc) + acc          # +0 + p[0]: -0.0 becomes +0
        for i in range(1, N):
            acc = acc + tl.load(p_ptr + i * S + offs, mask=m, other=0.0)
        tl.store(out_ptr + offs, acc, mask=m)

    @triton.jit
    def _qkx2_kernel(x_ptr, w_ptr, xmin_ptr, nums_ptr, scale_ptr, min_ptr, l_ptr, S,
                     N: tl.constexpr, NMAX: tl.constexpr, NSTEP: tl.constexpr,
                     USE_MAD: tl.constexpr, HAS_XMIN: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < S
        x0 = tl.load(x_ptr + offs, mask=m, other=0.0)
        w0 = tl.load(w_ptr + offs, mask=m, other=0.0)
        lo = x0
        hi = x0
        sum_w = w0                       # C starts both sums with the first term
        sum_x = w0 * x0
        for i in range(1, N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
            lo = tl.minimum(lo, xi)
            hi = tl.maximum(hi, xi)
            sum_w = sum_w + wi
            sum_x = sum_x + wi * xi
        if HAS_XMIN:
            lo = tl.load(xmin_ptr + offs, mask=m, other=0.0)
        mn0 = tl.where(lo > 0, 0.0, lo)
        degenerate = hi == mn0
        mn = mn0
        sel_shift = mn0
        sel_iscale = tl.math.div_rn(tl.full(mn0.shape, NMAX, tl.float32), hi - mn)
        scale = tl.math.div_rn(tl.full(mn0.shape, 1.0, tl.float32), sel_iscale)
        best = _fit_error(x_ptr, w_ptr, offs, m, S, sel_iscale, mn, scale, mn, N, NMAX, USE_MAD)
        for k in range(NSTEP + 1):
            num = tl.load(nums_ptr + k)
            iscale = tl.math.div_rn(num + tl.zeros_like(mn), hi - mn)
            sum_l2 = tl.zeros_like(mn)
            sum_l = tl.zeros_like(mn)
            sum_xl = tl.zeros_like(mn)
            for i in range(N):
                xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
                wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
                lv = _level(xi, mn, iscale, NMAX)
                wl = wi * lv
                sum_l2 = sum_l2 + wl * lv
                sum_l = sum_l + wl
                sum_xl = sum_xl + wl * xi
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = tl.math.div_rn(sum_w * sum_xl - sum_x * sum_l, D)
            this_min = tl.math.div_rn(sum_l2 * sum_x - sum_l * sum_xl, D)
            pos = this_min > 0
            this_min = tl.where(pos, 0.0, this_min)
            this_scale = tl.where(pos, tl.math.div_rn(sum_xl, sum_l2), this_scale)
            cur = _fit_error(x_ptr, w_ptr, offs, m, S, iscale, mn, this_scale, this_min,
                             N, NMAX, USE_MAD)
            take = (D > 0) & (cur < best)
            sel_iscale = tl.where(take, iscale, sel_iscale)
            sel_shift = tl.where(take, mn, sel_shift)
            best = tl.where(take, cur, best)
            scale = tl.where(take, this_scale, scale)
            mn = tl.where(take, this_min, mn)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            lv = tl.where(degenerate, 0.0, _level(xi, sel_shift, sel_iscale, NMAX))
            tl.store(l_ptr + i * S + offs, lv, mask=m)
        tl.store(scale_ptr + offs, tl.where(degenerate, 0.0, scale), mask=m)
        # C's -min; Triton's unary minus is 0 - v, which would give +0 for +0 (the sign is
        # stored in Q4_1/Q5_1's m)
        tl.store(min_ptr + offs, tl.where(degenerate, mn0, mn) * -1.0, mask=m)

    @triton.jit
    def _first_absmax(x_ptr, offs, m, S, N: tl.constexpr, BLOCK: tl.constexpr):
        # C: amax = 0; max = 0; for i: if (|x[i]| > amax) { amax = |x[i]|; max = x[i]; }
        amax = tl.zeros((BLOCK,), tl.float32)
        mx = tl.zeros((BLOCK,), tl.float32)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            ax = tl.abs(xi)
            up = ax > amax
            amax = tl.where(up, ax, amax)
            mx = tl.where(up, xi, mx)
        return mx, amax

    @triton.jit
    def _qx_sums(x_ptr, w_ptr, offs, m, S, iscale, N: tl.constexpr, NMAX: tl.constexpr,
                 WEIGHTED: tl.constexpr):
        # sum over positions (from +0) of l*(w*x) and (w*l)*l, l = clamp(ni(iscale*x))
        sumlx = tl.zeros_like(iscale)
        suml2 = tl.zeros_like(iscale)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            if WEIGHTED:
                wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
            else:
                wi = xi * xi
            li = _nearest_int(xi * iscale)
            lv = tl.minimum(tl.maximum(li, -NMAX), NMAX - 1).to(tl.float32)
            sumlx = sumlx + lv * (wi * xi)
            suml2 = suml2 + (wi * lv) * lv
        return sumlx, suml2

    @triton.jit
    def _qx_kernel(x_ptr, w_ptr, nums_ptr, scale_ptr, l_ptr, S, eps,
                   N: tl.constexpr, NMAX: tl.constexpr, WEIGHTED: tl.constexpr,
                   BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < S
        mx, amax = _first_absmax(x_ptr, offs, m, S, N, BLOCK)
        zero = amax < eps
        sel = tl.math.div_rn(tl.full(mx.shape, -NMAX, tl.float32), mx)
        sumlx, suml2 = _qx_sums(x_ptr, w_ptr, offs, m, S, sel, N, NMAX, WEIGHTED)
        scale = tl.where(suml2 == 0, 0.0, tl.math.div_rn(sumlx, suml2))
        best = scale * sumlx
        for k in range(18):
            num = tl.load(nums_ptr + k)
            iscale = tl.math.div_rn(-num + tl.zeros_like(mx), mx)
            sumlx, suml2 = _qx_sums(x_ptr, w_ptr, offs, m, S, iscale, N, NMAX, WEIGHTED)
            take = (sumlx * sumlx > best * suml2) & (suml2 > 0)
            this_scale = tl.math.div_rn(sumlx, suml2)
            sel = tl.where(take, iscale, sel)
            scale = tl.where(take, this_scale, scale)
            best = tl.where(take, this_scale * sumlx, best)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            li = tl.minimum(tl.maximum(_nearest_int(xi * sel), -NMAX), NMAX - 1) + NMAX
            tl.store(l_ptr + i * S + offs, tl.where(zero, 0.0, li.to(tl.float32)), mask=m)
        tl.store(scale_ptr + offs, tl.where(zero, 0.0, scale), mask=m)


    @triton.jit
    def _qp_mse(x_ptr, w_ptr, offs, m, S, iscale, N: tl.constexpr, NMAX: tl.constexpr,
                FIRST: tl.constexpr):
        # sum over positions (from +0) of (w*diff)*diff, diff = x - (1/iscale)*l; l the
        # levels nearest_int(iscale*x): & 0xFF in the first estimate, capped at nmax after
        scale = tl.math.div_rn(tl.full(iscale.shape, 1.0, tl.float32), iscale)
        acc = tl.zeros_like(iscale)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
            li = _nearest_int(iscale * xi)
            if FIRST:
                li = li & 0xFF
            else:
                li = tl.minimum(li, NMAX)
            diff = xi - scale * li.to(tl.float32)
            acc = acc + wi * diff * diff
        return acc

    @triton.jit
    def _qp_kernel(x_ptr, w_ptr, nums_ptr, scale_ptr, l_ptr, S, eps,
                   N: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < S
        mx = tl.zeros((BLOCK,), tl.float32)
        for i in range(N):              # C: max = MAX(max, x[i]) from 0
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            mx = tl.where(mx > xi, mx, xi)
        zero = mx < eps
        iscale = tl.math.div_rn(tl.full(mx.shape, NMAX, tl.float32), mx)
        best = _qp_mse(x_ptr, w_ptr, offs, m, S, iscale, N, NMAX, True)
        for k in range(8):
            iscale_k = tl.math.div_rn(tl.load(nums_ptr + k) + tl.zeros_like(mx), mx)
            cur = _qp_mse(x_ptr, w_ptr, offs, m, S, iscale_k, N, NMAX, False)
            take = cur < best
            best = tl.where(take, cur, best)
            iscale = tl.where(take, iscale_k, iscale)
        sumlx = tl.zeros_like(mx)
        suml2 = tl.zeros_like(mx)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
            li = tl.minimum(_nearest_int(iscale * xi), NMAX)
            lf = li.to(tl.float32)
            sumlx = sumlx + (wi * xi) * lf
            suml2 = suml2 + wi * lf * lf
            tl.store(l_ptr + i * S + offs, li & 0xFF, mask=m)
        # C's coordinate descent: up to 5 passes, each stopping the group once a pass changed
        # nothing (a further pass would repeat the same operations on the same state)
        for p in range(5):
            for i in range(N):
                xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
                wi = tl.load(w_ptr + i * S + offs, mask=m, other=0.0)
                wxi = wi * xi
                stored = tl.load(l_ptr + i * S + offs, mask=m, other=0)
                lf = stored.to(tl.float32)
                slx = sumlx - wxi * lf
                sl2 = suml2 - wi * lf * lf
                new_l = tl.minimum(_nearest_int(tl.math.div_rn(xi * sl2, slx)), NMAX)
                nl = new_l.to(tl.float32)
                slx2 = slx + wxi * nl
                sl22 = sl2 + wi * nl * nl
                accept = ((slx2 * slx2 * suml2 > sumlx * sumlx * sl22) & (slx > 0) & (sl2 > 0)
                          & (new_l != stored))
                tl.store(l_ptr + i * S + offs, tl.where(accept, new_l & 0xFF, stored), mask=m)
                sumlx = tl.where(accept, slx2, sumlx)
                suml2 = tl.where(accept, sl22, suml2)
        for i in range(N):
            stored = tl.load(l_ptr + i * S + offs, mask=m, other=0)
            tl.store(l_ptr + i * S + offs, tl.where(zero, 0, stored), mask=m)
        scale = tl.where(suml2 > 0, tl.math.div_rn(sumlx, suml2), 0.0)
        tl.store(scale_ptr + offs, tl.where(zero, 0.0, scale), mask=m)


    @triton.jit
    def _q3_kernel(x_ptr, scale_ptr, l_ptr, S, eps, N: tl.constexpr, NMAX: tl.constexpr,
                   BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < S
        mx, amax = _first_absmax(x_ptr, offs, m, S, N, BLOCK)
        live = amax >= eps
        iscale = tl.math.div_rn(tl.full(mx.shape, -NMAX, tl.float32), mx)
        sumlx = tl.zeros_like(mx)
        suml2 = tl.zeros_like(mx)
        for i in range(N):
            xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
            lf = tl.minimum(tl.maximum(_nearest_int(xi * iscale), -NMAX), NMAX - 1).to(tl.float32)
            wi = xi * xi
            sumlx = sumlx + (wi * xi) * lf
            suml2 = suml2 + wi * lf * lf
            tl.store(l_ptr + i * S + offs, lf, mask=m)
        # C's coordinate descent (do_rmse): up to 5 passes; running all five changes nothing
        # for a sub-block once a pass has left it as it was
        for p in range(5):
            for i in range(N):
                xi = tl.load(x_ptr + i * S + offs, mask=m, other=0.0)
                wi = xi * xi
                wxi = wi * xi
                li = tl.load(l_ptr + i * S + offs, mask=m, other=0.0)
                slx = sumlx - wxi * li
                sl2 = suml2 - wi * li * li
                t = tl.math.div_rn(xi * sl2, slx)
                nl = tl.minimum(tl.maximum(_nearest_int(t), -NMAX), NMAX - 1).to(tl.float32)
                slx2 = wxi * nl + slx
                sl22 = sl2 + wi * nl * nl
                accept = ((slx2 * slx2 * suml2 > sumlx * sumlx * sl22) & (sl22 > 0) & (slx > 0)
                          & (nl != li) & live)
                tl.store(l_ptr + i * S + offs, tl.where(accept, nl, li), mask=m)
                sumlx = tl.where(accept, slx2, sumlx)
                suml2 = tl.where(accept, sl22, suml2)
        for i in range(N):
            li = tl.load(l_ptr + i * S + offs, mask=m, other=0.0)
            tl.store(l_ptr + i * S + offs, tl.where(live, li + NMAX, 0.0), mask=m)
        scale = tl.where(suml2 > 0, tl.math.div_rn(sumlx, suml2), 0.0)
        tl.store(scale_ptr + offs, tl.where(live, scale, 0.0), mask=m)


_STEPS_9 = np.array([t for t in range(-9, 10) if t != 0], dtype=np.float32)
_STEPS_4 = np.array([t for t in range(-4, 5) if t != 0], dtype=np.float32)


def _on(x: torch.Tensor, a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float32)).to(x.device)


def _launch(kernel, S: int, *args, **meta) -> None:
    """Launch ``kernel`` over ``S`` lanes; a failure to compile or launch it turns the kernels
    off (warning once) and raises :class:`KernelUnavailable`."""
    global _failure
    try:
        kernel[(triton.cdiv(S, BLOCK),)](*args, BLOCK=BLOCK, enable_fp_fusion=False, **meta)
    except Exception as e:              # Triton's compile and launch errors have no common base
        _failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"quantpress: Triton kernel {getattr(kernel, '__name__', kernel)} failed ({_failure}); "
                      "the GGUF codecs use torch operations instead (the same bytes, slower)", RuntimeWarning)
        raise KernelUnavailable(_failure) from e


def seq_sum(p: torch.Tensor, out: torch.Tensor | None, from_first: bool) -> torch.Tensor:
    """:func:`common.seq_sum0` in one kernel: float32 ``p`` [n, ...] (contiguous) -> the sums
    over its first axis, one add per row in row order, from +0 (or from ``p[0]``), written
    into ``out`` when given (contiguous, ``p[0]``'s shape)."""
    n = p.shape[0]
    if out is None:
        out = torch.empty(p.shape[1:], dtype=torch.float32, device=p.device)
    S = out.numel()
    _launch(_seq_sum_kernel, S, p, out, S, N=n, FROM_FIRST=from_first)
    return out


def qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
         use_mad: bool, xmin: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_qkx2_quants` in one kernel: ``x``, ``w`` float32 [n, S]
    (positions first), ``xmin`` float32 [S] or None. Returns (scale [S], the_min [S],
    L float32 [n, S] of 0..nmax), the same bits as the torch version."""
    n, S = x.shape
    x, w = x.contiguous(), w.contiguous()
    # C: rmin + rdelta*is + nmax, float32 operations (NumPy's float32 arrays round each)
    k = np.arange(nstep + 1, dtype=np.float32)
    nums = _on(x, (np.float32(rmin) + np.float32(rdelta) * k) + np.float32(nmax))
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    the_min = torch.empty_like(scale)
    L = torch.empty_like(x)
    _launch(_qkx2_kernel, S, x, w, x if xmin is None else xmin.contiguous(), nums, scale, the_min, L, S,
            N=n, NMAX=nmax, NSTEP=nstep, USE_MAD=use_mad, HAS_XMIN=xmin is not None)
    return scale, the_min, L


def qx(x: torch.Tensor, nmax: int, w: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_qx_quants` (rmse_type 1) in one kernel, for finite ``x`` float32
    [n, S] (positions first) and weights ``w`` [n, S] or None (x²); ``eps``: the largest
    |x| below which a sub-block is zero (GROUP_MAX_EPS). Returns (scale [S], L float32
    [n, S] of 0..2*nmax-1), the same bits as the torch version."""
    n, S = x.shape
    x = x.contiguous()
    nums = _on(x, np.float32(nmax) + np.float32(0.1) * _STEPS_9)      # C: nmax + 0.1f*is
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    L = torch.empty_like(x)
    _launch(_qx_kernel, S, x, x if w is None else w.contiguous(), nums, scale, L, S, eps,
            N=n, NMAX=nmax, WEIGHTED=w is not None)
    return scale, L


def qp(x: torch.Tensor, w: torch.Tensor, nmax: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_qp_quants` in one kernel: ``x``, ``w`` float32 [n, S] (value i of
    group s at ``x[i, s]``), ``eps``: the max below which a group is zero (GROUP_MAX_EPS).
    Returns (scale float32 [S], L int32 [n, S] of the stored uint8 values), the same bits as
    the torch version."""
    n, S = x.shape
    x, w = x.contiguous(), w.contiguous()
    nums = _on(x, np.float32(0.1) * _STEPS_4 + np.float32(nmax))      # C: 0.1f*is + nmax
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    L = torch.empty((n, S), dtype=torch.int32, device=x.device)
    _launch(_qp_kernel, S, x, w, nums, scale, L, S, eps, N=n, NMAX=nmax)
    return scale, L


def q3(x: torch.Tensor, nmax: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_q3_quants` (do_rmse) in one kernel: ``x`` float32 [n, S]
    (positions first), ``eps``: the largest |x| below which a sub-block is zero
    (GROUP_MAX_EPS). Returns (scale float32 [S], L float32 [n, S] of 0..2*nmax-1), the same
    bits as the torch version."""
    n, S = x.shape
    x = x.contiguous()
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    L = torch.empty_like(x)
    _launch(_q3_kernel, S, x, scale, L, S, eps, N=n, NMAX=nmax)
    return scale, L
