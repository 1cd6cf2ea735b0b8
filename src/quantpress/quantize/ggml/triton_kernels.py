"""The Triton kernels behind :mod:`triton_searches` (its docstring gives the rules they keep:
C's operations in C's order, no multiply-add contraction, ``div_rn``, C's ``nearest_int``).
Imported on the first search of a CUDA tensor, not with quantpress: Triton's import costs
a process that never quantizes on a GPU, and a Triton that cannot be imported then turns the
kernels off instead of failing quantpress's own import."""
import triton
import triton.language as tl


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
def seq_sum_kernel(p_ptr, out_ptr, S, N: tl.constexpr, FROM_FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """``out[s] = p[0, s] + p[1, s] + ... + p[N-1, s]`` for float32 ``p`` [N, S] (contiguous),
    one add per row in row order, from +0 (``FROM_FIRST``: from ``p[0]``): C's sequential
    ``for`` sums (:func:`common.seq_sum0`)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < S
    acc = tl.load(p_ptr + offs, mask=m, other=0.0)
    if not FROM_FIRST:
        acc = tl.zeros_like(acc) + acc          # +0 + p[0]: -0.0 becomes +0
    for i in range(1, N):
        acc = acc + tl.load(p_ptr + i * S + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, acc, mask=m)


@triton.jit
def qkx2_kernel(x_ptr, w_ptr, xmin_ptr, nums_ptr, scale_ptr, min_ptr, l_ptr, S,
                N: tl.constexpr, NMAX: tl.constexpr, NSTEP: tl.constexpr,
                USE_MAD: tl.constexpr, HAS_XMIN: tl.constexpr, BLOCK: tl.constexpr):
    """llama.cpp ``make_qkx2_quants`` / ``make_qkx3_quants`` (ggml-quants.c, 0c1e570) for S
    sub-blocks of N values: ``x``, ``w`` float32 [N, S] positions first, ``xmin`` float32 [S]
    (read if ``HAS_XMIN``), ``nums`` float32 [NSTEP + 1] (the numerators rmin + rdelta*k +
    nmax) -> ``scale``, ``min`` (the_min = -min) float32 [S], ``l`` float32 [N, S] of
    0..NMAX (:func:`kquants.make_qkx2_quants`)."""
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
def qx_kernel(x_ptr, w_ptr, nums_ptr, scale_ptr, l_ptr, S, eps,
              N: tl.constexpr, NMAX: tl.constexpr, WEIGHTED: tl.constexpr,
              BLOCK: tl.constexpr):
    """llama.cpp ``make_qx_quants`` (rmse_type 1) for S sub-blocks of N values: ``x``
    float32 [N, S] positions first, ``w`` [N, S] (read if ``WEIGHTED``, else x²), ``nums``
    float32 [18] (nmax + 0.1*t, t = -9..9 but 0), ``eps`` (GROUP_MAX_EPS) -> ``scale``
    float32 [S], ``l`` float32 [N, S] of 0..2*NMAX-1 (:func:`kquants.make_qx_quants`)."""
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
def qp_kernel(x_ptr, w_ptr, nums_ptr, scale_ptr, l_ptr, S, eps,
              N: tl.constexpr, NMAX: tl.constexpr, BLOCK: tl.constexpr):
    """llama.cpp ``make_qp_quants`` for S groups of N values: ``x``, ``w`` float32 [N, S],
    ``nums`` float32 [8] (0.1*t + nmax, t = -4..4 but 0), ``eps`` -> ``scale`` float32 [S],
    ``l`` int32 [N, S] of the stored uint8 levels (:func:`kquants.make_qp_quants`)."""
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
def q3_kernel(x_ptr, scale_ptr, l_ptr, S, eps, N: tl.constexpr, NMAX: tl.constexpr,
              BLOCK: tl.constexpr):
    """llama.cpp ``make_q3_quants`` (do_rmse) for S sub-blocks of N values: ``x`` float32
    [N, S] positions first, ``eps`` -> ``scale`` float32 [S], ``l`` float32 [N, S] of
    0..2*NMAX-1 (:func:`kquants.make_q3_quants`)."""
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
