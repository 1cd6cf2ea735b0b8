"""FP8 E4M3 weights as compressed-tensors stores them (``quantize fp8``): the codec, pure tensor
math on the tensor's own device (CPU or CUDA), vectorized over whole tensors.

Three schemes, the presets of compressed-tensors 0.20 ``quantization/quant_scheme.py`` that
llm-compressor 0.14 applies (``FP8_DYNAMIC``, ``FP8``, ``FP8_BLOCK``):

==========  ====================  =====================  ====================================
scheme      weight strategy       ``weight_scale``       activations (at inference)
==========  ====================  =====================  ====================================
dynamic     channel               [N, 1]                 dynamic, per token
static      tensor                [1]                    static per tensor: ``input_scale`` [1]
block       block 128 × 128       [⌈N/128⌉, ⌈K/128⌉]     dynamic, per group of 128
==========  ====================  =====================  ====================================

Every scale is ``amax / 448`` over its block of weights, computed in the weight's own dtype
(a bfloat16 model gets bfloat16 scales), a zero scale replaced by that dtype's machine epsilon
(compressed-tensors ``calculate_qparams``, ``_get_dtype_eps``). The weight is divided by its
scale in the weight's dtype (plus the all-zero zero point llm-compressor passes, which makes
-0.0 +0.0), clamped to ±448 and rounded to nearest even by torch's cast to ``float8_e4m3fn``
(the clamp makes saturation independent of whether the cast saturates, which depends on the
torch version and device: torch 2.13 on CPU does, older casts give NaN); dequantization
is ``fp8.to(scale dtype) * scale`` (compressed-tensors ``_quantize`` / ``_dequantize`` in
``quantization/lifecycle/forward_helpers.py``, torch path). tests/test_fp8.py checks the
bits against compressed-tensors' own functions.
"""
from __future__ import annotations

import torch

from quantpress.errors import InputError

#: the largest finite float8_e4m3fn value (torch.finfo(torch.float8_e4m3fn).max)
FP8_MAX = 448.0
#: rows and columns of one weight block of the ``block`` scheme
BLOCK = 128
#: scheme → compressed-tensors weight strategy
WEIGHT_STRATEGY = {"dynamic": "channel", "static": "tensor", "block": "block"}
SCHEMES = tuple(WEIGHT_STRATEGY)
FP8_DTYPE = torch.float8_e4m3fn


def scale_eps(dtype: torch.dtype) -> float:
    """The value a zero scale is replaced by: ``torch.finfo(dtype).eps`` of the scale's dtype
    (compressed-tensors 0.20 ``quantization/utils/helpers.py`` ``_get_dtype_eps`` for a float
    dtype: 2⁻⁷ for bfloat16, 2⁻¹⁰ for float16, 2⁻²³ for float32). Dividing a zero block by it
    gives zeros, never NaN."""
    return torch.finfo(dtype).eps


def _scale_of_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in amax's dtype, zeros replaced by :func:`scale_eps` (``calculate_qparams``
    of a symmetric float8 argument: ``max_val_pos / (bit_range / 2)`` with bit_range 896)."""
    scale = amax / torch.tensor(FP8_MAX, dtype=amax.dtype, device=amax.device)
    eps = torch.tensor(scale_eps(amax.dtype), dtype=amax.dtype, device=amax.device)
    return torch.where(scale == 0, eps, scale)


def _check(weight: torch.Tensor, scheme: str, name: str | None) -> None:
    if scheme not in WEIGHT_STRATEGY:
        raise ValueError(f"unknown FP8 scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if weight.ndim != 2:
        raise ValueError(f"{name or 'weight'}: expected a 2-D weight [N, K], got shape {tuple(weight.shape)}")
    if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"{name or 'weight'}: expected a float16/bfloat16/float32 weight, got {weight.dtype}")


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] → [⌈N/128⌉, 128, ⌈K/128⌉, 128], zero-padded at the end of both dimensions (a copy
    only when padding is needed; compressed-tensors ``maybe_pad_tensor_for_block_quant``)."""
    n, k = weight.shape
    pn, pk = -n % BLOCK, -k % BLOCK
    if pn or pk:
        weight = torch.nn.functional.pad(weight, (0, pk, 0, pn))
    return weight.reshape((n + pn) // BLOCK, BLOCK, (k + pk) // BLOCK, BLOCK)


def _unblock(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return blocks.reshape(blocks.shape[0] * BLOCK, blocks.shape[2] * BLOCK)[:n, :k]


def check_finite(weight: torch.Tensor, name: str | None = None) -> None:
    """InputError naming tensor ``name`` (or "weight") and its first bad row when ``weight``
    (2-D, any float dtype, any device) holds NaN or Inf."""
    if weight.numel() == 0 or bool(torch.isfinite(weight.abs().amax())):  # max |w| is NaN/Inf iff one is
        return
    bad = ~torch.isfinite(weight)
    row = int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0]) if bad.ndim else 0
    raise InputError(f"tensor '{name or 'weight'}' (row {row}) holds NaN or Inf; cannot quantize it to FP8")


def weight_scale(weight: torch.Tensor, scheme: str, name: str | None = None) -> torch.Tensor:
    """The ``weight_scale`` of ``weight`` [N, K] (float16/bfloat16/float32) for ``scheme``, in
    the weight's dtype on its device: [N, 1] (dynamic: max |w| of each output row), [1]
    (static: of the whole tensor) or [⌈N/128⌉, ⌈K/128⌉] (block: of each 128 × 128 block, the
    last ones partial), each amax / 448, zero → :func:`scale_eps`.

    Reproduces llm-compressor 0.14's memoryless min-max weight observer followed by
    compressed-tensors 0.20 ``calculate_qparams`` (``quantization/utils/helpers.py``) for a
    symmetric 8-bit float argument. Raises InputError naming ``name`` (or "weight") when the
    weight holds NaN or Inf, ValueError for an unknown scheme, a non-2-D or non-float weight."""
    _check(weight, scheme, name)
    a = weight.abs()
    if scheme == "dynamic":
        amax = a.amax(dim=1, keepdim=True)
    elif scheme == "static":
        amax = a.amax().reshape(1)
    else:
        amax = _blocks(a).amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):  # NaN and Inf reach the maxima
        check_finite(weight, name)
    return _scale_of_amax(amax)


def quantize_with_scale(weight: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """float8_e4m3fn [N, K] of ``weight`` [N, K] with the given ``scale`` (shape as
    :func:`weight_scale` gives it, same dtype as the weight): ``weight / scale`` in the
    weight's dtype, clamped to ±448, cast with round-to-nearest-even.

    Reproduces compressed-tensors 0.20 ``quantize`` (``quantization/lifecycle/forward.py``) →
    ``_process_block`` / ``_quantize`` and ``round_to_quantized_type_args``
    (``forward_helpers.py``, ``quant_args.py``) on the torch path, as its
    ``FloatQuantizationCompressor.compress`` calls it. ValueError for an unknown scheme or a
    scale of the wrong shape."""
    _check(weight, scheme, None)
    n, k = weight.shape
    if scheme == "block":
        want = (-(-n // BLOCK), -(-k // BLOCK))
        if tuple(scale.shape) != want:
            raise ValueError(f"block scale has shape {tuple(scale.shape)}, expected {want}")
        scaled = _blocks(weight) / scale.to(weight.dtype)[:, None, :, None]
        scaled = _unblock(scaled, n, k)
    else:
        want = (n, 1) if scheme == "dynamic" else (1,)
        if tuple(scale.shape) != want:
            raise ValueError(f"{scheme} scale has shape {tuple(scale.shape)}, expected {want}")
        scaled = weight / scale.to(weight.dtype)
    # + the zero point of a symmetric scheme, as llm-compressor passes it (a zero parameter):
    # it turns -0.0 into +0.0, so a -0.0 weight is stored as fp8 +0 (0x00), as there
    scaled += 0.0
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()


def quantize_fp8(weight: torch.Tensor, scheme: str, name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn [N, K], weight_scale)`` of ``weight`` [N, K] (float16, bfloat16 or
    float32, on any device) for ``scheme`` in :data:`SCHEMES`: :func:`weight_scale` then
    :func:`quantize_with_scale`; the scale keeps the weight's dtype and device.

    Reproduces what llm-compressor 0.14 (``QuantizationModifier`` with the FP8_DYNAMIC, FP8 or
    FP8_BLOCK preset) stores through compressed-tensors 0.20. Raises InputError naming ``name``
    for NaN/Inf weights, ValueError for an unknown scheme or a non-2-D, non-float weight."""
    scale = weight_scale(weight, scheme, name)
    return quantize_with_scale(weight, scale, scheme), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight [N, K] a float8_e4m3fn ``q`` [N, K] and its ``scale`` stand for, in the
    scale's dtype: ``q.to(scale.dtype) * scale`` broadcast over each row (dynamic), the
    tensor (static) or each 128 × 128 block (block).

    Reproduces compressed-tensors 0.20 ``dequantize`` (``quantization/lifecycle/forward.py``,
    ``_process_block`` / ``_dequantize``), which transformers 5.23 and llm-compressor use to
    decompress. ValueError for an unknown scheme, a ``q`` that is not float8_e4m3fn or a
    scale of the wrong shape."""
    if scheme not in WEIGHT_STRATEGY:
        raise ValueError(f"unknown FP8 scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if q.dtype != FP8_DTYPE or q.ndim != 2:
        raise ValueError(f"expected a 2-D float8_e4m3fn tensor, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    w = q.to(scale.dtype)
    if scheme == "block":
        want = (-(-n // BLOCK), -(-k // BLOCK))
        if tuple(scale.shape) != want:
            raise ValueError(f"block scale has shape {tuple(scale.shape)}, expected {want}")
        return _unblock(_blocks(w) * scale[:, None, :, None], n, k).contiguous()
    want = (n, 1) if scheme == "dynamic" else (1,)
    if tuple(scale.shape) != want:
        raise ValueError(f"{scheme} scale has shape {tuple(scale.shape)}, expected {want}")
    return w * scale


def input_scale(amax: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """The static per-tensor activation scale ``input_scale`` [1] in ``dtype`` (the model's
    dtype) from ``amax``, the largest |x| seen at the linear's input over the calibration rows
    (a float or any-dtype tensor whose max is taken): amax cast to ``dtype`` (first clamped to
    its largest finite value, so a float32 amax beyond float16's range cannot give an infinite
    scale), / 448, zero → :func:`scale_eps`.

    Reproduces llm-compressor 0.14's ``static_minmax`` input observer (the running max over
    every calibration batch) followed by compressed-tensors 0.20 ``calculate_qparams``.
    Raises ValueError for a NaN/Inf or negative amax."""
    a = torch.as_tensor(amax).detach().float().max().reshape(1)
    if not bool(torch.isfinite(a).all()) or float(a) < 0:
        raise ValueError(f"activation amax {float(a)} is not a finite non-negative value")
    a = a.clamp(max=torch.finfo(dtype).max).to(dtype)
    return _scale_of_amax(a)
