"""AWQ math (quantize/awq.py) against independent computations: the fp16 group quantizer
against a numpy float16 transcription of AutoAWQ 0.2.9's ``pseudo_quantize_tensor``
(``awq/quantize/quantizer.py``), the GEMM packing (``WQLinear_GEMM.from_linear``) against
bit arithmetic on Python ints and the reference dequantization (convert/awq_dir.py, after
``awq/utils/packing_utils.py`` ``dequantize_gemm``), the scale grid (``_search_best_scale``)
and the clipping search (``_compute_best_clip``) against straightforward loop versions."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from quantpress.convert import awq_dir
from quantpress.quantize import awq


def _weights(out=64, cin=256, seed=0, outliers=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cin, generator=g) * 0.05
    if outliers:
        w[torch.rand(out, cin, generator=g) < 0.01] *= 20
    w[0, :64] = 0.0  # an all-zero group
    w[1, :64] = 0.25  # a constant group
    return w.half()


def _np_pseudo_quantize(w: np.ndarray, bits: int, gs: int):
    """AutoAWQ 0.2.9's pseudo-quantization (``awq/quantize/quantizer.py``
    ``pseudo_quantize_tensor``) in numpy float16 (every operation rounded to float16;
    w/scale overflows to inf in a constant group, as in torch)."""
    g = w.reshape(-1, gs).astype(np.float16)
    mx = g.max(axis=1, keepdims=True)
    mn = g.min(axis=1, keepdims=True)
    max_int = np.float16(2 ** bits - 1)
    scale = np.maximum(mx - mn, np.float16(1e-5)).astype(np.float16) / max_int
    with np.errstate(over="ignore"):
        zero = np.clip(-np.round(mn / scale), 0, max_int).astype(np.float16)
        q = np.clip(np.round(g / scale) + zero, 0, max_int).astype(np.float16)
    return ((q - zero) * scale).astype(np.float16).reshape(w.shape), q, scale, zero


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_pseudo_quantize_equals_spec_in_numpy_float16(gs):
    w = _weights(cin=256)
    r = awq.pseudo_quantize(w, 4, gs)
    w_fq, q, scale, zero = _np_pseudo_quantize(w.numpy(), 4, gs)
    assert np.array_equal(r.w_fq.numpy().view(np.uint16), w_fq.view(np.uint16))
    assert np.array_equal(r.q.numpy().reshape(-1, gs), q.astype(np.uint8))
    assert np.array_equal(r.scales.numpy().reshape(-1), scale.reshape(-1))
    assert np.array_equal(r.zeros.numpy().reshape(-1), zero.reshape(-1).astype(np.uint8))
    assert r.q.max() <= 15 and r.zeros.max() <= 15 and bool((r.scales > 0).all())
    # each value within half a step of the original (rows 2.. : the range covers the group;
    # row 1's constant group is AutoAWQ's degenerate case, scale = fp16(1e-5)/15, all q = 15)
    err = (r.w_fq.float() - w.float()).abs()[2:].reshape(-1, gs)
    assert bool((err <= r.scales[2:].float().reshape(-1, 1) * 0.5 + 1e-3).all())
    assert torch.equal(r.q[1, :64], torch.full((64,), 15, dtype=torch.uint8))


def test_pseudo_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="float16"):
        awq.pseudo_quantize(torch.zeros(8, 64), 4, 64)
    with pytest.raises(ValueError, match="not a multiple of group_size 64"):
        awq.pseudo_quantize(torch.zeros(8, 96, dtype=torch.float16), 4, 64)
    w = torch.zeros(8, 64, dtype=torch.float16)
    w[3, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        awq.pseudo_quantize(w, 4, 64)


def test_pack_order_on_python_ints():
    """Nibble k of int32 column c holds logical column 8c + [0,2,4,6,1,3,5,7][k] (AutoAWQ
    0.2.9 ``AWQ_ORDER``, ``awq/utils/packing_utils.py``)."""
    g = torch.Generator().manual_seed(1)
    v = torch.randint(0, 16, (5, 24), generator=g, dtype=torch.uint8)
    p = awq.pack_int4(v)
    assert p.dtype == torch.int32 and p.shape == (5, 3)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    for r in range(5):
        for c in range(3):
            word = sum(int(v[r, 8 * c + order[k]]) << (4 * k) for k in range(8))
            assert int(p[r, c]) & 0xFFFFFFFF == word
    assert torch.equal(awq_dir.unpack_awq_int4(p), v.to(torch.int16))


@pytest.mark.parametrize("gs", [32, 64, 128])
def test_reference_dequantization_is_bitwise_the_fake_quant(gs):
    w = _weights(out=96, cin=384, seed=gs)
    r = awq.pseudo_quantize(w, 4, gs)
    t = awq.pack_gemm(r)
    assert t["qweight"].shape == (384, 12) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (384 // gs, 12) and t["qzeros"].dtype == torch.int32
    assert t["scales"].shape == (384 // gs, 96) and t["scales"].dtype == torch.float16
    deq = awq_dir.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], gs)
    assert torch.equal(deq.view(torch.int16), r.w_fq.view(torch.int16))
    with pytest.raises(ValueError, match="inconsistent AWQ shapes"):
        awq_dir.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], gs * 2)


def test_grid_scales_follow_the_formula():
    g = torch.Generator().manual_seed(2)
    x_mean = (torch.rand(128, generator=g) * 3 + 0.01).half()
    w_mean = (torch.rand(128, generator=g) * 0.9 + 0.05).half()
    for r, duo in [(0.0, True), (0.35, True), (0.5, False), (0.95, False)]:
        s = awq.grid_scales(x_mean, w_mean, r, duo).double()
        xm, wm = x_mean.double(), w_mean.double()
        raw = (xm ** r / (wm ** (1 - r) + 1e-4)) if duo else xm ** r
        raw = raw.clamp(min=1e-4)
        expect = raw / (raw.max() * raw.min()).sqrt()
        assert torch.allclose(s, expect, rtol=4e-3), (r, duo)
        assert float(s.max() * s.min()) == pytest.approx(1.0, rel=1e-2)
    # duo at r = 0 is 1 / (w_mean + 1e-4), not the identity
    assert not torch.allclose(awq.grid_scales(x_mean, w_mean, 0.0, True).float(), torch.ones(128), atol=0.05)
    assert torch.equal(awq.grid_scales(x_mean, w_mean, 0.0, False), torch.ones(128, dtype=torch.float16))


def test_weight_mean_matches_definition():
    ws = [_weights(out=32, cin=128, seed=3), _weights(out=16, cin=128, seed=4)]
    m = awq.weight_mean(ws, 64).double()
    w = torch.cat(ws).double()
    rows = w.reshape(-1, 64).abs()
    expect = (rows / (rows.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    assert torch.allclose(m, expect, atol=2e-3)


def test_output_loss_with_scratch_is_the_same_loss():
    """The search's form of the loss (its candidate output and a float64 scratch reused) equals
    the loss of the definition, Σ(y0 − y)² / numel in float64, and the plain form bit for bit."""
    g = torch.Generator().manual_seed(5)
    y0 = torch.randn(4, 96, 80, generator=g) * 3
    y = y0 + torch.randn(4, 96, 80, generator=g) * 0.01
    plain = awq.output_loss(y0, y)
    assert plain == pytest.approx(float(((y0.double() - y.double()) ** 2).mean()), rel=1e-6)
    ptr, y_before = y.data_ptr(), y.clone()
    scratch = torch.empty(y.shape, dtype=torch.float64)
    assert awq.output_loss(y0, y, scratch) == plain
    assert y.data_ptr() == ptr and torch.equal(y, (y0 - y_before).pow(2))  # storage reused
    assert torch.equal(scratch, y.double())
    # other dtypes keep y and take differences in float32, as the plain form
    yh = y_before.half()
    assert awq.output_loss(y0, yh, scratch) == awq.output_loss(y0, yh.clone())
    assert torch.equal(yh, y_before.half())


def test_slice_sums_bound_the_loss_and_the_total_is_the_same():
    """A candidate scored slice by slice (``squared_errors`` per slice into one scratch, then
    the scratch's sum) gets ``output_loss``'s value bit for bit, and every running sum of the
    slices stays at or below it (what makes pruning on the running sum exact)."""
    g = torch.Generator().manual_seed(6)
    y0 = torch.randn(6, 40, 48, generator=g) * 2
    y = y0 + torch.randn(6, 40, 48, generator=g) * 0.05
    whole = awq.output_loss(y0, y.clone())
    for dtype in (torch.float32, torch.float16):
        yc = y.to(dtype, copy=True)
        scratch = torch.empty(y.shape, dtype=torch.float64)
        running = 0.0
        for a in range(0, 6, 2):
            running += awq.squared_errors(y0[a:a + 2], yc[a:a + 2], scratch[a:a + 2])
            assert running <= float(scratch[:a + 2].sum()) * (1 + 1e-12)
        total = float(scratch.sum()) / y.numel()
        assert total == awq.output_loss(y0, y.to(dtype).clone())
        assert running / y.numel() == pytest.approx(total, rel=1e-12)
    assert float(scratch.sum()) / y.numel() != whole  # float16 outputs do score differently


def test_gram_form_of_a_linears_loss():
    """``linear_output_loss(ΔW, XᵀX)`` equals the output form Σ(x·Wᵀ − x·W'ᵀ)² / numel of
    the same linear on the same inputs (with a bias, which cancels) to float32 rounding, for
    float32 and float16 inputs (the Gram matrix accumulated over several slices)."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(48, 96, generator=g) * 0.1
    wq = w + torch.randn(48, 96, generator=g) * 0.003
    b = torch.randn(48, generator=g)
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(5, 70, 96, generator=g) * 3).to(dtype)
        gram = awq.input_gram(x, slice_tokens=64)
        xd = x.double().reshape(-1, 96)
        assert torch.allclose(gram.double(), xd.T @ xd, rtol=1e-5, atol=1e-3)
        exact = float(((xd @ (w.double() - wq.double()).T) ** 2).mean())
        got = awq.linear_output_loss(wq - w, gram, 350)
        assert got == pytest.approx(exact, rel=1e-5)
        fwd = awq.output_loss(torch.nn.functional.linear(x.float(), w, b),
                              torch.nn.functional.linear(x.float(), wq, b))
        assert got == pytest.approx(fwd, rel=1e-4)


def test_best_clip_equals_loop_version():
    """The batched search picks, per (row, group), the candidate a direct loop over candidates,
    rows and groups picks (AutoAWQ 0.2.9 ``_compute_best_clip``), with the loop's own float32
    partial sums."""
    out, cin, gs = 24, 256, 64
    w = _weights(out=out, cin=cin, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(700, cin, generator=g) * (torch.rand(cin, generator=g) * 4)
    got = awq.best_clip(w, x, 4, gs, max_elements=5000)  # forces several row slices
    xs = x[:: max(1, 700 // 512)].float()
    for o in range(out):
        for gi in range(cin // gs):
            wg = w[o, gi * gs:(gi + 1) * gs]
            xg = xs[:, gi * gs:(gi + 1) * gs]
            org = xg @ wg.float()
            mx = wg.abs().max()
            best_err, best_m = float("inf"), None
            for i in range(10):
                m = mx * (1 - i / 20)
                q = awq.pseudo_quantize(torch.clamp(wg, -m, m).reshape(1, gs), 4, gs).w_fq[0]
                err = float(((xg @ q.float()) - org).pow(2).mean())
                if err < best_err * (1 - 1e-6):
                    best_err, best_m = err, m
                elif err < best_err:  # a float32 near-tie: either candidate is acceptable
                    best_m = torch.stack([best_m, m])
            assert bool((got[o, gi] == best_m).any()), (o, gi)
    clipped = awq.apply_clip(w, got, gs)
    assert bool((clipped.float().abs().reshape(out, -1, gs) <= got.float().unsqueeze(-1)).all())
