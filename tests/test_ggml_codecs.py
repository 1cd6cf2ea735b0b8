"""ggml codecs (quantize/ggml/legacy.py, kquants.py) against llama.cpp itself.

Reference bytes come from llama.cpp's ``ggml_quantize_chunk`` (libggml-base of the
installed llama-cpp-python 0.3.36, through tests/ggml_ref.py); dequantization is checked
against llama.cpp's ``to_float`` and against gguf-py's independent numpy implementation.
Nothing is hard-coded: every expectation is computed by the reference on the same input.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

import ggml_ref
import quantpress.quantize.ggml as qg
from quantpress.quantize.ggml import common, kquants

LEGACY = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
TYPES = LEGACY + KQUANTS

# the codecs reproduce C's silent float overflow: a NumPy RuntimeWarning from them fails a test
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


# ----------------------------------------------------------------------------- inputs

def _fp16_rows() -> np.ndarray:
    """128 x 4096 rows of N(0, 0.02^2) rounded through float16 (typical checkpoint weights)."""
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(128, 4096, generator=g) * 0.02).half().float().numpy()


def _llm_like_rows() -> np.ndarray:
    """32 x 4096 float32 rows with per-row scales and a few outlier columns (x20)."""
    r = np.random.default_rng(99)
    x = r.normal(0, 1, (32, 4096)) * 10.0 ** r.uniform(-3, 0, (32, 1))
    x[:, r.choice(4096, 24, replace=False)] *= 20.0
    return x.astype(np.float32)


def _random_rows() -> np.ndarray:
    """Float32 rows of several scales and shapes of distribution, 256 wide."""
    r = np.random.default_rng(7)
    rows = []
    for scale in (1e-6, 1e-3, 0.05, 1.0, 30.0, 1e4):
        rows.append(r.normal(0.0, scale, (16, 256)))
        rows.append(r.standard_t(3, (8, 256)) * scale)                 # heavy tails
        rows.append(r.normal(scale, scale / 4, (4, 256)))              # all positive
        rows.append(r.uniform(-scale, scale, (4, 256)))
    return np.concatenate(rows).astype(np.float32)


def edge_rows() -> np.ndarray:
    """Rows of 256 (one K-quant block, eight legacy blocks) that hit the special cases."""
    r = np.random.default_rng(3)
    n = 256
    rows = [
        np.zeros(n),                                                    # all zero
        np.where(r.random(n) < 0.5, -0.0, 0.0),                         # signed zeros
        np.where(np.arange(n) == 37, 5.0, 0.0),                         # single outlier
        np.where(np.arange(n) == 100, -3.0, r.normal(0, 0.02, n)),      # outlier in noise
        np.where(np.arange(n) % 32 == 0, 1.0, r.normal(0, 0.02, n)),    # outlier per block
        np.full(n, 0.5), np.full(n, -0.25),                             # constant (max == min)
        np.full(n, 1e-30), np.full(n, -1e-30),
        r.normal(0, 1e-30, n),                                          # near 1e-30
        r.normal(0, 1e-39, n), r.normal(0, 1e-42, n),                   # subnormal
        np.tile([0.3, -0.3], n // 2), np.tile([-0.3, 0.3, 0.1, -0.2], n // 4),  # mixed signs, |x| ties
        np.tile([0.5, -0.5, -0.5, 0.5, 0.25, -0.25, 0.0, 0.1], n // 8),
        r.normal(0, 1e30, n), r.normal(0, 1e37, n),                     # huge (squares overflow)
        np.where(r.random(n) < 0.1, 1e20, 1e-20) * r.choice([-1, 1], n),  # tiny and huge mixed
        r.normal(0, 1, n) * np.repeat(10.0 ** np.arange(-8, 8), 16),    # magnitude per sub-block
        r.integers(-8, 8, n) * 0.125, r.integers(0, 16, n) * 0.25,      # on the quant grid
        (r.integers(-40, 40, n) + 0.5) * 0.01,                          # rounding ties
        np.abs(r.normal(0, 1, n)), -np.abs(r.normal(0, 1, n)),          # one-signed
        np.where(r.random(n) < 0.05, r.normal(0, 1, n), 0.0),           # sparse
        np.where(r.random(n) < 0.5, 1.0, -1.0), np.where(r.random(n) < 0.5, 2.0, 1.0),
        np.linspace(-1, 1, n), np.linspace(0, 1, n),
        np.where(np.arange(n) % 16 == 3, 1.0, 0.0),
        np.concatenate([np.zeros(128), r.normal(0, 1, 128)]),
        np.concatenate([np.full(64, 0.1), r.normal(0, 1, 64), np.full(64, -0.2), np.zeros(64)]),
    ]
    return np.stack(rows).astype(np.float32)


INPUTS = {
    "fp16_rows": _fp16_rows,
    "llm_like_rows": _llm_like_rows,
    "random_rows": _random_rows,
    "edge_rows": edge_rows,
    "fuzz_rows": lambda: np.concatenate([ggml_ref.fuzz_rows(11, 192), ggml_ref.fuzz_rows(12, 192)]),
}


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    return {k: f() for k, f in INPUTS.items()}


def _ours(x: np.ndarray, name: str) -> np.ndarray:
    return qg.quantize(torch.from_numpy(x), name).numpy()


def _mismatched_blocks(a: np.ndarray, b: np.ndarray, type_size: int) -> np.ndarray:
    return np.nonzero((a.reshape(-1, type_size) != b.reshape(-1, type_size)).any(1))[0]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------------------- quantize

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", list(INPUTS))
def test_quantize_matches_llamacpp(inputs, name, kind):
    x = inputs[kind]
    ref = ggml_ref.ref_quantize(x, name)
    ours = _ours(x, name)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    bad = _mismatched_blocks(ours, ref, qg.get(name).type_size)
    assert bad.size == 0, f"{name}/{kind}: {bad.size} of {ref.size // qg.get(name).type_size} blocks differ, first {bad[:8]}"


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_qkx2_integer_rounding_path(inputs, name, monkeypatch):
    """make_qkx2_quants' and the requantization's C integer rounding path (used off-CPU)
    gives the same bytes."""
    monkeypatch.setattr(kquants, "FAST_ROUNDING_ON_CPU", False)
    x = np.concatenate([inputs["edge_rows"], inputs["fp16_rows"][:4].reshape(-1, 256)[:64]])
    assert np.array_equal(_ours(x, name), ggml_ref.ref_quantize(x, name))


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_numpy_searches_torch_ops(inputs, name, monkeypatch):
    """The searches that run NumPy's operations on the CPU (make_q3_quants' coordinate
    descent, make_qkx2_quants' and make_qx_quants' acceptance tests) give llama.cpp's bytes
    with torch's operations too, which other devices run."""
    monkeypatch.setattr(kquants, "NUMPY_SEARCHES_ON_CPU", False)
    x = np.concatenate([inputs["edge_rows"], inputs["fp16_rows"][:4].reshape(-1, 256)[:64],
                        inputs["fuzz_rows"][:16].reshape(-1, 256)])
    assert np.array_equal(_ours(x, name), ggml_ref.ref_quantize(x, name))


@pytest.mark.parametrize("name", ["Q4_0", "Q3_K", "Q6_K"])
def test_slicing_does_not_change_bytes(inputs, name, monkeypatch):
    """The CPU slicing into cache-sized pieces (including a ragged last slice) is invisible."""
    x = inputs["fuzz_rows"][:37]
    ref = ggml_ref.ref_quantize(x, name)
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 256 * 5)
    assert np.array_equal(_ours(x, name), ref)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q3_K", "Q4_K", "Q6_K"])
def test_threads_do_not_change_bytes(inputs, name, monkeypatch):
    """Slices dealt to the codec pool's threads (three lanes, small slices so that every lane
    gets several, ragged last slice) give llama.cpp's bytes, and the pool did take part (the
    suite otherwise runs on one torch thread, where no slice leaves the calling thread; a pool
    thread may run two lanes one after the other)."""
    import threading

    x = np.concatenate([inputs["fuzz_rows"][:37], inputs["edge_rows"]])
    ref = ggml_ref.ref_quantize(x, name)
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 256 * 5)
    monkeypatch.setattr(common, "CPU_PARALLEL_ELEMENTS", 256)
    monkeypatch.setattr(common, "CPU_PARALLEL_ELEMENTS_SEARCH", 256)
    lanes = set()
    real_get = qg.get

    def spying_get(type_name):
        t = real_get(type_name)
        inner = t.quantize_blocks.__wrapped__

        def spy(blocks):
            lanes.add(threading.current_thread().name)
            return inner(blocks)
        search = t.name.endswith("_K")
        return qg.GGMLType(t.name, t.block_size, t.type_size,
                           common.sliced(spy, search=search), t.dequantize_blocks)
    monkeypatch.setattr(qg, "get", spying_get)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = _ours(x, name)
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(got, ref)
    assert threading.current_thread().name in lanes and len(lanes) >= 2, lanes


@pytest.mark.parametrize("name", TYPES + ["IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("threads", [1, 2])
def test_extreme_weights_quantize_silently(name, threads, monkeypatch):
    """Weights near float32's limit overflow C's sums of squares and products silently: the
    codecs give llama.cpp's bytes and print no NumPy RuntimeWarning (common.quiet_floats),
    on the calling thread and on the codec pool's (their NumPy error state is their own)."""
    x = (np.random.default_rng(5).standard_normal((40, 256)) * 1e30).astype(np.float32)
    x[::3, :64] *= 1e6
    ref = ggml_ref.ref_quantize(x, name)
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 256 * 8)
    monkeypatch.setattr(common, "CPU_PARALLEL_ELEMENTS", 256)
    monkeypatch.setattr(common, "CPU_PARALLEL_ELEMENTS_SEARCH", 256)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _ours(x, name)
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("default", [torch.float16, torch.float64])
def test_codecs_do_not_depend_on_the_default_dtype(inputs, default):
    """The codecs' work buffers are float32 whatever torch's default dtype is (transformers
    sets it, process-wide, while it builds a model, e.g. in another thread)."""
    x = inputs["edge_rows"]
    refs = {name: ggml_ref.ref_quantize(x, name) for name in ("Q4_0", "Q8_0", "Q3_K", "Q4_K", "Q6_K")}
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = {name: _ours(x, name) for name in refs}
    finally:
        torch.set_default_dtype(before)
    for name in refs:
        assert np.array_equal(got[name], refs[name]), name


def test_thread_counts_are_per_thread():
    """single_threaded_ops in one thread leaves another thread's torch thread count alone
    (torch's count is per thread), also while it is held."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    held, release, seen = threading.Event(), threading.Event(), []

    def other():
        with common.single_threaded_ops() as was:
            seen.append((was, torch.get_num_threads()))
            held.set()
            release.wait(10)
    try:
        t = threading.Thread(target=other)
        t.start()
        held.wait(10)
        seen.append(torch.get_num_threads())
        with common.single_threaded_ops() as was:
            with common.single_threaded_ops() as inner:     # nested: the outermost count
                seen.append((was, inner, torch.get_num_threads()))
        seen.append(torch.get_num_threads())
        release.set()
        t.join()
    finally:
        torch.set_num_threads(before)
    assert seen[1:] == [2, (2, 2, 1), 2] and seen[0][1] == 1


def test_roundf_small_is_c_roundf():
    """Q8_0's two-pass roundf (``common.roundf_small``) == C's roundf (round half away from
    zero, computed exactly in float64) on the float32 neighbourhoods (+-3000 ulps) of every
    integer and half-integer of magnitude below ROUNDF_SMALL (256), both signs, and on random
    values."""
    top = np.float32(common.ROUNDF_SMALL)
    pts = np.arange(0, top + 0.5, 0.5, dtype=np.float32)
    bits = pts.view(np.int32)[:, None] + np.arange(-3000, 3001, dtype=np.int32)
    bits = bits[(bits >= 0) & (bits < top.view(np.int32))]
    r = np.random.default_rng(5)
    x = np.concatenate([bits.view(np.float32), r.uniform(0, top, 100_000).astype(np.float32)])
    x = np.concatenate([x, -x])
    ref = np.copysign(np.floor(np.abs(x.astype(np.float64)) + 0.5), x).astype(np.float32)
    ours = common.roundf_small(torch.from_numpy(x)).numpy()
    assert np.array_equal(ours, ref)


# ----------------------------------------------------------------------------- dequantize

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", ["fp16_rows", "edge_rows", "fuzz_rows"])
def test_dequantize_matches_gguf_py(inputs, name, kind):
    """Our dequantize == gguf-py's numpy dequantize, bit for bit, on the same bytes
    (llama.cpp's bytes)."""
    x = inputs[kind]
    raw = ggml_ref.ref_quantize(x, name)
    ours = qg.dequantize(torch.from_numpy(raw), name).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overflow in huge rows is part of the format
        theirs = gguf_quants.dequantize(raw, GGMLQuantizationType[name])
    assert _same_bits(ours, theirs.astype(np.float32))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", ["fp16_rows", "edge_rows", "fuzz_rows"])
def test_dequantize_matches_llamacpp(inputs, name, kind):
    x = inputs[kind]
    raw = ggml_ref.ref_quantize(x, name)
    ours = qg.dequantize(torch.from_numpy(raw), name).numpy()
    assert _same_bits(ours, ggml_ref.ref_dequantize(raw, name))


@pytest.mark.parametrize("name", TYPES + ["IQ4_NL", "IQ4_XS"])
def test_dequantize_arbitrary_bytes(name):
    """Random bytes (every bit pattern of scales and quants, NaN/inf fp16 scales included)
    dequantize exactly as llama.cpp's to_float."""
    t = qg.get(name)
    raw = np.random.default_rng(5).integers(0, 256, (64, 4 * t.type_size), dtype=np.uint8)
    ours = qg.dequantize(torch.from_numpy(raw), name).numpy()
    ref = ggml_ref.ref_dequantize(raw, name)
    assert np.array_equal(np.isnan(ours), np.isnan(ref))
    finite = ~np.isnan(ref)
    assert np.array_equal(ours[finite].view(np.uint32), ref[finite].view(np.uint32))


# ----------------------------------------------------------------------------- API

@pytest.mark.parametrize("name", TYPES)
def test_shapes_and_errors(name):
    t = qg.get(name)
    x = torch.randn(2, 3, 512)
    raw = qg.quantize(x, name)
    assert raw.shape == (2, 3, 512 // t.block_size * t.type_size) and raw.dtype == torch.uint8
    y = qg.dequantize(raw, name)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert torch.equal(qg.quantize(x.half(), name), qg.quantize(x.half().float(), name))
    with pytest.raises(ValueError):
        qg.quantize(torch.randn(4, t.block_size + 16), name)
    with pytest.raises(ValueError):
        qg.dequantize(torch.zeros(4, t.type_size + 1, dtype=torch.uint8), name)


@pytest.mark.parametrize("name", TYPES)
def test_round_trip_error_is_small(name):
    """Sanity on the meaning of the bytes: relative RMS error of a Gaussian row is modest
    and shrinks with the bit width (independent of the reference)."""
    x = torch.randn(8, 4096, generator=torch.Generator().manual_seed(0))
    err = (qg.dequantize(qg.quantize(x, name), name) - x).pow(2).mean().sqrt().item()
    limit = {"Q2_K": 0.45, "Q3_K": 0.25, "Q4_0": 0.15, "Q4_1": 0.15, "Q4_K": 0.12,
             "Q5_0": 0.07, "Q5_1": 0.07, "Q5_K": 0.06, "Q6_K": 0.03, "Q8_0": 0.01}[name]
    assert err < limit, err


@pytest.mark.parametrize("from_first", [False, True])
def test_seq_sum0_adds_in_c_order(from_first):
    """common.seq_sum0 == C's ``s = 0; for (i...) s += p[i]`` (``from_first``: ``s = p[0]``
    then i from 1), bit for bit and with the sign of zero, on values spread over 40 binary
    orders of magnitude (where any other order of the adds rounds differently), on both of
    its paths (numpy's reduce from SEQ_SUM_NUMPY_MIN sums up, the loop of adds below) and
    on shapes where numpy would reduce along the fast axis (one column) or the input is not
    contiguous. The reference adds one numpy float32 scalar at a time."""
    r = np.random.default_rng(11)
    shapes = [(1, 70), (2, 64), (9, 1), (32, 1), (16, 63), (16, 64), (17, 2, 33), (32, 3, 700),
              (33, 8192), (256, 65)]
    cases = []
    for shape in shapes:
        a = (r.standard_normal(shape) * np.exp(r.uniform(-14, 14, shape))).astype(np.float32)
        cases.append(torch.from_numpy(a))
    zeros = torch.full((5, 80), -0.0)            # C's +0 start: a sum of -0.0 is +0
    zeros[1:, 40:] = 0.0                         # (from_first: -0 where every term is -0)
    cases += [zeros, cases[-1].t()]              # the last: a transposed (strided) view
    for p in cases:
        flat = p.contiguous().numpy().reshape(p.shape[0], -1)
        ref = np.empty(flat.shape[1], dtype=np.float32)
        for j in range(flat.shape[1]):
            s = flat[0, j] if from_first else np.float32(0.0)
            for i in range(1 if from_first else 0, flat.shape[0]):
                s = np.float32(s + flat[i, j])
            ref[j] = s
        got = common.seq_sum0(p, from_first=from_first)
        out = torch.empty(p.shape[1:])
        into = common.seq_sum0(p, out, from_first=from_first)
        assert into.data_ptr() == out.data_ptr()
        for g in (got, out):
            assert np.array_equal(g.numpy().reshape(-1).view(np.int32), ref.view(np.int32)), p.shape


def test_first_absmax_ties_and_zero_sign():
    """C keeps the first element of strictly largest |x|, +0.0 for all-zero, never NaN."""
    x = torch.tensor([[0.5, -0.5, 0.1], [-0.0, 0.0, -0.0], [float("nan"), -2.0, 2.0]])
    for dim, xx in ((1, x), (0, x.T.contiguous())):
        m, a = common.first_absmax(xx, dim)
        assert m.tolist() == [0.5, 0.0, -2.0] and a.tolist() == [0.5, 0.0, 2.0]
        assert not torch.signbit(m[1])


def _scan_rows() -> torch.Tensor:
    """Rows of 32 that make the extremes' shortcuts fall back: ties of +a and -a in either
    order, zeros of both signs (alone and beside others), NaN, +-inf, all +0, all -0, all-NaN."""
    r = torch.Generator().manual_seed(11)
    x = (torch.randn(600, 32, generator=r) * 0.02).round(decimals=2)    # many ties
    x[0::9, 4], x[0::9, 20] = 0.5, -0.5
    x[1::9, 4], x[1::9, 20] = -0.5, 0.5
    x[2::9] = x[2::9].abs()
    x[2::9, 7], x[2::9, 3] = 0.0, -0.0
    x[3::9] = -x[3::9].abs()
    x[3::9, 1], x[3::9, 2] = -0.0, 0.0
    x[4::9, 5] = float("nan")
    x[5::9, 9], x[5::9, 30] = float("inf"), -float("inf")
    x[6::9] = -0.0
    x[15::18] = 0.0
    x[7::9, 0::2] = 0.0
    x[8::9] = float("nan")
    return x


def test_block_extremes_are_c_scans():
    """The legacy codecs' extremes from amax/amin (argmax only where they cannot tell the
    element) are C's scans: first_absmax along the last axis is ``if (|x| > amax)`` from 0
    (NaN never taken); _first_min_max is ``if (v < min) / if (v > max)`` from +-FLT_MAX on
    rows without NaN (non-finite weights are refused before the codecs), signs of zero kept.
    first_absmax along the first axis (the K- and i-quants' positions-first sub-blocks) gives
    the same on the transposed rows."""
    from quantpress.quantize.ggml import legacy

    x = _scan_rows()
    m, a = common.first_absmax(x, 1)
    m0, a0 = common.first_absmax(x.t().contiguous(), 0)
    mt, at = common._first_absmax_by_argmax(x, 1)                   # the path off the CPU
    mt0, at0 = common._first_absmax_by_argmax(x.t().contiguous(), 0)
    mn, mx = legacy._first_min_max(x)
    mnt, mxt = legacy._first_min_max_torch(x, x.amin(1), x.amax(1))
    for i, row in enumerate(x.tolist()):
        amax, best = 0.0, 0.0
        for v in row:
            if abs(v) > amax:
                amax, best = abs(v), v
        for got, got_a in ((m, a), (m0, a0), (mt, at), (mt0, at0)):
            assert got_a[i].item() == amax and got[i].item() == best
            assert math.copysign(1, got[i].item()) == math.copysign(1, best), (i, row)
            assert math.copysign(1, got_a[i].item()) == 1.0, (i, row)
        if any(v != v for v in row):
            continue
        lo, hi = 3.4028234663852886e38, -3.4028234663852886e38
        for v in row:
            if v < lo:
                lo = v
            if v > hi:
                hi = v
        for a_lo, a_hi in ((mn, mx), (mnt, mxt)):
            assert (a_lo[i, 0].item(), a_hi[i, 0].item()) == (lo, hi), (i, row)
            assert math.copysign(1, a_lo[i, 0].item()) == math.copysign(1, lo)
            assert math.copysign(1, a_hi[i, 0].item()) == math.copysign(1, hi)


def _sqrtf_inputs() -> torch.Tensor:
    """Random bit patterns over every non-negative float32 (subnormals, the largest, +inf),
    and zeros of both signs, NaN, powers of two, the smallest normal and subnormal."""
    bits = torch.randint(0, 0x7F800001, (1 << 20,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    edges = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45, 3.4028235e38, 4.0, 2.0, 1.0,
                          0.25, 1.17549435e-38, 1.1754942e-38])
    return torch.cat([bits.view(torch.float32), edges])


def test_sqrtf_is_correctly_rounded():
    """sqrtf (NumPy's float32 root on the CPU) and sqrtf_checked (torch's float64 root with
    the exact midpoint checks, the path off the CPU) agree bit for bit on every kind of
    float32: two independent ways to the correctly rounded root; and with a float64 root
    made wrong by up to 2**-30 relative (so that the float32 candidate misrounds), the
    checks still give that result."""
    x = _sqrtf_inputs()
    want = common.sqrtf(x).numpy().view(np.int32)
    assert np.array_equal(common.sqrtf_checked(x).numpy().view(np.int32), want)
    assert np.array_equal(common.sqrtf(x[::3]).numpy().view(np.int32), want[::3])    # strided input
    real = torch.sqrt
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    off = lambda t: real(t) * (1 + (noise - 0.5) * 2.0 ** -29) if t.dtype == torch.float64 else real(t)
    wrong = off(x.to(torch.float64)).to(torch.float32).numpy().view(np.int32)
    assert (wrong != want).sum() > 1000      # the candidates the checks must move
    torch.sqrt = off
    try:
        got = common.sqrtf_checked(x)
    finally:
        torch.sqrt = real
    assert np.array_equal(got.numpy().view(np.int32), want)


def test_exact_helpers():
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1e9, float("nan"), float("inf"), -4194303.0])
    assert common.nearest_int(v).tolist() == [0, 2, 2, 0, -2, 3238696, 0, -4194304, -4194303]
    q = torch.rand(100_000, generator=torch.Generator().manual_seed(1)) * 1e-3
    assert np.array_equal(common.sqrtf(q).numpy(), np.sqrt(q.numpy()))
    a = torch.randn(100_000, generator=torch.Generator().manual_seed(2))
    assert np.array_equal(common.fdiv(63.0, a).numpy(), np.float32(63.0) / a.numpy())
