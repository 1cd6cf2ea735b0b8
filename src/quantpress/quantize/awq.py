"""AWQ math: asymmetric group quantization with zero points, the activation-aware scale grid,
the clipping search, and AutoAWQ's GEMM packing. Pure tensor math on the tensors' device; no
model code and no file I/O (the per-layer algorithm is :mod:`calibration.awq`, the on-disk
directory :mod:`convert.awq_dir`).

Reproduces AutoAWQ 0.2.9 (``awq/quantize/quantizer.py`` ``AwqQuantizer.pseudo_quantize_tensor``,
``_search_best_scale``/``_compute_best_scale``, ``_compute_best_clip``;
``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``).
Weight arithmetic is done in float16, as AutoAWQ does on its fp16 model, so that the packed
integers and scales dequantize to the fake-quantized weights bit for bit; losses and the
clipping error are computed in float32 (AutoAWQ computes them in fp16 on the GPU), which can
pick a different grid point in a near-tie but never changes the format.

Layout conventions: a linear weight is ``[out_features, in_features]`` (torch order); groups of
``group_size`` consecutive input columns share one scale and zero point per output row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: AutoAWQ's nibble order inside one int32 of qweight/qzeros: nibble k holds column 8c + ORDER[k]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: scale grid size of the search (ratios k / N_GRID, k = 0..N_GRID-1; 1.0 is never tried)
N_GRID = 20
#: clipping search: N_CLIP_GRID steps of max|w|·(1 − i/N_CLIP_GRID), i < MAX_SHRINK·N_CLIP_GRID
N_CLIP_GRID = 20
MAX_SHRINK = 0.5
#: tokens the clipping search keeps (every ⌊n/512⌋-th)
CLIP_TOKENS = 512


@dataclass
class GroupQuant:
    """Result of :func:`pseudo_quantize` for a weight [out, in] with G = in / group_size groups.

    ``w_fq`` float16 [out, in]: fake-quantized weight ``(q − zero)·scale``;
    ``q`` uint8 [out, in]: integer weights in [0, 2^bits − 1];
    ``scales`` float16 [out, G]; ``zeros`` uint8 [out, G]: zero points in [0, 2^bits − 1]."""

    w_fq: torch.Tensor
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor


def check_shape(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why a linear [out, in] cannot be stored as AWQ GEMM with ``group_size``, or None if it
    can: in_features must be a multiple of the group size, out_features a multiple of 8 (eight
    4-bit values per int32 column), as AutoAWQ and vLLM require."""
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of group_size {group_size}"
    if out_features % 8:
        return f"out_features {out_features} is not a multiple of 8"
    return None


def pseudo_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128) -> GroupQuant:
    """Asymmetric round-to-nearest group quantization of ``w`` (float16 [..., in], in a multiple
    of ``group_size``), in float16 arithmetic, on ``w``'s device:

    ``scale = clamp(max − min, 1e-5) / (2^bits − 1)``, ``zero = clamp(−round(min/scale), 0,
    2^bits − 1)``, ``q = clamp(round(w/scale) + zero, 0, 2^bits − 1)``, ``w_fq = (q − zero)·scale``
    per group (round half to even; the range is not forced to include 0).

    Reproduces AutoAWQ ``AwqQuantizer.pseudo_quantize_tensor`` (zero_point=True) on fp16 tensors.
    Raises ValueError for a non-fp16 input, a width not divisible by the group size, or NaN."""
    if w.dtype != torch.float16:
        raise ValueError(f"pseudo_quantize works on float16 weights, got {w.dtype}")
    shape = w.shape
    if shape[-1] % group_size:
        raise ValueError(f"width {shape[-1]} is not a multiple of group_size {group_size}")
    g = w.reshape(-1, group_size)
    if bool(torch.isnan(g).any()):
        raise ValueError("weight holds NaN")
    max_int = 2 ** bits - 1
    max_val = g.amax(dim=1, keepdim=True)
    min_val = g.amin(dim=1, keepdim=True)
    scales = (max_val - min_val).clamp(min=1e-5) / max_int
    zeros = (-torch.round(min_val / scales)).clamp_(0, max_int)
    q = torch.clamp(torch.round(g / scales) + zeros, 0, max_int)
    w_fq = (q - zeros) * scales
    n_groups = shape[-1] // group_size
    lead = shape[:-1]
    return GroupQuant(w_fq.reshape(shape), q.to(torch.uint8).reshape(shape),
                      scales.reshape(*lead, n_groups), zeros.to(torch.uint8).reshape(*lead, n_groups))


# --------------------------------------------------------------------------------------------
# Scale search (AutoAWQ _search_best_scale)

def weight_mean(weights: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """``w_mean`` [in] (float16) of the weights of one scale group (each float16 [out_i, in]):
    the weights concatenated along the output dimension, viewed as rows of ``group_size``,
    ``|w| / (max|w| of the row + 1e-6)``, then the mean over all output rows, in float16.
    AutoAWQ ``_search_best_scale`` step 1."""
    w = torch.cat(weights, dim=0)
    shape = w.shape
    g = w.reshape(-1, group_size).abs()
    g = g / (g.amax(dim=1, keepdim=True) + 1e-6)
    return g.reshape(shape).mean(0)


def input_mean(abs_sum: torch.Tensor, count: int) -> torch.Tensor:
    """``x_mean`` [in] (float16): mean |x| over ``count`` tokens from the float32/float64 sum
    ``abs_sum`` [in], cast back to float16 (AutoAWQ step 2 sums in fp32 over fp16 inputs)."""
    return (abs_sum.float() / count).to(torch.float16)


def grid_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float, duo: bool = True) -> torch.Tensor:
    """Per-input-channel scales ``s`` [in] (float16) of grid point ``ratio`` ∈ [0, 1):

    duo scaling: ``s = clamp(x_mean^r / (w_mean^(1−r) + 1e-4), min=1e-4)``; without (llm-awq):
    ``s = clamp(x_mean^r, min=1e-4)``; then ``s /= sqrt(max(s)·min(s))`` and inf/NaN → 1.
    float16 arithmetic, as AutoAWQ ``_compute_best_scale`` on fp16 statistics."""
    if duo:
        s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    else:
        s = x_mean.pow(ratio).clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    s[torch.isinf(s)] = 1
    s[torch.isnan(s)] = 1
    return s


def scaled_fake_quant(w: torch.Tensor, s: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """``Q(W·diag(s))·diag(1/s)`` (float16 [out, in]): the weight a grid point is scored with
    (AutoAWQ: ``fc.weight.mul_(s); fc.weight = pseudo_quantize(fc.weight) / s``)."""
    return pseudo_quantize(w * s.view(1, -1), bits, group_size).w_fq / s.view(1, -1)


def squared_errors(y0: torch.Tensor, y: torch.Tensor, scratch: torch.Tensor) -> float:
    """Σ(y0 − y)² of one slice of a candidate's output, in float64: the squared differences
    (taken in float32) are written into ``scratch`` (float64, ``y``'s shape) and summed there.
    A float32 ``y`` is overwritten with them (no temporary of its size); other dtypes are cast
    to float32 first. ``y0``, ``y``: the same shape, any float dtype. The pieces of
    :func:`output_loss`: a search that scores a candidate slice by slice calls this per slice
    and takes the candidate's loss as ``scratch.sum() / numel`` once all slices are in (the
    per-slice sums only bound it from below: the squares are non-negative)."""
    if y.dtype == torch.float32 and y0.dtype == torch.float32:
        d = torch.sub(y0, y, out=y).pow_(2)
    else:
        d = (y0.float() - y.float()).pow_(2)
    return float(scratch.copy_(d).sum())


def output_loss(y0: torch.Tensor, y: torch.Tensor, scratch: torch.Tensor | None = None) -> float:
    """Σ(y0 − y)² / numel, accumulated in float64 (AutoAWQ ``_compute_loss``; float32 there).
    ``y0``, ``y``: outputs of the same shape, any float dtype (differences taken in float32).

    ``scratch``: a float64 tensor of ``y``'s shape, for a search that scores many candidates
    against one ``y0`` (:func:`squared_errors`): a float32 ``y`` is then overwritten with the
    squared differences and ``scratch`` holds their float64 copy, where the plain form makes
    two temporaries of ``y``'s size and one of twice its size (``sum(dtype=float64)`` casts its
    whole input first), each mapped and faulted in anew once it passes glibc's mmap threshold.
    The same operations on the same shapes, so the same loss bit for bit."""
    if scratch is not None:
        return squared_errors(y0, y, scratch) / y.numel()
    d = (y0.float() - y.float())
    return float(d.pow(2).sum(dtype=torch.float64)) / d.numel()


def input_gram(x: torch.Tensor, slice_tokens: int = 4096) -> torch.Tensor:
    """``G = XᵀX``, float32 [in, in], of the inputs ``x`` [..., in] (any float dtype; float32
    products and sums, as a float32 forward computes them), accumulated over slices of
    ``slice_tokens`` tokens so that a half-precision ``x`` is never copied whole."""
    xf = x.reshape(-1, x.shape[-1])
    g = torch.zeros(xf.shape[1], xf.shape[1], dtype=torch.float32, device=x.device)
    for a in range(0, xf.shape[0], slice_tokens):
        xs = xf[a:a + slice_tokens].float()
        g.addmm_(xs.T, xs)
    return g


def linear_output_loss(d: torch.Tensor, gram: torch.Tensor, tokens: int) -> float:
    """The :func:`output_loss` of a linear whose weight changes by ``d`` (float32 [out, in])
    on inputs whose Gram matrix is ``gram`` (:func:`input_gram`, [in, in]) over ``tokens``
    tokens: ``Σ_t Σ_o (x_t·d_o)² / (tokens·out) = Σ (d G) ∘ d / (tokens·out)``, the product
    in float32, the sum in float64. The bias cancels. It costs out·in² multiply-adds instead
    of tokens·in·out, so it pays when in < tokens; it equals the output form up to rounding
    (within 4e-7 of the float64 loss on SmolLM2's down_proj, first three layers, where
    the best and second-best grid losses differ by ≥ 3e-3: scripts/micro_figures.py)."""
    e = torch.mm(d, gram).mul_(d)
    return float(e.sum(dtype=torch.float64)) / (tokens * d.shape[0])


# --------------------------------------------------------------------------------------------
# Clipping search (AutoAWQ _compute_best_clip)

def clip_candidates(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Candidate clipping thresholds, float16 [n_shrink, out, G]: ``max|w|·(1 − i/20)`` per
    (row, group) for i = 0..9 (fp16 multiply, as AutoAWQ)."""
    out = w.shape[0]
    org_max = w.reshape(out, -1, group_size).abs().amax(dim=-1)
    n = int(MAX_SHRINK * N_CLIP_GRID)
    return torch.stack([org_max * (1 - i / N_CLIP_GRID) for i in range(n)])


def best_clip(w: torch.Tensor, x: torch.Tensor, bits: int = 4, group_size: int = 128,
              max_elements: int = 1 << 23) -> torch.Tensor:
    """The clipping threshold ``max_val`` float16 [out, G] of every (output row, group) that
    minimizes the error of the group's partial dot products on calibration inputs:

    for each candidate m (:func:`clip_candidates`), ``q = Q(clamp(w, −m, m))`` and
    ``err = mean_tokens (Σ_group x·q − Σ_group x·w)²``; the lowest error wins (strict <, so the
    first — least clipped — candidate on ties). ``w`` float16 [out, in]; ``x`` [tokens, in] (any
    float dtype), subsampled to every max(1, tokens // 512)-th token. The partial dot products
    are float32 batched matmuls over all groups at once; output rows are processed in slices of
    at most ``max_elements`` products (memory bound, not a loop over rows).

    Reproduces AutoAWQ ``_compute_best_clip`` (n_grid 20, max_shrink 0.5, n_sample_token 512).
    The clip itself is symmetric while Q is asymmetric."""
    out, cin = w.shape
    n_groups = cin // group_size
    x = x.reshape(-1, cin)
    step = max(1, x.shape[0] // CLIP_TOKENS)
    x = x[::step].float()
    n_tok = x.shape[0]
    xg = x.reshape(n_tok, n_groups, group_size).permute(1, 0, 2).contiguous()  # [G, T, gs]
    cands = clip_candidates(w, group_size)  # [S, out, G]
    best = cands[0].clone()
    rows = max(1, max_elements // max(1, n_groups * n_tok))
    for a in range(0, out, rows):
        wb = w[a:a + rows]
        r = wb.shape[0]
        wg = wb.reshape(r, n_groups, group_size)
        org = torch.bmm(xg, wg.float().permute(1, 2, 0))  # [G, T, r]
        min_err = torch.full((n_groups, r), float("inf"), device=w.device)
        best_b = best[a:a + r]
        for i in range(cands.shape[0]):
            m = cands[i, a:a + r].unsqueeze(-1)  # [r, G, 1]
            cur = torch.clamp(wg, -m, m).reshape(r, cin)
            qw = pseudo_quantize(cur, bits, group_size).w_fq.reshape(r, n_groups, group_size)
            y = torch.bmm(xg, qw.float().permute(1, 2, 0))
            err = y.sub_(org).square_().mean(dim=1)  # [G, r]
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best_b.copy_(torch.where(better.T, cands[i, a:a + r], best_b))
    return best


def apply_clip(w: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    """``clamp(w, −max_val, max_val)`` per (row, group): float16 [out, in] (AutoAWQ
    ``apply_clip``)."""
    out = w.shape[0]
    m = max_val.unsqueeze(-1)
    return torch.clamp(w.reshape(out, -1, group_size), -m, m).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# GEMM packing (AutoAWQ WQLinear_GEMM.from_linear)

def pack_int4(v: torch.Tensor) -> torch.Tensor:
    """Pack uint8 [R, C] (values 0..15, C a multiple of 8) into int32 [R, C/8] with AutoAWQ's
    order: nibble k (bits 4k..4k+3) of packed column c holds column ``8c + AWQ_ORDER[k]``."""
    r, c = v.shape
    if c % 8:
        raise ValueError(f"{c} columns is not a multiple of 8")
    g = v.reshape(r, c // 8, 8)
    packed = torch.zeros(r, c // 8, dtype=torch.int64, device=v.device)
    for k, col in enumerate(AWQ_ORDER):  # the 8 nibble positions, each over the whole tensor
        packed |= g[:, :, col].to(torch.int64) << (4 * k)  # < 2^32, disjoint bits
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # two's complement view


def pack_gemm(gq: GroupQuant) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors of one linear from :func:`pseudo_quantize`'s result (4 bits):
    ``qweight`` int32 [in, out/8] (q transposed, packed along out), ``qzeros`` int32
    [G, out/8] (zeros transposed, same packing), ``scales`` float16 [G, out] (transposed).
    Raises ValueError when out is not a multiple of 8."""
    return {"qweight": pack_int4(gq.q.T.contiguous()),
            "qzeros": pack_int4(gq.zeros.T.contiguous()),
            "scales": gq.scales.T.contiguous()}
