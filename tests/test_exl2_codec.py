"""EXL2 codec (quantize/exl2.py, quantize/gptq.py) against exllamav2 0.3.2.

* option tables and bit costs: exllamav2's own ``conversion/qparams.py``, loaded from the
  0.3.2 wheel by file (the package ``__init__`` JIT-builds CUDA); the bits per weight its
  ``QParams.total_bits`` gives for Llama-3-8B shapes;
* packing: bitstreams and scale nibbles rebuilt here with Python integers;
* reconstruction: equals the quantizer's fake-quant weights bit for bit for every option;
* the kernel-constraint checker; GPTQ vs round-to-nearest; act-order; the scale search.
"""
from __future__ import annotations

import importlib.util
import math
import zipfile

import pytest
import torch

from quantpress import assets
from quantpress.quantize import exl2
from quantpress.quantize.exl2 import QParams
from quantpress.quantize.gptq import find_params, gptq_quantize, hessian_inverse_factor

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HEAD_BITS = (2, 3, 4, 5, 6, 8)

# (K, N) = (in_features, out_features)
LLAMA3_8B_ATTN = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096)}
LLAMA3_8B_MLP = {"gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
SMOL_ATTN = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576)}
SMOL_MLP = {"gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}

# bits per weight exllamav2 0.3.2's `QParams.total_bits` gives for Llama-3-8B shapes
# (`qparams_attn`, `qparams_mlp`; `qparams_headoptions` on a 4096 x 128256 head)
SPEC_ATTN_BPW = [2.138, 2.199, 2.283, 2.677, 3.169, 3.170, 4.044, 4.047, 4.082, 4.138, 4.170, 4.190,
                 4.274, 4.329, 5.256, 5.329, 6.044, 6.338, 8.044]
SPEC_MLP_BPW = [2.245, 2.323, 2.596, 2.912, 3.283, 3.366, 3.619, 4.137, 4.198, 4.266, 4.348, 5.249,
                5.331, 6.071, 6.303, 6.869, 8.035]
SPEC_HEAD_BPW = {2: 2.73, 3: 3.28, 4: 4.44, 5: 5.19, 6: 6.34, 8: 8.03}


# ---------------------------------------------------------------------------------------------
# exllamav2's own qparams.py
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """exllamav2 0.3.2 ``conversion/qparams.py`` imported as a lone module (it needs only
    ``math``), from the wheel the default calibration text also comes from."""
    dl = assets.cache_root() / "dl"
    wheels = sorted(dl.glob("exllamav2-0.3.2-*.whl")) if dl.exists() else []
    if not wheels:
        wheels = [assets.pip_download(assets.EXLLAMAV2_WHEEL, dl)]
    src = tmp_path_factory.mktemp("exllamav2_ref") / "qparams.py"
    with zipfile.ZipFile(wheels[0]) as z:
        src.write_bytes(z.read("exllamav2/conversion/qparams.py"))
    spec = importlib.util.spec_from_file_location("exllamav2_qparams_ref", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same(ours: QParams, theirs) -> bool:
    return (list(ours.bits) == list(theirs.bits)
            and list(ours.bits_prop) == [float(p) for p in theirs.bits_prop]
            and dict(zip(ours.bits, ours.group_size)) == theirs.group_size
            and ours.scale_bits == theirs.scale_bits)


def test_option_tables_equal_upstream(upstream):
    ours_a, ours_m = exl2.attn_options(), exl2.mlp_options()
    assert len(ours_a) == len(upstream.qparams_attn) == 19
    assert len(ours_m) == len(upstream.qparams_mlp) == 17
    for i, (o, u) in enumerate(zip(ours_a, upstream.qparams_attn)):
        assert list(o) == list(ATTN)
        for name, uq in zip(ATTN, u):
            assert _same(o[name], uq), (i, name, str(o[name]), repr(uq))
    for i, (o, u) in enumerate(zip(ours_m, upstream.qparams_mlp)):
        assert list(o) == list(MLP)
        for name, uq in zip(MLP, u):
            assert _same(o[name], uq), (i, name, str(o[name]), repr(uq))
    assert sorted(upstream.qparams_headoptions) == list(HEAD_BITS)
    for b in HEAD_BITS:
        assert _same(exl2.head_options(b), upstream.qparams_headoptions[b]), b


def _all_qparams() -> list[QParams]:
    seen: dict[QParams, None] = {}
    for opt in exl2.attn_options() + exl2.mlp_options():
        for qp in opt.values():
            seen.setdefault(qp)
    for b in HEAD_BITS:
        seen.setdefault(exl2.head_options(b))
    return list(seen)


COST_SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256), (576, 576),
               (576, 192), (576, 1536), (1536, 576), (576, 49152), (5120, 640), (200, 96), (100, 33),
               (8192, 28672), (64, 32), (1, 7)]


def test_bits_cost_equals_upstream(upstream):
    n = 0
    for qp in _all_qparams():
        theirs = upstream.QParams(dict(zip(qp.bits, qp.group_size)), list(qp.bits), list(qp.bits_prop),
                                  qp.scale_bits)
        for K, N in COST_SHAPES:
            assert exl2.bits_cost(qp, K, N) == theirs.total_bits((K, N)), (str(qp), K, N)
            assert exl2.bits_cost(qp, K, N, bias=True) == theirs.total_bits((K, N), (N,)), (str(qp), K, N)
            assert exl2.bpw(qp, K, N) == pytest.approx(theirs.bpw((K, N)), rel=1e-12)
            n += 1
    assert n == len(_all_qparams()) * len(COST_SHAPES)
    # a setting upstream rejects (rows left over) is rejected here too
    short = upstream.QParams(64, [4, 3], [0.5, 0.3], 4)
    with pytest.raises(AssertionError):
        short.total_bits((4096, 4096))
    with pytest.raises(ValueError, match="left unallocated"):
        exl2.bits_cost(QParams(64, [4, 3], [0.5, 0.3]), 4096, 4096)


def _module_bpw(option: dict[str, QParams], shapes: dict[str, tuple[int, int]]) -> float:
    return (sum(exl2.bits_cost(qp, *shapes[name]) for name, qp in option.items())
            / sum(k * n for k, n in shapes.values()))


def test_bpw_columns_of_the_spec():
    attn = [round(_module_bpw(o, LLAMA3_8B_ATTN), 3) for o in exl2.attn_options()]
    mlp = [round(_module_bpw(o, LLAMA3_8B_MLP), 3) for o in exl2.mlp_options()]
    assert attn == SPEC_ATTN_BPW
    assert mlp == SPEC_MLP_BPW
    for b, want in SPEC_HEAD_BPW.items():
        assert round(exl2.bpw(exl2.head_options(b), 4096, 128256), 2) == want
    assert round(exl2.bpw(exl2.head_options(6), 576, 49152), 2) == 6.48      # SmolLM2 head
    # SmolLM2 ranges and the non-monotone pairs (attn 5 < 4, 11 < 10)
    a = [_module_bpw(o, SMOL_ATTN) for o in exl2.attn_options()]
    m = [_module_bpw(o, SMOL_MLP) for o in exl2.mlp_options()]
    assert (round(min(a), 2), round(max(a), 2)) == (2.26, 8.12)
    assert (round(min(m), 2), round(max(m), 2)) == (2.32, 8.07)
    assert a[5] < a[4] and a[11] < a[10]


def test_row_allocation_layout():
    for qp in _all_qparams():
        for K in (576, 1536, 200, 4096, 100):
            groups = qp.groups(K)
            counts = qp.group_counts(K)
            assert len(groups) == sum(counts)
            assert groups[0].start == 0 and groups[-1].end == K
            assert all(g1.end == g2.start for g1, g2 in zip(groups, groups[1:]))
            assert [g.bits for g in groups] == sorted((g.bits for g in groups), reverse=True)
            gs = dict(zip(qp.bits, qp.group_size))
            assert all(g.rows == gs[g.bits] for g in groups[:-1])
            assert 0 < groups[-1].rows <= gs[groups[-1].bits]
    # `QParams.total_bits`'s row allocation by hand: 6/3/2 (.05/.2/.75) g32/64/64 on K=576
    qp = exl2.mlp_options()[0]["down_proj"]
    n6 = math.ceil(576 * 0.05 / 32)                              # 1  -> rem 544
    n3 = math.ceil(min(576 * 0.2, 576 - 32 * n6) / 64)          # 2  -> rem 416
    n2 = math.ceil(min(576 * 0.75, 576 - 32 * n6 - 64 * n3) / 64)  # 7
    assert qp.group_counts(576) == (n6, n3, n2)


def test_qparams_validation_and_dicts():
    qp = QParams({"8": 32, "4": 128}, [8, 4], [0.05, 0.95])
    assert qp.group_size == (32, 128) and str(qp) == "8/4 (.05/.95) g32/128"
    assert QParams.from_dict(qp.as_dict()) == qp
    assert qp.as_dict() == {"group_size": {"8": 32, "4": 128}, "bits": [8, 4],
                            "bits_prop": [0.05, 0.95], "scale_bits": 4}
    assert QParams([64, 64], [3, 2], [0.1, 0.9]) == QParams(64, [3, 2], [0.1, 0.9])
    bad = [
        (lambda: QParams(64, [3, 4], [0.5, 0.5]), "descending"),
        (lambda: QParams(64, [7], [1.0]), "not supported"),
        (lambda: QParams(64, [4, 3], [1.0]), "bits_prop"),
        (lambda: QParams(0, [4], [1.0]), "positive"),
        (lambda: QParams(64, [4], [1.0], scale_bits=6), "scale_bits"),
        (lambda: QParams({4: 64}, [4, 3], [0.5, 0.5]), "keys"),
        (lambda: QParams(64, [4], [0.0]), r"\(0, 1\]"),
        (lambda: QParams(64, [4, 3], [0.5, 0.3]).groups(4096), "left unallocated"),
        (lambda: QParams([128, 32], [4, 3], [0.5, 0.5]).groups(40), "negative|-2 groups"),
        (lambda: QParams(64, [4], [1.0]).groups(0), "in_features"),
        (lambda: exl2.bits_cost(QParams(64, [4], [1.0]), 64, 0), "out_features"),
        (lambda: exl2.head_options(7), "head bits"),
        (lambda: QParams.from_dict({"bits": [4], "bits_prop": [1.0]}), "group_size"),
    ]
    for make, msg in bad:
        with pytest.raises(ValueError, match=msg):
            make()


# ---------------------------------------------------------------------------------------------
# Bitstream and scale layout on hand-built codes (exllamav2 0.3.2
# `exllamav2_ext/cuda/pack_tensor.cu`), decoded independently
# ---------------------------------------------------------------------------------------------

def _hand_built(bits: int, K: int, N: int, gs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qp = QParams(gs, [bits], [1.0])
    G = len(qp.groups(K))
    q = torch.randint(0, 1 << bits, (K, N), generator=g, dtype=torch.int64)
    qs = torch.randint(1, 17, (G, N), generator=g, dtype=torch.int64)
    qsm = (torch.rand(G, generator=g) * 0.01 + 1e-4).to(torch.float16)
    invperm = torch.randperm(K, generator=g)
    return qp, q, qs, qsm, invperm


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_bitstream_layout(bits):
    K, N, gs = 69, 40, 32          # groups of 32, 32 and 5 rows; N padded to 64
    qp, q, qs, qsm, invperm = _hand_built(bits, K, N, gs, seed=bits)
    t = exl2.pack(q, qs, qsm, invperm, qp)
    words_full = 32 * bits // 32    # repeating unit: 32 rows -> `bits` words
    words_last = math.ceil(5 * bits / 32)
    assert t["q_weight"].dtype == torch.int32
    assert tuple(t["q_weight"].shape) == (2 * words_full + words_last, 64)
    assert t["q_groups"].dtype == torch.int16
    assert t["q_groups"].tolist() == [bits, 0, bits, words_full, bits, 2 * words_full]
    assert t["q_invperm"].dtype == torch.int32 and t["q_invperm"].tolist() == invperm.tolist()
    assert t["q_scale_max"].dtype == torch.float16 and torch.equal(t["q_scale_max"], qsm)

    qw = [[w & 0xFFFFFFFF for w in row] for row in t["q_weight"].tolist()]
    codes = q.tolist()
    for n in range(64):
        for start, rows, off in ((0, 32, 0), (32, 32, words_full), (64, 5, 2 * words_full)):
            stream = 0
            for j in range(rows):
                v = codes[start + j][n] if n < N else 1 << (bits - 1)   # padded column: zero point
                stream |= v << (j * bits)
            for i in range(math.ceil(rows * bits / 32)):
                assert qw[off + i][n] == (stream >> (32 * i)) & 0xFFFFFFFF, (n, start, i)

    sc = [[w & 0xFFFFFFFF for w in row] for row in t["q_scale"].tolist()]
    assert tuple(t["q_scale"].shape) == (3, 8)
    scl = qs.tolist()
    for g in range(3):
        for c in range(8):
            want = sum(((scl[g][8 * c + i] - 1) if 8 * c + i < N else 0) << (4 * i) for i in range(8))
            assert sc[g][c] == want


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("N,chunk", [(40, None), (37, 16)])
def test_reconstruct_hand_built(bits, N, chunk, monkeypatch):
    """Decode with fp16 tensor ops here (q_scale_max down to fp16 subnormals); ``chunk``:
    reconstruct's column chunk (columns 0-15, 16-31, 32-36 of 37, padded to 64)."""
    K = 69
    if chunk:
        monkeypatch.setattr(exl2, "RECONSTRUCT_ELEMENTS", K * chunk)
    qp, q, qs, qsm, invperm = _hand_built(bits, K, N, 32, seed=100 + bits)
    qsm = torch.tensor([3e-3, 2e-5, 6.1e-6], dtype=torch.float16)    # x 2^-8: normal, subnormal, tiny
    t = exl2.pack(q, qs, qsm, invperm, qp)
    w = exl2.reconstruct(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"], N)
    assert w.dtype == torch.float16 and tuple(w.shape) == (N, K)
    pre = torch.tensor(2.0 ** -8, dtype=torch.float16)
    group_of_row = torch.tensor([0] * 32 + [1] * 32 + [2] * 5)
    scale = (qs * qs).to(torch.float16) * (qsm * pre)[:, None]       # [G, N], fp16 ops
    assert bool((scale[1:] != 0).any()) and bool((scale.float().abs() < 6.1e-5).any())  # subnormals
    wp = (q - (1 << (bits - 1))).to(torch.float16) * scale[group_of_row]
    want = wp[invperm].T
    assert torch.equal(w.view(torch.int16), want.contiguous().view(torch.int16))


# ---------------------------------------------------------------------------------------------
# Quantizer + packer + reconstruction, every option
# ---------------------------------------------------------------------------------------------

def _hessian(K: int, seed: int, n: int | None = None) -> torch.Tensor:
    """Random positive-definite Hessian XᵀX/n from correlated inputs with uneven energy."""
    g = torch.Generator().manual_seed(seed)
    n = n or 2 * K
    z = torch.randn(n, K // 8, generator=g) @ torch.randn(K // 8, K, generator=g) / math.sqrt(K // 8)
    x = (z + 0.5 * torch.randn(n, K, generator=g)) * torch.rand(K, generator=g).add_(0.1)
    return x.T @ x / n


def _weight(N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, torch.randperm(K, generator=g)[:4]] *= 8.0            # a few outlier inputs
    return w.to(torch.float16)


def _check_roundtrip(w: torch.Tensor, h: torch.Tensor | None, qp: QParams, **kw):
    N, K = w.shape
    r = gptq_quantize(w, h, qp, **kw)
    t = r.pack()
    exl2.check_kernel_constraints(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])
    rec = exl2.reconstruct(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"], N)
    assert r.weight.dtype == torch.float16 and tuple(r.weight.shape) == (N, K)
    assert torch.equal(rec.view(torch.int16), r.weight.view(torch.int16)), str(qp)
    n_pad = -(-N // 32) * 32
    G = len(qp.groups(K))
    assert tuple(t["q_weight"].shape) == (sum(-(-g.rows * g.bits // 32) for g in r.groups), n_pad)
    assert tuple(t["q_scale"].shape) == (G, n_pad // 8) and tuple(t["q_scale_max"].shape) == (G,)
    assert t["q_invperm"].tolist() == torch.argsort(r.perm).tolist()
    if N % 32 == 0 and all(g.rows * g.bits % 32 == 0 for g in r.groups):
        # the stored tensors' size in bits is the `QParams.total_bits` cost
        stored = sum(v.numel() * v.element_size() * 8 for v in t.values())
        assert stored == exl2.bits_cost(qp, K, N), str(qp)
    return r, rec


def _roundtrip_cases():
    """Every distinct setting of both tables and the head options, on SmolLM2-like shapes:
    K=576 (attention, gate/up, head) and K=1536 (down_proj); N cycles over 192, 576 and 200
    (not a multiple of 32), and over 192 and 200 for down_proj. K=576 is not a multiple of
    128, so the g128 settings end on a partial group."""
    cases: dict[QParams, tuple[int, int]] = {}
    for opt in exl2.attn_options() + exl2.mlp_options():
        for name, qp in opt.items():
            if qp in cases:
                continue
            i = len(cases)
            if name == "down_proj":
                cases[qp] = (1536, (192, 200)[i % 2])
            else:
                cases[qp] = (576, (192, 576, 200)[i % 3])
    for b in HEAD_BITS:
        cases.setdefault(exl2.head_options(b), (576, (192, 576, 200)[len(cases) % 3]))
    return [(qp, K, N) for qp, (K, N) in cases.items()]


ROUNDTRIP_CASES = _roundtrip_cases()


@pytest.fixture(scope="module")
def hessians():
    return {576: _hessian(576, 1), 1536: _hessian(1536, 2)}


@pytest.mark.parametrize("qp,K,N", ROUNDTRIP_CASES, ids=[f"{qp}-{K}x{N}" for qp, K, N in ROUNDTRIP_CASES])
def test_roundtrip_every_option(qp, K, N, hessians):
    w = _weight(N, K, seed=K + N + len(qp.bits))
    r, rec = _check_roundtrip(w, hessians[K], qp)
    # the reconstruction is a quantization of w: error bounded by the coarsest step of its width
    err = (rec.float() - w.float()).abs().max().item()
    assert err < w.float().abs().max().item() * 2.0 / (1 << (min(qp.bits) - 1))


def test_every_option_is_covered():
    covered = {qp for qp, _, _ in ROUNDTRIP_CASES}
    for opt in exl2.attn_options() + exl2.mlp_options():
        assert set(opt.values()) <= covered
    assert {exl2.head_options(b) for b in HEAD_BITS} <= covered
    assert any(N % 32 for _, _, N in ROUNDTRIP_CASES)
    assert any(K % max(qp.group_size) for qp, K, _ in ROUNDTRIP_CASES)


def test_roundtrip_odd_shapes_zero_and_tiny_weights():
    # K not a multiple of 32 (packs and reconstructs; the kernel check rejects it), no Hessian
    w = _weight(40, 200, seed=5)
    r = gptq_quantize(w, None, QParams(64, [4, 3], [0.25, 0.75]))
    t = r.pack()
    rec = exl2.reconstruct(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"], 40)
    assert torch.equal(rec.view(torch.int16), r.weight.view(torch.int16))
    with pytest.raises(ValueError, match="multiple"):
        exl2.check_kernel_constraints(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])
    # tiny weights: fp16-subnormal scales; all-zero inputs and outputs: zero scale codes, no NaN
    w = (_weight(64, 256, seed=6).float() * 1e-4).to(torch.float16)
    w[:, 10:80] = 0
    w[5] = 0
    h = _hessian(256, 7)
    for qp in (QParams(32, [8, 4], [0.5, 0.5]), QParams(64, [3, 2], [0.1, 0.9])):
        r, rec = _check_roundtrip(w, h, qp)
        assert bool(torch.isfinite(rec.float()).all())
        assert bool((rec[5] == 0).all())             # an all-zero output stays zero
    assert bool((r.qscale_max.float() * 2 ** -8 < 6.1e-5).any())      # subnormal scales occurred
    r, rec = _check_roundtrip(w, h, QParams(32, [4], [1.0]), rtn=True)
    assert bool((rec[:, 10:80] == 0).all())         # without error feedback zero inputs stay zero
    # whole groups of zeros (identity Hessian keeps index order): q_scale_max 0, scale 0, no NaN
    w = _weight(64, 256, seed=9)
    w[:, :64] = 0
    for rtn in (False, True):
        r, rec = _check_roundtrip(w, None, QParams(32, [4], [1.0]), rtn=rtn)
        assert r.qscale_max[:2].tolist() == [0.0, 0.0] and bool((r.qscale_max[2:] > 0).all())
        assert bool((rec[:, :64] == 0).all()) and bool(torch.isfinite(rec.float()).all())
        assert bool((r.qweight[:64] == 8).all())            # the zero point
    # RTN path packs the same way
    _check_roundtrip(_weight(96, 576, seed=8), None, QParams(128, [6, 5], [0.15, 0.85]), rtn=True)


# ---------------------------------------------------------------------------------------------
# Kernel constraints (exllamav2 0.3.2 `exllamav2_ext/cuda/q_matrix.cu`)
# ---------------------------------------------------------------------------------------------

def _packed(qp: QParams, K: int, N: int, seed: int = 0) -> dict[str, torch.Tensor]:
    _, q, _, _, invperm = _hand_built(8, K, N, K, seed)
    G = len(qp.groups(K))
    g = torch.Generator().manual_seed(seed)
    codes = torch.cat([q[gr.start:gr.end] % (1 << gr.bits) for gr in qp.groups(K)])
    qs = torch.randint(1, 17, (G, N), generator=g)
    return exl2.pack(codes, qs, torch.rand(G, generator=g).to(torch.float16), invperm, qp)


def _check(t: dict[str, torch.Tensor]) -> None:
    exl2.check_kernel_constraints(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"], t["q_invperm"])


def test_kernel_constraints_accept():
    for qp, K in ((QParams(32, [4, 3], [0.5, 0.5]), 64), (QParams(16, [2], [1.0]), 64),
                  (QParams([32, 16], [3, 2], [0.5, 0.5]), 80), (QParams([32, 64, 64], [6, 3, 2], [0.05, 0.2, 0.75]), 576),
                  (QParams(128, [8, 6], [0.15, 0.85]), 576)):
        _check(_packed(qp, K, 40))


def test_kernel_constraints_reject():
    good = _packed(QParams(32, [4, 3], [0.5, 0.5]), 64, 40)
    _check(good)

    def broken(**over):
        t = dict(good)
        t.update(over)
        return t

    qg = good["q_groups"].clone()
    assert qg.tolist() == [4, 0, 3, 4]
    swapped = torch.tensor([3, 0, 4, 3], dtype=torch.int16)        # 3-bit rows before 4-bit rows
    with pytest.raises(ValueError, match="non-increasing"):
        _check(broken(q_groups=swapped))
    with pytest.raises(ValueError, match="multiple of 32"):         # N not padded
        _check(broken(q_weight=good["q_weight"][:, :40].contiguous(), q_scale=good["q_scale"][:, :5].contiguous()))
    with pytest.raises(ValueError, match="q_scale"):
        _check(broken(q_scale=good["q_scale"][:, :4].contiguous()))
    with pytest.raises(ValueError, match="dtype"):
        _check(broken(q_weight=good["q_weight"].to(torch.int64)))
    with pytest.raises(ValueError, match="fit int16"):              # an offset wrapped negative
        _check(broken(q_groups=torch.tensor([4, 0, 3, -32764], dtype=torch.int16)))
    with pytest.raises(ValueError, match="first offset"):
        _check(broken(q_groups=torch.tensor([4, 1, 3, 4], dtype=torch.int16)))
    with pytest.raises(ValueError, match="bits"):
        _check(broken(q_groups=torch.tensor([7, 0, 3, 4], dtype=torch.int16)))
    with pytest.raises(ValueError, match="permutation"):
        _check(broken(q_invperm=torch.zeros(64, dtype=torch.int32)))
    with pytest.raises(ValueError, match=r"q_scale_max"):
        _check(broken(q_scale_max=good["q_scale_max"][:1]))
    # group boundary at row 48 (4-bit groups of 48 rows pack into whole words)
    with pytest.raises(ValueError, match="starts at row 48.*multiples of 32"):
        _check(_packed(QParams(48, [4], [1.0]), 96, 32))
    # 16-row groups are only allowed inside the 2-bit segment
    with pytest.raises(ValueError, match="multiples of 32"):
        _check(_packed(QParams(16, [4], [1.0]), 64, 32))
    # K over 65535
    big = {"q_weight": torch.zeros(16384, 32, dtype=torch.int32), "q_scale": torch.zeros(1, 4, dtype=torch.int32),
           "q_scale_max": torch.ones(1, dtype=torch.float16), "q_groups": torch.tensor([8, 0], dtype=torch.int16),
           "q_invperm": torch.arange(65536, dtype=torch.int32)}
    with pytest.raises(ValueError, match="65535"):
        _check(big)
    big["q_invperm"] = torch.arange(65535, dtype=torch.int32)
    big["q_weight"] = torch.zeros(16384, 32, dtype=torch.int32)       # ceil(65535*8/32) = 16384
    with pytest.raises(ValueError, match="multiple"):                  # 65535 is not a multiple of 32
        _check(big)


def test_pack_rejects_bad_codes():
    qp, q, qs, qsm, invperm = _hand_built(4, 64, 32, 32, seed=3)
    with pytest.raises(ValueError, match="outside"):
        exl2.pack(q + 16, qs, qsm, invperm, qp)
    with pytest.raises(ValueError, match="1..16"):
        exl2.pack(q, qs * 0, qsm, invperm, qp)
    with pytest.raises(ValueError, match="qscale shape"):
        exl2.pack(q, qs[:1], qsm, invperm, qp)
    with pytest.raises(ValueError, match="whole 32-bit words"):      # a 3-bit group of 48 rows
        exl2.pack(q[:, :] % 8, torch.ones(2, 32, dtype=torch.int64), qsm, invperm,
                  QParams(48, [3], [1.0]))


# ---------------------------------------------------------------------------------------------
# The quantizer
# ---------------------------------------------------------------------------------------------

def test_gptq_beats_round_to_nearest():
    g = torch.Generator().manual_seed(11)
    K, N, n = 512, 128, 2048
    # strongly correlated inputs: 32 latent factors + small noise, uneven channel energy
    x = (torch.randn(n, 32, generator=g) @ torch.randn(32, K, generator=g)
         + 0.1 * torch.randn(n, K, generator=g)) * torch.rand(K, generator=g).add_(0.2)
    h = x.T @ x / n
    w = (torch.randn(N, K, generator=g) * 0.02).to(torch.float16)
    y = x @ w.float().T
    for qp in (QParams(64, [3], [1.0]), QParams(128, [4, 3], [0.1, 0.9])):
        gq = gptq_quantize(w, h, qp)
        rtn = gptq_quantize(w, h, qp, rtn=True)
        # the RTN path is plain rounding with its own scales
        wp = w.float().T[rtn.perm]
        for gi, grp in enumerate(rtn.groups):
            z = 1 << (grp.bits - 1)
            s = (rtn.qscale[gi].long() ** 2).to(torch.float16) * (rtn.qscale_max[gi] * torch.tensor(2 ** -8, dtype=torch.float16))
            want = torch.clamp(torch.round(wp[grp.start:grp.end] / s.float()) + z, 0, 2 * z - 1)
            assert torch.equal(rtn.qweight[grp.start:grp.end].long(), want.long())
        e_gptq = (y - x @ gq.weight.float().T).norm().item()
        e_rtn = (y - x @ rtn.weight.float().T).norm().item()
        assert e_gptq < 0.7 * e_rtn, (str(qp), e_gptq, e_rtn)


def test_act_order():
    K = 256
    h = _hessian(K, 21)
    d = torch.diagonal(h)
    r = gptq_quantize(_weight(64, K, 3), h, QParams(32, [8, 4], [0.25, 0.75]))
    assert int(r.perm[0]) == int(torch.argmax(d))
    assert bool((d[r.perm][1:] <= d[r.perm][:-1]).all())
    assert torch.equal(r.invperm, torch.argsort(r.perm))
    # the 8-bit group holds the highest-energy inputs: their columns get the smallest error
    w = _weight(64, K, 3).float()
    err = (r.weight.float() - w).abs().mean(0)
    top, rest = r.perm[:64], r.perm[64:]
    assert err[top].mean() < 0.25 * err[rest].mean()


def test_find_params_scale_search():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=g) * torch.rand(96, generator=g).add_(0.05)
    for bits in (2, 3, 4, 5, 6, 8):
        qs, qmax, scale = find_params(x, bits)
        base = (x.abs().amax(0) + 1e-12) / ((2 ** bits - 1) / 2)
        smax = base.max()
        # the correctly rounded root (quantize/exact_ops.py): float64's, within an ulp, rounded
        want_qs = torch.clamp(torch.round(torch.sqrt((base / smax).double()).float() * 16), 1, 16)
        assert torch.equal(qs.long(), want_qs.long())
        cand = (want_qs / 16) ** 2 * smax
        z = 2 ** (bits - 1)

        # E(p) in float64 for the 97 grid points, written here from exllamav2 0.3.2's
        # `AdaptiveQuantizer.find_params` / `quantize_err_kernel` (`cuda/quantize.cu`)
        grid = torch.tensor([0.70 * (1 - i / 96) + 1.20 * (i / 96) for i in range(97)], dtype=torch.float64)
        s = cand.double()[None, None, :] * grid[:, None, None]
        q = torch.clamp(torch.round(x.double()[None] / s), -z, z - 1)
        errs = ((q * s - x.double()[None]).abs() ** 3.5).sum(dim=(1, 2)).tolist()
        grid = grid.tolist()
        picked = [i for i, p in enumerate(grid) if torch.tensor(smax.item() * p, dtype=torch.float16) == qmax]
        assert picked, bits
        assert min(errs[i] for i in picked) <= min(errs) * (1 + 1e-4), bits
        want_scale = (want_qs * want_qs).to(torch.float16) * (qmax * torch.tensor(1 / 256, dtype=torch.float16))
        assert torch.equal(scale, want_scale)


def test_hessian_damping_and_errors():
    K = 64
    h = _hessian(K, 9)
    u = hessian_inverse_factor(h)
    damped = h + torch.eye(K) * 0.12 * torch.diagonal(h).mean()
    assert torch.allclose(u.T @ u, torch.linalg.inv(damped.double()).float(), rtol=1e-3, atol=1e-5)
    assert torch.equal(u, torch.triu(u))
    # singular (rank-1) Hessian: damping makes it usable
    v = torch.randn(K, 1)
    hessian_inverse_factor(v @ v.T)
    # negative definite: damping can't fix it
    with pytest.raises(ValueError, match="not positive definite"):
        hessian_inverse_factor(-torch.eye(K))
    w = _weight(32, K, 1)
    qp = QParams(32, [4], [1.0])
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq_quantize(w, torch.eye(K + 1), qp)
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize(w, h * float("nan"), qp)
    bad = w.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        gptq_quantize(bad, h, qp)
    with pytest.raises(ValueError, match="2-D"):
        gptq_quantize(w[0], h, qp)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_roundtrip():
    w = _weight(200, 576, 12).cuda()
    h = _hessian(576, 13).cuda()
    for qp in (exl2.head_options(6), exl2.mlp_options()[0]["down_proj"]):
        r, rec = _check_roundtrip(w, h, qp)
        assert rec.is_cuda and r.weight.is_cuda
        cpu = exl2.reconstruct(*(r.pack()[k].cpu() for k in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")), 200)
        assert torch.equal(cpu.view(torch.int16), rec.cpu().view(torch.int16))


def test_pack_by_column_blocks_equals_whole(monkeypatch):
    """pack() packs PACK_COLUMNS output columns at a time (bounded int64 temporaries for a
    large head); blocks that split the columns unevenly, with the 32-column padding in the
    last one, give the same tensors as one block."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 256, generator=g).half()          # N = 200: padded to 224
    qp = QParams(64, [6, 3], [0.3, 0.7])
    res = gptq_quantize(w, None, qp)
    whole = res.pack(torch.randn(200, generator=g).half())
    for cols in (32, 96):
        monkeypatch.setattr(exl2, "PACK_COLUMNS", cols)
        blocks = res.pack(whole["bias"])
        assert set(blocks) == set(whole)
        for k in whole:
            assert blocks[k].dtype == whole[k].dtype and torch.equal(blocks[k], whole[k]), (cols, k)
    assert whole["q_weight"].shape[1] == 224
