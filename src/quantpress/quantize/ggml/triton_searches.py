"""The K-quants' scale searches as single Triton kernels, for CUDA tensors.

On a GPU the torch versions of :func:`kquants.make_qkx2_quants`, :func:`kquants.make_qx_quants`,
:func:`kquants.make_qp_quants` and :func:`kquants.make_q3_quants` are hundreds to thousands of
small kernels per call (each step of a search one pass over the whole chunk per operation,
the coordinate descents a host synchronization per pass), and :func:`common.seq_sum0` one
per position; here each is one kernel (:mod:`triton_kernels`), one program lane per
sub-block (or group, or sum), with the same float32 operations in the same order, so the
results are the same bits:

* the sequential sums of C (``for (i = 0; i < n; ++i) s += ...``) are loops over the
  sub-block's positions inside the kernel, one add per position, in C's order;
* the kernels are compiled with :data:`COMPILE_OPTIONS` (no multiply-add contraction);
  divisions are ``div_rn`` (IEEE round to nearest; Triton's ``/`` may be approximate);
* ``nearest_int`` is C's bit trick (``v + 12582912.0f``, the low 23 bits minus 2^22);
* the coordinate descents run all of C's 5 passes: a pass that changes nothing leaves the
  state as it was, so the passes C skips after it would change nothing either;
* a negation is ``v * -1.0``: Triton's unary minus is ``0 - v``, +0 for +0.

They reproduce llama.cpp's ``make_qkx2_quants``/``make_qkx3_quants``, ``make_qx_quants``
(rmse_type 1), ``make_qp_quants`` and ``make_q3_quants`` (do_rmse) in
``ggml/src/ggml-quants.c`` at 0c1e570 (llama-cpp-python 0.3.36), as the torch versions in
:mod:`kquants` do: tests/test_triton_searches.py runs them in Triton's interpreter against
llama.cpp's bytes and the torch searches, and checks the float32 instructions of their PTX
for an H100; ``scripts/gpu_checks.py --checks ggml`` compares their CUDA bytes with the
CPU's.

Used when the tensor is on a CUDA device, Triton imports and ``QUANTPRESS_TRITON`` is not
``0``; everything else takes the torch path. A kernel that cannot be compiled or launched
(an older Triton, a GPU it does not support) raises :class:`KernelUnavailable` once, with a
warning, and turns the kernels off for the process: the callers then take the torch path,
which gives the same bytes.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import warnings

import numpy as np
import torch

# Triton ships with CUDA builds of torch; optional. Its kernels (triton_kernels.py) are
# imported on first use.
HAVE_TRITON = importlib.util.find_spec("triton") is not None

# sub-blocks (lanes) per program; the interpreter runs a program's operations one NumPy call
# each, so there one program takes them all
BLOCK = 1 << 14 if os.environ.get("TRITON_INTERPRET") == "1" else 128


#: Triton's compile options for every kernel: no contraction of a product and a sum into one
#: fused multiply-add (C rounds each; tests/test_triton_searches.py checks the PTX)
COMPILE_OPTIONS = {"enable_fp_fusion": False}


class KernelUnavailable(RuntimeError):
    """A kernel could not be compiled or launched; the caller takes the torch path."""


_failure: str | None = None             # why the kernels were turned off, once one failed


def available(x: torch.Tensor) -> bool:
    """True when ``x``'s searches run as Triton kernels: ``x`` on a CUDA device (or any
    device under ``TRITON_INTERPRET=1``, the interpreter the tests use) with fewer than 2^31
    elements, Triton importable, no kernel failed before in this process, and the environment
    variable ``QUANTPRESS_TRITON`` not ``0``."""
    if (not HAVE_TRITON or _failure is not None or os.environ.get("QUANTPRESS_TRITON", "1") == "0"
            or x.numel() >= 1 << 31):
        return False                    # (the kernels index with int32)
    return x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


_STEPS_9 = np.array([t for t in range(-9, 10) if t != 0], dtype=np.float32)
_STEPS_4 = np.array([t for t in range(-4, 5) if t != 0], dtype=np.float32)


def _on(x: torch.Tensor, a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.float32)).to(x.device)


def _turn_off(what: str, e: BaseException) -> KernelUnavailable:
    """Record why the kernels are off (warning once); the exception for the caller."""
    global _failure
    _failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    warnings.warn(f"quantpress: {what} failed ({_failure}); the GGUF codecs use torch operations "
                  "instead (the same bytes, slower)", RuntimeWarning)
    return KernelUnavailable(_failure)


def _launch(name: str, S: int, *args, **meta) -> None:
    """Launch the kernel ``name`` of :mod:`triton_kernels` over ``S`` lanes; a failure to
    import Triton, compile or launch the kernel turns the kernels off (warning once) and
    raises :class:`KernelUnavailable`. Nothing to do for ``S`` = 0."""
    if S == 0:
        return
    try:
        kernels = importlib.import_module(".triton_kernels", __package__)
    except Exception as e:              # (not only ImportError: a broken installation)
        raise _turn_off("importing Triton", e) from e
    kernel = getattr(kernels, name)
    try:
        kernel[(-(-S // BLOCK),)](*args, BLOCK=BLOCK, **COMPILE_OPTIONS, **meta)
    except Exception as e:              # Triton's compile and launch errors have no common base
        raise _turn_off(f"Triton kernel {name}", e) from e


def seq_sum(p: torch.Tensor, out: torch.Tensor | None, from_first: bool) -> torch.Tensor:
    """:func:`common.seq_sum0` in one kernel: float32 ``p`` [n, ...] (contiguous) -> the sums
    over its first axis, one add per row in row order, from +0 (or from ``p[0]``), written
    into ``out`` when given (contiguous, ``p[0]``'s shape). Raises :class:`KernelUnavailable`
    (the kernels are then off; ``out`` is untouched)."""
    n = p.shape[0]
    if out is None:
        out = torch.empty(p.shape[1:], dtype=torch.float32, device=p.device)
    S = out.numel()
    _launch("seq_sum_kernel", S, p, out, S, N=n, FROM_FIRST=from_first)
    return out


def qkx2(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
         use_mad: bool, xmin: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_qkx2_quants` in one kernel: ``x``, ``w`` float32 [n, S]
    (positions first), ``xmin`` float32 [S] or None. Returns (scale [S], the_min [S],
    L float32 [n, S] of 0..nmax), the same bits as the torch version. Raises
    :class:`KernelUnavailable`."""
    n, S = x.shape
    x, w = x.contiguous(), w.contiguous()
    # C: rmin + rdelta*is + nmax, float32 operations (NumPy's float32 arrays round each)
    k = np.arange(nstep + 1, dtype=np.float32)
    nums = _on(x, (np.float32(rmin) + np.float32(rdelta) * k) + np.float32(nmax))
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    the_min = torch.empty_like(scale)
    L = torch.empty_like(x)
    _launch("qkx2_kernel", S, x, w, x if xmin is None else xmin.contiguous(), nums, scale, the_min, L, S,
            N=n, NMAX=nmax, NSTEP=nstep, USE_MAD=use_mad, HAS_XMIN=xmin is not None)
    return scale, the_min, L


def qx(x: torch.Tensor, nmax: int, w: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_qx_quants` (rmse_type 1) in one kernel, for ``x`` float32 [n, S]
    (positions first; non-finite values as C takes them) and weights ``w`` [n, S] or None
    (x²); ``eps``: the largest |x| below which a sub-block is zero (GROUP_MAX_EPS). Returns
    (scale [S], L float32 [n, S] of 0..2*nmax-1), the same bits as the torch version.
    Raises :class:`KernelUnavailable`."""
    n, S = x.shape
    x = x.contiguous()
    nums = _on(x, np.float32(nmax) + np.float32(0.1) * _STEPS_9)      # C: nmax + 0.1f*is
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    L = torch.empty_like(x)
    _launch("qx_kernel", S, x, x if w is None else w.contiguous(), nums, scale, L, S, eps,
            N=n, NMAX=nmax, WEIGHTED=w is not None)
    return scale, L


def qp(x: torch.Tensor, w: torch.Tensor, nmax: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_qp_quants` in one kernel: ``x``, ``w`` float32 [n, S] (value i of
    group s at ``x[i, s]``), ``eps``: the max below which a group is zero (GROUP_MAX_EPS).
    Returns (scale float32 [S], L int32 [n, S] of the stored uint8 values), the same bits as
    the torch version. Raises :class:`KernelUnavailable`."""
    n, S = x.shape
    x, w = x.contiguous(), w.contiguous()
    nums = _on(x, np.float32(0.1) * _STEPS_4 + np.float32(nmax))      # C: 0.1f*is + nmax
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    L = torch.empty((n, S), dtype=torch.int32, device=x.device)
    _launch("qp_kernel", S, x, w, nums, scale, L, S, eps, N=n, NMAX=nmax)
    return scale, L


def q3(x: torch.Tensor, nmax: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kquants.make_q3_quants` (do_rmse) in one kernel: ``x`` float32 [n, S]
    (positions first), ``eps``: the largest |x| below which a sub-block is zero
    (GROUP_MAX_EPS). Returns (scale float32 [S], L float32 [n, S] of 0..2*nmax-1), the same
    bits as the torch version. Raises :class:`KernelUnavailable`."""
    n, S = x.shape
    x = x.contiguous()
    scale = torch.empty(S, dtype=torch.float32, device=x.device)
    L = torch.empty_like(x)
    _launch("q3_kernel", S, x, scale, L, S, eps, N=n, NMAX=nmax)
    return scale, L
