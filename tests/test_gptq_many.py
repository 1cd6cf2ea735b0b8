"""quantize/gptq.py ``gptq_quantize_many``: one linear under several EXL2 settings at once.

* (a) it equals separate ``gptq_quantize`` runs bit for bit (same code, S = 1), and every
  result reconstructs from its packed tensors bit for bit;
* (b) against a plain textbook GPTQ written here (float64, every row's error applied to all
  later rows at once, no blocking; same :func:`find_params`), the codes agree on ≥ 99% of the
  entries and the output error ‖(W − Wq)X‖ is within 1%; the same bounds reject the reference
  with its error feedback removed or with scales taken from the unupdated rows;
* (c) bad input raises ValueError naming the problem;
* (d) one :func:`hessian_factor` shared by several calls and linears gives the results of
  passing the Hessian, and the scale search's threaded passes leave its sums (and so the
  chosen scales) as single-threaded.
"""
from __future__ import annotations

import math

import pytest
import torch

from quantpress.quantize import exl2
from quantpress.quantize.exl2 import QParams
from quantpress.quantize.ggml.common import single_threaded_ops
from quantpress.quantize.gptq import (PERCDAMP, find_params, gptq_quantize, gptq_quantize_many,
                                      hessian_factor, scale_search_error)

#: (b): least share of codes equal to the reference's, and largest relative difference of the
#: output error. float32 (ours) against float64 (reference) error accumulation moves W[c]/s by
#: ~1e-6 relative, so a code differs only where W[c]/s lies that close to a rounding boundary
#: (and then nudges the later rows a little): measured ≥ 99.97% equal codes and ≤ 1e-4 error
#: difference here. A broken quantizer is far off: without error feedback 73-81% equal codes
#: and 2.6-3x the error; scales from the unupdated rows 79-89%; without the update of the
#: rows after a group 73-82% and 2.2-2.9x; err not divided by U[c,c] 54-65% and 4-6x.
MIN_CODE_AGREEMENT = 0.99
MAX_ERROR_RATIO = 1.01


def _data(K: int, N: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Correlated activations X float32 [n, K] (K/8 latent factors + noise, uneven channel
    energy), H = XᵀX/n float32 [K, K] and a float16 weight [N, K] with a few outlier inputs."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, K // 8, generator=g) @ torch.randn(K // 8, K, generator=g) / math.sqrt(K // 8)
    x = (z + 0.3 * torch.randn(n, K, generator=g)) * torch.rand(K, generator=g).add_(0.1)
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, torch.randperm(K, generator=g)[:4]] *= 8.0
    return x, x.T @ x / n, w.to(torch.float16)


def _same(a, b) -> bool:
    return (torch.equal(a.qweight, b.qweight) and torch.equal(a.qscale, b.qscale)
            and torch.equal(a.qscale_max.view(torch.int16), b.qscale_max.view(torch.int16))
            and torch.equal(a.weight.view(torch.int16), b.weight.view(torch.int16))
            and torch.equal(a.perm, b.perm) and torch.equal(a.invperm, b.invperm)
            and a.qparams == b.qparams and a.groups == b.groups)


def _reconstructs(r) -> bool:
    t = r.pack()
    rec = exl2.reconstruct(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"],
                           t["q_invperm"], r.weight.shape[0])
    return torch.equal(rec.view(torch.int16), r.weight.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# (a) the same results as one call per setting
# ---------------------------------------------------------------------------------------------

def test_many_equals_single_runs():
    # every distinct q_proj setting of the attention table (the measurement's list), plus a
    # repeated one; K=576 (g128 settings end on a partial group), N=200 (not a multiple of 32)
    qps = list(dict.fromkeys(opt["q_proj"] for opt in exl2.attn_options()))
    assert len(qps) == 14
    qps.append(qps[3])
    _, h, w = _data(576, 200, 1024, 1)
    many = gptq_quantize_many(w, h, qps)
    assert len(many) == len(qps)
    for qp, r in zip(qps, many):
        single = gptq_quantize(w, h, qp)
        assert r.qparams == qp
        assert _same(r, single), str(qp)
        assert _reconstructs(r), str(qp)
    assert _same(many[3], many[-1])


def test_many_equals_single_runs_down_proj_and_zero_groups():
    # down_proj settings (K=1536 in SmolLM2; 512 here) on N=96
    qps = list(dict.fromkeys(opt["down_proj"] for opt in exl2.mlp_options()))[:6]
    _, h, w = _data(512, 96, 1024, 2)
    for r, qp in zip(gptq_quantize_many(w, h, qps), qps):
        assert _same(r, gptq_quantize(w, h, qp)), str(qp)
    # all-zero groups (identity Hessian keeps the index order): zero scales in some columns
    # of the stacked matrix while the other settings have none
    w = w.clone()
    w[:, :64] = 0
    qps = [QParams(32, [4], [1.0]), QParams(128, [6, 5], [0.5, 0.5]), QParams(64, [3, 2], [0.25, 0.75])]
    many = gptq_quantize_many(w, None, qps)
    assert many[0].qscale_max[:2].tolist() == [0.0, 0.0]
    for r, qp in zip(many, qps):
        assert _same(r, gptq_quantize(w, None, qp)), str(qp)
        assert _reconstructs(r) and bool(torch.isfinite(r.weight.float()).all())


def test_k_not_a_multiple_of_32():
    # the last 32-row block is partial (K = 200: rows 192..199); group starts stay aligned
    qps = [QParams(32, [4], [1.0]), QParams(64, [4, 3], [0.25, 0.75])]
    _, h, w = _data(200, 48, 512, 3)
    for r, qp in zip(gptq_quantize_many(w, h, qps), qps):
        assert r.groups[-1].end == 200
        assert _same(r, gptq_quantize(w, h, qp)) and _reconstructs(r)


# ---------------------------------------------------------------------------------------------
# (b) against textbook GPTQ
# ---------------------------------------------------------------------------------------------

def _textbook(w: torch.Tensor, h: torch.Tensor, qp: QParams, mode: str = "gptq"):
    """Plain GPTQ with act-order, float64: for each group, :func:`find_params` on its current
    rows, then row by row q = clamp(rint(W[c]/s) + 2^(b−1), 0, 2^b − 1), deq = fp16(q − z)·s,
    err = (W[c] − deq)/U[c,c], W[c+1:] −= U[c, c+1:]ᵀ·err (all later rows at once).

    ``mode`` "nofeedback" drops the update; "stale" takes the scales from the unupdated rows.
    Returns (codes int64 [K, N] in act-order, fake-quantized weight float16 [N, K])."""
    N, K = w.shape
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    W = w.double().T[perm].clone()
    W_orig = W.clone()
    Hp = h.double()[perm][:, perm]
    Hp += torch.eye(K, dtype=torch.float64) * max(PERCDAMP * Hp.diagonal().mean().item(), 1e-5)
    U = torch.linalg.cholesky(torch.linalg.inv(Hp), upper=True)
    codes = torch.empty((K, N), dtype=torch.int64)
    deq = torch.empty((K, N), dtype=torch.float16)
    for g in qp.groups(K):
        _, _, scale = find_params((W_orig if mode == "stale" else W)[g.start:g.end].float(), g.bits)
        z = 1 << (g.bits - 1)
        for c in range(g.start, g.end):
            q = torch.clamp(torch.round(W[c] / scale.double()) + z, 0, 2 * z - 1)
            codes[c] = q.long()
            deq[c] = (q - z).to(torch.float16) * scale
            err = (W[c] - deq[c].double()) / U[c, c]
            if mode != "nofeedback":
                W[c + 1:] -= torch.outer(U[c, c + 1:], err)
    return codes, deq[torch.argsort(perm)].T.contiguous()


def _agreement(x, w, codes, weight, ref_codes, ref_weight) -> tuple[float, float]:
    """(share of equal codes, output error ‖(W − Wq)X‖ / the reference's)."""
    y = x @ w.float().T
    e = (y - x @ weight.float().T).norm().item()
    e_ref = (y - x @ ref_weight.float().T).norm().item()
    return (codes == ref_codes).double().mean().item(), e / e_ref


def test_against_textbook_gptq():
    x, h, w = _data(512, 128, 2048, 0)
    qps = [QParams(128, [4, 3], [0.1, 0.9]), QParams(32, [8, 4], [0.05, 0.95]),
           QParams(64, [3, 2], [0.25, 0.75]), QParams([32, 64, 64], [6, 3, 2], [0.05, 0.2, 0.75])]
    for r, qp in zip(gptq_quantize_many(w, h, qps), qps):
        ref_codes, ref_weight = _textbook(w, h, qp)
        agree, ratio = _agreement(x, w, r.qweight.long(), r.weight, ref_codes, ref_weight)
        assert agree >= MIN_CODE_AGREEMENT, (str(qp), agree)
        assert abs(ratio - 1.0) <= MAX_ERROR_RATIO - 1.0, (str(qp), ratio)


def test_textbook_bounds_reject_broken_gptq():
    # the bounds of test_against_textbook_gptq fail for a quantizer without error feedback
    # and for one that takes its scales from the unupdated rows
    x, h, w = _data(512, 128, 2048, 0)
    for qp in (QParams(128, [4, 3], [0.1, 0.9]), QParams(32, [8, 4], [0.05, 0.95])):
        ref_codes, ref_weight = _textbook(w, h, qp)
        for mode in ("nofeedback", "stale"):
            agree, ratio = _agreement(x, w, *_textbook(w, h, qp, mode), ref_codes, ref_weight)
            assert agree < MIN_CODE_AGREEMENT or abs(ratio - 1.0) > MAX_ERROR_RATIO - 1.0, (mode, agree, ratio)


# ---------------------------------------------------------------------------------------------
# (c) bad input
# ---------------------------------------------------------------------------------------------

def test_bad_input():
    _, h, w = _data(576, 64, 256, 4)
    good = QParams(64, [4, 3], [0.25, 0.75])
    # a group boundary off the 32-row blocks (group sizes 48 and 16): named with its setting
    with pytest.raises(ValueError, match=r"4 g48 at K=576: group 1 starts at row 48, not a multiple of 32"):
        gptq_quantize_many(w, h, [good, QParams(48, [4], [1.0])])
    with pytest.raises(ValueError, match=r"group 1 starts at row 16, not a multiple of 32"):
        gptq_quantize(w, h, QParams(16, [2], [1.0]))
    with pytest.raises(ValueError, match=r"Hessian shape \(608, 608\), expected \(576, 576\)"):
        gptq_quantize_many(w, torch.eye(608), [good])
    with pytest.raises(ValueError, match="Hessian has NaN"):
        gptq_quantize_many(w, h * float("nan"), [good])
    with pytest.raises(ValueError, match="qparams_list is empty"):
        gptq_quantize_many(w, h, [])
    with pytest.raises(ValueError, match="must be QParams"):
        gptq_quantize_many(w, h, [good, good.as_dict()])
    with pytest.raises(ValueError, match="2-D"):
        gptq_quantize_many(w[0], h, [good])
    with pytest.raises(ValueError, match="left unallocated"):
        gptq_quantize_many(w, h, [QParams(64, [4, 3], [0.25, 0.25])])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_many():
    _, h, w = _data(576, 200, 1024, 5)
    qps = list(dict.fromkeys(opt["v_proj"] for opt in exl2.attn_options()))
    many = gptq_quantize_many(w.cuda(), h.cuda(), qps)
    for r, qp in zip(many, qps):
        assert r.weight.is_cuda and _reconstructs(r)
        assert _same(r, gptq_quantize(w.cuda(), h.cuda(), qp)), str(qp)
        cpu = gptq_quantize(w, h, qp)
        # CUDA and CPU round differently in places: nearly all codes agree
        assert (r.qweight.cpu() == cpu.qweight).double().mean().item() > 0.99, str(qp)


# ---------------------------------------------------------------------------------------------
# (d) what the measurement shares: one Hessian factor, the cores in the scale search
# ---------------------------------------------------------------------------------------------

def test_shared_hessian_factor_equals_the_hessian():
    # q/k/v share one Hessian in the EXL2 measurement: one factor for linears of different
    # widths and for every batch of settings gives the results of passing the Hessian each time
    qps = list(dict.fromkeys(opt["k_proj"] for opt in exl2.attn_options()))[:5]
    _, h, w = _data(256, 160, 1024, 6)
    fac = hessian_factor(h, 256)
    assert fac.upper is not None and fac.perm.tolist() == torch.argsort(
        torch.diagonal(h), descending=True, stable=True).tolist()
    for ww in (w, w[:64].flip(0).contiguous()):
        for part in (qps[:2], qps[2:]):
            for r, ref in zip(gptq_quantize_many(ww, fac, part), gptq_quantize_many(ww, h, part)):
                assert _same(r, ref), str(r.qparams)
    rtn = hessian_factor(h, 256, rtn=True)
    assert rtn.upper is None
    assert _same(gptq_quantize(w, rtn, qps[0], rtn=True), gptq_quantize(w, h, qps[0], rtn=True))
    with pytest.raises(ValueError, match=r"factor \(K=256.*does not fit weight \[160, 288\]"):
        gptq_quantize(torch.zeros(160, 288, dtype=torch.float16), fac, qps[0])
    with pytest.raises(ValueError, match="factor absent"):
        gptq_quantize(w, rtn, qps[0])
    with pytest.raises(ValueError, match="percdamp 0.12"):
        gptq_quantize(w, fac, qps[0], percdamp=0.05)
    with pytest.raises(ValueError, match=r"Hessian shape \(255, 255\), expected \(256, 256\)"):
        hessian_factor(h[1:, 1:], 256)


def test_scale_search_threads_leave_the_sums_alone():
    # 128 x 4096 = 2^19 elements: one grid point per chunk, the case where torch.sum split
    # over two threads rounds differently. The scale search's sums are pairwise in one order
    # (exact_ops.tree_sum_): E(p) is the same bit for bit on any thread count.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(128, 4096, generator=g) * 0.02
    cand = x.abs().amax(dim=0) / 7.5
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = scale_search_error(x, cand, 4)
        with single_threaded_ops():
            assert torch.equal(scale_search_error(x, cand, 4, threads=2), ref)
        torch.set_num_threads(2)
        threaded = scale_search_error(x, cand, 4)     # the pairwise sums' adds threaded too
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(threaded, ref)


def test_scale_search_chunking_leaves_the_sums_alone(monkeypatch):
    # the chunk budget (SEARCH_ELEMENTS_CPU) is a speed setting only: every chunking of the 97
    # grid points, from one point per chunk to all in one, gives the same E(p) bit for bit
    # (each E(p) is one whole reduction inside its chunk)
    from quantpress.quantize import gptq
    g = torch.Generator().manual_seed(11)
    x = torch.randn(32, 576, generator=g) * 0.02
    cand = x.abs().amax(dim=0) / 7.5
    saved = torch.get_num_threads()
    outs = []
    try:
        torch.set_num_threads(1)
        for budget in (x.numel(), 1 << 17, 1 << 18, 1 << 19, 1 << 23):
            monkeypatch.setattr(gptq, "SEARCH_ELEMENTS_CPU", budget)
            outs.append(scale_search_error(x, cand, 4))
    finally:
        torch.set_num_threads(saved)
    assert outs[0].shape == (97,) and bool((outs[0] > 0).all())
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
