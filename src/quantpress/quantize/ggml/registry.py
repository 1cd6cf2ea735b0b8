"""The registry of ggml tensor types: :class:`GGMLType` (block geometry and codecs), filled
by the codec modules at their import (:func:`register`) and read through the package
(``quantize.ggml.get``, ``names``).

Its own module so that the codec modules (``floats``, ``legacy``, ``kquants``, ``iquants``),
which the package imports, do not import the package back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGMLQuantizationType


@dataclass(frozen=True)
class GGMLType:
    """One ggml type.

    ``block_size`` is elements per block, ``type_size`` bytes per block.
    ``quantize_blocks``: float32 [nb, block_size] -> uint8 [nb, type_size] (any float dtype
    is taken and widened to float32 exactly: on the CPU one slice at a time,
    ``common.map_block_slices``).
    ``dequantize_blocks``: uint8 [nb, type_size] -> float32 [nb, block_size].
    ``quantize_blocks_weighted``: the path ``ggml_quantize_chunk`` takes with an importance
    matrix (``quantize_row_<type>_impl``), or None when the type ignores it (Q8_0, F16 …):
    ``(x float32 [nb, block_size], qw float32 [nb, block_size], row_sigma2 float32 [nb, 1] or
    None) -> uint8 [nb, type_size]``, where ``qw`` holds the imatrix entries of each block's
    columns and ``row_sigma2`` C's ``sum_x2/n_per_row`` of the block's whole row (sequential
    float32 sum, one division; only computed for types with ``weighted_uses_row_sigma2``:
    the legacy types' sigma² is per row, the others' per super-block).
    ``needs_imatrix``: llama.cpp refuses the type without one (the very low-bit i-quants).
    """

    name: str
    block_size: int
    type_size: int
    quantize_blocks: Callable[[torch.Tensor], torch.Tensor]
    dequantize_blocks: Callable[[torch.Tensor], torch.Tensor]
    quantize_blocks_weighted: Callable[..., torch.Tensor] | None = None
    weighted_uses_row_sigma2: bool = False
    needs_imatrix: bool = False

    @property
    def type_id(self) -> int:
        """ggml_type enum value (``gguf.GGMLQuantizationType``)."""
        return int(GGMLQuantizationType[self.name])

    @property
    def bpw(self) -> float:
        """Bits per weight of the encoding (``8 * type_size / block_size``)."""
        return 8.0 * self.type_size / self.block_size

    def row_bytes(self, n: int) -> int:
        """Bytes of one row of ``n`` elements; raises ValueError if n % block_size != 0."""
        if n % self.block_size:
            raise ValueError(f"{self.name}: row length {n} is not a multiple of the block size {self.block_size}")
        return n // self.block_size * self.type_size


#: the registered types by name, in order of registration
REGISTRY: dict[str, GGMLType] = {}


def register(t: GGMLType) -> GGMLType:
    """Add a type to the registry (called by the codec modules at import)."""
    REGISTRY[t.name] = t
    return t


def get(name: str) -> GGMLType:
    """The :class:`GGMLType` called ``name`` (e.g. ``"Q4_K"``); KeyError names the known ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown ggml type {name!r}; known: {', '.join(sorted(REGISTRY))}") from None


def names() -> list[str]:
    """Names of all registered types."""
    return list(REGISTRY)
