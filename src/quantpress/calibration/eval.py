"""Perplexity and KL divergence on logits, with llama.cpp ``llama-perplexity``'s conventions.

Reproduced: llama.cpp 0c1e57098 ``tools/perplexity/perplexity.cpp`` — ``perplexity()`` (the
default, ``--ppl-stride 0``) and ``kl_divergence()`` (``--kl-divergence``):

- the text is tokenized once (``common_tokenize(text, add_special=true)``: a BOS first when
  the vocabulary's ``add_bos`` is set) and cut into ``n_chunk = ⌊n_tokens / n_ctx⌋``
  consecutive, non-overlapping chunks of ``n_ctx`` tokens (``--chunks`` keeps the first N);
  at least ``2·n_ctx`` tokens are required;
- when ``add_bos``, the first token of *every* chunk is replaced by BOS;
- each chunk is evaluated from an empty context; only the second half is scored: with
  ``first = n_ctx // 2``, the logits at positions ``first … n_ctx−2`` predict the tokens at
  ``first+1 … n_ctx−1`` (``n_ctx − first − 1`` tokens per chunk, 255 for 512);
- PPL = exp(mean NLL) over all scored tokens; its uncertainty is
  ``ppl · sqrt((E[nll²] − E[nll]²) / (count − 1))``;
- KL divergence per token is KL(P_base ‖ P_model) = Σ_v p_base(v) · (log p_base(v) − log p(v));
  reported: mean (± its standard error), percentiles with llama.cpp's interpolation
  ``(1−f)·v[⌊q⌋] + f·v[⌊q⌋+1]``, ``q = fraction·(n−1)`` over the sorted values, maximum;
  "same top p" = share of tokens whose arg-max token agrees; Δp = p(target) − p_base(target)
  (mean and RMS); ln(PPL/PPL_base).

Differences from llama.cpp, all deliberate and far below the reported precision: the base
distribution is used exactly (llama.cpp stores base log-probabilities as 16-bit integers,
≈5e-4 resolution, and drops terms with log p_base ≤ −16 from the KL sum), and log-softmax is
computed in float32 with float64 accumulation of the sums.

Everything here works on batches of logits (``[rows, positions, vocab]``), so a caller never
needs the logits of the whole text at once: feed one batch of chunks at a time to the
accumulators (:class:`PerplexityStats`, :class:`KLStats`). The per-token KL values (4 bytes
per scored token) are kept for the percentiles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from quantpress.errors import InputError


# --------------------------------------------------------------------------------------------
# Chunks and scored positions

def make_chunks(tokens: torch.Tensor, n_ctx: int, n_chunks: int | None = None,
                bos_id: int | None = None) -> torch.Tensor:
    """Cut a token stream into llama-perplexity's evaluation chunks.

    ``tokens``: int64 [n_tokens], the whole text tokenized once (with the leading BOS already
    in place when the model adds one). ``n_ctx``: chunk length (``-c``). ``n_chunks``: keep
    only the first N chunks (``--chunks``; None = all). ``bos_id``: when not None (the
    vocabulary's ``add_bos``), the first token of every chunk is replaced by it.

    Returns int64 [n_chunk, n_ctx] (CPU), n_chunk = min(n_chunks, ⌊n_tokens / n_ctx⌋).

    Raises InputError when ``n_ctx`` < 4 (or odd sizes leave no scored token), when the text
    has fewer than ``2·n_ctx`` tokens (llama-perplexity's "you need at least 2*n_ctx tokens")
    or when ``n_chunks`` < 1. Source: perplexity.cpp ``perplexity()``."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if n_ctx < 4:
        raise InputError(f"context length {n_ctx} is too small (need at least 4 tokens)")
    if n_chunks is not None and n_chunks < 1:
        raise InputError(f"number of chunks must be positive, got {n_chunks}")
    n = tokens.numel()
    if n < 2 * n_ctx:
        raise InputError(f"text too short: {n} tokens, at least {2 * n_ctx} needed for a "
                         f"context of {n_ctx} (llama-perplexity's minimum of 2 x ctx)")
    n_chunk = n // n_ctx if n_chunks is None else min(n_chunks, n // n_ctx)
    chunks = tokens[: n_chunk * n_ctx].reshape(n_chunk, n_ctx).clone()
    if bos_id is not None:
        chunks[:, 0] = int(bos_id)
    return chunks


def first_scored(n_ctx: int) -> int:
    """Position of the first logit that is scored: ``n_ctx // 2`` (perplexity.cpp ``first``)."""
    return n_ctx // 2


def scored_targets(chunks: torch.Tensor) -> torch.Tensor:
    """Target tokens of the scored logits: ``chunks[:, first+1:]``, int64 [n_chunk, n_ctx−first−1].
    The matching logits are those at positions ``first … n_ctx−2``
    (``logits[:, first:-1]``)."""
    return chunks[:, first_scored(chunks.shape[1]) + 1:]


def scored_slice(n_ctx: int) -> slice:
    """Positions whose logits are scored: ``slice(first, n_ctx − 1)``."""
    return slice(first_scored(n_ctx), n_ctx - 1)


# --------------------------------------------------------------------------------------------
# Per-token quantities

def _check(logits: torch.Tensor, targets: torch.Tensor, what: str) -> None:
    if logits.ndim < 2 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"{what}: logits {tuple(logits.shape)} do not match targets "
                         f"{tuple(targets.shape)} (expected [..., vocab] and [...])")
    if not bool(torch.isfinite(logits).all()):
        raise InputError(f"{what}: the logits hold NaN/Inf (the model overflows in this dtype "
                         f"or its weights are corrupt)")


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last axis in float32: float32 [..., vocab]."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of ``targets`` (int64 [...]) under ``logits`` ([..., vocab], any
    float dtype), float32 [...] in nats: ``max + log Σ exp(l − max) − l[target]``
    (perplexity.cpp ``log_softmax``)."""
    lp = log_probs(logits)
    return -lp.gather(-1, targets.to(lp.device).unsqueeze(-1)).squeeze(-1)


def token_kl(base_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(P_base ‖ P) = Σ_v p_base (log p_base − log p) in nats, float32 [...].
    Both ``[..., vocab]`` on the same device (perplexity.cpp ``kl_divergence`` ``log_softmax``,
    without its 16-bit storage of the base)."""
    lb = log_probs(base_logits)
    lq = log_probs(logits)
    return (lb.exp() * (lb - lq)).sum(-1, dtype=torch.float64).float().clamp_min(0)


# --------------------------------------------------------------------------------------------
# Accumulators

def _mean_unc(s: float, s2: float, n: int) -> tuple[float, float]:
    """perplexity.cpp ``mean_and_uncertainty``: (mean, standard error; 0 if n ≤ 10)."""
    if n < 1:
        return 0.0, 0.0
    f = s / n
    df = s2 / n - f * f
    return f, (math.sqrt(df / (n - 1)) if df > 0 and n > 10 else 0.0)


def percentile(sorted_values: torch.Tensor, fraction: float) -> float:
    """llama.cpp's percentile of ascending ``sorted_values`` (float [n]):
    ``(1−f)·v[i] + f·v[i+1]`` with ``i + f = fraction·(n−1)``."""
    n = sorted_values.numel()
    if n == 0:
        return float("nan")
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (n - 1)
    i = int(p)
    p -= i
    return float((1 - p) * sorted_values[i] + p * sorted_values[min(i + 1, n - 1)])


@dataclass
class PerplexityStats:
    """Running NLL sums over scored tokens (float64). ``update`` with each batch of logits."""

    count: int = 0
    sum_nll: float = 0.0
    sum_nll2: float = 0.0

    def update(self, logits: torch.Tensor, targets: torch.Tensor, what: str = "model") -> torch.Tensor:
        """Add ``logits`` [..., vocab] for ``targets`` [...]; returns the per-token NLL (float32,
        on the logits' device). Raises InputError (naming ``what``) on NaN/Inf logits."""
        _check(logits, targets, what)
        nll = token_nll(logits, targets)
        d = nll.double()
        self.count += nll.numel()
        self.sum_nll += float(d.sum())
        self.sum_nll2 += float(d.square().sum())
        return nll

    def result(self) -> dict:
        """``{"ppl", "ppl_unc", "nll", "tokens"}`` (perplexity.cpp's "Final estimate: PPL = x +/- u")."""
        return perplexity_result(self.sum_nll, self.sum_nll2, self.count)


def perplexity_result(sum_nll: float, sum_nll2: float, count: int) -> dict:
    """PPL from NLL sums over ``count`` tokens: ``{"ppl": exp(mean), "ppl_unc", "nll": mean,
    "tokens"}``, with perplexity.cpp's uncertainty ``ppl·sqrt(var/(count−1))``. ValueError if
    no token was scored."""
    if count == 0:
        raise ValueError("no tokens were scored")
    nll = sum_nll / count
    var = sum_nll2 / count - nll * nll
    ppl = math.exp(nll)
    unc = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return {"ppl": ppl, "ppl_unc": unc, "nll": nll, "tokens": count}


@dataclass
class KLStats:
    """Running statistics of a model against the base on the same scored tokens
    (perplexity.cpp ``kl_divergence_result``)."""

    count: int = 0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    n_same_top: int = 0
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    kld_values: list = field(default_factory=list)
    #: float64 scratch for the KL terms, reused by every batch (:meth:`_float64`)
    scratch: torch.Tensor | None = field(default=None, repr=False)

    def _float64(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied into the float64 scratch (grown when too small): what
        ``t.sum(-1, dtype=torch.float64)`` casts to, without a fresh tensor of twice ``t``'s
        size per batch (100 MB for one chunk of SmolLM2's 49,152-token vocabulary, above
        glibc's mmap threshold: mapped and faulted in anew each time)."""
        n = t.numel()
        if self.scratch is None or self.scratch.numel() < n or self.scratch.device != t.device:
            self.scratch = torch.empty(n, dtype=torch.float64, device=t.device)
        return self.scratch[:n].view(t.shape).copy_(t)

    @torch.no_grad()
    def update(self, base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor,
               what: str = "model") -> None:
        """Add one batch: ``base_logits`` and ``logits`` [..., vocab] (same shape and device),
        ``targets`` int64 [...]. Raises InputError (naming ``what``) on NaN/Inf logits."""
        _check(base_logits, targets, "base model")
        _check(logits, targets, what)
        if base_logits.shape != logits.shape:
            raise InputError(f"{what}: logits {tuple(logits.shape)} do not match the base model's "
                             f"{tuple(base_logits.shape)} (a different vocabulary?)")
        lb = log_probs(base_logits)
        lq = log_probs(logits)
        t = targets.to(lb.device).unsqueeze(-1)
        nll_b = -lb.gather(-1, t).squeeze(-1).double()
        nll_q = -lq.gather(-1, t).squeeze(-1).double()
        same = lb.argmax(-1) == lq.argmax(-1)
        lq = torch.sub(lb, lq, out=lq)  # log p_base − log p, in place (bounded temporaries)
        kld = self._float64(lb.exp_().mul_(lq)).sum(-1).clamp_min(0)  # = (p_base·Δ).sum(-1, dtype=float64)
        p_diff = torch.exp(-nll_q) - torch.exp(-nll_b)
        self.count += kld.numel()
        self.sum_kld += float(kld.sum())
        self.sum_kld2 += float(kld.square().sum())
        self.n_same_top += int(same.sum())
        self.sum_nll += float(nll_q.sum())
        self.sum_nll2 += float(nll_q.square().sum())
        self.sum_nll_base += float(nll_b.sum())
        self.sum_nll_base2 += float(nll_b.square().sum())
        self.sum_nll_nll_base += float((nll_q * nll_b).sum())
        self.sum_p_diff += float(p_diff.sum())
        self.sum_p_diff2 += float(p_diff.square().sum())
        self.sum_p_diff4 += float(p_diff.square().square().sum())
        self.kld_values.append(kld.float().reshape(-1).cpu())

    def perplexity(self) -> dict:
        """The evaluated model's perplexity on the same tokens (:func:`perplexity_result`)."""
        return perplexity_result(self.sum_nll, self.sum_nll2, self.count)

    def result(self) -> dict:
        """KL summary as perplexity.cpp prints it after ``--kl-divergence``:

        ``kld_mean``/``kld_mean_unc`` (nats), ``kld_median``, ``kld_p90``, ``kld_p95``,
        ``kld_p99``, ``kld_p999``, ``kld_max``; ``same_top`` (fraction of tokens whose arg-max
        agrees with the base, "Same top p") and ``same_top_unc``; ``dp_mean`` / ``dp_rms``
        (Δp of the target token, as fractions); ``ln_ppl_ratio`` = mean NLL − mean NLL_base;
        ``tokens``."""
        if self.count == 0:
            raise ValueError("no tokens were scored")
        v = torch.cat(self.kld_values).sort().values
        n = v.numel()
        mean, unc = _mean_unc(self.sum_kld, self.sum_kld2, self.count)
        median = float(0.5 * (v[n // 2] + v[n // 2 - 1])) if n % 2 == 0 else float(v[n // 2])
        top = self.n_same_top / self.count
        dp_mean, _ = _mean_unc(self.sum_p_diff, self.sum_p_diff2, self.count)
        dp_mse, _ = _mean_unc(self.sum_p_diff2, self.sum_p_diff4, self.count)
        return {
            "kld_mean": mean, "kld_mean_unc": unc, "kld_median": median,
            "kld_p90": percentile(v, 0.90), "kld_p95": percentile(v, 0.95),
            "kld_p99": percentile(v, 0.99), "kld_p999": percentile(v, 0.999),
            "kld_max": float(v[-1]),
            "same_top": top,
            "same_top_unc": math.sqrt(top * (1 - top) / (self.count - 1)) if self.count > 1 else 0.0,
            "dp_mean": dp_mean, "dp_rms": math.sqrt(max(dp_mse, 0.0)),
            "ln_ppl_ratio": (self.sum_nll - self.sum_nll_base) / self.count,
            "tokens": self.count,
        }
