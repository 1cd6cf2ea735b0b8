"""IQ4_NL / IQ4_XS codecs (quantize/ggml/iquants.py) against llama.cpp itself.

Reference bytes come from llama.cpp's ``ggml_quantize_chunk`` (libggml-base of the
installed llama-cpp-python 0.3.36, through tests/ggml_ref.py), without an importance matrix
and with one; dequantization is checked against llama.cpp's ``to_float`` and against
gguf-py's independent numpy implementation. Nothing is hard-coded: every expectation is
computed by the reference on the same input.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

import ggml_ref
import quantpress.quantize.ggml as qg
from quantpress.quantize.ggml import common, iquants

TYPES = ["IQ4_NL", "IQ4_XS"]

pytestmark = pytest.mark.skipif(not ggml_ref.available(), reason="llama.cpp's libggml-base not installed")


# ----------------------------------------------------------------------------- inputs

def _random_rows() -> np.ndarray:
    """192 x 4096 float32 rows: Gaussian / heavy-tailed / one-signed / uniform at scales
    1e-6 .. 1e4, per-row scales and outlier columns."""
    r = np.random.default_rng(7)
    rows = []
    for scale in (1e-6, 1e-3, 0.02, 1.0, 30.0, 1e4):
        rows.append(r.normal(0.0, scale, (16, 4096)))
        rows.append(r.standard_t(3, (8, 4096)) * scale)
        rows.append(r.normal(scale, scale / 4, (4, 4096)))
        rows.append(r.uniform(-scale, scale, (4, 4096)))
    x = np.concatenate(rows)
    x *= 10.0 ** r.uniform(-1, 1, (x.shape[0], 1))
    x[:, r.choice(4096, 24, replace=False)] *= 20.0
    return x.astype(np.float32)


def _fp16_rows() -> np.ndarray:
    """256 x 1024 rows of N(0, 0.02^2) rounded through float16 (typical checkpoint weights)."""
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(256, 1024, generator=g) * 0.02).half().float().numpy()


def _tie_block(r: np.random.Generator, n: int, top: float) -> np.ndarray:
    """Blocks of 32 whose first element is ``top`` (+-127 or 113) and the others grid values
    and midpoints between neighbouring grid values: with ``id = (itry - 127)/max`` of
    magnitude 1 (itry = 0) the scaled values land exactly on best_index_int8's ties."""
    kv = np.array(iquants.KVALUES_IQ4NL, dtype=np.float64)
    cand = np.concatenate([kv, (kv[1:] + kv[:-1]) / 2])
    v = r.choice(cand, n) * r.choice([-1.0, 1.0], n)
    v = np.clip(v, -abs(top) + 1, abs(top) - 1)
    v[::32] = top
    return v


def _edge_rows() -> np.ndarray:
    """Rows of 256 (one IQ4_XS super-block, eight IQ4_NL blocks) that hit the special cases."""
    r = np.random.default_rng(3)
    n = 256
    blocks_of = np.repeat(np.arange(8), 32)
    rows = [
        np.zeros(n),                                                    # all zero
        np.where(r.random(n) < 0.5, -0.0, 0.0),                         # signed zeros
        np.where(blocks_of % 2 == 0, 0.0, r.normal(0, 1, n)),           # all-zero sub-blocks
        np.where(blocks_of == 5, r.normal(0, 1, n), 0.0),               # one live sub-block
        r.normal(0, 1e-16, n), np.full(n, 9e-16), np.full(n, -1e-15),   # below / at GROUP_MAX_EPS
        np.where(blocks_of < 4, r.normal(0, 1e-16, n), r.normal(0, 1, n)),
        np.where(blocks_of < 4, 2e-15, 1e-16) * r.choice([-1, 1], n),   # tiny, just above eps
        np.where(np.arange(n) == 37, 5.0, 0.0),                         # single value
        np.where(np.arange(n) == 100, -3e4, r.normal(0, 0.02, n)),      # single huge value
        np.where(np.arange(n) == 200, 1e12, r.normal(0, 1, n)),         # huger (w*q*x overflows)
        np.where(np.arange(n) % 32 == 0, 1.0, r.normal(0, 0.02, n)),    # outlier per block
        np.full(n, 0.5), np.full(n, -0.25), np.full(n, 3.0),            # all equal
        -np.abs(r.normal(0, 1, n)), np.abs(r.normal(0, 1, n)),          # one-signed
        -np.abs(r.standard_t(2, n)),
        -np.abs(r.normal(0, 1e-14, n)) - 2e-15, np.abs(r.normal(0, 1e-14, n)) + 2e-15,  # tiny one-signed
        np.full(n, 1e-30), r.normal(0, 1e-39, n),                       # tiny / subnormal
        r.normal(0, 1e16, n), r.normal(0, 1e30, n), r.normal(0, 1e37, n),  # squares overflow
        np.where(r.random(n) < 0.1, 1e20, 1e-20) * r.choice([-1, 1], n),
        r.normal(0, 1, n) * np.repeat(10.0 ** np.arange(-8, 8), 16),    # magnitude per half-block
        _tie_block(r, n, -127.0), _tie_block(r, n, 127.0), _tie_block(r, n, 113.0),
        _tie_block(r, n, -127.0) / 64, _tie_block(r, n, 127.0) * 1024,
        np.tile(np.array(iquants.KVALUES_IQ4NL, dtype=float), n // 16),  # on the grid
        r.integers(-8, 8, n) * 0.125, (r.integers(-40, 40, n) + 0.5) * 0.01,
        np.tile([0.3, -0.3], n // 2), np.tile([-0.3, 0.3, 0.1, -0.2], n // 4),
        np.where(r.random(n) < 0.5, 1.0, -1.0), np.where(r.random(n) < 0.5, 2.0, 1.0),
        np.where(r.random(n) < 0.05, r.normal(0, 1, n), 0.0),           # sparse
        np.linspace(-1, 1, n), np.linspace(0, 1, n),
    ]
    return np.stack(rows).astype(np.float32)


INPUTS = {
    "random_rows": _random_rows,
    "fp16_rows": _fp16_rows,
    "edge_rows": _edge_rows,
    "fuzz_rows": lambda: ggml_ref.fuzz_rows(11, 256),
}


def _imatrix(kind: str, n: int) -> np.ndarray | None:
    """None, or float32 [n] importance: ``wide`` random positive over 12 decades, ``zeros``
    with a third of the columns 0 (and whole 32-blocks 0), ``flat`` all ones, ``extreme``
    1e-44 .. 1e30 (subnormal weights, products that underflow to signed zeros)."""
    if kind == "none":
        return None
    r = np.random.default_rng(n)
    if kind == "wide":
        return (10.0 ** r.uniform(-6, 6, n)).astype(np.float32)
    if kind == "zeros":
        im = r.gamma(0.5, 1.0, n) * (r.random(n) < 0.66)
        im[np.arange(n) // 32 % 5 == 3] = 0.0
        return im.astype(np.float32)
    if kind == "extreme":
        return (10.0 ** r.uniform(-44, 30, n)).astype(np.float32)
    return np.ones(n, dtype=np.float32)


@pytest.fixture(scope="module")
def inputs() -> dict[str, np.ndarray]:
    return {k: f() for k, f in INPUTS.items()}


def _ours(x: np.ndarray, name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    im = None if imatrix is None else torch.from_numpy(imatrix)
    return qg.quantize(torch.from_numpy(x), name, im).numpy()


def _mismatched_blocks(a: np.ndarray, b: np.ndarray, type_size: int) -> np.ndarray:
    return np.nonzero((a.reshape(-1, type_size) != b.reshape(-1, type_size)).any(1))[0]


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ----------------------------------------------------------------------------- quantize

@pytest.mark.parametrize("imatrix", ["none", "wide", "zeros", "flat", "extreme"])
@pytest.mark.parametrize("kind", list(INPUTS))
@pytest.mark.parametrize("name", TYPES)
def test_quantize_matches_llamacpp(inputs, name, kind, imatrix):
    x = inputs[kind]
    im = _imatrix(imatrix, x.shape[1])
    ref = ggml_ref.ref_quantize(x, name, imatrix=im)
    ours = _ours(x, name, im)
    assert ours.shape == ref.shape and ours.dtype == np.uint8
    ts = qg.get(name).type_size
    bad = _mismatched_blocks(ours, ref, ts)
    assert bad.size == 0, f"{name}/{kind}/{imatrix}: {bad.size} of {ref.size // ts} blocks differ, first {bad[:8]}"


@pytest.mark.parametrize("name", TYPES)
def test_column_widths(name):
    """Rows of 256 .. 4096 columns (several super-blocks per row, imatrix per column)."""
    r = np.random.default_rng(21)
    for n in (256, 768, 2048, 4096):
        x = (r.normal(0, 1, (48, n)) * 10.0 ** r.uniform(-3, 2, (48, 1))).astype(np.float32)
        for im in (None, _imatrix("wide", n)):
            assert np.array_equal(_ours(x, name, im), ggml_ref.ref_quantize(x, name, imatrix=im)), (n, im is None)


@pytest.mark.parametrize("name", TYPES)
def test_slicing_does_not_change_bytes(inputs, name, monkeypatch):
    """The CPU slicing into cache-sized pieces (including a ragged last slice) is invisible,
    with and without imatrix."""
    x = inputs["fuzz_rows"][:37]
    im = _imatrix("wide", x.shape[1])
    ref, ref_w = ggml_ref.ref_quantize(x, name), ggml_ref.ref_quantize(x, name, imatrix=im)
    monkeypatch.setattr(common, "CPU_SLICE_ELEMENTS", 256 * 5)
    assert np.array_equal(_ours(x, name), ref)
    assert np.array_equal(_ours(x, name, im), ref_w)


@pytest.mark.parametrize("name", TYPES)
def test_underflowing_products_keep_c_zero_signs(name):
    """Tiny one-signed blocks with tiny importances: every w*q*x underflows to a zero of the
    same sign while sumq2 > 0; C's sums start at +0.0, so the scale is +0.0, not -0.0."""
    r = np.random.default_rng(1)
    mag = np.abs(r.normal(0, 1e-14, (8, 512))) + 2e-15
    x = np.concatenate([-mag, mag, -mag * 1e3]).astype(np.float32)
    for e in (-20, -25, -30, -32, -35, -40):
        im = np.full(512, 10.0 ** e, dtype=np.float32)
        assert np.array_equal(_ours(x, name, im), ggml_ref.ref_quantize(x, name, imatrix=im)), e


@pytest.mark.parametrize("name", TYPES)
def test_non_finite_input_does_not_raise(name):
    """inf / NaN inputs (outside the format's domain) quantize without error; on CPU the
    bytes even follow C's IEEE propagation."""
    x = np.random.default_rng(0).normal(0, 1, (4, 512)).astype(np.float32)
    x[0, 3], x[1, 300], x[2, 7], x[3] = np.inf, np.nan, -np.inf, np.nan
    for im in (None, np.ones(512, np.float32)):
        assert np.array_equal(_ours(x, name, im), ggml_ref.ref_quantize(x, name, imatrix=im))


def test_best_index_int8_matches_c_search():
    """Vectorized best_index_int8 == C's clamp + binary search + float32 tie-break, on dense
    float32 neighbourhoods of every grid value and midpoint, random values, and the ends."""
    valf = np.array(iquants.KVALUES_IQ4NL, dtype=np.float32)
    pts = np.concatenate([valf, (valf[1:] + valf[:-1]) / 2, [0.0, -0.0]]).astype(np.float32)
    bits = pts.view(np.int32)[:, None] + np.arange(-2000, 2001, dtype=np.int32)
    r = np.random.default_rng(0)
    x = np.concatenate([
        bits.view(np.float32).ravel(), -bits.view(np.float32).ravel(),
        r.uniform(-140, 140, 200_000).astype(np.float32),
        (r.normal(0, 1, 10_000) * 10.0 ** r.uniform(-45, 38, 10_000)).astype(np.float32),
        np.array([np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, -1e-45], dtype=np.float32),
    ]).astype(np.float32)
    with np.errstate(invalid="ignore"):
        mu = np.searchsorted(valf, x, side="right").clip(1, 15)
        c = np.where((x - valf[mu - 1]) < (valf[mu] - x), mu - 1, mu)
        ref = np.where(x <= valf[0], 0, np.where(x >= valf[15], 15, c))
    ours = iquants.best_index_int8(torch.from_numpy(x)).numpy()
    assert np.array_equal(ours, ref)


# ----------------------------------------------------------------------------- dequantize

@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("kind", ["fp16_rows", "edge_rows", "fuzz_rows"])
def test_dequantize_matches_llamacpp_and_gguf_py(inputs, name, kind):
    """Our dequantize == llama.cpp's to_float == gguf-py's numpy dequantize, bit for bit, on
    llama.cpp's bytes (with and without imatrix)."""
    x = inputs[kind]
    for im in (None, _imatrix("wide", x.shape[1])):
        raw = ggml_ref.ref_quantize(x, name, imatrix=im)
        ours = qg.dequantize(torch.from_numpy(raw), name).numpy()
        assert _same_bits(ours, ggml_ref.ref_dequantize(raw, name))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # overflow in huge rows is part of the format
            theirs = gguf_quants.dequantize(raw, GGMLQuantizationType[name])
        assert _same_bits(ours, theirs.astype(np.float32))


# ----------------------------------------------------------------------------- API

@pytest.mark.parametrize("name", TYPES)
def test_registry_facts(name):
    t = qg.get(name)
    assert (t.block_size, t.type_size) == GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    assert (t.block_size, t.type_size) == {"IQ4_NL": (32, 18), "IQ4_XS": (256, 136)}[name]
    assert t.quantize_blocks_weighted is not None and not t.needs_imatrix
    assert not t.weighted_uses_row_sigma2
    assert t.type_id == int(GGMLQuantizationType[name])


@pytest.mark.parametrize("name", TYPES)
def test_shapes_and_round_trip(name):
    t = qg.get(name)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(0))
    raw = qg.quantize(x, name)
    assert raw.shape == (2, 3, 512 // t.block_size * t.type_size) and raw.dtype == torch.uint8
    y = qg.dequantize(raw, name)
    assert y.shape == x.shape and y.dtype == torch.float32
    err = (y - x).pow(2).mean().sqrt().item()
    assert err < 0.12, err                    # 4.25 / 4.5 bits per weight
    assert torch.equal(qg.quantize(x.half(), name), qg.quantize(x.half().float(), name))
    with pytest.raises(ValueError):
        qg.quantize(torch.randn(4, 512), name, torch.ones(256))
    with pytest.raises(ValueError):
        qg.dequantize(torch.zeros(4, t.type_size + 1, dtype=torch.uint8), name)
