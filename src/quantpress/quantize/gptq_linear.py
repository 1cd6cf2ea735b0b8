"""GPTQ of one linear onto the uniform integer grid of GPTQ checkpoints.

Reproduces the algorithm of GPTQ (Frantar et al. 2022, reference code ``gptq.py``
``GPTQ.fasterquant``) as GPTQModel 7.7 runs it (``gptqmodel/quantization/gptq.py``
``GPTQ.quantize`` with ``static_groups=False``, ``quantizer.py`` ``Quantizer.find_params``):

* dead inputs (diag(H) = 0) get H[i, i] = 1 and a zero weight column;
* act-order (``desc_act``): inputs sorted by descending diag(H);
* damping ``damp·mean(diag H)`` on the diagonal, then ``U = chol_upper(H⁻¹)``;
* the inputs in blocks of :data:`BLOCK` = 128 (lazy batch): inside a block each input row is
  quantized, its error divided by U[c, c] and spread over the rest of the block (each
  product and difference rounded apart, ``exact_ops.sub_outer_``: the same on every CPU
  capability); after the block, the rows after it get the block's error in one matmul;
* group parameters (min-max, per output column) computed when a group starts, from the
  group's current, error-updated weights (every group boundary is made to fall on a block
  start or inside a block whose rows hold all earlier updates, so "current" is exact here,
  where the reference code reads the partly stale matrix for groups smaller than a block).

The scale is rounded to float16 when it is found and the codes and the error feedback use
that float16 scale, so that the fake-quantized weight equals the checkpoint's dequantization
``scale·(q − zero)`` (float16) bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpress.quantize import exact_ops
from quantpress.quantize.ggml.common import all_finite, single_threaded_ops

#: Rows per lazy-batch block (GPTQModel's ``blocksize``).
BLOCK = 128
#: Damping fraction of mean(diag H) added to the diagonal (llm-compressor's
#: ``dampening_frac`` default; GPTQModel's ``damp_percent``).
DAMP = 0.01
#: Cholesky attempts, each with the damping increased by ``DAMP_STEP`` (GPTQModel's
#: ``damp_auto_increment``).
MAX_ATTEMPTS = 10
DAMP_STEP = 0.0025
SUPPORTED_BITS = (2, 4, 8)


@dataclass
class GPTQLinearResult:
    """GPTQ of a linear with weight [N, K] (out, in), G groups.

    ``codes``  uint8 [K, N]: stored values 0..2^bits−1, rows in the original input order;
    ``zeros``  uint8 [G, N]: integer zero points (symmetric: 2^(bits−1));
    ``scales`` float16 [G, N];
    ``g_idx``  int32 [K]: the group of each input row (original order);
    ``perm``   int64 [K]: the order the rows were quantized in (identity without act-order);
    ``weight`` float16 [N, K]: fake-quantized weight ``scales[g_idx]·(codes − zeros[g_idx])``;
    ``damp``   the damping fraction that made the Hessian factorable.
    """

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor
    perm: torch.Tensor
    weight: torch.Tensor
    damp: float


def find_params(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max parameters of one group, per output column (GPTQModel 7.7 ``Quantizer.find_params``
    for weights, ``perchannel``, no MSE search).

    ``x`` float32 [rows, N] (the group's input rows). Range [min(x, 0), max(x, 0)]; symmetric:
    [−m, m] with m = max(|min|, max), zero 2^(b−1) (e.g. 8 for 4 bits); an all-zero column gets
    [−1, 1]; ``scale = (max − min)/(2^b − 1)``; asymmetric zero ``round(−min/scale)``.
    Returns (scale float16 [N], zero float32 [N], integral).
    """
    maxq = float((1 << bits) - 1)
    xmin = torch.clamp(x.amin(dim=0), max=0.0)
    xmax = torch.clamp(x.amax(dim=0), min=0.0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both = (xmin == 0) & (xmax == 0)
    xmin = torch.where(both, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(both, torch.full_like(xmax, 1.0), xmax)
    scale = (xmax - xmin) / maxq
    if sym:
        zero = torch.full_like(scale, (maxq + 1.0) / 2.0)
    else:
        zero = torch.round(-xmin / scale)
    return scale.to(torch.float16), zero


def hessian_inverse_factor(hessian: torch.Tensor, damp: float = DAMP) -> tuple[torch.Tensor, float]:
    """``(U, damp)``: U float32 [K, K] the upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹
    for ``hessian`` float32 [K, K] (not modified). When a factorisation fails the damping grows
    by :data:`DAMP_STEP`, at most :data:`MAX_ATTEMPTS` times (GPTQModel 7.7
    ``GPTQ.hessian_inverse``: ``cholesky``, ``cholesky_inverse``, ``cholesky(upper=True)``).
    Raises ValueError when none works."""
    mean = torch.diagonal(hessian).mean()
    d = float(damp)
    for _ in range(MAX_ATTEMPTS):
        h = hessian.clone()
        torch.diagonal(h).add_(d * mean)
        chol, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if int(info) == 0 and all_finite(upper):
                return upper, d
        d += DAMP_STEP
    raise ValueError(f"Hessian [{hessian.shape[0]}x{hessian.shape[0]}] is not positive definite "
                     f"with damping up to {d - DAMP_STEP:.4f}")


def block_rows(group_size: int, in_features: int) -> int:
    """Rows per lazy-batch block for groups of ``group_size`` rows: :data:`BLOCK` when groups
    tile it or it tiles the groups (or one group spans everything), else the largest multiple
    of the group size up to :data:`BLOCK` (or the group size itself when larger), so that every
    group starts where its rows hold every earlier row's update."""
    gs = group_size
    if gs >= in_features or BLOCK % gs == 0 or gs % BLOCK == 0:
        return BLOCK
    return gs * (BLOCK // gs) if gs < BLOCK else gs


@dataclass
class HessianFactor:
    """What GPTQ needs from a Hessian, shared by the linears that read the same input (q/k/v,
    gate/up): ``dead`` bool [K] (inputs with diag(H) = 0), ``perm`` int64 [K] (act-order or
    identity), ``U`` float32 [K, K] (:func:`hessian_inverse_factor` of the permuted, dead-fixed
    Hessian; None for the identity Hessian, whose factor is diagonal: no error feedback, i.e.
    round to nearest), ``damp`` (the damping fraction used), ``in_features`` K."""

    dead: torch.Tensor
    perm: torch.Tensor
    U: torch.Tensor | None
    damp: float
    in_features: int


def factor_hessian(hessian: torch.Tensor | None, in_features: int, *, act_order: bool = False,
                   damp: float = DAMP, device=None) -> HessianFactor:
    """:class:`HessianFactor` of ``hessian`` float [K, K] (None: identity) on ``device``
    (default: the Hessian's): dead inputs get H[i, i] = 1; with ``act_order`` the inputs are
    sorted by descending diag(H) (ties in index order); then :func:`hessian_inverse_factor`.
    Raises ValueError for a wrong shape, NaN/Inf, or a Hessian that cannot be factored."""
    K = in_features
    if hessian is None:
        ar = torch.arange(K, device=device)
        return HessianFactor(torch.zeros(K, dtype=torch.bool, device=device), ar, None, float(damp), K)
    else:
        if tuple(hessian.shape) != (K, K):
            raise ValueError(f"gptq_quantize_linear: Hessian shape {tuple(hessian.shape)}, "
                             f"expected ({K}, {K})")
        H = hessian.to(device=device or hessian.device, dtype=torch.float32).clone()
        if not all_finite(H):
            raise ValueError("gptq_quantize_linear: Hessian has NaN or Inf values")
    dead = torch.diagonal(H) == 0
    torch.diagonal(H)[dead] = 1.0
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        H = H[perm][:, perm]
    else:
        perm = torch.arange(K, device=H.device)
    if H.device.type == "cpu":
        with single_threaded_ops():
            U, used = hessian_inverse_factor(H, damp)
    else:
        U, used = hessian_inverse_factor(H, damp)
    return HessianFactor(dead, perm, U, used, K)


def gptq_quantize_linear(weight: torch.Tensor, hessian: torch.Tensor | None, *, bits: int = 4,
                         group_size: int = 128, sym: bool = True, act_order: bool = False,
                         damp: float = DAMP, factor: HessianFactor | None = None) -> GPTQLinearResult:
    """GPTQ one linear (see the module docstring for the steps and the upstream code).

    ``weight`` [N, K] (float16/bfloat16/float32, any device); ``hessian`` float [K, K]
    (∝ Σ xᵀx over the calibration tokens; None: identity, i.e. round-to-nearest with the same
    groups); ``group_size`` input rows per group, or −1 for one group (per output column);
    ``bits`` in {2, 4, 8}; ``factor``: a :class:`HessianFactor` made by :func:`factor_hessian`
    with the same ``act_order`` and ``damp`` (replaces ``hessian``; linears that read the same
    input share it). Works on Wᵀ float32 [K, N] on the weight's device; on CPU with one
    intra-op thread (the row loop is thousands of small ops).

    Raises ValueError for bad shapes, a group size that does not divide K, NaN/Inf input, or a
    Hessian that cannot be factored.
    """
    if weight.dim() != 2:
        raise ValueError(f"gptq_quantize_linear: weight must be 2-D [N, K], got {tuple(weight.shape)}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"gptq_quantize_linear: bits {bits} not in {SUPPORTED_BITS}")
    N, K = weight.shape
    gs = K if group_size == -1 else int(group_size)
    if gs <= 0 or K % gs:
        raise ValueError(f"gptq_quantize_linear: group size {group_size} does not divide in_features {K}")
    if not all_finite(weight):
        raise ValueError("gptq_quantize_linear: weight has NaN or Inf values")
    if factor is None:
        factor = factor_hessian(hessian, K, act_order=act_order, damp=damp, device=weight.device)
    elif factor.in_features != K:
        raise ValueError(f"gptq_quantize_linear: Hessian factor of {factor.in_features} inputs, "
                         f"expected {K}")
    if weight.device.type == "cpu":
        with single_threaded_ops():
            return _quantize(weight, factor, bits, gs, sym)
    return _quantize(weight, factor, bits, gs, sym)


def _quantize(weight: torch.Tensor, f: HessianFactor, bits: int, gs: int, sym: bool) -> GPTQLinearResult:
    N, K = weight.shape
    dev = weight.device
    W = weight.to(torch.float32).T.contiguous()          # [K, N], updated in place
    W[f.dead.to(dev)] = 0.0
    perm, used = f.perm.to(dev), f.damp
    U = None if f.U is None else f.U.to(dev)
    W = W[perm].contiguous()
    G = K // gs
    maxq = float((1 << bits) - 1)
    codes = torch.empty((K, N), dtype=torch.uint8, device=dev)
    deq = torch.empty((K, N), dtype=torch.float16, device=dev)
    scales = torch.empty((G, N), dtype=torch.float16, device=dev)
    zeros = torch.empty((G, N), dtype=torch.float32, device=dev)
    if U is None:  # identity Hessian: no error feedback; every group at once
        Wg = W.view(G, gs, N)
        for g in range(G):   # find_params per group (a reduction over its rows)
            scales[g], zeros[g] = find_params(Wg[g], bits, sym)
        sc = scales.to(torch.float32)[:, None, :]
        z = zeros[:, None, :]
        q = torch.clamp(torch.round(Wg / sc) + z, 0.0, maxq)
        codes = q.to(torch.uint8).view(K, N)
        deq = ((q - z) * sc).to(torch.float16).view(K, N)
        return _result(codes, deq, scales, zeros, perm, gs, used)
    udiag = torch.diagonal(U)
    bsz = block_rows(gs, K)
    err = torch.empty((bsz, N), dtype=torch.float32, device=dev)
    q = torch.empty(N, dtype=torch.float32, device=dev)
    prod = torch.empty(((bsz - 1) * N,), dtype=torch.float32, device=dev)
    scale_h = scale = zero = None
    for a in range(0, K, bsz):
        be = min(a + bsz, K)
        for c in range(a, be):
            if c % gs == 0:
                # rows c.. of this block hold every earlier update; rows past the block hold
                # all updates of earlier blocks (a group longer than a block starts on a block
                # start: block_rows)
                scale_h, zero = find_params(W[c:c + gs], bits, sym)
                scales[c // gs], zeros[c // gs] = scale_h, zero
                scale = scale_h.to(torch.float32)
            w = W[c]
            torch.div(w, scale, out=q)
            q.round_().add_(zero).clamp_(0.0, maxq)
            codes[c] = q.to(torch.uint8)
            dq = (q - zero).mul_(scale).to(torch.float16)
            deq[c] = dq
            r = err[c - a]
            torch.sub(w, dq.to(torch.float32), out=r)
            r.div_(udiag[c])
            if c + 1 < be:
                # product and difference rounded apart on every capability (addr_ fuses them
                # into one FMA at avx2 and above, not at default: quantize/exact_ops.py)
                exact_ops.sub_outer_(W[c + 1:be], U[c, c + 1:be], r, prod)
        if be < K:
            W[be:].addmm_(U[a:be, be:].T, err[:be - a], alpha=-1.0)
    return _result(codes, deq, scales, zeros, perm, gs, used)


def _result(codes, deq, scales, zeros, perm, gs, damp) -> GPTQLinearResult:
    """Rows back in the original input order; g_idx of each input row."""
    K = codes.shape[0]
    invperm = torch.argsort(perm)
    g_idx = (torch.arange(K, device=codes.device) // gs)[invperm].to(torch.int32)
    return GPTQLinearResult(codes=codes[invperm].contiguous(), zeros=zeros.to(torch.uint8),
                            scales=scales, g_idx=g_idx, perm=perm,
                            weight=deq[invperm].T.contiguous(), damp=damp)
