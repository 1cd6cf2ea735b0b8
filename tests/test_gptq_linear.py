"""quantize/gptq_linear.py: GPTQ of one linear for GPTQ checkpoints.

* (a) against a plain textbook GPTQ written here (float64, every row's error applied to all
  later rows at once, no blocking, group parameters from the error-updated rows with the same
  :func:`find_params`), symmetric and asymmetric, with and without act-order, for group sizes
  32, 128 and −1: the codes agree on ≥ 99% of the entries and the output error ‖(W − Wq)X‖ is
  within 1%; the same bounds reject the reference without error feedback;
* (b) the fake-quantized weight is ``scales[g_idx]·(codes − zeros[g_idx])`` in float16 bit for
  bit, and the groups, zero points and act-order permutation follow the definitions;
* (c) bad input raises ValueError naming the problem.
"""
from __future__ import annotations

import math

import pytest
import torch

from quantpress.quantize.gptq_linear import block_rows, find_params, gptq_quantize_linear

#: least share of codes equal to the reference's and largest relative difference of the output
#: error (float32 blocked against float64 unblocked: codes differ only where W/s lies within
#: ~1e-6 of a rounding boundary). Measured on CASES: ≥ 99.9% equal codes, error ratio ≤ 1.00006;
#: the reference without error feedback: 66-88% equal codes, error ratio 0.28-0.72.
MIN_CODE_AGREEMENT = 0.99
MAX_ERROR_RATIO = 1.01


def _data(K: int, N: int, n: int, seed: int):
    """Correlated activations X float32 [n, K], H = XᵀX/n, a float16 weight [N, K] with a few
    outlier inputs and one dead input (zero activations)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, K // 8, generator=g) @ torch.randn(K // 8, K, generator=g) / math.sqrt(K // 8)
    x = (z + 0.3 * torch.randn(n, K, generator=g)) * torch.rand(K, generator=g).add_(0.1)
    x[:, 5] = 0.0
    w = torch.randn(N, K, generator=g) * 0.02
    w[:, torch.randperm(K, generator=g)[:4]] *= 8.0
    return x, x.T @ x / n, w.to(torch.float16)


def textbook(w: torch.Tensor, H: torch.Tensor, bits: int, gs: int, sym: bool, act_order: bool,
             damp: float = 0.01, feedback: bool = True):
    """GPTQ as written in the paper, in float64 on W [N, K]: after each input column, its
    error (divided by U[c, c]) is applied to every later column. Returns codes [K, N] and the
    fake-quantized weight [N, K] float64, both in the original input order."""
    W = w.double().clone()
    H = H.double().clone()
    N, K = W.shape
    gs = K if gs == -1 else gs
    dead = torch.diagonal(H) == 0
    torch.diagonal(H)[dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diagonal(H), descending=True, stable=True) if act_order else torch.arange(K)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.diagonal(H).mean() * torch.eye(K, dtype=torch.float64)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(K, N, dtype=torch.int64)
    Q = torch.zeros_like(W)
    for c in range(K):
        if c % gs == 0:
            s16, zero = find_params(W[:, c:c + gs].T.float(), bits, sym)
            s = s16.double()
            zero = zero.double()
        q = torch.clamp(torch.round(W[:, c] / s) + zero, 0, 2 ** bits - 1)
        codes[c] = q.long()
        Q[:, c] = (s * (q - zero)).half().double()
        if feedback:
            e = (W[:, c] - Q[:, c]) / U[c, c]
            W[:, c + 1:] -= e[:, None] * U[c, c + 1:][None, :]
    inv = torch.argsort(perm)
    return codes[inv], Q[:, inv]


CASES = [(4, 128, True, False), (4, 128, True, True), (4, 32, False, False), (4, 32, True, True),
         (8, -1, True, False), (4, 64, False, True), (2, 128, False, False)]


@pytest.mark.parametrize("bits,gs,sym,act", CASES)
def test_against_textbook_gptq(bits, gs, sym, act):
    K, N = 256, 96
    x, H, w = _data(K, N, 512, seed=bits * 100 + abs(gs) + 7 * sym + 3 * act)
    r = gptq_quantize_linear(w, H, bits=bits, group_size=gs, sym=sym, act_order=act)
    codes, Q = textbook(w, H, bits, gs, sym, act)
    agree = float((r.codes.long() == codes).float().mean())
    err = float(torch.linalg.norm((w.double() - r.weight.double()) @ x.double().T))
    err_ref = float(torch.linalg.norm((w.double() - Q) @ x.double().T))
    msg = f"codes agree {agree:.5f}, error ratio {err / err_ref:.6f}"
    assert agree >= MIN_CODE_AGREEMENT, msg
    assert abs(err / err_ref - 1.0) <= MAX_ERROR_RATIO - 1.0, msg
    # GPTQ beats round-to-nearest with the same groups on the calibration activations
    rtn = gptq_quantize_linear(w, None, bits=bits, group_size=gs, sym=sym)
    err_rtn = float(torch.linalg.norm((w.double() - rtn.weight.double()) @ x.double().T))
    assert err < 0.9 * err_rtn, f"{msg}; rtn error {err_rtn:.4g} vs gptq {err:.4g}"


def test_bounds_reject_gptq_without_error_feedback():
    K, N = 256, 96
    x, H, w = _data(K, N, 512, seed=3)
    r = gptq_quantize_linear(w, H, bits=4, group_size=128, sym=True)
    codes, Q = textbook(w, H, 4, 128, True, False, feedback=False)
    agree = float((r.codes.long() == codes).float().mean())
    err = float(torch.linalg.norm((w.double() - r.weight.double()) @ x.double().T))
    err_ref = float(torch.linalg.norm((w.double() - Q) @ x.double().T))
    assert agree < MIN_CODE_AGREEMENT or abs(err / err_ref - 1.0) > MAX_ERROR_RATIO - 1.0


@pytest.mark.parametrize("bits,gs,sym,act", CASES)
def test_fake_quant_is_the_checkpoint_dequantization(bits, gs, sym, act):
    K, N = 256, 64
    _, H, w = _data(K, N, 256, seed=11)
    r = gptq_quantize_linear(w, H, bits=bits, group_size=gs, sym=sym, act_order=act)
    G = 1 if gs == -1 else K // gs
    assert r.codes.shape == (K, N) and r.codes.dtype == torch.uint8
    assert r.scales.shape == (G, N) and r.scales.dtype == torch.float16
    assert r.zeros.shape == (G, N) and r.g_idx.shape == (K,) and r.g_idx.dtype == torch.int32
    assert int(r.codes.max()) <= 2 ** bits - 1
    if sym:
        assert bool((r.zeros == 2 ** (bits - 1)).all())
    g = r.g_idx.long()
    deq = (r.scales[g].float() * (r.codes.float() - r.zeros[g].float())).half().T
    assert torch.equal(deq.view(torch.int16), r.weight.view(torch.int16))
    # act-order: rows quantized by descending diag(H); groups are runs of that order
    d = torch.diagonal(H).clone()
    d[d == 0] = 1.0
    if act:
        assert torch.equal(r.perm, torch.argsort(d, descending=True, stable=True))
    else:
        assert torch.equal(r.perm, torch.arange(K))
    gsz = K if gs == -1 else gs
    assert torch.equal(g[r.perm], torch.arange(K) // gsz)
    # the dead input's column is zero
    assert bool((r.weight[:, 5] == 0).all())


def test_block_rows_keep_groups_exact():
    assert block_rows(32, 4096) == 128 and block_rows(256, 4096) == 128
    assert block_rows(4096, 4096) == 128
    assert block_rows(96, 4608) == 96 and block_rows(48, 4608) == 96 and block_rows(192, 4608) == 192


def test_bad_input():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="does not divide"):
        gptq_quantize_linear(w, None, group_size=48)
    with pytest.raises(ValueError, match="bits 3"):
        gptq_quantize_linear(w, None, bits=3, group_size=32)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        gptq_quantize_linear(w, None, group_size=32)
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq_quantize_linear(torch.randn(8, 64), torch.eye(32), group_size=32)


@pytest.mark.parametrize("bits,gs,sym,act", CASES)
def test_round_to_nearest_path_equals_the_loop_with_identity_feedback(bits, gs, sym, act):
    """hessian=None takes a vectorized path; it must equal the row loop run with a diagonal
    factor (no error feedback) bit for bit."""
    from quantpress.quantize.gptq_linear import HessianFactor

    K, N = 256, 64
    _, H, w = _data(K, N, 256, seed=5)
    fast = gptq_quantize_linear(w, None, bits=bits, group_size=gs, sym=sym)
    eye = HessianFactor(torch.zeros(K, dtype=torch.bool), torch.arange(K), torch.eye(K), 0.01, K)
    loop = gptq_quantize_linear(w, None, bits=bits, group_size=gs, sym=sym, factor=eye)
    assert torch.equal(fast.codes, loop.codes) and torch.equal(fast.zeros, loop.zeros)
    assert torch.equal(fast.scales.view(torch.int16), loop.scales.view(torch.int16))
    assert torch.equal(fast.weight.view(torch.int16), loop.weight.view(torch.int16))
