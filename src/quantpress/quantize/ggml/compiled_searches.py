"""The K-quants' affine scale search (``make_qkx2_quants``) as fused CPU loops, compiled by
TorchInductor (``torch.compile``) from the same torch operations.

On the CPU each step of :func:`kquants.make_qkx2_quants` is about sixteen torch operations,
each a pass over a slice of 2^18 values: the slice's arrays do not stay in the L2 cache
between passes, and smaller slices spend the time saved on each operation's dispatch. Here
one step (:func:`qkx2_step`) is compiled into a few C++ loops over the sub-blocks, each
holding a sub-block's values in registers from its levels to its error: the codecs that use
the search run about twice as fast on one thread (``scripts/micro_figures.py --compiled``;
the figures are in docs/benchmarks.md, "Compiled K-quant search").

The bits are those of the torch search, hence llama.cpp's (``make_qkx2_quants`` /
``make_qkx3_quants``, ``ggml/src/ggml-quants.c`` at 0c1e570, llama-cpp-python 0.3.36):

* Inductor compiles its C++ with ``-ffp-contract=off`` and ``-fno-unsafe-math-optimizations``
  (set again here, :func:`_configure`): every product, sum and division rounds once, as the
  eager operation does; no multiply-add is fused, nothing is reassociated;
* a sub-block's sums (``sum(0)`` over [n, S]) are one accumulator per sub-block that adds
  the positions in order from +0, C's ``for`` loop (Inductor's reduction over a non-inner
  axis; tests/test_compiled_searches.py compares the bits with the eager search and
  llama.cpp's bytes);
* the levels are rounded with ``round`` (half to even) as the eager fast path does, under the
  same range check: a step whose values may leave the range where that equals C's
  ``nearest_int`` is not taken from here, and the eager search goes on from that step.

Used on the CPU once :func:`enable` was called (the GGUF target does for large workloads,
``targets.gguf``) or with ``QUANTPRESS_COMPILED_SEARCHES=1``; ``=0`` turns it off. The
first call compiles (the kernels are kept in quantpress's cache under ``inductor/``, one
directory per instruction set and processor, :func:`machine_key`, and a later process loads
them, faster than it compiles them: micro_figures.py --compiled, docs/benchmarks.md).
A failure to compile (no C++ compiler) turns it off for the process with one warning: the
eager search gives the same bytes.
"""
from __future__ import annotations

import hashlib
import math
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Iterable

import torch

from .common import single_threaded_ops

#: ggml types whose quantization runs make_qkx2_quants: always, and only with importance weights
SEARCH_TYPES = frozenset({"Q2_K", "Q4_K", "Q5_K"})
WEIGHTED_SEARCH_TYPES = frozenset({"Q4_1", "Q5_1"})
#: weights quantized by those searches from which compiling pays: from about 2^27 weights the
#: time the kernels save on each of two lanes exceeds the time a process takes to load them
#: (micro_figures.py --compiled; the load time and the saving per weight are in
#: docs/benchmarks.md, "Compiled K-quant search"). SmolLM2's Q4_K_M
#: stays below (tests/test_compiled_searches.py), the 554M random llama's goes above
#: (``bench_gguf.py --model synth4x``: its "prepare" stage loads the kernels)
MIN_WEIGHTS = 1 << 27

_state = {"on": False, "failed": None, "fn": None}
_lock = threading.Lock()
_compiled_signatures: set = set()


def enable(on: bool = True) -> None:
    """Use (or stop using) the compiled steps in this process and the processes it forks."""
    _state["on"] = on


def enabled() -> bool:
    """Whether :func:`kquants.make_qkx2_quants` takes the compiled steps on the CPU:
    ``QUANTPRESS_COMPILED_SEARCHES`` (``1`` on, ``0`` off) when set, else :func:`enable`'s
    setting; never after a compile failure."""
    if _state["failed"] is not None:
        return False
    env = os.environ.get("QUANTPRESS_COMPILED_SEARCHES")
    return env == "1" if env in ("0", "1") else _state["on"]


def worth_it(tensors: Iterable[tuple[str, int, bool]]) -> bool:
    """Whether a job's searches are worth compiling: ``tensors`` gives (ggml type name, number
    of weights, has importance weights) per tensor; True when at least :data:`MIN_WEIGHTS`
    go through make_qkx2_quants (:data:`SEARCH_TYPES`, :data:`WEIGHTED_SEARCH_TYPES` with
    importance weights)."""
    n = sum(numel for t, numel, weighted in tensors
            if t in SEARCH_TYPES or (weighted and t in WEIGHTED_SEARCH_TYPES))
    return n >= MIN_WEIGHTS


def warm_up(mad: bool = True) -> bool:
    """Compile (or load from the cache) the steps' kernels now, so that processes forked
    afterwards inherit them: those of the squared error, and of the absolute error when
    ``mad`` (Q2_K without importance weights). Returns whether they are usable."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    ends = torch.stack([x.amin(0), x.amax(0)])
    st = torch.stack([torch.full((64,), 7.0), ends[0], torch.full((64,), 1e30), torch.ones(64), ends[0]])
    for use_mad in (False, True) if mad else (False,):
        run_steps(x, x.abs() + 1.0, ends, None, st.clone(), torch.ones(64), torch.ones(64), 15, [14.0],
                  use_mad, math.inf)
    return enabled() and _state["fn"] is not None


def qkx2_step(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, live: torch.Tensor,
              mx: torch.Tensor, st: torch.Tensor, sum_w: torch.Tensor, sum_x: torch.Tensor,
              num: torch.Tensor, nmax: torch.Tensor, safe: torch.Tensor,
              use_mad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``make_qkx2_quants`` over S sub-blocks, in plain torch operations: what
    :func:`compiled` compiles (run eagerly, torch's ``sum`` would not add in C's order).

    ``x``, ``w`` float32 [n, S] (values, weights); ``ends`` [2, S] each sub-block's (min,
    max), ``live`` bool [S] (False: max == min, excluded from the range check), ``mx`` [S]
    its max; ``st`` float32 [5, S] the search state (selected inverse scale, its shift, best
    error, scale, min); ``sum_w``, ``sum_x`` [S]; ``num`` the step's numerator
    ``rmin + rdelta·k + nmax`` (float32 0-d), ``nmax`` float32 0-d, ``safe`` the rounding
    bound (``kquants.NI_SAFE``); ``use_mad``: |e| instead of e². Returns (the new state [5, S],
    bool 0-d: some live sub-block's scaled values may exceed ``safe``, and then the step is
    not valid)."""
    sel_iscale, sel_shift, best, scale, mn = st.unbind(0)
    iscale = num / (mx - mn)
    chk = torch.where(live[None], ((ends - mn) * iscale).abs(), 0.0)
    unsafe = ~(chk.amax() <= safe)
    la = torch.clamp(torch.round((x - mn) * iscale), min=torch.zeros_like(nmax), max=nmax)
    wl = w * la
    sum_l, sum_l2, sum_xl = wl.sum(0), (wl * la).sum(0), (wl * x).sum(0)
    d = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / d
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d
    pos = this_min > 0
    this_min = torch.where(pos, 0.0, this_min)
    this_scale = torch.where(pos, sum_xl / sum_l2, this_scale)
    e = la * this_scale + this_min - x
    e = e.abs() if use_mad else e * e
    cur = (e * w).sum(0)
    take = (d > 0) & (cur < best)
    new = torch.stack([iscale, mn, cur, this_scale, this_min])
    return torch.where(take, new, st), unsafe


#: the kernel directory this process gave Inductor (:func:`kernel_cache_dir`), inherited by
#: the processes it starts: theirs is keyed again from the same base
KERNEL_DIR_ENV = "QUANTPRESS_INDUCTOR_DIR"
#: /proc/cpuinfo's fields that identify the processor and what it can run
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags", "CPU implementer",
               "CPU architecture", "CPU variant", "CPU part", "Features")


def machine_key() -> str:
    """``<capability>-<digest>`` naming the kernels this process may use: torch's CPU
    capability (``ATEN_CPU_CAPABILITY`` or the detected one: ``avx512``, ``avx2``, ``default``,
    the instruction set Inductor vectorizes for) and 12 hex digits of a SHA-256 over the torch
    version, the architecture and the first processor's identity and feature flags in
    ``/proc/cpuinfo`` (:data:`_CPU_FIELDS`; the architecture and processor name elsewhere).

    Inductor's own cache (torch 2.13) does not key its C++ kernels by the instruction set: a
    kernel generated for AVX-512 and loaded by a process at ``ATEN_CPU_CAPABILITY=avx2``
    wrote Q4_K bytes of which half the blocks were not llama.cpp's (``scripts/micro_figures.py
    --kernel-cache``: 128 of 256), and at ``default`` failed to compile; a directory
    shared by machines of different processors (a home directory on NFS, a batch's Ray nodes)
    or a process started at another capability must not see another's kernels."""
    cap = torch.backends.cpu.get_cpu_capability().lower()
    ident = [torch.__version__, platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break                                   # the first processor's block
                k, _, v = line.partition(":")
                if k.strip() in _CPU_FIELDS:
                    ident.append(f"{k.strip()}={v.strip()}")
    except OSError:
        pass
    digest = hashlib.sha256("\n".join(ident).encode()).hexdigest()
    return f"{cap}-{digest[:12]}"


def kernel_cache_dir() -> Path:
    """The directory for Inductor's cache in this process: ``<base>/<machine_key()>``, the
    base being ``$TORCHINDUCTOR_CACHE_DIR`` when a user (or a caller) set it, else
    quantpress's cache's ``inductor/`` (:func:`assets.cache_root`); a directory that a
    quantpress parent set (:data:`KERNEL_DIR_ENV`) gives back its base, keyed for this
    process."""
    from quantpress import assets

    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env and env == os.environ.get(KERNEL_DIR_ENV):
        base = Path(env).parent
    elif env:
        base = Path(env)
    else:
        base = assets.cache_root() / "inductor"
    return base / machine_key()


def _configure() -> None:
    """Inductor's settings that the bits depend on, and its cache (:func:`kernel_cache_dir`)."""
    # before Inductor first reads it (its default cache directory is taken then)
    d = str(kernel_cache_dir())
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.environ[KERNEL_DIR_ENV] = d
    import torch._inductor.config as ic

    ic.cpp.enable_floating_point_contract_flag = "off"
    ic.cpp.enable_unsafe_math_opt_flag = False
    ic.compile_threads = 1          # compile in this process: no worker pool to fork with


def compiled():
    """:func:`qkx2_step` compiled (dynamic shapes: one kernel set for every S and n), made
    once per process; None when compiling is not possible (warned once)."""
    if _state["fn"] is None and _state["failed"] is None:
        try:
            _configure()
            _state["fn"] = torch.compile(qkx2_step, dynamic=True, fullgraph=True)
        except Exception as e:                      # noqa: BLE001 (import or set-up errors)
            _turn_off(e)
    return _state["fn"]


def _turn_off(e: BaseException) -> None:
    _state["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    warnings.warn(f"quantpress: compiling the K-quant search failed ({_state['failed']}); the "
                  "GGUF codecs use torch operations instead (the same bytes, slower)", RuntimeWarning)


def run_steps(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, dead: torch.Tensor | None,
              st: torch.Tensor, sum_w: torch.Tensor, sum_x: torch.Tensor, nmax: int,
              nums: list[float], use_mad: bool, safe: float) -> int:
    """Run the steps with numerators ``nums`` (float32 values, in order) compiled, updating
    the state ``st`` [5, S] in place (shapes as :func:`qkx2_step`; ``dead`` bool [S] or None;
    ``safe`` the fast rounding's range, ``kquants.NI_SAFE``).
    Returns how many steps were done: all of them, or fewer when a step fails the range check
    or compiling failed (the caller goes on from there with the eager steps, from the same
    state)."""
    fn = compiled()
    if fn is None:
        return 0
    with single_threaded_ops():         # the kernels' loops run on the calling thread
        return _steps(fn, x, w, ends, dead, st, sum_w, sum_x, nmax, nums, use_mad, safe)


def _steps(fn, x, w, ends, dead, st, sum_w, sum_x, nmax, nums, use_mad, safe) -> int:
    S = x.shape[1]
    live = torch.ones(S, dtype=torch.bool) if dead is None else ~dead
    mx = ends[1]
    nmax_t = torch.tensor(float(nmax))
    safe = torch.tensor(safe)
    sig = (use_mad, x.shape[0] == 1, S == 1)
    for k, num in enumerate(nums):
        args = (x, w, ends, live, mx, st, sum_w, sum_x, torch.tensor(num), nmax_t, safe, use_mad)
        try:
            if sig in _compiled_signatures:
                new, unsafe = fn(*args)
            else:                                   # the first call of a kind compiles: one at a time
                with _lock:
                    new, unsafe = fn(*args)
                    _compiled_signatures.add(sig)
        except Exception as e:                      # noqa: BLE001 (Inductor's compile errors)
            _turn_off(e)
            return k
        if bool(unsafe):
            return k
        st.copy_(new)
    return len(nums)
