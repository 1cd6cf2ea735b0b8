"""Operations with one defined result (quantize/exact_ops.py) and EXL2 bytes that do not depend
on the CPU (issue 56 item 9).

* :func:`defined_sqrt_` against the correctly rounded root (NumPy's float64 root rounded to
  float32: a correctly rounded float64 root rounded to float32 is the correctly rounded
  float32 root, 53 ≥ 2·24 + 2) on adversarial inputs: subnormals, the largest floats, exact
  squares, the float32 neighbours of the squares of midpoints between floats (roots closest
  to a rounding boundary), random bit patterns over every binade, and the special values;
* :func:`tree_sum_` against its order written out as a recursion over float32 scalars, and
  the same bits under one and two threads;
* the EXL2 scale search (``quantize.gptq.scale_search_error``) against E(p) computed with
  NumPy from its definition (IEEE float32 steps, the correctly rounded root, the pairwise
  order): with torch 2.13's own CPU ``sqrt`` (one ulp off for 0.7-17% of inputs, depending on
  the processor) or torch.sum this fails;
* one EXL2 quantization in a child process at each ``ATEN_CPU_CAPABILITY`` this CPU runs,
  and in this process: the same packed bytes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from quantpress.quantize import exact_ops
from quantpress.quantize.gptq import find_params, p_grid, scale_search_error


def _ref_sqrt(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.sqrt(x.astype(np.float64)).astype(np.float32)


def _adversarial() -> np.ndarray:
    rng = np.random.default_rng(0)
    parts = []
    # subnormals (bit patterns 1 .. 2^23 - 1) and the smallest normals
    parts.append(np.concatenate([np.arange(1, 4096, dtype=np.uint32),
                                 rng.integers(1, 1 << 23, 20000, dtype=np.uint32),
                                 np.arange((1 << 23) - 64, (1 << 23) + 64, dtype=np.uint32)]).view(np.float32))
    # the largest floats
    parts.append(np.arange(0x7F7FFFFF - 4096, 0x7F7FFFFF + 1, dtype=np.uint32).view(np.float32))
    # exact squares of floats with at most 12 significant bits, over many binades
    k = rng.integers(1, 1 << 12, 20000).astype(np.float64) * np.exp2(rng.integers(-70, 50, 20000))
    parts.append((k * k).astype(np.float32))
    # neighbours of the squares of midpoints: s + ulp(s)/2 has 25 bits, its square 50 (exact in
    # float64); the float32 values just below and above it have roots next to a boundary
    s = np.exp2(rng.uniform(-60, 60, 40000)).astype(np.float32)
    mid = (s.astype(np.float64) + np.nextafter(s, np.float32(np.inf)).astype(np.float64)) / 2
    sq = mid * mid
    lo = sq.astype(np.float32)
    parts += [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(0))]
    # random bit patterns of every positive finite float
    parts.append(rng.integers(1, 0x7F800000, 200000, dtype=np.uint32).view(np.float32))
    # special values
    parts.append(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, -1e-40, 1.0, 4.0], dtype=np.float32))
    return np.concatenate(parts)


def _bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, every NaN as one value."""
    b = a.view(np.uint32).copy()
    b[np.isnan(a)] = 0x7FC00000
    return b


def test_defined_sqrt_is_correctly_rounded():
    x = _adversarial()
    want = _bits(_ref_sqrt(x))
    got = exact_ops.defined_sqrt(torch.from_numpy(x))
    assert got.dtype == torch.float32 and got.shape == (x.size,)
    bad = np.flatnonzero(_bits(got.numpy()) != want)
    assert bad.size == 0, f"{bad.size} of {x.size} roots misrounded, e.g. sqrt({x[bad[0]]!r})"
    # in place, and on a strided view (copied through the contiguous path)
    t = torch.from_numpy(x.copy())
    assert exact_ops.defined_sqrt_(t) is t
    assert np.array_equal(_bits(t.numpy()), want)
    v = torch.from_numpy(x.copy())[::3]
    exact_ops.defined_sqrt_(v)
    assert np.array_equal(_bits(v.numpy()), want[::3])
    with pytest.raises(TypeError, match="float32"):
        exact_ops.defined_sqrt_(torch.ones(3, dtype=torch.float16))


def _pairwise(vals: list) -> np.float32:
    """:func:`tree_sum_`'s order as a recursion: n values become the h = n//2 sums
    v[i] + v[i + n - h] followed by the unpaired middle value when n is odd."""
    if len(vals) == 1:
        return vals[0]
    n, h = len(vals), len(vals) // 2
    nxt = [np.float32(vals[i] + vals[i + n - h]) for i in range(h)] + vals[h:n - h]
    return _pairwise(nxt)


def test_tree_sum_order_and_threads():
    rng = np.random.default_rng(1)
    for L in (1, 2, 3, 5, 8, 31, 64, 97, 200):
        x = (rng.standard_normal((3, L)) * np.exp2(rng.integers(-20, 20, (3, L)))).astype(np.float32)
        got = exact_ops.tree_sum(torch.from_numpy(x))
        want = np.array([_pairwise([np.float32(v) for v in row]) for row in x], dtype=np.float32)
        assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32)), L
    big = torch.from_numpy((rng.standard_normal((4, 3, 1 << 17)) ** 2).astype(np.float32))
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = exact_ops.tree_sum(big)
        torch.set_num_threads(2)
        two = exact_ops.tree_sum(big)
    finally:
        torch.set_num_threads(saved)
    assert one.shape == (4,) and torch.equal(one, two)
    exact = big.double().sum(dim=(1, 2))
    assert torch.allclose(one.double(), exact, rtol=20 * 2.0 ** -24, atol=0)
    assert float(exact_ops.tree_sum(torch.tensor([1.5, 2.25]), 0)) == 3.75
    with pytest.raises(ValueError, match="L >= 1"):
        exact_ops.tree_sum_(torch.empty(2, 0))


def _search_reference(x: np.ndarray, cand: np.ndarray, bits: int, grid: np.ndarray) -> np.ndarray:
    """E(p) from its definition with NumPy's IEEE float32 operations (exllamav2 0.3.2
    ``quantize_err_kernel``): s = cand·p, e = |clamp(rint(x/s), −z, z−1)·s − x|, e³·√e with
    the correctly rounded root, summed in :func:`tree_sum_`'s order."""
    z = np.float32(1 << (bits - 1))
    out = []
    for p in grid:
        s = cand * p
        q = np.clip(np.rint(x / s), -z, z - np.float32(1))
        e = np.abs(q * s - x)
        e35 = ((e * e) * e) * np.sqrt(e)
        out.append(_pairwise(list(e35.reshape(-1))))
    return np.array(out, dtype=np.float32)


def test_scale_search_has_one_defined_result():
    g = torch.Generator().manual_seed(3)
    grid = p_grid()
    # two terms per E(p): one addition, which any order makes alike
    bad = 0
    for _ in range(40):
        x = torch.randn(1, 2, generator=g) * torch.rand(2, generator=g).add_(0.05)
        cand = x.abs().amax(0) / 7.5 * torch.rand(2, generator=g).add_(0.5)
        want = _search_reference(x.numpy(), cand.numpy(), 4, grid.numpy())
        bad += int((scale_search_error(x, cand, 4, grid).numpy().view(np.uint32) != want.view(np.uint32)).sum())
    assert bad == 0, f"E(p) of two terms differs from its definition at {bad} of {40 * 97} grid points"
    # 768 terms: the order of the sum too
    x = torch.randn(32, 24, generator=g) * torch.rand(24, generator=g).add_(0.05)
    cand = x.abs().amax(0) / 7.5
    got = scale_search_error(x, cand, 4, grid)
    want = _search_reference(x.numpy(), cand.numpy(), 4, grid.numpy())
    diff = np.flatnonzero(got.numpy().view(np.uint32) != want.view(np.uint32))
    assert diff.size == 0, f"E(p) differs from its definition at {diff.size} of 97 grid points"
    # find_params' scale codes: round(16·sqrt(base/smax)) with the correctly rounded root
    qs, _, _ = find_params(x, 4)
    base = (x.abs().amax(0) + 1e-12) / 7.5
    want_qs = np.clip(np.rint(_ref_sqrt((base / base.max()).numpy()) * np.float32(16)), 1, 16)
    assert np.array_equal(qs.numpy(), want_qs.astype(np.uint8))


_CHILD = r"""
import hashlib, sys, numpy as np, torch
from quantpress.quantize.exl2 import QParams
from quantpress.quantize.gptq import gptq_quantize
# inputs from NumPy and a Hessian made in float64 (torch's randn and float32 matmul give other
# bits at other capabilities: they are not what is tested here)
rng = np.random.default_rng(5)
w = torch.from_numpy(rng.standard_normal((96, 256)) * 0.02).half()
z = rng.standard_normal((1024, 256)) * (rng.random(256) + 0.1)
h = torch.from_numpy(z.T @ z / 1024).float()
packed = gptq_quantize(w, h, QParams(64, [4, 3], [0.5, 0.5])).pack()
d = hashlib.sha256()
for k in sorted(packed):
    d.update(k.encode()); d.update(packed[k].contiguous().view(torch.uint8).numpy().tobytes())
# the bits the bytes are chosen from, which move long before a code does: the scale search's
# E(p) of one group and the GPTQ rank-1 update
from quantpress.quantize import exact_ops
from quantpress.quantize.gptq import scale_search_error
x = w[:64].float().T.contiguous()
d.update(scale_search_error(x, x.abs().amax(0) / 7.5, 4).numpy().tobytes())
a, u, r = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) for n in ((31, 512), 31, 512))
d.update(exact_ops.sub_outer_(a, u, r, torch.empty(31 * 512)).numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), d.hexdigest())
"""


def test_exl2_bytes_at_every_capability():
    """The same EXL2 tensors at every ATEN_CPU_CAPABILITY this CPU runs, and the same bits of
    the scale search's E(p) and of the GPTQ rank-1 update they are chosen from (a 1-ulp
    difference there moves a code only near a rounding boundary: the packed bytes of a small
    layer alone would hide it). The Hessian and the block updates are BLAS products, which the
    capability does not select (exact_ops' docstring). With torch's ``addr_`` in place of
    ``sub_outer_`` this fails on an AVX2 machine (it fuses a multiply-add at avx2, not at
    default); the scale search's sums are pairwise in one order (``tree_sum_``), where
    torch.sum's order follows the vector width (16 lanes at avx512, 8 below)."""
    runs = {}
    for cap in ("default", "avx2", "avx512"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300)
        if r.returncode == -signal.SIGILL:  # torch accepts a capability the CPU lacks, then dies
            continue
        assert r.returncode == 0, r.stderr[-2000:]
        got_cap, digest = r.stdout.split()
        if got_cap.lower() == cap:          # a capability the CPU lacks falls back: not a run
            runs[cap] = digest
    assert "default" in runs and len(runs) >= 2 or torch.backends.cpu.get_cpu_capability() == "DEFAULT", runs
    assert len(set(runs.values())) == 1, runs
