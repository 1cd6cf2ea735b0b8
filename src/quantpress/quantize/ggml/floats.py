"""F32, F16 and BF16 "codecs" (block size 1): exact conversions with RNE rounding, from float32
(an input of another float dtype is widened to float32 first, as ggml converts from it: torch's
direct float16 -> bfloat16 conversion differs from it for some values)."""
from __future__ import annotations

import torch

from .registry import GGMLType, register


def _q_f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.uint8).reshape(-1, 4)


def _dq_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32).reshape(-1, 1)


def _q_f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _dq_f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32).reshape(-1, 1)


def _q_bf16(x: torch.Tensor) -> torch.Tensor:
    # ggml_compute_fp32_to_bf16: NaN -> quiet NaN with the sign kept, else round to nearest even
    return x.to(torch.float32).to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1, 2)


def _dq_bf16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.bfloat16).to(torch.float32).reshape(-1, 1)


F32 = register(GGMLType("F32", 1, 4, _q_f32, _dq_f32))
F16 = register(GGMLType("F16", 1, 2, _q_f16, _dq_f16))
BF16 = register(GGMLType("BF16", 1, 2, _q_bf16, _dq_bf16))
