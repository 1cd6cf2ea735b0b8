"""ggml codecs with an importance matrix (``quantize_row_<type>_impl``) against llama.cpp.

Reference bytes come from llama.cpp's ``ggml_quantize_chunk(type, ..., imatrix)`` (libggml-base
of the installed llama-cpp-python 0.3.36, through tests/ggml_ref.py). Nothing is hard-coded:
every expectation is computed by the reference on the same input.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ggml_ref
import quantpress.quantize.ggml as qg
from quantpress.quantize.ggml import common, kquants
from test_ggml_codecs import edge_rows

# the codecs reproduce C's silent float overflow: a NumPy RuntimeWarning from them fails a test
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

WEIGHTED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


# ----------------------------------------------------------------------------- inputs

def _random_tensor(seed: int, rows: int, n: int) -> np.ndarray:
    """Rows of several scales (1e-5 .. 1e3 per row), Gaussian and heavy-tailed, some outlier
    columns."""
    r = np.random.default_rng(seed)
    x = np.where(r.random((rows, 1)) < 0.5, r.normal(0, 1, (rows, n)), r.standard_t(3, (rows, n)))
    x *= 10.0 ** r.uniform(-5, 3, (rows, 1))
    x[:, r.choice(n, max(1, n // 128), replace=False)] *= 15.0
    return x.astype(np.float32)


def _imatrix(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """float32 [n] importance vectors: wide dynamic range, with zeros, constant, one huge
    entry, all zero, tiny."""
    r = np.random.default_rng(seed)
    if kind == "lognormal":                         # ~1e-7 .. 1e7
        v = np.exp(r.normal(0, 4, n))
    elif kind == "zeros":                           # scattered zeros and one all-zero run of 256
        v = np.where(r.random(n) < 0.3, 0.0, r.exponential(1.0, n))
        v[(n // 2) // 256 * 256:][:256] = 0.0
    elif kind == "ones":
        v = np.ones(n)
    elif kind == "const":
        v = np.full(n, 3.7e-3)
    elif kind == "huge":                            # one entry whose products overflow
        v = r.uniform(0.5, 2.0, n)
        v[n // 3] = 1e30
    elif kind == "all_zero":
        v = np.zeros(n)
    elif kind == "tiny":                            # subnormal products
        v = r.uniform(0, 1, n) * 1e-38
    elif kind == "subnormal":                       # a few ulps of the smallest subnormal
        v = r.choice([1.4e-45, 2.8e-45, 4.2e-45, 7e-45, 1e-44], n)
    else:
        raise ValueError(kind)
    return v.astype(np.float32)


def _special_rows(n: int = 1024) -> np.ndarray:
    """Rows with all-zero blocks / super-blocks, a single huge weight, all-equal weights."""
    r = np.random.default_rng(21)
    base = r.normal(0, 0.02, (12, n))
    base[0, :32] = 0.0                              # one zero legacy block
    base[1, 256:512] = 0.0                          # one zero super-block
    base[2] = 0.0                                   # zero row
    base[3, 100] = 1e4                              # single huge weight
    base[4] = 0.0
    base[4, 700] = -3.0                             # a single nonzero weight
    base[5, 5] = 3e37                               # squares overflow
    base[6] = 0.5                                   # all equal
    base[7] = -1e-3
    base[8] = np.repeat(r.normal(0, 1, n // 32), 32)  # equal within each block
    base[9] = np.where(np.arange(n) % 2, 0.0, -0.0)  # signed zeros
    base[10] = np.abs(base[10])                     # one-signed with zeros
    base[10, ::7] = 0.0
    base[11] = np.round(base[11] * 400) / 400       # on a coarse grid
    return base.astype(np.float32)


def _ours(x: np.ndarray, name: str, im: np.ndarray | None) -> np.ndarray:
    imt = None if im is None else torch.from_numpy(im)
    return qg.quantize(torch.from_numpy(x), name, imatrix=imt).numpy()


def _check(x: np.ndarray, name: str, im: np.ndarray) -> np.ndarray:
    ref = ggml_ref.ref_quantize(x, name, imatrix=im)
    ours = _ours(x, name, im)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    ts = qg.get(name).type_size
    bad = np.nonzero((ours.reshape(-1, ts) != ref.reshape(-1, ts)).any(1))[0]
    assert bad.size == 0, f"{name}: {bad.size} of {ref.size // ts} blocks differ, first {bad[:8]}"
    return ours


# ----------------------------------------------------------------------------- quantize

@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("shape", [(384, 256), (256, 1024), (192, 4096)])
@pytest.mark.parametrize("im_kind", ["lognormal", "zeros"])
def test_random_tensors_match_llamacpp(name, shape, im_kind):
    x = _random_tensor(shape[1], *shape)
    _check(x, name, _imatrix(im_kind, shape[1], seed=shape[0]))


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("im_kind", ["lognormal", "zeros", "ones", "huge", "all_zero", "tiny"])
def test_edge_rows_match_llamacpp(name, im_kind):
    x = edge_rows()
    _check(x, name, _imatrix(im_kind, x.shape[1], seed=1))


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("im_kind", ["lognormal", "const", "huge"])
def test_special_rows_match_llamacpp(name, im_kind):
    x = _special_rows()
    _check(x, name, _imatrix(im_kind, x.shape[1], seed=2))


@pytest.mark.parametrize("name", WEIGHTED)
@pytest.mark.parametrize("im_kind", ["lognormal", "zeros", "huge"])
def test_fuzz_rows_match_llamacpp(name, im_kind):
    """Magnitudes 1e-40 .. 1e37 with wide imatrices: overflowing weights and scales."""
    x = np.concatenate([ggml_ref.fuzz_rows(13, 192), ggml_ref.fuzz_rows(14, 192)])
    _check(x, name, _imatrix(im_kind, x.shape[1], seed=3))


@pytest.mark.parametrize("name", WEIGHTED)
def test_underflowing_weights(name):
    """Weights of a few subnormal ulps: w*x underflows to zero while w*l*l does not, so
    sums of only zero terms meet nonzero ones (C's sums start at +0: zero scales are +0)."""
    r = np.random.default_rng(9)
    x = np.clip(r.normal(0, 0.15, (96, 256)), -0.45, 0.45).astype(np.float32)
    _check(x, name, _imatrix("subnormal", 256, seed=7))
    _check(x, name, np.full(256, 2.8e-45, dtype=np.float32))


@pytest.mark.parametrize("name", ["Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_integer_rounding_path(name, monkeypatch):
    """The C integer rounding path of make_qkx2_quants and of the requantization (taken
    off-CPU) gives the same bytes."""
    monkeypatch.setattr(kquants, "FAST_ROUNDING_ON_CPU", False)
    x = np.concatenate([edge_rows(), _random_tensor(5, 24, 256)])
    _check(x, name, _imatrix("lognormal", 256, seed=4))


@pytest.mark.parametrize("im_kind", ["lognormal", "zeros", "huge"])
@pytest.mark.parametrize("name", ["Q2_K", "Q4_K", "Q5_K", "Q4_1", "Q6_K"])
def test_numpy_searches_torch_ops(name, im_kind, monkeypatch):
    """make_qp_quants (the weighted scale and min search of Q2_K, Q4_K, Q5_K),
    make_qkx2_quants' acceptance test (those and Q4_1's) and make_qx_quants' (Q6_K's) with
    torch's operations, which other devices run, give llama.cpp's bytes as the NumPy ones the
    CPU runs do (the other tests)."""
    monkeypatch.setattr(kquants, "NUMPY_SEARCHES_ON_CPU", False)
    x = np.concatenate([edge_rows(), _random_tensor(8, 24, 256)])
    _check(x, name, _imatrix(im_kind, 256, seed=6))


@pytest.mark.parametrize("name", ["Q4_0", "Q5_1", "Q4_K", "Q3_K"])
def test_slicing_does_not_change_bytes(name, monkeypatch):
    """CPU slices (a ragged last one included) carry the matching imatrix and row sigma²."""
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 256 * 5)
    x = _random_tensor(6, 9, 1024)
    _check(x, name, _imatrix("lognormal", 1024, seed=5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_sigma2_in_groups_of_rows(dtype, monkeypatch):
    """row_sigma2 on the CPU works in groups of rows (here of 64 rows, the least, and a
    ragged last one): every row's sum is C's sequential float32 sum of x², bit for bit
    (the reference adds one numpy float32 at a time), for float32 and float16 input; and
    the Q5_0 bytes over such groups equal llama.cpp's."""
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 256 * 5)
    r = np.random.default_rng(8)
    x = (r.standard_normal((150, 96)) * np.exp(r.uniform(-6, 6, (150, 96)))).astype(np.float32)
    t = torch.from_numpy(x).to(dtype)
    wide = t.to(torch.float32).numpy()
    ref = np.empty((150, 1), dtype=np.float32)
    for i in range(150):
        s = np.float32(0.0)
        for v in wide[i]:
            s = np.float32(s + np.float32(v * v))
        ref[i, 0] = np.float32(s / np.float32(96))
    got = qg.row_sigma2(t)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy().view(np.int32), ref.view(np.int32))
    _check(_random_tensor(9, 150, 256), "Q5_0", _imatrix("lognormal", 256, seed=6))


# ----------------------------------------------------------------------------- other paths

def test_q8_0_ignores_imatrix():
    x = _random_tensor(7, 16, 512)
    im = _imatrix("lognormal", 512)
    ours = _ours(x, "Q8_0", im)
    assert np.array_equal(ours, _ours(x, "Q8_0", None))
    assert np.array_equal(ours, ggml_ref.ref_quantize(x, "Q8_0", imatrix=im))


@pytest.mark.parametrize("name", WEIGHTED)
def test_round_trip_through_llamacpp_dequantize(name):
    """Our imatrix bytes dequantize identically in llama.cpp and here, and the imatrix-weighted
    error is modest."""
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(0)).numpy()
    im = _imatrix("lognormal", 1024, seed=6)
    raw = _check(x, name, im)
    ref = ggml_ref.ref_dequantize(raw, name)
    ours = qg.dequantize(torch.from_numpy(raw), name).numpy()
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    err = np.sqrt((im * (ref - x) ** 2).sum() / (im * x ** 2).sum())
    assert err < 0.5, err


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K"])
def test_imatrix_shape_and_dtype(name):
    x = torch.from_numpy(_random_tensor(8, 6, 512)).reshape(2, 3, 512)
    im = torch.from_numpy(_imatrix("lognormal", 512))
    out = qg.quantize(x, name, imatrix=im)
    assert out.shape == (2, 3, 512 // qg.get(name).block_size * qg.get(name).type_size)
    assert torch.equal(out, qg.quantize(x, name, imatrix=im.double()))
    assert not torch.equal(out, qg.quantize(x, name))
    with pytest.raises(ValueError):
        qg.quantize(x, name, imatrix=im[:256])


# ----------------------------------------------------------------------------- several tensors

@pytest.mark.parametrize("name", WEIGHTED + ["Q8_0", "IQ4_NL", "IQ4_XS"])
@pytest.mark.parametrize("chunk_blocks", [None, 7])
def test_quantize_many_equals_llamacpp_per_tensor(name, chunk_blocks, monkeypatch):
    """quantize_many: tensors of three widths, float32 and float16, with and without importance
    weights, in one pass (and cut into chunks of 7 blocks, as off the CPU and with weights on
    it, across tensor and row boundaries): each tensor's bytes are llama.cpp's for that
    tensor alone."""
    if chunk_blocks is not None:
        monkeypatch.setattr(qg, "_blocks_per_chunk", lambda nb, bs, device, weighted=False: chunk_blocks)
    xs = [_random_tensor(20, 5, 256), _random_tensor(21, 3, 1024).astype(np.float16),
          edge_rows(), _random_tensor(22, 2, 512)]
    ims = [_imatrix("lognormal", 256, seed=8), None, _imatrix("zeros", xs[2].shape[1], seed=9),
           _imatrix("huge", 512, seed=10)]
    outs = qg.quantize_many([torch.from_numpy(x) for x in xs], name,
                            [None if w is None else torch.from_numpy(w) for w in ims])
    for x, w, out in zip(xs, ims, outs):
        ref = ggml_ref.ref_quantize(x.astype(np.float32), name, imatrix=w)
        assert out.dtype == torch.uint8 and np.array_equal(out.numpy(), ref)
    if qg.get(name).quantize_blocks_weighted is not None:   # Q8_0 ignores importance weights
        with pytest.raises(ValueError, match="imatrix has shape"):
            qg.quantize_many([torch.from_numpy(xs[0])], name, [torch.ones(512)])
    with pytest.raises(ValueError, match="2 imatrices"):
        qg.quantize_many([torch.from_numpy(xs[0])], name, [None, None])
