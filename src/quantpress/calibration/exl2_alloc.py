"""EXL2 bit allocation: one measured option per decoder module under a budget in bits.

Replaces exllamav2 0.3.2 ``conversion/optimize.py`` (simulated annealing in the C++
``sim_anneal``, over a sweep of error norms, then a fill-up pass) by an exact-up-to-rounding
multiple-choice knapsack:

* **slots**: 2 per decoder layer (attention, MLP) in layer order; slot s offers options
  j = 0..m_s−1, each with a cost ``c[s, j]`` (total_bits, int, bits) and an error
  ``e[s, j] = 1 − accuracy`` (float, from measurement.json);
* **budget** ``B = int(numel × bpw)`` bits, numel = the parameter count of the decoder-layer
  modules (:func:`decoder_numel`, :func:`budget_bits`); the embedding and the head are excluded;
* **aggregate** (:func:`allocate`'s ``objective``) ``"sum"``: minimize Σ_s w[s, j_s]^power
  subject to Σ_s c[s, j_s] ≤ B; ``"max"``: minimize max_s w[s, j_s] exactly (bisection over the
  measured values), then, among the options with w ≤ that optimum, minimize Σ w^power as for
  ``"sum"``; w is the error the slots carry.

``quantize exl2 --objective`` (:data:`OBJECTIVE_MODES`):

* ``"content"`` (default): w = err / ρ, power 2, i.e. minimize Σ_s (err_s / ρ_s)², where ρ_s =
  mean_rows(‖y_ref[ordinary tokens]‖ / ‖y_ref‖) is the share of module s's unquantized output
  norm carried by ordinary tokens (:func:`content_slots`,
  :func:`calibration.exl2_measure.content_share`: a token is not ordinary when its norm
  exceeds 4× its row's median token norm). err / ρ ≈ ‖y_q − y_ref‖ / ‖y_ref[ordinary
  tokens]‖;
* ``"sum"``: w = err, power 1 (Σ err, the measured errors as they are);
* ``"max"``: w = err, minimax (exllamav2's stated intent, "minimizes the maximum quantization
  error"; exllamav2 itself anneals Σ err^p with p ∈ [1.5, 3.5] picked for a small max err).

Why ``"content"``. exllamav2's err is relative to ‖y_ref‖_F over all tokens of a row, and in
models with an attention sink one token dominates that norm: in SmolLM2-135M, from layer 11
on, position 0 carries a massive activation (hidden-state norm ≈ 23 850 against ≈ 150 for the
other tokens), so ‖y_ref‖ is 99% that token and every module of layers 11–27 shows
err < 0.01 even at its cheapest option (ρ ≈ 0.1 there, ≈ 0.7–1 before layer 11). Σ err then
starves those layers (2.3–2.4 bpw MLPs at a 4.0 target) although their errors matter as much
once measured against the tokens that carry content. Dividing by ρ restores that scale; the
square follows from the KL divergence being, to second order, a quadratic form in the output
perturbation, with independent module errors adding in quadrature. ρ is not in
measurement.json (its schema stays exllamav2's, so exllamav2's own files work): the pipeline
takes it from the measurement pass, or from one unquantized forward pass over the calibration
rows when a measurement is reused.

Measured (SmolLM2-135M-Instruct, one measurement of 8 × 256 calibration tokens, 4.0 bpw
target, ``quantize eval --ctx 256 --chunks 8``, KL divergence from the FP16 model; the
allocation's error weights varied, everything else fixed):

  objective                                           KLD mean   PPL
  Σ err (``"sum"``, the former default)               0.393      26.65
  max err (``"max"``)                                 0.494      29.76
  Σ err / r, r = ‖y_ref − h‖ / ‖y_ref‖ (h the input)  0.396      27.76
  Σ (err / r)²                                        0.258      23.64
  Σ err / √r                                          0.240      23.15
  max err / r                                         0.265      23.50
  Σ err / ρ                                           0.176      21.86
  Σ (err / ρ)²  (``"content"``)                       0.157      22.06
  Σ (err / ρ)³                                        0.160      22.07
  max err / ρ                                         0.166      21.31

FP16 PPL 18.63; for scale, the issue reports KLD 0.20 for a uniform choice (attn option 6,
mlp option 7: 4.17 bpw). r, each module's own update relative to its output (the first idea,
tried because it needs no token outlier rule), divides by a norm that the sink token also
dominates and starves layer 0 and the MLPs that create or remove the sink.

The same comparison over targets (``scripts/exl2_quality.py --measurement M --objectives
content,sum``; KLD mean, same measurement and evaluation; 5.5343 is the decoder bpw of our
Q4_K_M GGUF of SmolLM2, whose own KLD is 0.0457; quantized after the lazy-batch GPTQ change
3c47fcf, the table above before it, hence 0.364 here and 0.393 there for Σ err at 4.0):

  target bpw     3.0     4.0     5.0     5.5343  6.0
  ``"content"``  0.772   0.160   0.0381  0.0179  0.0132
  ``"sum"``      0.954   0.364   0.107   0.0484  0.0268

The file format does not record how options were chosen (exllamav2 0.3.2's simulated annealing,
``conversion/optimize.py`` with ``sim_anneal`` in ``exllamav2_ext/ext_quant.cpp``, leaves no
trace in it), so other solvers are legitimate.

Solver (``"sum"``), exact with a certificate; each round:

1. options dominated within their slot (another costs no more and errs no more) are dropped;
   costs are taken relative to each slot's cheapest option, in units of their gcd g and of a
   grid step q = g·⌈extra budget / (g·grid)⌉ (q = g, exact, when the extra budget spans at most
   ``grid`` units);
2. dynamic programming over the slots, vectorized over the budget axis, on costs rounded **up**
   to q and the budget rounded **down**: every result provably satisfies Σ c ≤ B; then a local
   search on the true costs (best improving one- or two-slot change that fits the slack) wins
   back budget lost to the rounding → an incumbent;
3. the same DP on costs rounded **down** (a relaxation: every feasible choice fits it) gives a
   lower bound on the optimum and, from the prefix and suffix DP tables, a lower bound for
   every option on the best choice that uses it; options whose bound exceeds the incumbent
   cannot be in a better solution and are removed, which narrows the cost range, so the next
   round's grid is finer.

It stops when q = g (the DP was exact), when the lower bound meets the incumbent, or when
nothing more can be removed; ``Allocation.lower_bound`` reports the bound, so
``objective_value − lower_bound`` is a proven distance to the optimum (0 on every instance in
the tests, which compare with ``scipy.optimize.milp``). Then exllamav2's fill-up: move a slot
to another option when the cost delta fits the budget and its error does not get worse.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from quantpress.errors import InputError

#: the aggregates :func:`allocate` minimizes (Σ err^power, or max err)
OBJECTIVES = ("sum", "max")
#: ``quantize exl2 --objective`` → (err divided by the module's content share ρ, aggregate,
#: power): ``"content"`` minimizes Σ (err / ρ)², ``"sum"`` Σ err, ``"max"`` max err
OBJECTIVE_MODES = {"content": (True, "sum", 2.0), "sum": (False, "sum", 1.0),
                   "max": (False, "max", 1.0)}
DEFAULT_OBJECTIVE = "content"
#: content shares ρ below this are raised to it (keeps err / ρ finite)
MIN_SHARE = 1e-6
DEFAULT_GRID = 1 << 16


@dataclass(frozen=True)
class Allocation:
    """Result of :func:`allocate`.

    ``choice``: option index per slot (list of int, len n_slots). ``total_bits``: Σ cost of the
    chosen options (bits, ≤ ``budget``). ``err_sum`` / ``err_max``: Σ and max of
    err = 1 − accuracy over the chosen options. ``objective_value``: Σ err^power of the choice
    (for ``"max"`` the secondary sum over the allowed options). ``lower_bound``: a proven lower
    bound on the best Σ err^power under the budget (within the allowed options for ``"max"``);
    equal to ``objective_value`` (up to float round-off) when the optimum is certified.
    ``max_allowed``: for ``"max"``, the optimal (smallest reachable) max err; None for
    ``"sum"``. ``rounds``: solver rounds used (see the module docstring).
    """

    choice: list[int]
    total_bits: int
    budget: int
    err_sum: float
    err_max: float
    objective: str
    objective_value: float
    lower_bound: float
    max_allowed: float | None = None
    rounds: int = 0

    def bpw(self, numel: int) -> float:
        """Achieved bits per weight over ``numel`` decoder parameters."""
        return self.total_bits / numel


# --------------------------------------------------------------------------------------------
# Budget


def decoder_numel(num_layers: int, shapes: Mapping[str, Sequence],
                  norm_numel_per_layer: int = 0, pad32: bool = True) -> int:
    """Parameter count of the decoder-layer modules that the budget is relative to.

    ``shapes``: linear name → ``(in_features, out_features[, has_bias])`` of one layer's
    linears (q/k/v/o_proj, gate/up/down_proj; identical in every layer for llama/qwen).
    Counts Σ in × out per linear per layer (out padded to a multiple of 32 with ``pad32``, as
    ``ExLlamaV2Linear.numel()`` is), biases not counted, plus ``norm_numel_per_layer``.
    exllamav2 0.3.2 ``optimize.py`` sums ``module.numel()`` over the 2·L decoder modules;
    ``ExLlamaV2Attention/MLP.numel()`` add their norms' ``numel()``, but
    ``ExLlamaV2RMSNorm.numel()`` returns 0, so the default 0 reproduces its budget for
    llama/qwen exactly (pass the norm weights' count to include them).
    """
    per_layer = 0
    for name, shp in shapes.items():
        k, n = int(shp[0]), int(shp[1])
        per_layer += k * (n + (-n % 32 if pad32 else 0))
    return int(num_layers) * (per_layer + int(norm_numel_per_layer))


def budget_bits(target_bpw: float, numel: int) -> int:
    """``int(numel × target_bpw)``: the budget in bits for a decoder-only target bpw
    (exllamav2 0.3.2 ``optimize.py`` ``weight_budget``). Raises InputError for a non-finite or
    non-positive target."""
    if not (isinstance(target_bpw, numbers.Real) and not isinstance(target_bpw, bool)
            and math.isfinite(target_bpw) and target_bpw > 0):
        raise InputError(f"target bpw {target_bpw!r} is not a positive number")
    return int(numel * target_bpw)


# --------------------------------------------------------------------------------------------
# Slots


def _as_arrays(slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pad the ragged slots into C int64 [S, M] bits, E float64 [S, M], valid bool [S, M]."""
    slots = list(slots)
    if not slots:
        raise ValueError("allocate: no slots")
    m = max(len(s) for s in slots)
    C = np.zeros((len(slots), m), dtype=np.int64)
    E = np.full((len(slots), m), np.inf)
    V = np.zeros((len(slots), m), dtype=bool)
    for i, s in enumerate(slots):
        if len(s) == 0:
            raise ValueError(f"allocate: slot {i} has no options")
        for j, (c, e) in enumerate(s):
            c, e = int(c), float(e)
            if c < 0 or not math.isfinite(e) or e < 0:
                raise ValueError(f"allocate: slot {i} option {j}: cost {c} / err {e} invalid "
                                 f"(need cost ≥ 0 bits and a finite err ≥ 0)")
            C[i, j], E[i, j], V[i, j] = c, e, True
    return C, E, V


def reachable_bits(slots) -> tuple[int, int]:
    """``(Σ_s min_j c[s, j], Σ_s max_j c[s, j])``: the cheapest and the most expensive total (bits)
    over all choices."""
    C, _, V = _as_arrays(slots)
    big = np.iinfo(np.int64).max // 4
    return (int(np.where(V, C, big).min(1).sum()), int(np.where(V, C, -1).max(1).sum()))


def reachable_bpw(slots, numel: int) -> tuple[float, float]:
    """The reachable range of decoder bpw, :func:`reachable_bits` / ``numel``."""
    lo, hi = reachable_bits(slots)
    return lo / numel, hi / numel


def _range_error(budget: int, lo: int, hi: int, numel: int | None) -> InputError:
    side = "below" if budget < lo else "above"
    if numel:
        rlo = math.ceil(lo / numel * 100) / 100      # rounded inwards: printed ⊆ reachable
        rhi = math.floor(hi / numel * 100) / 100
        return InputError(f"target {budget / numel:.4f} bpw is {side} the reachable range "
                          f"[{rlo:.2f}, {rhi:.2f}] bpw of this measurement (all cheapest / all "
                          f"most expensive options)")
    return InputError(f"budget {budget} bits is {side} the reachable range [{lo}, {hi}] bits "
                      f"of this measurement")


def content_slots(slots, shares: Sequence[float]) -> list[list[tuple[int, float]]]:
    """The slots with every err divided by its module's content share ρ (the ``"content"``
    objective): ``err / max(ρ, MIN_SHARE)``, costs unchanged.

    ``shares``: per slot (same order), ρ = mean_rows(‖y_ref[ordinary tokens]‖ / ‖y_ref‖) of
    the module's unquantized output (dimensionless, in (0, 1];
    :func:`calibration.exl2_measure.content_share`). Since err = mean_rows(‖y_q − y_ref‖ /
    ‖y_ref‖), err / ρ ≈ ‖y_q − y_ref‖ / ‖y_ref[ordinary tokens]‖: the error relative to the
    residual stream's content, not to a norm that an attention-sink token dominates. Raises
    InputError when the counts differ or a ρ is not a finite number ≥ 0."""
    slots = list(slots)
    q = np.asarray(shares, dtype=np.float64)
    if q.shape != (len(slots),):
        raise InputError(f"{q.size} module content shares for {len(slots)} slots")
    bad = ~(np.isfinite(q) & (q >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InputError(f"content share of slot {i} is {float(q[i])}, not a finite number ≥ 0 "
                         f"(NaN/Inf hidden states in the unquantized forward pass?)")
    q = np.maximum(q, MIN_SHARE)
    return [[(int(c), float(e) / float(qi)) for c, e in s] for s, qi in zip(slots, q)]


# --------------------------------------------------------------------------------------------
# Solvers


def _dp_step(f: np.ndarray, units: np.ndarray, w: np.ndarray, js: np.ndarray,
             tmp: np.ndarray, want_arg: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """One knapsack step over a budget axis of n = len(f) cells, vectorized over the cells:
    ``g(b) = min_{j in js} f(b − units[j]) + w[j]`` (inf where no option fits b). Returns
    (g float64 [n], argmin option index int16 [n] or None); ties keep the earliest option.
    ``tmp`` is float64 scratch of length ≥ n."""
    n = len(f)
    g = np.full(n, np.inf)
    arg = np.full(n, js[0], dtype=np.int16) if want_arg else None
    if want_arg:
        better = np.empty(n, dtype=bool)
    for j in js:
        u = int(units[j])
        if u >= n:
            continue
        t = tmp[: n - u]
        np.add(f[: n - u], w[j], out=t)
        if want_arg:
            m = better[: n - u]
            np.less(t, g[u:], out=m)
            np.copyto(g[u:], t, where=m)
            np.copyto(arg[u:], j, where=m)
        else:
            np.minimum(g[u:], t, out=g[u:])
    return g, arg


def _dp(X: np.ndarray, W: np.ndarray, A: np.ndarray, cap: int) -> tuple[float, list[int]]:
    """min Σ_s W[s, j_s] s.t. Σ_s X[s, j_s] ≤ cap over the allowed options A; X int64 [S, M] ≥ 0
    in grid units. f_0 ≡ 0 makes f_s(b) the best total of slots < s with cost ≤ b; the argmins
    (int16 [S, cap + 1]) give the choice by backtracking from b = cap."""
    S = X.shape[0]
    n = cap + 1
    f = np.zeros(n)
    tmp = np.empty(n)
    args = np.empty((S, n), dtype=np.int16)
    for s in range(S):
        f, args[s] = _dp_step(f, X[s], W[s], np.flatnonzero(A[s]), tmp)
    choice = [0] * S
    b = cap
    for s in range(S - 1, -1, -1):
        j = int(args[s, b])
        choice[s] = j
        b -= int(X[s, j])
    return float(f[-1]), choice


def _option_bounds(X: np.ndarray, W: np.ndarray, A: np.ndarray, cap: int) -> tuple[float,
                                                                                    np.ndarray]:
    """Lower bounds from the DP on costs rounded **down** (X = ⌊extra / q⌋, cap = ⌊extra budget
    / q⌋; every truly feasible choice fits it). Returns (bound on the optimum, LB float64
    [S, M]) where LB[s, j] bounds every feasible choice that takes option j in slot s:
    min_b F_{s−1}(b) + W[s, j] + G_{s+1}(cap − X[s, j] − b), with F the forward (prefix) and G
    the backward (suffix) DP tables (inf where not allowed)."""
    S, M = X.shape
    n = cap + 1
    tmp = np.empty(n)
    F = np.empty((S + 1, n))
    F[0] = 0.0
    for s in range(S):
        F[s + 1] = _dp_step(F[s], X[s], W[s], np.flatnonzero(A[s]), tmp, False)[0]
    LB = np.full((S, M), np.inf)
    G = np.zeros(n)
    for s in range(S - 1, -1, -1):
        js = np.flatnonzero(A[s])
        for j in js:
            t = cap - int(X[s, j])
            if t >= 0:
                LB[s, j] = W[s, j] + float((F[s, : t + 1] + G[t::-1]).min())
        G = _dp_step(G, X[s], W[s], js, tmp, False)[0]
    return float(F[S, cap]), LB


def _dominated(C: np.ndarray, W: np.ndarray, A: np.ndarray) -> np.ndarray:
    """bool [S, M]: options for which another allowed option of the same slot costs no more and
    errs no more (strictly better in one, or equal and earlier); never needed by the optimum."""
    c1, c2 = C[:, :, None], C[:, None, :]
    w1, w2 = W[:, :, None], W[:, None, :]
    M = C.shape[1]
    earlier = np.arange(M)[None, :] < np.arange(M)[:, None]       # [j, k]: k before j
    better = (c2 <= c1) & (w2 <= w1) & ((c2 < c1) | (w2 < w1) | earlier[None])
    return A & (better & A[:, None, :]).any(2)


def _improve(C: np.ndarray, W: np.ndarray, A: np.ndarray, choice: list[int], budget: int,
             chunk: int = 256) -> list[int]:
    """Local search on the true costs: repeatedly apply the best Σ W-decreasing change of one
    slot, or of two slots together, whose cost change fits the slack (budget − Σ cost), until
    there is none. A useful pair has a W-lowering change (a) with a change (b) that lowers W or
    frees budget; pairs are scored in blocks of ``chunk`` rows of a, so memory stays
    O(chunk · n_moves)."""
    S, M = C.shape
    rows = np.arange(S)
    ch = np.array(choice)
    big = np.iinfo(np.int64).max // 4
    Cm = np.where(A, C, big)
    Wm = np.where(A, W, np.inf)
    for _ in range(20 * S):
        cur_c, cur_w = C[rows, ch], W[rows, ch]
        slack = budget - int(cur_c.sum())
        tol = 1e-13 * max(float(cur_w.sum()), 1e-300)
        dC = Cm - cur_c[:, None]
        dW = Wm - cur_w[:, None]
        best, move = -tol, None
        ok1 = A & (dC <= slack) & (dW < -tol)
        if ok1.any():
            flat = np.where(ok1, dW, np.inf).ravel()
            i = int(flat.argmin())
            best, move = float(flat[i]), ((i // M, i % M),)
        sa, oa = np.nonzero(A & (dW < 0))
        sb, ob = np.nonzero(A & ((dW < 0) | (dC < 0)))
        if len(sa) and len(sb):
            dcb, dwb = dC[sb, ob], dW[sb, ob]
            for lo in range(0, len(sa), chunk):
                a_s, a_o = sa[lo:lo + chunk], oa[lo:lo + chunk]
                tot = dW[a_s, a_o][:, None] + dwb[None, :]
                fits = ((dC[a_s, a_o][:, None] + dcb[None, :] <= slack)
                        & (a_s[:, None] != sb[None, :]))
                tot[~fits] = np.inf
                i = int(tot.argmin())
                a, b = divmod(i, len(sb))
                if tot[a, b] < best - tol:
                    best = float(tot[a, b])
                    move = ((a_s[a], a_o[a]), (sb[b], ob[b]))
        if move is None:
            break
        for s, j in move:
            ch[s] = j
    return [int(j) for j in ch]


def _fill_up(C: np.ndarray, W: np.ndarray, A: np.ndarray, choice: list[int],
             budget: int) -> list[int]:
    """exllamav2's fill-up (``optimize.py`` since d302fa3): sweep the slots in layer order and
    move a slot to another option when the cost delta fits the remaining budget and its error
    does not get worse (lowest W first, then the highest cost), until a sweep changes nothing."""
    ch = list(choice)
    total = int(sum(int(C[s, j]) for s, j in enumerate(ch)))
    changed = True
    while changed:
        changed = False
        for s in range(C.shape[0]):
            j0 = ch[s]
            js = np.flatnonzero(A[s] & (C[s] - C[s, j0] <= budget - total) & (W[s] <= W[s, j0]))
            if len(js) == 0:
                continue
            j = int(js[np.lexsort((-C[s, js], W[s, js]))[0]])
            if (W[s, j], -C[s, j]) < (W[s, j0], -C[s, j0]):
                total += int(C[s, j] - C[s, j0])
                ch[s] = j
                changed = True
    return ch


def _min_sum(C: np.ndarray, W: np.ndarray, A: np.ndarray, budget: int, grid: int,
             max_rounds: int = 8) -> tuple[list[int], float, int]:
    """Σ-objective over the allowed options A (bool [S, M]); returns (choice, lower bound on
    the optimum, rounds).

    Each round: options dominated in their slot are dropped; extra costs over each slot's
    cheapest remaining option are expressed in units of their gcd g and of q = g·⌈extra / (g ·
    grid)⌉; DP on costs rounded up (feasible) + local search give an incumbent; if q = g the DP
    was exact. Otherwise the DP on costs rounded down bounds, for every option, the best choice
    that uses it; options whose bound exceeds the incumbent are removed, which narrows the cost
    range, so the next round's grid is finer. Stops when exact, when the bound meets the
    incumbent, or when nothing is removed."""
    S = C.shape[0]
    rows = np.arange(S)
    big = np.iinfo(np.int64).max // 4
    B = A & ~_dominated(C, W, A)
    best, best_val, lower = None, np.inf, -np.inf
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        base = np.where(B, C, big).min(1)
        X = np.where(B, C - base[:, None], 0)
        extra = budget - int(base.sum())
        if int(X.max(1).sum()) <= extra:           # the budget does not bind: best W per slot
            best = [int(j) for j in np.where(B, W, np.inf).argmin(1)]
            best_val = lower = float(W[rows, best].sum())
            break
        g = int(np.gcd.reduce(X[B]))
        q = g * max(1, -(-(extra // g) // grid))
        cap = extra // q
        choice = _improve(C, W, B, _dp(-(-X // q), W, B, cap)[1], budget)
        val = float(W[rows, choice].sum())
        if val < best_val:
            best, best_val = choice, val
        if q == g:                                   # exact DP (units of the gcd)
            lower = best_val
            break
        lb, LB = _option_bounds(X // q, W, B, cap)
        lower = max(lower, lb)
        if best_val - lower <= 1e-12 * abs(best_val):
            break
        keep = B & (LB <= best_val + 1e-9 * abs(best_val))
        keep[rows, best] = True
        if int(keep.sum()) == int(B.sum()):
            break
        B = keep
    return best, min(lower, best_val), rounds


def _spend(C: np.ndarray, W: np.ndarray, A: np.ndarray, choice: list[int], budget: int,
           min_bits: int) -> list[int]:
    """Raise the cost of ``choice`` to at least ``min_bits`` (never past ``budget``) when the
    optimum leaves more budget unspent: repeatedly move one slot to a dearer allowed option
    that fits — the one with the smallest objective increase if some move reaches
    ``min_bits``, else the one with the smallest increase per added bit — until the cost
    reaches ``min_bits`` or no move fits."""
    ch = list(choice)
    rows = np.arange(C.shape[0])
    total = int(C[rows, ch].sum())
    while total < min_bits:
        cur_c = C[rows, ch][:, None]
        cur_w = W[rows, ch][:, None]
        dc = C - cur_c
        ok = A & (dc > 0) & (dc <= budget - total)
        if not ok.any():
            break
        dw = W - cur_w
        reach = ok & (dc >= min_bits - total)
        if reach.any():  # one move reaches the window: the one that costs least objective
            pick = np.where(reach, dw, np.inf)
        else:
            pick = np.where(ok, dw / np.where(dc > 0, dc, 1), np.inf)
        s, j = np.unravel_index(int(np.argmin(pick)), pick.shape)
        total += int(dc[s, j])
        ch[int(s)] = int(j)
    return ch


def allocate(slots, budget: int, *, numel: int | None = None, objective: str = "sum",
             power: float = 1.0, grid: int = DEFAULT_GRID, min_bits: int | None = None) -> Allocation:
    """Choose one option per slot under ``budget`` bits.

    ``slots``: per slot (2 per decoder layer: attn, mlp, layer order), a sequence of
    ``(total_bits: int, err: float)`` in option order, err = 1 − accuracy ≥ 0 (as
    :meth:`calibration.exl2_measurement.Measurement.slots` returns). ``budget``: int bits
    (:func:`budget_bits`). ``numel``: the decoder parameter count, used only to state the
    reachable range in bpw in errors.

    ``objective="sum"`` minimizes Σ err^power subject to Σ total_bits ≤ budget: rounds of DP
    on a grid of at most ``grid`` + 1 budget cells with costs rounded up (feasible) and down
    (lower bound), local search on the true costs, and removal of options that cannot beat the
    incumbent (module docstring), then exllamav2's fill-up. ``objective="max"`` first minimizes
    max err exactly (bisection over the measured err values: t is reachable iff Σ_s min{c : err
    ≤ t} ≤ budget), then Σ err^power among the options whose err is ≤ that optimum.

    Time and memory per round: O(n_slots · n_options · grid) float64 operations, and
    n_slots · (grid + 1) float64 + int16 tables (60 slots, 2^16 grid: about 40 MiB; the time
    of SmolLM2-shaped and of 160-slot instances on one CPU core is in docs/benchmarks.md,
    "Figures behind the code", ``calibration/exl2_alloc.py``).

    Replaces exllamav2 0.3.2 ``conversion/optimize.py`` (same slots and budget, solved
    exactly rather than by simulated annealing; the fill-up pass is kept).

    ``min_bits``: when the optimum costs less, dearer options are taken greedily (smallest
    objective increase per bit) until the cost reaches it, so that the achieved bpw lands in a
    window below the target (the pipeline asks for target − 0.05 bpw); ``objective_value``
    and ``lower_bound`` then no longer certify optimality.

    Raises InputError when the budget is below Σ cheapest costs or above Σ most expensive
    costs, giving the reachable range (in bpw to 2 decimals with ``numel``, rounded inwards);
    ValueError for malformed slots, an unknown objective, power ≤ 0 or grid < 1.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"allocate: objective {objective!r} not in {OBJECTIVES}")
    if not (power > 0 and math.isfinite(power)):
        raise ValueError(f"allocate: power {power!r} must be a positive number")
    if int(grid) < 1:
        raise ValueError(f"allocate: grid {grid!r} must be ≥ 1")
    C, E, V = _as_arrays(slots)
    budget = int(budget)
    big = np.iinfo(np.int64).max // 4
    lo = int(np.where(V, C, big).min(1).sum())
    hi = int(np.where(V, C, -1).max(1).sum())
    if budget < lo or budget > hi:
        raise _range_error(budget, lo, hi, numel)

    W = np.where(V, E, np.inf) ** power if power != 1.0 else E.copy()
    A = V.copy()
    t_star = None
    if objective == "max":
        # smallest measured err t with Σ_s min{c : err ≤ t} ≤ budget (monotone in t)
        levels = np.unique(E[V])
        lo_i, hi_i = 0, len(levels) - 1        # levels[-1] is feasible since budget ≥ lo
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            need = np.where(V & (E <= levels[mid]), C, big).min(1)
            if (need < big).all() and int(need.sum()) <= budget:
                hi_i = mid
            else:
                lo_i = mid + 1
        t_star = float(levels[lo_i])
        A = V & (E <= t_star)

    choice, lower, rounds = _min_sum(C, W, A, budget, int(grid))
    choice = _fill_up(C, W, A, choice, budget)
    if min_bits is not None:
        choice = _spend(C, W, A, choice, budget, int(min_bits))
    rows = np.arange(len(choice))
    total = int(C[rows, choice].sum())
    assert total <= budget
    e = E[rows, choice]
    return Allocation(choice=choice, total_bits=total, budget=budget, err_sum=float(e.sum()),
                      err_max=float(e.max()), objective=objective,
                      objective_value=float(W[rows, choice].sum()), lower_bound=lower,
                      max_allowed=t_star, rounds=rounds)
