"""Operations with one defined result on every machine, for the codecs whose bytes depend on them.

A quantizer's bytes are reproducible across machines only if every operation they depend on
gives the same bits everywhere. IEEE-754 defines the result of ``+ − × ÷`` and of the square
root (correctly rounded, round to nearest even), and torch's elementwise ``add``/``sub``/
``mul``/``div`` of two tensors, ``abs``, ``round``, ``clamp`` and the float conversions are
those operations lane by lane on every ``ATEN_CPU_CAPABILITY`` and on CUDA. Two things are
not:

* **torch 2.13's CPU float32 ``sqrt`` is not correctly rounded**, and how often it is one
  ulp off depends on the processor (about 0.7% of inputs on an Intel Xeon, 17% on an AMD
  EPYC, at every capability; ``scripts/cpu_determinism.py`` prints the rate on the machine
  it runs on). :func:`defined_sqrt` / :func:`defined_sqrt_` give the correctly rounded root:
  on the CPU from NumPy's float32 root, which is the processor's IEEE instruction
  (``sqrtps``/``vsqrtps``, NEON ``fsqrt``), elsewhere torch's float64 root rounded to
  float32 and checked exactly: they are ``quantize.ggml.common.sqrtf``, the root the GGUF
  codecs use (C's ``sqrtf``), so one definition serves every format.
* **a float32 reduction** (``sum``/``mean`` over a dimension) adds in an order that depends on
  torch's vector width (8 lanes at avx2, 16 at avx512), on the thread count and on the
  device. :func:`tree_sum_` adds in one fixed order, pairwise, each level one elementwise
  ``add`` of two halves, so its result depends only on the values and their count.
  (``amax``/``amin`` need nothing: the largest element is the same in any order.)

A third thing is the compilers': torch's fused elementwise kernels such as ``addr_`` (rank-1
update) may compute ``a − b·c`` with one fused multiply-add at one capability (avx2, avx512,
CUDA) and with two roundings at another (``default``). :func:`sub_outer_` runs the product
and the difference as two kernels.

What stays machine-dependent, and is not made exact here (``scripts/cpu_determinism.py``
measures each): BLAS and LAPACK (``matmul``/``addmm``, ``cholesky``, ``cholesky_solve``):
their kernels (MKL/OpenBLAS, chosen by the processor, not by ``ATEN_CPU_CAPABILITY``) block
and fuse the products differently, so the GPTQ Hessian factor and the block updates of
``quantize.gptq`` (and every model forward pass: the calibration statistics of AWQ/GPTQ/EXL2,
the EXL2 measurement) agree across processors only to a few float32 ulps. The result of one
such product is bounded by the usual ``|fl(A·B) − A·B| ≤ k·u·|A|·|B|`` (k the inner
dimension, u = 2^-24); the bytes change only where a code or a grid choice sits that close to
a rounding boundary. A measurement file (EXL2) or calibration statistics made once and shared
take the model forward out of a distributed batch.
"""
from __future__ import annotations

import numpy as np
import torch

from quantpress.quantize.ggml.common import sqrtf


def defined_sqrt_(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root of ``x`` in place; returns ``x``.

    ``x`` float32, any shape and device; negative inputs give NaN, ``sqrt(-0) = -0``,
    ``sqrt(inf) = inf`` (IEEE-754 ``squareRoot``, C ``sqrtf``): the GGUF codecs' root,
    :func:`quantpress.quantize.ggml.common.sqrtf` (NumPy's float32 root on the CPU, torch's
    float64 root rounded and checked exactly elsewhere), in ``x``. Raises
    TypeError for a dtype other than float32.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"defined_sqrt_: expected a float32 tensor, got {x.dtype}")
    if x.device.type == "cpu" and x.is_contiguous():
        return sqrtf(x, out=x)
    return x.copy_(sqrtf(x))


def defined_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root of ``x`` as a new tensor (contiguous, ``x``'s
    shape and device); see :func:`defined_sqrt_`."""
    if x.dtype != torch.float32:
        raise TypeError(f"defined_sqrt: expected a float32 tensor, got {x.dtype}")
    return sqrtf(x)


def sub_outer_(w: torch.Tensor, u: torch.Tensor, r: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``w −= outer(u, r)`` in place with each product rounded, then each difference:
    ``w[i, j] = fl(w[i, j] − fl(u[i]·r[j]))``; returns ``w``.

    ``w`` float32 [n, C], ``u`` [n], ``r`` [C], ``scratch`` float32 with at least n·C
    elements (holds the products; contiguous). torch's ``addr_`` computes the same update in
    one kernel whose compiler may fuse the multiply and the subtraction (a fused multiply-add
    rounds once): on an AMD EPYC 24% of ``addr_``'s results at ``ATEN_CPU_CAPABILITY=avx2``
    differ from those at ``default`` (``scripts/cpu_determinism.py``), and CUDA's kernels fuse
    too. Two kernels cannot fuse, so this is the same on every capability and device.
    """
    n, c = w.shape
    prod = scratch.view(-1)[:n * c].view(n, c)
    torch.mul(u[:, None], r[None, :], out=prod)
    return w.sub_(prod)


def tree_sum_(x: torch.Tensor) -> torch.Tensor:
    """Sum of each row of ``x`` (float [m, L], L ≥ 1, contiguous rows) in a fixed pairwise
    order, using ``x`` as scratch (its values are destroyed); returns a view [m] of column 0.

    With n values left in a row, the h = ⌊n/2⌋ first are each added the value n − h places
    after them (``x[:, :h] += x[:, n−h:n]``: one elementwise add, IEEE round to nearest even
    per element), leaving n − h; until one is left. The order of every addition depends only
    on L, so the result is the same for every vector width, thread count and device (not
    torch.sum's: its order follows the capability's vector width and the threads). The error
    is that of pairwise summation, at most ⌈log2 L⌉·u·Σ|x| (u = 2^-24 in float32). ``x`` must
    not be a view the caller still needs. Raises ValueError for a tensor that is not 2-D or
    has no columns.
    """
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"tree_sum_: expected a 2-D tensor [m, L] with L >= 1, got {tuple(x.shape)}")
    n = x.shape[1]
    while n > 1:
        h = n // 2
        # the halves do not overlap (n − h >= h), so one in-place add is exact per element
        x[:, :h].add_(x[:, n - h:n])
        n -= h
    return x[:, 0]


def tree_sum(x: torch.Tensor, start_dim: int = 1) -> torch.Tensor:
    """:func:`tree_sum_` of a copy of ``x`` over the dimensions ``start_dim`` and after
    (``x`` float, shape [d0, ..., d_{start_dim−1}, ...]): returns the leading shape
    (a 0-d tensor for ``start_dim=0``); ``x`` is not modified. Raises ValueError when the
    summed dimensions hold no element."""
    lead = x.shape[:start_dim]
    m = int(np.prod(lead)) if lead else 1
    flat = x.reshape(m, -1).clone(memory_format=torch.contiguous_format) if m else x.reshape(0, 1)
    if m and flat.shape[1] == 0:
        raise ValueError(f"tree_sum: no element to sum over dimensions {start_dim}.. of {tuple(x.shape)}")
    return tree_sum_(flat).reshape(lead).clone()
