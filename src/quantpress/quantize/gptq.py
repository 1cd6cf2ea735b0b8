"""GPTQ with act-order and EXL2's mixed-bit groups (exllamav2 0.3.2 ``conversion/adaptivegptq.py``).

Reproduces exllamav2 0.3.2 ``conversion/adaptivegptq.py`` (``AdaptiveGPTQ.prepare`` /
``quantize`` / ``quantize_rtn_inplace``, ``AdaptiveQuantizer.find_params``) and its CUDA
helpers (``cuda/quantize.cu`` ``quantize_err_kernel`` and ``fused_quantize_adjust_kernel``,
``cpp/quantize_func.cpp`` ``quantize_range``) in plain torch, on the weight's device.

The quantizer works on Wᵀ (rows = the K inputs, columns = the N outputs) in float32, in
32-row GPTQ blocks; :func:`gptq_quantize_many` runs several settings of one linear side by
side (the EXL2 measurement), :func:`gptq_quantize` is the same code for one setting. The
result holds the stored codes and per-group parameters that :func:`quantize.exl2.pack` turns
into EXL2 tensors, and the fake-quantized fp16 weight that the next module is run with.
Quantization is symmetric (implicit zero 2^(b-1)); scales are 4-bit square-law codes times a
per-group fp16 maximum.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from quantpress.quantize import exact_ops
from quantpress.quantize.exl2 import Group, QParams, pack
from quantpress.quantize.ggml.common import all_finite, intra_op_threads, single_threaded_ops

#: Damping added to diag(H), as a fraction of its mean (exllamav2 ``percdamp``).
PERCDAMP = 0.12
#: Smallest damping added.
MIN_DAMP = 1e-5
#: Cholesky attempts, each after adding the damping once more.
MAX_ATTEMPTS = 10
#: Scale search: p runs over MIN_P..MAX_P in P_GRID steps; error norm |err|^ERR_NORM.
MIN_P, MAX_P, P_GRID, ERR_NORM = 0.70, 1.20, 96, 3.5
#: Elements per scale-search chunk ([p, rows, N] float32 scratch): on CPU 2^19 (2 MiB each,
#: they stay in cache: several times faster than 2^23, figures in docs/benchmarks.md,
#: "Figures behind the code", ``quantize/gptq.py``; the same sums bit for bit for every
#: chunking: tests/test_gptq_many.py); elsewhere 2^23 (fewer kernel launches).
SEARCH_ELEMENTS_CPU = 1 << 19
SEARCH_ELEMENTS = 1 << 23


@dataclass
class GPTQResult:
    """Output of :func:`gptq_quantize` (one per setting of :func:`gptq_quantize_many`) for a
    linear with weight [N, K] and G groups.

    ``qweight``    uint8 [K, N]: stored codes 0..2^b-1, rows in act-order (row i = input perm[i]);
    ``qscale``     uint8 [G, N]: square-law scale codes 1..16 (q_scale stores qscale - 1);
    ``qscale_max`` float16 [G]: the stored q_scale_max (group max scale, without the 1/256);
    ``perm``       int64 [K]: act-order permutation (inputs by descending diag(H));
    ``invperm``    int64 [K]: argsort(perm), stored as q_invperm;
    ``weight``     float16 [N, K]: fake-quantized weight (deq[invperm].T), which equals
                   :func:`quantize.exl2.reconstruct` of the packed tensors bit for bit;
    ``qparams``, ``groups``: the settings and the group layout along the act-order rows;
    ``search_seconds``: wall seconds of the call's scale searches (:func:`find_params`; the
    same for every result of one :func:`gptq_quantize_many` call; on CUDA the launch time).
    """

    qweight: torch.Tensor
    qscale: torch.Tensor
    qscale_max: torch.Tensor
    perm: torch.Tensor
    invperm: torch.Tensor
    weight: torch.Tensor
    qparams: QParams
    groups: list[Group]
    search_seconds: float = 0.0

    def pack(self, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """EXL2 tensors {q_weight, q_scale, q_scale_max, q_groups, q_invperm[, bias]}; see
        :func:`quantize.exl2.pack`."""
        return pack(self.qweight, self.qscale, self.qscale_max, self.invperm, self.qparams, bias)


def act_order(hessian: torch.Tensor) -> torch.Tensor:
    """Act-order permutation: int64 [K], inputs sorted by descending diag(H) (float32 [K, K]),
    ties in index order (exllamav2 ``prepare``: ``argsort(diag(H), descending=True)``)."""
    return torch.argsort(torch.diagonal(hessian), descending=True, stable=True)


def hessian_inverse_factor(hessian: torch.Tensor, percdamp: float = PERCDAMP) -> torch.Tensor:
    """Upper Cholesky factor of the inverse of the damped Hessian: float32 [K, K].

    ``hessian`` float32 [K, K] (already in act-order; not modified). Damping
    ``max(percdamp·mean(diag H), 1e-5)`` is added to the diagonal; then
    ``U = chol_upper(cholesky_inverse(chol(H)))``. When a factorisation fails or gives a
    non-finite value, the damping is added again, at most 10 attempts (exllamav2 0.3.2
    ``AdaptiveGPTQ.prepare``). Raises ValueError when all attempts fail.
    """
    h = hessian.to(torch.float32).clone()
    damp = torch.clamp(percdamp * torch.diagonal(h).mean(), min=MIN_DAMP)
    for _ in range(MAX_ATTEMPTS):
        torch.diagonal(h).add_(damp)
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) != 0:
            continue
        # the same product L⁻ᵀL⁻¹ as exllamav2's torch.cholesky_inverse(chol), rounded
        # differently; on torch 2.13's CPU cholesky_inverse is several times faster (figures
        # and the command in docs/benchmarks.md, "Figures behind the code", quantize/gptq.py),
        # but switching changes the measurements and allocations the README's EXL2 figures
        # come from (kept for now)
        inv = torch.cholesky_solve(torch.eye(h.shape[0], dtype=h.dtype, device=h.device), chol)
        if not all_finite(inv):
            continue
        upper, info = torch.linalg.cholesky_ex(inv, upper=True)
        if int(info) == 0 and all_finite(upper):
            return upper
    raise ValueError(f"Hessian [{h.shape[0]}x{h.shape[0]}] is not positive definite after "
                     f"{MAX_ATTEMPTS} damping attempts")


def p_grid(device: torch.device | str | None = None) -> torch.Tensor:
    """The 97 scale multipliers of the search, float32: p_i = 0.70·(1 − i/96) + 1.20·(i/96)."""
    pi = torch.arange(P_GRID + 1, dtype=torch.float32, device=device) / P_GRID
    return MIN_P * (1.0 - pi) + MAX_P * pi


def scale_search_error(x: torch.Tensor, cand: torch.Tensor, bits: int,
                       grid: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """E(p) = Σ_{rows,n} |clamp(rint(x/(cand·p)), −2^(b−1), 2^(b−1)−1)·cand·p − x|^3.5 for every
    p of the grid (exllamav2 0.3.2 ``quantize_err_kernel``).

    ``x`` float32 [rows, N], ``cand`` float32 [N] (candidate scales), ``grid`` float32 [P]
    (default :func:`p_grid`). Returns float32 [P]. Vectorized over p, rows and columns at
    once, in p-chunks of at most 2^19 elements on CPU, 2^23 on other devices (each E(p) is
    summed whole inside one chunk, so the chunking does not change it).

    Every E(p) has one defined value on every machine: the root is correctly rounded
    (:func:`~quantpress.quantize.exact_ops.defined_sqrt_`; torch 2.13's CPU ``sqrt`` is not,
    how often depending on the processor) and the sum adds in one fixed pairwise order
    (:func:`~quantpress.quantize.exact_ops.tree_sum_`; torch.sum's order follows the vector
    width and the threads); the other steps are single IEEE operations per element.

    ``threads``: torch intra-op threads for the passes on CPU (None: the count in effect);
    the result does not depend on it.
    """
    if grid is None:
        grid = p_grid(x.device)
    z = float(1 << (bits - 1))
    budget = SEARCH_ELEMENTS_CPU if x.device.type == "cpu" else SEARCH_ELEMENTS
    rn, P = x.numel(), grid.numel()
    per = min(P, max(1, budget // max(1, rn)))
    # two scratch buffers for all chunks (fresh temporaries per op cost page faults: 2-3x)
    e_buf = torch.empty(per * rn, dtype=torch.float32, device=x.device)
    t_buf = torch.empty_like(e_buf)
    out = torch.empty(P, dtype=torch.float32, device=x.device)
    xb = x[None]
    if x.device.type != "cpu":
        threads = None
    for i in range(0, P, per):
        p = grid[i:i + per]
        m = p.numel()
        s = cand[None, None, :] * p[:, None, None]                   # [m, 1, N]
        e = e_buf[:m * rn].view(m, *x.shape)
        e35 = t_buf[:m * rn].view(m, *x.shape)
        with intra_op_threads(threads):
            torch.div(xb, s, out=e)
            e.round_().clamp_(-z, z - 1.0).mul_(s).sub_(xb).abs_()
            torch.pow(e, 3, out=e35)                                  # = e·e·e, bit for bit
            # |err|^3.5 with the correctly rounded root: torch 2.13's CPU sqrt is not, and how
            # often depends on the processor (quantize/exact_ops.py)
            e35.mul_(exact_ops.defined_sqrt_(e))
            # E(p) added in one fixed order (torch.sum's follows the vector width and threads)
            out[i:i + m] = exact_ops.tree_sum_(e35.view(m, rn))
    return out


def find_params(x: torch.Tensor, bits: int,
                threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale parameters of one group (exllamav2 0.3.2 ``AdaptiveQuantizer.find_params``).

    ``x`` float32 [rows, N]: the group's current (error-updated) rows. Returns
    ``(qscale, qscale_max, scale)``:

    * ``qscale`` uint8 [N], 1..16: ``clamp(round(sqrt(base/smax)·16), 1, 16)`` with
      ``base = (max|x| + 1e-12) / ((2^b − 1)/2)`` per column and ``smax = max(base)``;
    * ``qscale_max`` float16 0-d: ``fp16(smax·p*)``, p* the first argmin of
      :func:`scale_search_error` over the candidates ``(qscale/16)²·smax``;
    * ``scale`` float16 [N]: the effective scale ``fp16(qscale²) × fp16(qscale_max × 1/256)``
      (fp16 multiplies), the one the codes are made with and the kernel dequantizes with.

    ``threads``: intra-op threads of the search's elementwise passes (:func:`scale_search_error`).
    """
    maxq = (1 << bits) - 1
    xmax = x.abs().amax(dim=0) + 1e-12
    base = xmax / (maxq / 2)
    smax = base.max()
    qs = torch.clamp(torch.round(exact_ops.defined_sqrt_(base / smax) * 16.0), 1.0, 16.0)
    cand = (qs / 16.0) ** 2 * smax
    grid = p_grid(x.device)
    best = torch.argmin(scale_search_error(x, cand, bits, grid, threads))
    qscale_max = (smax * grid[best]).to(torch.float16)
    prescale = torch.tensor(1.0 / 256, dtype=torch.float16, device=x.device)
    scale = (qs * qs).to(torch.float16) * (qscale_max * prescale)
    return qs.to(torch.uint8), qscale_max, scale


@dataclass
class HessianFactor:
    """What every setting quantized against one Hessian shares (:func:`hessian_factor`):
    ``perm``, ``invperm`` int64 [K] (act-order and its inverse); ``upper`` float32 [K, K],
    the upper Cholesky factor U of the damped inverse Hessian in act-order (None when made
    for round-to-nearest only); ``percdamp`` the damping it was made with."""

    perm: torch.Tensor
    invperm: torch.Tensor
    upper: torch.Tensor | None
    percdamp: float


def hessian_factor(hessian: torch.Tensor | None, K: int, device: torch.device | str = "cpu",
                   percdamp: float = PERCDAMP, rtn: bool = False) -> HessianFactor:
    """Act-order permutation and inverse-Hessian factor of a [*, K] linear's Hessian, made once
    for every setting and every linear that shares it (the EXL2 measurement: q/k/v share one
    Hessian, gate/up another, each with ~14 settings in several calls).

    ``hessian`` float [K, K] = mean of XᵀX (None: identity), moved to ``device``; ``rtn``: no
    factor (round-to-nearest needs only the permutation). Steps of exllamav2 0.3.2
    ``AdaptiveGPTQ.prepare`` (:func:`act_order`, :func:`hessian_inverse_factor`), single-threaded
    on CPU as in :func:`gptq_quantize`. Raises ValueError for a wrong shape, NaN/Inf or a
    Hessian that cannot be factored.
    """
    if hessian is None:
        H = torch.eye(K, dtype=torch.float32, device=device)
    else:
        if tuple(hessian.shape) != (K, K):
            raise ValueError(f"gptq_quantize: Hessian shape {tuple(hessian.shape)}, expected "
                             f"({K}, {K}) for weight [*, {K}]")
        H = hessian.to(device=device, dtype=torch.float32)
        if not all_finite(H):
            raise ValueError("gptq_quantize: Hessian has NaN or Inf values")
    with single_threaded_ops() if H.device.type == "cpu" else contextlib.nullcontext():
        perm = act_order(H)
        upper = None if rtn else hessian_inverse_factor(H[perm][:, perm], percdamp)
    return HessianFactor(perm=perm, invperm=torch.argsort(perm), upper=upper, percdamp=percdamp)


#: Rows per GPTQ block (lazy batch): the rows of a block are quantized one by one with updates
#: inside the block; the rows after it get the block's error in one matmul. Every EXL2 group
#: boundary (group sizes 32/64/128) falls on a block start.
BLOCK = 32


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | HessianFactor | None,
                  qparams: QParams, *,
                  rtn: bool = False, percdamp: float = PERCDAMP) -> GPTQResult:
    """Quantize one linear to EXL2 with GPTQ and act-order (exllamav2 0.3.2 ``AdaptiveGPTQ``).

    ``weight`` [N, K] (out_features, in_features), fp16/bf16/fp32, any device; ``hessian``
    float [K, K] = mean over calibration rows of XᵀX (None: identity, as exllamav2 does
    without data), moved to the weight's device, or its :func:`hessian_factor` made on that
    device with the same ``percdamp``; ``qparams`` the bit widths and groups.

    Steps (exllamav2 0.3.2 ``AdaptiveGPTQ.prepare`` + ``quantize``): act-order permutation by
    descending diag(H); damping and :func:`hessian_inverse_factor` (U, upper triangular);
    then GPTQ over the rows in blocks of :data:`BLOCK` = 32 rows [a, a+32) (lazy batch;
    :func:`gptq_quantize_many` with one setting, the same code):

    * at a block start where a group [a, e) begins, :func:`find_params` on its current,
      error-updated rows W[a:e] (all rows ≥ a then hold the error of every row before a);
    * for each row c of the block (``quantize_range``): ``q = clamp(rint(W[c]/s) + 2^(b−1),
      0, 2^b−1)``, ``deq = fp16(fp16(q − 2^(b−1))·s)``, ``err = (W[c] − deq)/U[c,c]``,
      ``W[c+1:be] −= U[c, c+1:be]ᵀ·err`` (be = block end; each product and difference
      rounded apart, :func:`~quantpress.quantize.exact_ops.sub_outer_`, the same on every
      CPU capability and device);
    * after the block, ``W[be:] −= U[a:be, be:]ᵀ·err[a:be]`` (one matmul).

    exllamav2 updates the rest of a group row by row and the rows after the group once per
    group; the blocks give the same arithmetic up to the float rounding order. Every group
    must start on a multiple of 32 rows (true for EXL2's group sizes 32/64/128; the last
    group may end at any K), else ValueError.

    ``rtn=True`` skips the error feedback (``quantize_rtn_inplace``, which exllamav2 uses for a
    head over 1e9 weights): same act-order, groups and scales, codes by rounding.
    Raises ValueError for bad shapes, non-finite input or a Hessian that cannot be factored.

    On CPU the ops run with one intra-op thread (torch's setting is restored afterwards), as
    quantize/ggml's codecs do: the thousands of small sequential ops of the GPTQ loop stall in
    OpenMP spin-waits otherwise (a 2048x2048 layer is several times slower with 2 threads on a
    busy 2-core machine than single-threaded: docs/benchmarks.md, "Figures behind the code",
    ``quantize/gptq.py``). The scale searches' elementwise passes (2^19-element chunks, most of
    the time) get the thread count in effect before; their sums stay single-threaded, so the
    chosen scales do not depend on it (:func:`scale_search_error`).
    """
    return _run(weight, hessian, [qparams], rtn, percdamp)[0]


def gptq_quantize_many(weight: torch.Tensor, hessian: torch.Tensor | HessianFactor | None,
                       qparams_list: Sequence[QParams], *,
                       percdamp: float = PERCDAMP) -> list[GPTQResult]:
    """Quantize one linear under S settings at once: ``[gptq_quantize(weight, hessian, qp)
    for qp in qparams_list]``, bit for bit, in one pass (the EXL2 measurement quantizes every
    linear under each of its ~14 distinct settings: exllamav2 0.3.2 ``conversion/measure.py``).

    ``weight`` [N, K] (fp16/bf16/fp32, any device), ``hessian`` float [K, K] or None
    (identity) or its :func:`hessian_factor` (made once for every call that shares it),
    ``qparams_list`` S ≥ 1 :class:`QParams` (duplicates allowed; each gets its
    own result). Returns S :class:`GPTQResult`, in the order of ``qparams_list``.

    Shared by all settings: the act-order permutation and the factor U of the damped inverse
    Hessian (computed once). The S copies of Wᵀ (float32 [K, N] each, act-order rows) are
    stacked side by side, ``W`` float32 [K, S·N] (columns s·N..s·N+N−1 = setting s), so each
    row step of the GPTQ loop (see :func:`gptq_quantize`) is one op over all settings, with
    per-column scale, zero point 2^(b−1) and maximum code 2^b−1 vectors [S·N]; the block
    update is one [K−be, 32] × [32, S·N] matmul. At a block start, the settings whose group
    starts there get :func:`find_params` on their own columns (a Python loop over those
    settings only; settings whose groups so far are the same share one call, their columns
    being equal). Every column's arithmetic is that of the single-setting run: the row
    step is elementwise, and the two updates (:func:`~quantpress.quantize.exact_ops.sub_outer_`
    in the block, BLAS ``addmm_`` after it) compute each column from that column alone
    (tests/test_gptq_many.py checks the results are bit-identical to separate runs).

    Memory: about K·S·N·11 bytes (float32 W, float32 block error, fp16 deq, uint8 codes) plus
    the S results. Raises ValueError for an empty list, a group that does not start on a
    multiple of 32 rows, bad shapes, non-finite input or a Hessian that cannot be factored.
    CPU ops run single-threaded but for the scale searches' passes, as in :func:`gptq_quantize`.
    """
    qps = list(qparams_list)
    if not qps:
        raise ValueError("gptq_quantize_many: qparams_list is empty")
    return _run(weight, hessian, qps, False, percdamp)


def _run(weight: torch.Tensor, hessian: torch.Tensor | HessianFactor | None, qps: list[QParams],
         rtn: bool, percdamp: float) -> list[GPTQResult]:
    """:func:`_gptq_many`, with single-threaded ops on CPU except the scale search's
    elementwise passes, which get the thread count in effect before."""
    if isinstance(weight, torch.Tensor) and weight.device.type == "cpu":
        with single_threaded_ops() as threads:
            return _gptq_many(weight, hessian, qps, rtn, percdamp, threads)
    return _gptq_many(weight, hessian, qps, rtn, percdamp, None)


def _gptq_many(weight: torch.Tensor, hessian: torch.Tensor | HessianFactor | None,
               qps: list[QParams], rtn: bool, percdamp: float,
               threads: int | None) -> list[GPTQResult]:
    """The quantizer behind :func:`gptq_quantize` and :func:`gptq_quantize_many` (see there):
    S = len(qps) settings on the stacked float32 [K, S·N] Wᵀ; ``rtn`` skips the error feedback
    (and the Hessian factor), quantizing each 32-row block at once."""
    if weight.dim() != 2:
        raise ValueError(f"gptq_quantize: weight must be 2-D [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    S = len(qps)
    dev = weight.device
    for qp in qps:
        if not isinstance(qp, QParams):
            raise ValueError(f"gptq_quantize: settings must be QParams, got {type(qp).__name__}")
    groups = [qp.groups(K) for qp in qps]
    for qp, gs in zip(qps, groups):
        for gi, g in enumerate(gs):
            if g.start % BLOCK:
                raise ValueError(f"gptq_quantize: setting {qp} at K={K}: group {gi} starts at row "
                                 f"{g.start}, not a multiple of {BLOCK}; the {BLOCK}-row GPTQ "
                                 f"blocks need every group boundary on a multiple of {BLOCK} rows")
    W0 = weight.to(torch.float32).T
    if not all_finite(W0):
        raise ValueError("gptq_quantize: weight has NaN or Inf values")
    if isinstance(hessian, HessianFactor):
        fac = hessian
        if fac.perm.numel() != K or fac.perm.device != dev or fac.percdamp != percdamp \
                or (fac.upper is None and not rtn):
            raise ValueError(f"gptq_quantize: the Hessian factor (K={fac.perm.numel()}, "
                             f"{fac.perm.device}, percdamp {fac.percdamp}, factor "
                             f"{'absent' if fac.upper is None else 'present'}) does not fit "
                             f"weight [{N}, {K}] on {dev} with percdamp {percdamp}")
    else:
        fac = hessian_factor(hessian, K, dev, percdamp, rtn)
    perm, invperm, U = fac.perm, fac.invperm, (None if rtn else fac.upper)
    W = W0[perm].repeat(1, S)                     # fresh float32 [K, S·N], updated in place
    del W0
    SN = S * N
    qweight = torch.empty((K, SN), dtype=torch.uint8, device=dev)
    deq = torch.empty((K, SN), dtype=torch.float16, device=dev)
    qscale = [torch.empty((len(gs), N), dtype=torch.uint8, device=dev) for gs in groups]
    qscale_max = [torch.empty((len(gs),), dtype=torch.float16, device=dev) for gs in groups]
    # per-column parameters of the current group of each setting
    scale_h = torch.zeros(SN, dtype=torch.float16, device=dev)    # fp16 effective scale
    scale = torch.zeros(SN, dtype=torch.float32, device=dev)      # the same in float32
    zero = torch.zeros(SN, dtype=torch.float32, device=dev)       # 2^(b-1)
    maxq = torch.zeros(SN, dtype=torch.float32, device=dev)       # 2^b - 1
    starts: dict[int, list[tuple[int, int, Group]]] = {}
    for s, gs in enumerate(groups):
        for gi, g in enumerate(gs):
            starts.setdefault(g.start, []).append((s, gi, g))
    udiag = None if U is None else torch.diagonal(U).tolist()   # Python floats: exact, no 0-d ops
    err = torch.empty((BLOCK, SN), dtype=torch.float32, device=dev)
    q = torch.empty(SN, dtype=torch.float32, device=dev)
    prod = None if rtn else torch.empty(((BLOCK - 1) * SN,), dtype=torch.float32, device=dev)
    zero_scale = False                           # an all-zero group somewhere: 0/0 below
    search = 0.0                                 # seconds in find_params
    # row views made once (indexing is a dispatch per use: the row loop runs K times)
    w_rows, qweight_rows, deq_rows, err_rows = W.unbind(0), qweight.unbind(0), deq.unbind(0), err.unbind(0)

    for a in range(0, K, BLOCK):
        be = min(a + BLOCK, K)
        new = starts.get(a, ())
        found: dict[tuple[Group, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for s, gi, g in new:
            cols = slice(s * N, (s + 1) * N)
            # settings with the same groups up to here have the same columns so far
            prefix = tuple(groups[s][:gi + 1])
            if prefix not in found:
                t0 = time.perf_counter()
                found[prefix] = find_params(W[g.start:g.end, cols].contiguous(), g.bits, threads)
                search += time.perf_counter() - t0
            qs, qmax, sc = found[prefix]
            qscale[s][gi], qscale_max[s][gi] = qs, qmax
            scale_h[cols] = sc
            scale[cols] = sc.to(torch.float32)
            zero[cols] = float(1 << (g.bits - 1))
            maxq[cols] = float((1 << g.bits) - 1)
        if new:
            zero_scale = bool((scale_h == 0).any())
        if rtn:
            qb = torch.round(W[a:be] / scale).add_(zero).clamp_(min=0.0)
            torch.minimum(qb, maxq, out=qb)
            if zero_scale:
                qb = torch.where(torch.isnan(qb), zero, qb)
            qweight[a:be] = qb.to(torch.uint8)
            deq[a:be] = (qb - zero).to(torch.float16) * scale_h
            continue
        for c in range(a, be):
            w = w_rows[c]
            torch.div(w, scale, out=q)
            q.round_().add_(zero).clamp_(min=0.0)
            torch.minimum(q, maxq, out=q)
            qc = torch.where(torch.isnan(q), zero, q) if zero_scale else q
            qweight_rows[c].copy_(qc)
            dq = deq_rows[c]
            dq.copy_(torch.sub(qc, zero, out=q))       # exact small integers, then fp16
            dq.mul_(scale_h)
            r = err_rows[c - a]
            torch.sub(w, dq, out=r)                    # fp16 → float32 is exact
            r.div_(udiag[c])
            if c + 1 < be:
                # product and difference rounded apart on every capability (addr_ fuses them
                # into one FMA at avx2 and above, not at default: quantize/exact_ops.py)
                exact_ops.sub_outer_(W[c + 1:be], U[c, c + 1:be], r, prod)
        if be < K:
            W[be:].addmm_(U[a:be, be:].T, err[:be - a], alpha=-1.0)

    deq = deq[invperm]
    out = []
    for s, qp in enumerate(qps):
        cols = slice(s * N, (s + 1) * N)
        out.append(GPTQResult(qweight=qweight[:, cols].contiguous(), qscale=qscale[s],
                              qscale_max=qscale_max[s], perm=perm.clone(), invperm=invperm.clone(),
                              weight=deq[:, cols].T.contiguous(), qparams=qp, groups=groups[s],
                              search_seconds=search))
    return out
