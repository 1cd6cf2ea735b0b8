"""Float32 helpers that reproduce the rounding of ggml's C reference quantizers.

All helpers work element-wise on tensors of any shape and keep the device of their input.
They exist so that every codec rounds exactly as ``ggml/src/ggml-quants.c`` does in a
baseline (non-FMA) x86-64 build: one float32 rounding after every operation, in C's order.
"""
from __future__ import annotations

import torch


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml ``nearest_int``: round half to even, as int32.

    ``x`` is float32 of any shape; valid for |x| <= 4194303 (C adds 12582912.0f and reads
    the mantissa bits, which is round-half-even in that range). Returns int32, same shape.
    """
    return torch.round(x).to(torch.int32)


def trunc_int(x: torch.Tensor) -> torch.Tensor:
    """C float -> integer conversion (truncation toward zero), as int32."""
    return torch.trunc(x).to(torch.int32)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round half away from zero, exact for every float32 (returns float32)."""
    t = torch.trunc(x)
    frac = x - t  # exact in float32
    return torch.where(frac.abs() >= 0.5, t + torch.sign(x), t)


def fp16_round(x: torch.Tensor) -> torch.Tensor:
    """float32 -> fp16 (IEEE round-to-nearest-even) -> float32, as ggml's
    ``GGML_FP32_TO_FP16`` followed by ``GGML_FP16_TO_FP32``."""
    return x.to(torch.float16).to(torch.float32)


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., n] -> uint8 [..., 2n]: little-endian fp16 (RNE) bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def bytes_fp16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] little-endian fp16 -> float32 [..., n]."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def seq_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis sequentially from index 0 in float32, as a C ``for`` loop.

    ``x`` float32 [..., n] -> float32 [...]. One vectorized add per position, so the
    result has C's rounding (a torch reduction sums pairwise and may differ in the last bit).
    """
    acc = x[..., 0].clone()
    for j in range(1, x.shape[-1]):
        acc = acc + x[..., j]
    return acc


def pack_u32_le(bits: torch.Tensor) -> torch.Tensor:
    """int64 [..., k] of values < 2**32 -> uint8 [..., 4k], little-endian."""
    shifts = torch.arange(0, 32, 8, device=bits.device, dtype=torch.int64)
    out = (bits.unsqueeze(-1) >> shifts) & 0xFF
    return out.reshape(*bits.shape[:-1], bits.shape[-1] * 4).to(torch.uint8)


def unpack_u32_le(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4k] -> int64 [..., k], little-endian u32 words."""
    v = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    shifts = torch.arange(0, 32, 8, device=b.device, dtype=torch.int64)
    return (v << shifts).sum(-1)
