"""GPTQ with act-order and EXL2's mixed-bit groups (specs/exl2.md §5).

Reproduces exllamav2 0.3.2 ``conversion/adaptivegptq.py`` (``AdaptiveGPTQ.prepare`` /
``quantize`` / ``quantize_rtn_inplace``, ``AdaptiveQuantizer.find_params``) and its CUDA
helpers (``cuda/quantize.cu`` ``quantize_err_kernel`` and ``fused_quantize_adjust_kernel``,
``cpp/quantize_func.cpp`` ``quantize_range``) in plain torch, on the weight's device.

The quantizer works on Wᵀ (rows = the K inputs, columns = the N outputs) in float32. The
result holds the stored codes and per-group parameters that :func:`quantize.exl2.pack` turns
into EXL2 tensors, and the fake-quantized fp16 weight that the next module is run with.
Quantization is symmetric (implicit zero 2^(b-1)); scales are 4-bit square-law codes times a
per-group fp16 maximum.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantize.exl2 import Group, QParams, pack
from quantize.ggml.common import _single_threaded_ops

#: Damping added to diag(H), as a fraction of its mean (exllamav2 ``percdamp``).
PERCDAMP = 0.12
#: Smallest damping added.
MIN_DAMP = 1e-5
#: Cholesky attempts, each after adding the damping once more.
MAX_ATTEMPTS = 10
#: Scale search: p runs over MIN_P..MAX_P in P_GRID steps; error norm |err|^ERR_NORM.
MIN_P, MAX_P, P_GRID, ERR_NORM = 0.70, 1.20, 96, 3.5
#: Elements per scale-search chunk ([p, rows, N] float32 temporaries).
_SEARCH_ELEMS = 1 << 23


@dataclass
class GPTQResult:
    """Output of :func:`gptq_quantize` for a linear with weight [N, K] and G groups.

    ``qweight``    uint8 [K, N]: stored codes 0..2^b-1, rows in act-order (row i = input perm[i]);
    ``qscale``     uint8 [G, N]: square-law scale codes 1..16 (q_scale stores qscale - 1);
    ``qscale_max`` float16 [G]: the stored q_scale_max (group max scale, without the 1/256);
    ``perm``       int64 [K]: act-order permutation (inputs by descending diag(H));
    ``invperm``    int64 [K]: argsort(perm), stored as q_invperm;
    ``weight``     float16 [N, K]: fake-quantized weight (deq[invperm].T), which equals
                   :func:`quantize.exl2.reconstruct` of the packed tensors bit for bit;
    ``qparams``, ``groups``: the settings and the group layout along the act-order rows.
    """

    qweight: torch.Tensor
    qscale: torch.Tensor
    qscale_max: torch.Tensor
    perm: torch.Tensor
    invperm: torch.Tensor
    weight: torch.Tensor
    qparams: QParams
    groups: list[Group]

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
        # = torch.cholesky_inverse(chol); cholesky_solve is the same product L⁻ᵀL⁻¹ and ~10x
        # faster on CPU (torch 2.x's CPU cholesky_inverse is slow)
        inv = torch.cholesky_solve(torch.eye(h.shape[0], dtype=h.dtype, device=h.device), chol)
        if not bool(torch.isfinite(inv).all()):
            continue
        upper, info = torch.linalg.cholesky_ex(inv, upper=True)
        if int(info) == 0 and bool(torch.isfinite(upper).all()):
            return upper
    raise ValueError(f"Hessian [{h.shape[0]}x{h.shape[0]}] is not positive definite after "
                     f"{MAX_ATTEMPTS} damping attempts")


def p_grid(device: torch.device | str | None = None) -> torch.Tensor:
    """The 97 scale multipliers of the search, float32: p_i = 0.70·(1 − i/96) + 1.20·(i/96)."""
    pi = torch.arange(P_GRID + 1, dtype=torch.float32, device=device) / P_GRID
    return MIN_P * (1.0 - pi) + MAX_P * pi


def scale_search_error(x: torch.Tensor, cand: torch.Tensor, bits: int,
                       grid: torch.Tensor | None = None) -> torch.Tensor:
    """E(p) = Σ_{rows,n} |clamp(rint(x/(cand·p)), −2^(b−1), 2^(b−1)−1)·cand·p − x|^3.5 for every
    p of the grid (exllamav2 0.3.2 ``quantize_err_kernel``).

    ``x`` float32 [rows, N], ``cand`` float32 [N] (candidate scales), ``grid`` float32 [P]
    (default :func:`p_grid`). Returns float32 [P]. Vectorized over p, rows and columns at
    once, in p-chunks of at most 2^23 elements.
    """
    if grid is None:
        grid = p_grid(x.device)
    z = float(1 << (bits - 1))
    per = max(1, _SEARCH_ELEMS // max(1, x.numel()))
    out = []
    for p in grid.split(per):
        s = cand[None, None, :] * p[:, None, None]                  # [P, 1, N]
        e = torch.round(x[None] / s).clamp_(-z, z - 1.0).mul_(s).sub_(x[None]).abs_()
        e35 = e * e
        e35.mul_(e).mul_(e.sqrt_())                                  # |err|^3.5
        out.append(e35.sum(dim=(1, 2)))
    return torch.cat(out)


def find_params(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scale parameters of one group (exllamav2 0.3.2 ``AdaptiveQuantizer.find_params``).

    ``x`` float32 [rows, N]: the group's current (error-updated) rows. Returns
    ``(qscale, qscale_max, scale)``:

    * ``qscale`` uint8 [N], 1..16: ``clamp(round(sqrt(base/smax)·16), 1, 16)`` with
      ``base = (max|x| + 1e-12) / ((2^b − 1)/2)`` per column and ``smax = max(base)``;
    * ``qscale_max`` float16 0-d: ``fp16(smax·p*)``, p* the first argmin of
      :func:`scale_search_error` over the candidates ``(qscale/16)²·smax``;
    * ``scale`` float16 [N]: the effective scale ``fp16(qscale²) × fp16(qscale_max × 1/256)``
      (fp16 multiplies), the one the codes are made with and the kernel dequantizes with.
    """
    maxq = (1 << bits) - 1
    xmax = x.abs().amax(dim=0) + 1e-12
    base = xmax / (maxq / 2)
    smax = base.max()
    qs = torch.clamp(torch.round(torch.sqrt(base / smax) * 16.0), 1.0, 16.0)
    cand = (qs / 16.0) ** 2 * smax
    grid = p_grid(x.device)
    best = torch.argmin(scale_search_error(x, cand, bits, grid))
    qscale_max = (smax * grid[best]).to(torch.float16)
    prescale = torch.tensor(1.0 / 256, dtype=torch.float16, device=x.device)
    scale = (qs * qs).to(torch.float16) * (qscale_max * prescale)
    return qs.to(torch.uint8), qscale_max, scale


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | None, qparams: QParams, *,
                  rtn: bool = False, percdamp: float = PERCDAMP) -> GPTQResult:
    """Quantize one linear to EXL2 with GPTQ and act-order (specs/exl2.md §5).

    ``weight`` [N, K] (out_features, in_features), fp16/bf16/fp32, any device; ``hessian``
    float [K, K] = mean over calibration rows of XᵀX (None: identity, as exllamav2 does
    without data), moved to the weight's device; ``qparams`` the bit widths and groups.

    Steps (exllamav2 0.3.2 ``AdaptiveGPTQ.prepare`` + ``quantize``): act-order permutation by
    descending diag(H); damping and :func:`hessian_inverse_factor`; then for every group in
    order, :func:`find_params` on the current rows and the GPTQ loop over its rows c
    (``quantize_range``): ``q = clamp(rint(W[c]/s) + 2^(b−1), 0, 2^b−1)``,
    ``deq = fp16(fp16(q − 2^(b−1))·s)``, ``err = (W[c] − deq)/U[c,c]``, ``W[c+1:e] −= U[c, c+1:e]ᵀ·err``;
    after the group ``W[e:] −= U[a:e, e:]ᵀ·err[a:e]`` (one matmul).

    ``rtn=True`` skips the error feedback (``quantize_rtn_inplace``, which exllamav2 uses for a
    head over 1e9 weights): same act-order, groups and scales, codes by rounding.
    Raises ValueError for bad shapes, non-finite input or a Hessian that cannot be factored.

    On CPU the ops run with one intra-op thread (torch's setting is restored afterwards), as
    quantize/ggml's codecs do: the thousands of small sequential ops of the GPTQ loop stall in
    OpenMP spin-waits otherwise (a 2048x2048 layer: 5 s single-threaded, 23 s with 2 threads
    on a busy 2-core machine).
    """
    if weight.device.type == "cpu":
        with _single_threaded_ops():
            return _gptq_quantize(weight, hessian, qparams, rtn, percdamp)
    return _gptq_quantize(weight, hessian, qparams, rtn, percdamp)


def _gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor | None, qparams: QParams,
                   rtn: bool, percdamp: float) -> GPTQResult:
    if weight.dim() != 2:
        raise ValueError(f"gptq_quantize: weight must be 2-D [N, K], got {tuple(weight.shape)}")
    N, K = weight.shape
    dev = weight.device
    groups = qparams.groups(K)
    W = weight.to(torch.float32).T
    if not bool(torch.isfinite(W).all()):
        raise ValueError("gptq_quantize: weight has NaN or Inf values")
    if hessian is None:
        H = torch.eye(K, dtype=torch.float32, device=dev)
    else:
        if tuple(hessian.shape) != (K, K):
            raise ValueError(f"gptq_quantize: Hessian shape {tuple(hessian.shape)}, expected ({K}, {K})")
        H = hessian.to(device=dev, dtype=torch.float32)
        if not bool(torch.isfinite(H).all()):
            raise ValueError("gptq_quantize: Hessian has NaN or Inf values")

    perm = act_order(H)
    invperm = torch.argsort(perm)
    W = W[perm].contiguous()                      # fresh float32 [K, N], updated in place
    U = None if rtn else hessian_inverse_factor(H[perm][:, perm], percdamp)
    del H
    G = len(groups)
    qweight = torch.empty((K, N), dtype=torch.uint8, device=dev)
    deq = torch.empty((K, N), dtype=torch.float16, device=dev)
    qscale = torch.empty((G, N), dtype=torch.uint8, device=dev)
    qscale_max = torch.empty((G,), dtype=torch.float16, device=dev)
    udiag = None if U is None else torch.diagonal(U)

    for gi, g in enumerate(groups):
        a, e, b = g.start, g.end, g.bits
        qs, qmax, scale_h = find_params(W[a:e], b)
        qscale[gi], qscale_max[gi] = qs, qmax
        s = scale_h.to(torch.float32)
        z, maxq = float(1 << (b - 1)), float((1 << b) - 1)
        zero_scale = bool((scale_h == 0).any())     # an all-zero group: 0/0 below
        if rtn:
            q = torch.round(W[a:e] / s).add_(z).clamp_(0.0, maxq)
            if zero_scale:
                q.nan_to_num_(nan=z)
            qweight[a:e] = q.to(torch.uint8)
            deq[a:e] = (q - z).to(torch.float16) * scale_h
            continue
        err = torch.empty((e - a, N), dtype=torch.float32, device=dev)
        for c in range(a, e):
            w = W[c]
            q = torch.round(w / s).add_(z).clamp_(0.0, maxq)
            if zero_scale:
                q.nan_to_num_(nan=z)
            qweight[c] = q.to(torch.uint8)
            dq = (q - z).to(torch.float16).mul_(scale_h)
            deq[c] = dq
            r = err[c - a]
            torch.sub(w, dq.to(torch.float32), out=r)
            r.div_(udiag[c])
            if c + 1 < e:
                W[c + 1:e].addr_(U[c, c + 1:e], r, alpha=-1.0)
        if e < K:
            W[e:].addmm_(U[a:e, e:].T, err, alpha=-1.0)

    weight_q = deq[invperm].T.contiguous()
    return GPTQResult(qweight=qweight, qscale=qscale, qscale_max=qscale_max, perm=perm,
                      invperm=invperm, weight=weight_q, qparams=qparams, groups=groups)
