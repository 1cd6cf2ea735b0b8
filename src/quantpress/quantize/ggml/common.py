"""Float32 helpers that reproduce the rounding of ggml's C reference quantizers.

All helpers work element-wise on tensors of any shape and keep the device of their input.
They exist so that every codec rounds exactly as ``ggml/src/ggml-quants.c`` does in a
baseline (non-FMA) x86-64 build: one float32 rounding after every operation, in C's order.
"""
from __future__ import annotations

import contextlib
import functools
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import triton_searches


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml ``nearest_int`` exactly: float32 ``x + 12582912.0f`` reinterpreted as int32,
    ``(bits & 0x7FFFFF) - 0x400000``.

    ``x`` is float32 of any shape; returns int32 of the same shape. For |x| <= 4194303 this is
    round-half-to-even; outside that range (and for inf/NaN) it returns the same wrapped
    value as the C code, so results stay bit-exact after the callers' clamps.
    """
    return ((x + 12582912.0).view(torch.int32) & 0x7FFFFF) - 0x400000


def trunc_int(x: torch.Tensor) -> torch.Tensor:
    """C float -> integer conversion (truncation toward zero), as int32."""
    return torch.trunc(x).to(torch.int32)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round half away from zero, exact for every float32 (returns float32)."""
    t = torch.trunc(x)
    frac = x - t  # exact in float32
    return torch.where(frac.abs() >= 0.5, t + torch.sign(x), t)


#: |v| below this: :func:`roundf_small` is C's roundf (as tested; Q8_0 needs up to 128)
ROUNDF_SMALL = 256.0
#: the float32 just below 0.5 (0.5 - 2**-25)
_BELOW_HALF = 0.4999999701976776


def roundf_small(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (half away from zero) of float32 ``v`` with |v| < ROUNDF_SMALL, as float32:
    ``trunc(v + copysign(0.5 - 2**-25, v))``, two passes fewer than :func:`roundf`.
    Exact there: a half-integer k + 0.5 sums to k + 1 - 2**-25, which rounds to k + 1 (for
    k = 0 a tie, to the even 1.0); anything below it stays below k + 1, and 0.5 - 2**-25
    itself, the value for which ``trunc(v + 0.5)`` would round up, sums exactly to
    1 - 2**-24 (tests/test_ggml_codecs.py checks the float32 neighbourhoods of every integer
    and half-integer below 256)."""
    return torch.trunc(v + torch.copysign(torch.tensor(_BELOW_HALF, dtype=v.dtype, device=v.device), v))


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


# On the CPU :func:`seq_sum0` hands sums over at least this many positions at once to numpy
SEQ_SUM_NUMPY_MIN = 64


def seq_sum0(p: torch.Tensor, out: torch.Tensor | None = None, from_first: bool = False) -> torch.Tensor:
    """C's ``float s = 0; for (int i = 0; i < n; ++i) s += p[i];`` for every position of the
    trailing axes at once: float32 ``p`` [n, ...] -> float32 [...] on ``p``'s device, written
    into ``out`` (float32, contiguous, that shape) when given. One float32 rounding per add
    in index order, starting from +0 (so a sum of -0.0 terms is +0, as in C);
    ``from_first``: from ``p[0]`` itself instead, for C loops that start the sum with the
    first term (``s = p[0]; for (i = 1; ...)``; always the loop below).

    On the CPU, for a contiguous ``p`` with at least :data:`SEQ_SUM_NUMPY_MIN` sums, this is
    numpy's ``np.add.reduce(axis=0)``, which accumulates a slow axis row by row into the
    output from the identity +0 (numpy sums pairwise only along the fast axis in memory,
    numpy.sum's notes; a single column would be such an axis, hence the bound;
    tests/test_ggml_codecs.py checks the bits against one add at a time): one call, which
    releases the GIL, instead of n - 1 torch adds, each with its dispatch: faster for Q4_K's
    sums and for Q5_0 with an imatrix (its row sums too), Q6_K within the noise (figures and
    the command in docs/benchmarks.md, "Figures behind the code", ``quantize/ggml/common.py``,
    ``seq_sum0``). On a CUDA device one Triton kernel (:func:`triton_searches.seq_sum`);
    elsewhere the loop of adds, one vectorized op per position.
    """
    if (p.dtype == torch.float32 and p.dim() >= 2 and p.is_contiguous() and triton_searches.available(p)
            and (out is None or out.is_contiguous())):
        with contextlib.suppress(triton_searches.KernelUnavailable):
            return triton_searches.seq_sum(p, out, from_first)  # on a CUDA device: one kernel
    if (not from_first and p.device.type == "cpu" and p.dim() >= 2 and p.is_contiguous()
            and p[0].numel() >= SEQ_SUM_NUMPY_MIN and (out is None or out.is_contiguous())):
        if out is None:
            out = torch.empty(p.shape[1:], dtype=torch.float32)
        np.add.reduce(p.numpy(), axis=0, out=out.numpy())
        return out
    rows = p.unbind(0)
    if out is None:
        out = torch.empty_like(rows[0])
    if from_first:
        out.copy_(rows[0])
    else:
        torch.add(rows[0], 0.0, out=out)            # +0 + p[0]: -0.0 becomes +0
    add = out.add_
    for r in rows[1:]:
        add(r)
    return out


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


INT32_MIN = -(1 << 31)


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 value (RNE); returns a Python float.

    Used to form C float32 constants such as ``0.1f*is + nmax`` exactly (each step rounded).
    """
    return struct.unpack("<f", struct.pack("<f", v))[0]


def fdiv(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 division ``a / b`` with one rounding, as C's ``/``.

    At least one of ``a``/``b`` is a float32 tensor; a Python number is first turned into a
    tensor of the other's shape and device. (``number / tensor`` in torch is computed as
    ``reciprocal(tensor) * number``, and CUDA divides by a CPU scalar through its
    reciprocal: both round twice, so codecs must divide through this helper.)
    """
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    elif not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return torch.div(a, b)


def c_float_to_int(x: torch.Tensor) -> torch.Tensor:
    """C float -> int conversion as x86-64 ``cvttss2si`` does it, as int32.

    Truncates toward zero; NaN and values outside [-2**31, 2**31) give INT32_MIN (the
    "integer indefinite" value). ``x`` float32, any shape; returns int32.
    """
    ok = (x >= -2147483648.0) & (x < 2147483648.0)
    return torch.where(ok, x, 0.0).to(torch.int32).masked_fill_(~ok, INT32_MIN)


def to_int8(v: torch.Tensor) -> torch.Tensor:
    """C ``(int8_t)`` of an int32 tensor: keep the low byte, sign-extend (int32 result)."""
    return ((v & 0xFF) ^ 0x80) - 0x80


def first_absmax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element of largest |x| along ``dim``, as C's scan
    ``amax = 0; max = 0; for i: if (|x[i]| > amax) { amax = |x[i]|; max = x[i]; }``:
    the first one on ties, NaN never selected, and +0.0 when no |x| is > 0 (so the sign of
    a zero is C's).

    ``x`` float32; returns (max with its sign, amax), ``dim`` removed. torch.argmax returns
    the first maximal index (NaN counts as maximal there, so it is masked to 0 first).

    On the CPU, for a matrix (the legacy types' blocks of 32 along the last axis; the K- and
    i-quants' sub-blocks of 16 or 32 positions along the first), torch's argmax is costly per
    row along the last axis and needs a comparison of every element with its maximum along the
    first: there the element is found from plain reductions instead (the largest and smallest
    value, far cheaper per row): max|x| is the larger of max and -min, the element is +max|x|
    if the largest equals it, -max|x| if the smallest equals its negative; rows where both or
    neither hold (+a and -a both present, or a NaN, which the reductions propagate) are
    scanned, gathered. The per-row logic is NumPy's (faster than torch's comparison and
    ``any()`` on a row). This beats argmax along the last axis and the weighted positions along
    the first, with ties and zero rows mixed in (figures and the commands in
    docs/benchmarks.md, "Figures behind the code", ``quantize/ggml/common.py``,
    ``first_absmax``).
    """
    if x.device.type == "cpu" and x.dim() == 2:
        d = dim % 2
        hi = x.amax(d).numpy()
        nlo = x.amin(d).neg_().numpy()
        amax = np.maximum(hi, nlo)          # NaN where the row holds one
        amax += 0.0                         # +0, not -0, for a row of zeros
        pos = hi == amax
        m = np.negative(amax)
        np.copyto(m, amax, where=pos)       # +amax, or -amax; +0 for a row of zeros
        odd = pos == (nlo == amax)
        odd &= amax != 0                    # a tie of +a and -a, or a NaN
        if odd.any():                       # those rows scanned as C does, in NumPy
            rows = np.flatnonzero(odd)
            xn = x.numpy()
            part = xn[:, rows].T if d == 0 else xn[rows]
            ax = np.abs(part)
            ax[np.isnan(ax)] = 0.0          # never selected
            at = (np.arange(rows.size), ax.argmax(1))      # the first largest
            amax[rows] = ax[at]
            m[rows] = np.where(ax[at] > 0, part[at], 0.0)
        return torch.from_numpy(m), torch.from_numpy(amax)
    return _first_absmax_by_argmax(x, dim)


def _first_absmax_by_argmax(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`first_absmax` through the first index of the largest |x| (NaN masked to 0)."""
    ax = x.abs().nan_to_num_(nan=0.0, posinf=float("inf"))     # (much faster than where(isnan))
    n = x.shape[dim]
    if dim in (-1, x.dim() - 1) or n > 255:
        idx = ax.argmax(dim, keepdim=True)
    else:
        # torch's argmax over a non-innermost axis is slow on CPU: weight the positions equal
        # to the maximum by n, n-1, ..., 1 (uint8) and take the largest weight = first index
        amax = ax.amax(dim, keepdim=True)
        shape = [1] * x.dim()
        shape[dim] = n
        weights = torch.arange(n, 0, -1, dtype=torch.uint8, device=x.device).view(shape)
        idx = (n - ((ax == amax) * weights).amax(dim, keepdim=True)).long()
    amax = ax.gather(dim, idx).squeeze(dim)
    m = x.gather(dim, idx).squeeze(dim)
    return torch.where(amax > 0, m, 0.0), amax


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of the float tensor ``x`` is finite (True when empty): its
    smallest and largest are (torch's ``amin``/``amax`` propagate NaN). Two reductions with no
    temporary, many times faster than ``torch.isfinite(x).all()`` (figures and the command in
    docs/benchmarks.md, "Figures behind the code", ``quantize/ggml/common.py``,
    ``all_finite``). Synchronizes with the device (returns a Python bool)."""
    if x.numel() == 0:
        return True
    return bool(torch.isfinite(torch.stack([x.amin(), x.amax()])).all())


def sqrtf(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Correctly rounded float32 square root, as C ``sqrtf`` (``sqrtss``): float32 of any
    shape (>= 0, or NaN/inf) -> float32 of the same shape, on ``x``'s device; ``out``: a
    contiguous float32 tensor of that shape to hold it (``x`` itself: in place), returned.

    ``torch.sqrt`` on float32 is not correctly rounded on every backend (torch 2.13's AVX-512
    CPU kernel misrounds 17-20% of inputs, ``scripts/micro_figures.py --weighted``). On the CPU
    this is NumPy's float32 square root, the processor's IEEE instruction (``sqrtps``/
    ``vsqrtps``, NEON ``fsqrt``), correctly rounded, and far faster than :func:`sqrtf_checked`,
    which made Q5_0 with an imatrix measurably faster (figures and the command in
    docs/benchmarks.md, "Figures behind the code", ``quantize/ggml/common.py``, ``sqrtf``).
    Other devices: :func:`sqrtf_checked`.
    """
    if x.device.type != "cpu":
        return sqrtf_checked(x) if out is None else out.copy_(sqrtf_checked(x))
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    with np.errstate(invalid="ignore"):     # (a negative input gives NaN, as sqrtf)
        np.sqrt(x.contiguous().numpy(), out=out.numpy())
    return out


def sqrtf_checked(x: torch.Tensor) -> torch.Tensor:
    """:func:`sqrtf` from torch's float64 root, checked exactly (any device).

    The float64 root rounded to float32 is the candidate. It is correctly rounded whenever
    the float64 root is within 4 ulp (a float32 ``x`` is a multiple of 2**(2k-46) where its
    root lies in [2**k, 2**(k+1)), so it stays 2**(2k-48) from every float32 midpoint's square
    and its root 2**(k-50) from the midpoint), and it is checked anyway: the float32
    neighbours' midpoints (25 significant bits) square exactly in float64 and bracket ``x``,
    else the candidate moves to that neighbour. The neighbours of a finite positive float are
    its bit pattern ± 1 (NaN below +0 and above the largest float, where the comparisons are
    false). On the CPU the corrections are applied only when some element needs one.
    """
    xd = x.to(torch.float64)
    s = torch.sqrt(xd).to(torch.float32)
    si = s.view(torch.int32)
    sd = s.to(torch.float64)
    up_f = (si + 1).view(torch.float32)
    dn_f = (si - 1).view(torch.float32)
    hi = up_f.to(torch.float64).add_(sd).mul_(0.5)
    up = xd > hi.mul_(hi)
    lo = dn_f.to(torch.float64).add_(sd).mul_(0.5)
    dn = xd < lo.mul_(lo)
    if x.device.type != "cpu" or bool((up | dn).any()):   # (no host sync off the CPU)
        s = torch.where(up, up_f, s)
        s = torch.where(dn, dn_f, s)
    return s


# Elements per slice for the block codecs on CPU: the codecs keep several float32 copies
# of their input alive (a K-quant step touches ~8 of them), and slices of 2**18 elements
# (1 MiB each) keep that working set in the cache while each elementwise op is long enough
# that its dispatch stays small next to its work. With codec processes (no GIL between the
# lanes) the working set is what counts: the 554M random llama's hf-to-gguf to Q4_K_M was
# faster with 2**18 than with 2**19, SmolLM2's (mostly Q5_0, bound by its metadata) the same
# within noise. On threads alone (GIL-bound dispatch: where no codec processes run) an older
# run favoured 2**19. Figures and the commands in docs/benchmarks.md, "Figures behind the
# code", ``quantize/ggml/common.py``, ``CPU_SLICE_ELEMENTS``.
# Results do not depend on the slicing (blocks are independent).
CPU_SLICE_ELEMENTS = 1 << 18
# Below this many elements a codec call runs on the calling thread alone: handing a slice to
# another thread costs more than it saves there (a 576 x 576 Q5_0 tensor was slower on two
# threads than alone: docs/benchmarks.md, "Figures behind the code",
# ``quantize/ggml/common.py``, ``CPU_PARALLEL_ELEMENTS``). The search-based codecs (K-quants,
# i-quants) spend 5-10x longer per element, so they share out from
# CPU_PARALLEL_ELEMENTS_SEARCH (``sliced(search=True)``).
CPU_PARALLEL_ELEMENTS = 1 << 20
CPU_PARALLEL_ELEMENTS_SEARCH = 1 << 18
# Most threads a codec call deals its slices to: every op's dispatch holds the GIL, so past a
# few threads they wait on each other more than they work (the codec processes of
# quantize.ggml.processes, where started, have no such cap). Q4_K of 16384 x 4096 on the
# 16-core Intel Xeon of an H200 box was fastest on 4 threads and slower on more (the sweep
# and its command in docs/benchmarks.md, "Figures behind the code",
# ``quantize/ggml/common.py``, ``CPU_CODEC_THREADS``).
CPU_CODEC_THREADS = 4


# how the search codecs' slices reach the codec processes: quantize.ggml.processes (which
# builds on this module) registers its map_slices here at its import; None: threads only
_process_slices: list = [None]


def use_codec_processes(map_slices) -> None:
    """Register the function that deals a search codec's CPU slices to codec processes
    (``quantize.ggml.processes.map_slices``'s signature: the results in row order, or None
    when the call cannot go there), called by :func:`map_block_slices`; None: threads only."""
    _process_slices[0] = map_slices


_threads_local = threading.local()
# torch gives a thread its intra-op thread count at the thread's first use of it, from the
# count last set by any thread: have the importing (main) thread take the process's count now,
# before some other thread's single_threaded_ops sets 1.
torch.get_num_threads()


@contextlib.contextmanager
def single_threaded_ops():
    """Run torch's ops on one intra-op thread in the calling thread while the block runs,
    yielding the thread count in effect before (for nested blocks, the count before the
    outermost). torch's count is per thread (the OpenMP setting of the calling thread), so
    blocks in other threads neither see nor undo this one."""
    depth = getattr(_threads_local, "depth", 0)
    if depth == 0:
        _threads_local.saved = torch.get_num_threads()
        if _threads_local.saved != 1:
            torch.set_num_threads(1)
    _threads_local.depth = depth + 1
    try:
        yield _threads_local.saved
    finally:
        _threads_local.depth = depth
        if depth == 0 and _threads_local.saved != 1:
            torch.set_num_threads(_threads_local.saved)


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads (restoring the count in effect before);
    ``n`` None: unchanged. For elementwise passes that are large enough to share out (each
    element's result does not depend on the thread count) inside :func:`single_threaded_ops`;
    keep reductions outside it where their rounding must not depend on the machine."""
    if n is None or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(n)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_pool_local = threading.local()


def _pool_worker_init() -> None:
    torch.set_num_threads(1)
    _pool_local.worker = True


def _codec_pool(workers: int) -> ThreadPoolExecutor:
    """The process's codec thread pool with at least ``workers`` threads, made once and kept
    (a fresh thread's first torch ops are slow: a new pool per call cost more than a small
    tensor's whole quantization, docs/benchmarks.md, "Figures behind the code",
    ``quantize/ggml/common.py``); each thread runs torch ops single-threaded."""
    global _pool, _pool_workers
    with _pool_lock:
        if _pool is None or _pool_workers < workers:
            old, _pool = _pool, ThreadPoolExecutor(workers, thread_name_prefix="quantpress-codec",
                                                   initializer=_pool_worker_init)
            _pool_workers = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


@contextlib.contextmanager
def serial_codecs():
    """Within the block, codec calls made by this thread run their slices on this thread alone
    (as calls from the codec pool's own threads do), leaving the pool to other callers: for
    work done beside a quantization, such as a round trip's dequantization."""
    before = getattr(_pool_local, "worker", False)
    _pool_local.worker = True
    try:
        yield
    finally:
        _pool_local.worker = before


def widened(x: torch.Tensor) -> torch.Tensor:
    """A floating tensor in float32 (exactly: float16 and bfloat16 widen without rounding;
    ``x`` itself when already float32); any other tensor (a dequantizer's bytes) as it is."""
    return x.to(torch.float32) if x.is_floating_point() else x


def quiet_floats():
    """A context in which NumPy does not warn about floating-point overflow, division by zero
    or invalid operations (``np.errstate(all="ignore")``, this thread only): the codecs
    reproduce C's float arithmetic, which overflows silently on extreme weights (a sum of
    squares of 1e30 values is Inf there too), so a NumPy operation in them must not print a
    RuntimeWarning for it. :func:`map_block_slices` runs every CPU slice in it, in whichever
    thread or codec process, and ``quantize.ggml.row_sigma2`` its row sums: the searches'
    NumPy operations (``kquants._NumpyOps``), which divide by zero as C does, rely on it."""
    return np.errstate(all="ignore")


def map_block_slices(fn, x: torch.Tensor, *more, search: bool = False, slice_factor: int = 1) -> torch.Tensor:
    """Apply a block codec ``fn`` ([nb, k] -> [nb, m]) to slices of the rows of ``x``.

    ``more``: further arguments of ``fn``; tensors among them are [nb, ...] and sliced along
    with ``x`` (None and other values are passed as they are). A floating ``x`` may be of
    any float dtype: ``fn`` is given it in float32 (:func:`widened`), one slice at a time on
    the CPU, so that a float16/bfloat16 input is never copied whole into float32 (nor into a
    codec process's shared area: the process widens its slices itself).
    Other devices: ``fn(x in float32, *more)`` once. CPU: the rows are cut into slices of about
    ``slice_factor`` (a codec's own, :func:`sliced`) times :data:`CPU_SLICE_ELEMENTS` (read at
    the call) elements and the results concatenated in order. The codecs
    issue thousands of small elementwise ops, for which torch's intra-op (OpenMP) threading
    costs more than it brings (and stalls badly on a busy machine), so ops run single-threaded
    and, from :data:`CPU_PARALLEL_ELEMENTS` elements up, the slices are dealt round-robin to as
    many threads as torch had intra-op threads: the calling thread and the threads of one
    persistent pool (torch releases the GIL inside ops), at most :data:`CPU_CODEC_THREADS`; ``search``: ``fn`` is a search-based
    codec, shared out from :data:`CPU_PARALLEL_ELEMENTS_SEARCH`, and where this process started
    codec processes (:mod:`quantize.ggml.processes`, free of the GIL) its slices go to the
    calling thread and up to one process less than torch's thread count instead. A call made
    from a pool thread runs its slices itself. torch's thread setting is restored on return.
    Raises what ``fn`` raises; RuntimeError when a codec process dies during the call.
    """
    if x.device.type != "cpu":
        return fn(widened(x), *more)
    nb, k = x.shape

    def part(i: int, step: int) -> torch.Tensor:
        args = [m[i:i + step] if isinstance(m, torch.Tensor) else m for m in more]
        with quiet_floats():
            return fn(widened(x[i:i + step]), *args)

    with single_threaded_ops() as threads:
        per = max(1, slice_factor * CPU_SLICE_ELEMENTS // max(1, k))    # rows per slice
        least = CPU_PARALLEL_ELEMENTS_SEARCH if search else CPU_PARALLEL_ELEMENTS
        workers = min(threads, CPU_CODEC_THREADS, max(2, -(-nb // per)) if nb * k >= least else 1)
        alone = workers < 2 or getattr(_pool_local, "worker", False)
        # the codec processes (when started), one lane per thread torch had; None: threads
        to_processes = _process_slices[0]
        outs = (None if alone or not search or to_processes is None
                else to_processes(fn, part, nb, per, threads, x, more))
        if outs is None and alone:
            outs = [part(i, per) for i in range(0, nb, per)]
        elif outs is None:
            # equal slices, as many per thread: the threads finish together
            n = workers * -(-nb // (per * workers))
            step = -(-nb // n)
            starts = list(range(0, nb, step))

            def deal(lane: int) -> list[torch.Tensor]:
                return [part(i, step) for i in starts[lane::workers]]
            pool = _codec_pool(workers - 1)
            futures = [pool.submit(deal, lane) for lane in range(1, workers)]
            lanes = [deal(0)] + [f.result() for f in futures]
            outs = [lanes[j % workers][j // workers] for j in range(len(starts))]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def sliced(fn=None, *, search: bool = False, slice_factor: int = 1):
    """Decorator: run block codec ``fn`` through :func:`map_block_slices` (same signature,
    docstring kept; the undecorated function is ``fn.__wrapped__``). ``@sliced(search=True)``
    for the search-based codecs; ``slice_factor``: the codec's CPU slices are that many times
    :data:`CPU_SLICE_ELEMENTS` (see ``map_block_slices``)."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(x: torch.Tensor, *more) -> torch.Tensor:
            return map_block_slices(fn, x, *more, search=search, slice_factor=slice_factor)
        return run
    return wrap if fn is None else wrap(fn)
