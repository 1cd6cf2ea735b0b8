"""EXL2's two passes on the layer-streaming engine (:mod:`calibration.engine`): the
measurement (every candidate option of every decoder module scored on reference inputs) and
the quantization (sequential GPTQ with error propagation), as exllamav2 0.3.2
``conversion/convert_exl2.py`` runs them.

A decoder layer of transformers' llama / qwen2 / qwen3 families is two EXL2 modules:

* the **attention block** ``h + o_proj(attn(input_layernorm(h)))`` (exllamav2
  ``ExLlamaV2Attention`` with its residual), linears q/k/v/o_proj;
* the **MLP block** ``h + down_proj(act(gate_proj(x)) * up_proj(x))``, ``x =
  post_attention_layernorm(h)`` (``ExLlamaV2MLP``), linears gate/up/down_proj.

Hessians (exllamav2 0.3.2 ``AdaptiveGPTQ.add_batch`` / ``prepare``): ``H = Σ_rows XᵀX /
n_rows``, X the (tokens × K) input of one calibration row, accumulated in float32; k_proj and
v_proj reuse q_proj's H (same input), gate_proj reuses up_proj's (``reuse_h``); o_proj and
down_proj have their own. :class:`~calibration.stats.LinearStats` sums XᵀX over all tokens; it
is divided here by the number of rows.

**Measurement** (:class:`Measurer`; exllamav2 ``conversion/measure.py`` ``measure_quant``,
``measure_attn``, ``measure_mlp``, ``test_quant``, ``test_error``): every module gets the
reference (unquantized) hidden states, so no error accumulates; the next layer is fed the
unquantized layer's output. For each module, each linear is GPTQ-quantized once per unique
setting among the options (``get_qparams_reduced``: e.g. q 14, v 15, gate 13, down 14 of the
19 / 17 options), then each option sets its linears' fake-quantized weights and runs the
module once::

    accuracy = max(1e-6, 1 − mean_rows ‖y_q − y_ref‖_F / ‖y_ref‖_F)      (float32, per row)
    total_bits = Σ_linears bits_cost(qparams, K, N_pad [, bias])           (QParams.total_bits)

**Quantization** (:class:`Quantizer`; exllamav2 ``conversion/quantize.py`` ``quant``): the
layers are fed the **quantized** model's hidden states. Per layer: the attention Hessians
come from this layer's unquantized attention on its (quantized-model) input, q/k/v/o are
quantized with the chosen option; the MLP Hessians come from the unquantized MLP on the output
of the *quantized* attention block, gate/up/down are quantized; the quantized layer's output
goes to the next layer. Then the head: ``lm_head`` with the ``--head-bits`` setting and the
Hessian of the quantized model's final-norm output (round-to-nearest instead of GPTQ above
1e9 weights, as exllamav2 does).

Weights enter the quantizer as float16 (EXL2 is fp16: a BF16 checkpoint is cast; a value
outside the float16 range is an InputError naming the tensor). Forward passes run in the
engine's compute dtype (float32 on CPU by default) on its device; the fake-quantized fp16
weights are exact in it. Everything is torch on the model's device: the same code on CPU and
CUDA.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from quantpress.calibration import engine
from quantpress.calibration.awq import tensor_digest
from quantpress.calibration.exl2_measurement import layer_key
from quantpress.calibration.stats import StatsCollector
from quantpress.quantize import exl2 as qexl2
from quantpress.errors import InputError
from quantpress.quantize.gptq import HessianFactor, gptq_quantize, gptq_quantize_many, hessian_factor
from quantpress.quantize.ggml.common import all_finite

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
#: module (measurement key suffix) → its linears, relative to the decoder layer
MODULES = {"self_attn": ATTN_LINEARS, "mlp": MLP_LINEARS}
#: linear → the linear whose input (and so Hessian) it shares (exllamav2 ``reuse_h``)
HESSIAN_OF = {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
              "gate_proj": "up_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
#: the run aborts when the best option of a module scores below this (exllamav2 measure.py)
MIN_BEST_ACCURACY = 0.1
#: working memory of one batched GPTQ call of the measurement (about 11 bytes per weight and
#: setting; SmolLM2's attention linears take all their settings in one call, its MLP linears
#: 6 at a time, an 8B model's one each)
GPTQ_BATCH_BYTES = 64 << 20
#: lm_head is quantized by round-to-nearest above this many weights (exllamav2 quantize.py)
RTN_HEAD_NUMEL = 1e9
FP16_MAX = float(torch.finfo(torch.float16).max)
#: :func:`content_share`: a token whose hidden-state norm exceeds this multiple of its row's
#: median token norm is an outlier (attention sink / massive activation)
OUTLIER_TOKEN_FACTOR = 4.0


# --------------------------------------------------------------------------------------------
# The two EXL2 modules of a transformers decoder layer

class AttnBlock(nn.Module):
    """``h + self_attn(input_layernorm(h), **kwargs)[0]``: exllamav2's attention module with
    its residual (the first half of ``LlamaDecoderLayer.forward``). Shares the layer's
    submodules (no copy)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.norm = layer.input_layernorm
        self.attn = layer.self_attn

    def forward(self, hidden: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.attn(hidden_states=self.norm(hidden), **kwargs)
        return hidden + (out[0] if isinstance(out, (tuple, list)) else out)


class MLPBlock(nn.Module):
    """``h + mlp(post_attention_layernorm(h))``: exllamav2's MLP module with its residual (the
    second half of ``LlamaDecoderLayer.forward``)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.norm = layer.post_attention_layernorm
        self.mlp = layer.mlp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.norm(hidden))


def block(layer: nn.Module, mode: str) -> tuple[nn.Module, bool]:
    """(module, with_kwargs) of EXL2 module ``mode`` ("self_attn" / "mlp") of ``layer``."""
    return (AttnBlock(layer), True) if mode == "self_attn" else (MLPBlock(layer), False)


def linear_of(layer: nn.Module, mode: str, name: str, index: int | None = None) -> nn.Linear:
    """``layer.<mode>.<name>`` as an ``nn.Linear``; InputError naming it when the layer has no
    such linear (only llama-like layouts with q/k/v/o and gate/up/down are supported)."""
    try:
        lin = layer.get_submodule(f"{mode}.{name}")
    except AttributeError:
        lin = None
    if not isinstance(lin, nn.Linear):
        where = f"decoder layer {index}" if index is not None else "the decoder layer"
        raise InputError(f"{where} has no linear '{mode}.{name}'; EXL2 supports llama-like layers "
                         f"(self_attn q/k/v/o_proj, mlp gate/up/down_proj)")
    return lin


# --------------------------------------------------------------------------------------------
# Shared steps

class HessianCapture:
    """XᵀX accumulators (float32, on the activations' device;
    :class:`~calibration.stats.LinearStats`) hooked onto ``linears`` (names relative to the
    layer, e.g. ``self_attn.q_proj``) of decoder layer ``index``; ``remove()`` detaches the
    hooks (the engine's hook-handle protocol)."""

    def __init__(self, layer: nn.Module, index: int, prefix: str, linears: Sequence[str]):
        self.collector = StatsCollector(kinds={"hessian"}, include=(), prefix=prefix, offload=False)
        self._handles = []
        for name in linears:
            mode, lin_name = name.split(".")
            sub = linear_of(layer, mode, lin_name, index)
            self._handles.append(self.collector.attach(sub, f"{prefix}{index}.{name}"))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def seconds(self) -> float:
        """Wall seconds spent accumulating XᵀX so far (all hooked linears)."""
        return sum(st.seconds for st in self.collector.stats.values())

    def hessian(self, full_name: str, rows: int) -> torch.Tensor:
        """``H = Σ_rows XᵀX / n_rows`` float32 [K, K] of linear ``full_name`` (exllamav2 adds
        one batch per calibration row and divides by the number of batches)."""
        st = self.collector.stats.get(full_name)
        if st is None or st.count == 0:
            raise InputError(f"{full_name}: no activations were captured (0 tokens)")
        return st.xtx / float(rows)


def fp16_weight(lin: nn.Linear, name: str) -> torch.Tensor:
    """The linear's weight [N, K] as float16 (what EXL2 quantizes); InputError naming the
    tensor if it holds values outside the float16 range or NaN/Inf."""
    w = lin.weight.detach()
    h = w.to(torch.float16)
    if not all_finite(h):
        if all_finite(w):
            raise InputError(f"tensor '{name}.weight' has values outside the float16 range "
                             f"(max |w| = {float(w.abs().max()):.4g}); EXL2 weights are float16")
        raise InputError(f"tensor '{name}.weight' holds NaN or Inf")
    return h


def shared_factor(factors: dict[str, HessianFactor], name: str, hessian, device) -> HessianFactor:
    """``factors[name]``, made on first use from ``hessian()`` (float32 [K, K]) on ``device``
    (:func:`quantize.gptq.hessian_factor`): one factor for every linear whose input shares
    the Hessian ``name`` (:data:`HESSIAN_OF`) and every batch of its settings."""
    if name not in factors:
        h = hessian()
        factors[name] = hessian_factor(h, h.shape[0], device)
    return factors[name]


def module_accuracy(y: torch.Tensor, y_ref: torch.Tensor) -> float:
    """exllamav2 0.3.2 ``test_error``: ``max(1e-6, 1 − mean_rows(‖y − y_ref‖_F / ‖y_ref‖_F))``
    with y, y_ref [rows, seq, hidden] (any float dtype), in float32 per row; y is clamped to
    the float16 range first (exllamav2 clamps outputs of an fp16 residual stream)."""
    return AccuracyScorer(y_ref).score(y)


class AccuracyScorer:
    """:func:`module_accuracy` against one reference output ``y_ref`` [rows, seq, hidden] for
    many candidate outputs: ‖y_ref‖ per row computed once, and one float32 scratch of y_ref's
    size reused by every :meth:`score` (the same operations on the same shapes, so the same
    values bit for bit; fresh [rows, seq, hidden] temporaries per candidate are mapped and
    faulted in anew each time once they pass glibc's mmap threshold)."""

    def __init__(self, y_ref: torch.Tensor):
        self.yr = y_ref.float().flatten(1)
        self.den = torch.linalg.vector_norm(self.yr, dim=1)
        self.scratch = torch.empty_like(self.yr)

    def score(self, y: torch.Tensor) -> float:
        """The accuracy of candidate output ``y`` (the shape of ``y_ref``)."""
        d = torch.clamp(y.float().flatten(1), -FP16_MAX, FP16_MAX, out=self.scratch)
        d.sub_(self.yr)
        rel = torch.linalg.vector_norm(d, dim=1) / self.den
        return max(1e-6, 1.0 - float(rel.mean()))


def content_share(y_ref: torch.Tensor, factor: float | None = None) -> float:
    """The share of a module output's norm carried by ordinary tokens:
    ``ρ = mean_rows(‖y_ref[ordinary tokens]‖_F / ‖y_ref‖_F)`` (dimensionless, in (0, 1]),
    ``y_ref`` [rows, seq, hidden], in float32 per row. A token is ordinary unless its hidden
    state's norm exceeds ``factor`` (default :data:`OUTLIER_TOKEN_FACTOR`) times the median
    token norm of its row: the outliers are attention-sink tokens carrying a massive activation
    (SmolLM2-135M: from layer 11 on, position 0 has norm ≈ 23 850 against ≈ 150 for the other
    tokens, so it makes up 99% of ‖y_ref‖_F). Since err = 1 − accuracy = mean_rows(‖y_q −
    y_ref‖_F / ‖y_ref‖_F) (:func:`module_accuracy`), err / ρ ≈ ‖y_q − y_ref‖_F / ‖y_ref[ordinary
    tokens]‖_F: the module's error relative to the residual stream's content rather than to a
    norm that one token dominates."""
    factor = OUTLIER_TOKEN_FACTOR if factor is None else float(factor)
    tn = torch.linalg.vector_norm(y_ref.float(), dim=-1)                 # [rows, seq]
    ordinary = tn <= factor * tn.median(dim=1, keepdim=True).values
    full = torch.linalg.vector_norm(tn, dim=1)
    part = torch.linalg.vector_norm(torch.where(ordinary, tn, torch.zeros_like(tn)), dim=1)
    return float((part / full.clamp_min(1e-30)).mean())


@dataclass
class ContentProbe:
    """One unquantized forward pass over the calibration rows that records, per EXL2 module,
    the :func:`content_share` ρ of its reference output (``results``: measurement key → ρ).
    Use :meth:`on_layer` as :func:`calibration.engine.run`'s ``on_layer`` (no hooks needed):
    the layer's own output is the MLP block's reference output, so each layer costs one extra
    attention-block forward."""

    results: dict = field(default_factory=dict)

    @torch.no_grad()
    def on_layer(self, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                 ctx) -> None:
        attn, kw = block(layer, "self_attn")
        y_attn = ctx.forward(attn, inputs, with_kwargs=kw, what=f"attention of decoder layer {index}")
        self.results[layer_key(index, "self_attn")] = content_share(y_attn)
        self.results[layer_key(index, "mlp")] = content_share(outputs)
        return None


def padded(n: int) -> int:
    """N rounded up to a multiple of 32 (``ExLlamaV2Linear(pad32=True)``)."""
    return n + (-n % qexl2.COLUMN_PAD)


def linear_bits(qp: qexl2.QParams, lin: nn.Linear) -> int:
    """Bit cost of ``lin`` quantized with ``qp`` (exllamav2 0.3.2 ``QParams.total_bits``):
    :func:`quantize.exl2.bits_cost` on (K, N_pad), bias included (as exllamav2's
    ``test_quant`` counts the padded weight)."""
    return qexl2.bits_cost(qp, lin.in_features, padded(lin.out_features), lin.bias is not None)


@dataclass
class Timings:
    """Wall seconds spent in GPTQ (``gptq``; ``search`` of it in the scale searches,
    :func:`quantize.gptq.find_params`: elementwise work, the rest is the row loop and the
    blocked error updates), in module forwards (``forward``: the reference and the candidate
    settings' outputs) and in accumulating the Hessians XᵀX (``hessian``, inside the reference
    forward's hooks)."""

    gptq: float = 0.0
    forward: float = 0.0
    hessian: float = 0.0
    search: float = 0.0

    def minus(self, other: "Timings") -> "Timings":
        """The seconds added since ``other`` was copied (a per-layer share)."""
        return Timings(**{k: v - getattr(other, k) for k, v in vars(self).items()})

    def plus(self, other: "Timings") -> "Timings":
        """Both timings' seconds added (a module measured in another thread)."""
        return Timings(**{k: v + getattr(other, k) for k, v in vars(self).items()})


# --------------------------------------------------------------------------------------------
# Measurement pass

@dataclass
class Measurer:
    """The measurement pass over every decoder layer streamed by :func:`calibration.engine.run`.

    Use :meth:`hooks` as the engine's ``hooks_factory`` and :meth:`on_layer` as its
    ``on_layer``. ``rows``: number of calibration rows (the Hessian divisor). ``prefix``: the
    decoder layers' checkpoint prefix (``model.layers.``). ``attn_opts`` / ``mlp_opts``: the
    candidates (default: :func:`quantize.exl2.attn_options` / ``mlp_options``, 19 / 17).
    After the run, ``results`` maps ``model.layers.N.self_attn`` / ``.mlp`` to the option
    lists of measurement.json (as exllamav2 0.3.2 ``measure_quant`` writes them), ``content``
    maps the same keys to the :func:`content_share` ρ of the module's reference output (not
    part of measurement.json: the ``"content"`` allocation objective divides err by it) and
    ``quantized`` counts the GPTQ runs per module; ``per_layer`` holds each layer's
    :class:`Timings` share, in layer order (what the summary and scripts/bench_exl2.py
    report). A layer's attention and MLP options are measured side by side when
    :func:`quantpress.calibration.engine.side_by_side_threads` allows (CPU, one intra-op
    thread, a free core); the timings then add both threads' seconds."""

    rows: int
    prefix: str = "model.layers."
    attn_opts: list = field(default_factory=qexl2.attn_options)
    mlp_opts: list = field(default_factory=qexl2.mlp_options)
    results: dict = field(default_factory=dict)
    content: dict = field(default_factory=dict)
    quantized: dict = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    per_layer: list = field(default_factory=list)
    _col: HessianCapture | None = None

    def hooks(self, index: int, layer: nn.Module):
        """XᵀX of q_proj, o_proj, up_proj and down_proj inputs while the engine runs the
        unquantized layer on the reference hidden states: the inputs of both modules are then
        the reference ones (the MLP's input is the unquantized attention block's output)."""
        self._col = HessianCapture(layer, index, self.prefix, ("self_attn.q_proj", "self_attn.o_proj",
                                                                 "mlp.up_proj", "mlp.down_proj"))
        return self._col

    @torch.no_grad()
    def on_layer(self, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                 ctx) -> None:
        """Measure layer ``index``'s two modules; return None so that the next layer gets the
        unquantized layer's output (no error accumulates)."""
        col, self._col = self._col, None
        before = Timings(**vars(self.timings))
        self.timings.hessian += col.seconds()
        x, work = inputs, []
        for mode, what in (("self_attn", "attention"), ("mlp", "MLP")):
            t0 = time.perf_counter()
            module, kw = block(layer, mode)
            y = ctx.forward(module, x, with_kwargs=kw, what=f"{what} of decoder layer {index}")
            self.timings.forward += time.perf_counter() - t0
            self.content[layer_key(index, mode)] = content_share(y)
            work.append((mode, x, y))
            x = y  # the MLP block's input is the (unquantized) attention block's output
        keys = [layer_key(index, mode) for mode, _, _ in work]
        for k in keys:           # the dicts keep layer order whichever module finishes first
            self.results[k], self.quantized[k] = None, 0
        if engine.side_by_side_threads(ctx.model.device, len(work)) > 1:
            # the two modules' options are independent (each is scored against its own
            # reference output): measured side by side, each on its own copy of the layer's
            # parameters, with its own timings
            own = [Timings() for _ in work]
            engine.raise_first(engine.run_side_by_side(
                [functools.partial(self.measure_module, index, engine.private_parameters(layer), mode, xm, ym,
                                   col, ctx, timings=t) for (mode, xm, ym), t in zip(work, own)], len(work)))
            for t in own:
                self.timings = self.timings.plus(t)
        else:
            for mode, xm, ym in work:
                self.measure_module(index, layer, mode, xm, ym, col, ctx)
        self.per_layer.append(self.timings.minus(before))
        return None

    def layer_state(self, index: int) -> dict:
        """What layer ``index`` added (option lists, content shares, GPTQ counts) and the
        timings so far, for a checkpointed pass."""
        keys = [layer_key(index, m) for m in MODULES]
        return {"results": {k: self.results[k] for k in keys}, "content": {k: self.content[k] for k in keys},
                "quantized": {k: self.quantized[k] for k in keys},
                "timings": (self.timings.gptq, self.timings.forward, self.timings.hessian),
                "per_layer": [vars(t) for t in self.per_layer]}

    def restore(self, index: int, saved: dict) -> None:
        """Take back layer ``index``'s saved measurement (a resumed pass)."""
        self.results.update(saved["results"])
        self.content.update(saved["content"])
        self.quantized.update(saved["quantized"])
        self.timings = Timings(*saved["timings"])
        self.per_layer = [Timings(**t) for t in saved.get("per_layer", [])]

    def measure_module(self, index: int, layer: nn.Module, mode: str, x: torch.Tensor,
                       y_ref: torch.Tensor, col: HessianCapture, ctx,
                       timings: Timings | None = None) -> list[dict]:
        """Score every option of module ``mode`` of layer ``index`` on input ``x`` against the
        reference output ``y_ref`` (both [rows, seq, hidden]); store and return the option list.

        Each (linear, QParams) is GPTQ-quantized once, when the first option that needs it is
        reached, together with the linear's next settings (:func:`quantize.gptq.gptq_quantize_many`,
        as many as fit in :data:`GPTQ_BATCH_BYTES` of working memory), and dropped after the
        last option that uses it. The module's original weights are restored afterwards.
        ``timings``: where its seconds go (default :attr:`timings`; a module measured beside
        the other has its own)."""
        tm = self.timings if timings is None else timings
        names = MODULES[mode]
        opts = self.attn_opts if mode == "self_attn" else self.mlp_opts
        lins = {n: linear_of(layer, mode, n, index) for n in names}
        full = {n: f"{self.prefix}{index}.{mode}.{n}" for n in names}
        w16 = {n: fp16_weight(lins[n], full[n]) for n in names}
        H = {n: col.hessian(f"{self.prefix}{index}.{mode}.{HESSIAN_OF[n]}", self.rows) for n in names}
        factors: dict[str, HessianFactor] = {}      # one per Hessian, shared by its linears
        last_use: dict[tuple[str, qexl2.QParams], int] = {}
        order: dict[str, list[qexl2.QParams]] = {n: [] for n in names}  # first-use order
        for j, opt in enumerate(opts):
            for n in names:
                if (n, opt[n]) not in last_use:
                    order[n].append(opt[n])
                last_use[(n, opt[n])] = j
        done = {n: 0 for n in names}
        per_call = {n: max(1, GPTQ_BATCH_BYTES // (11 * w16[n].numel())) for n in names}
        self.quantized[layer_key(index, mode)] = len(last_use)
        module, kw = block(layer, mode)
        orig = {n: lins[n].weight.data for n in names}
        cache: dict[tuple[str, qexl2.QParams], torch.Tensor] = {}
        scorer = AccuracyScorer(y_ref)
        ybuf = None                                  # every candidate's output, in turn
        out = []
        try:
            for j, opt in enumerate(opts):
                for n in names:
                    key = (n, opt[n])
                    if key not in cache:
                        # this setting and the next ones of the same linear, in one batched call
                        t0 = time.perf_counter()
                        qps = order[n][done[n]:done[n] + per_call[n]]
                        assert qps[0] == opt[n]
                        fac = shared_factor(factors, HESSIAN_OF[n], lambda: H[n], w16[n].device)
                        many = gptq_quantize_many(w16[n], fac, qps)
                        for q, r in zip(qps, many):
                            cache[(n, q)] = r.weight
                        tm.search += many[0].search_seconds
                        del many
                        done[n] += len(qps)
                        tm.gptq += time.perf_counter() - t0
                    lins[n].weight.data = cache[key].to(orig[n].dtype)
                t0 = time.perf_counter()
                y = ctx.forward(module, x, with_kwargs=kw,
                                what=f"{mode} of decoder layer {index} (option {j})", out=ybuf)
                acc = scorer.score(y)
                ybuf = y
                tm.forward += time.perf_counter() - t0
                entry = {"accuracy": acc,
                         "total_bits": sum(linear_bits(opt[n], lins[n]) for n in names)}
                entry.update({n: opt[n].as_dict() for n in names})
                out.append(entry)
                for n in names:
                    if last_use[(n, opt[n])] == j:
                        cache.pop((n, opt[n]), None)
        finally:
            for n in names:
                lins[n].weight.data = orig[n]
        best = max(o["accuracy"] for o in out)
        if best < MIN_BEST_ACCURACY:
            raise InputError(f"{layer_key(index, mode)}: the best option's accuracy is {best:.4g} "
                             f"(< {MIN_BEST_ACCURACY}): measurement/inference error (does the "
                             f"model overflow in this dtype?)")
        self.results[layer_key(index, mode)] = out
        return out


def measurement_dict(results: Mapping[str, list], num_layers: int, norm_name: str = "model.norm",
                     head_name: str = "lm_head") -> tuple[dict, int]:
    """``(measurement, last_module_idx)`` as exllamav2 0.3.2 exports them: the layer keys in
    order, then the unmeasured final norm and head as ``null`` (``"model.norm.norm"``,
    ``"lm_head.linear"``); ``last_module_idx = 2·L + 2`` (embedding, 2 per layer, norm, head)."""
    meas = {}
    for i in range(num_layers):
        for mode in MODULES:
            meas[layer_key(i, mode)] = results[layer_key(i, mode)]
    meas[f"{norm_name}.norm"] = None
    meas[f"{head_name}.linear"] = None
    return meas, 2 * num_layers + 2


# --------------------------------------------------------------------------------------------
# Quantization pass

@dataclass
class LinearRecord:
    """One quantized linear: ``name`` (checkpoint module name), ``shape`` (N, K) =
    (out_features, in_features), ``qparams`` (its setting), ``bits`` (exllamav2 0.3.2
    ``QParams.total_bits``, N padded), ``has_bias``, ``digest`` (SHA-256 of the fake-quantized
    float16 weight [N, K], which the round trip compares with the reconstruction from the
    files), ``rel_rmse`` of that weight against the float16 original."""

    name: str
    shape: tuple[int, int]
    qparams: qexl2.QParams
    bits: int
    has_bias: bool
    digest: str
    rel_rmse: float


LayerSink = Callable[[int, dict, list], None]


@dataclass
class Quantizer:
    """The quantization pass (exllamav2 0.3.2 ``conversion/quantize.py`` ``quant``) over every
    decoder layer streamed by :func:`calibration.engine.run`, then the head
    (:meth:`quantize_head`).

    ``strategy``: measurement key (``model.layers.N.self_attn`` / ``.mlp``) → chosen option
    dict (linear name → QParams dict, as in measurement.json). ``rows``: calibration rows.
    ``sink(index, tensors, records)`` receives each layer's output tensors under their EXL2
    names (``{prefix}{i}.self_attn.q_proj.q_weight``, ``.q_scale``, ``.q_scale_max``,
    ``.q_groups``, ``.q_invperm``, ``.bias``; norms as float16 ``.weight``) on CPU and its
    :class:`LinearRecord` list. ``timings`` accumulates GPTQ and forward seconds."""

    strategy: Mapping[str, Mapping]
    rows: int
    sink: LayerSink
    prefix: str = "model.layers."
    timings: Timings = field(default_factory=Timings)
    _col: HessianCapture | None = None

    def hooks(self, index: int, layer: nn.Module):
        """XᵀX of q_proj and o_proj inputs while the engine runs the unquantized layer on the
        quantized model's hidden states (the attention Hessians). The engine's MLP activations
        are not used: the MLP Hessians need the quantized attention's output."""
        self._col = HessianCapture(layer, index, self.prefix, ("self_attn.q_proj", "self_attn.o_proj"))
        return self._col

    def _options(self, index: int, mode: str) -> dict[str, qexl2.QParams]:
        key = layer_key(index, mode)
        if key not in self.strategy:
            raise KeyError(f"no chosen option for {key}")
        opt = self.strategy[key]
        return {n: qexl2.QParams.from_dict(opt[n]) for n in MODULES[mode]}

    def _quantize_linears(self, index: int, layer: nn.Module, mode: str, col: HessianCapture,
                          tensors: dict, records: list) -> None:
        qps = self._options(index, mode)
        factors: dict[str, HessianFactor] = {}      # one per Hessian, shared by its linears
        for n in MODULES[mode]:
            lin = linear_of(layer, mode, n, index)
            full = f"{self.prefix}{index}.{mode}.{n}"
            t0 = time.perf_counter()
            fac = shared_factor(factors, HESSIAN_OF[n], lambda: col.hessian(
                f"{self.prefix}{index}.{mode}.{HESSIAN_OF[n]}", self.rows), lin.weight.device)
            self.timings.gptq += time.perf_counter() - t0
            records.append(quantize_linear(lin, full, fac, qps[n], tensors, self.timings))

    @torch.no_grad()
    def on_layer(self, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                 ctx) -> torch.Tensor:
        """Quantize layer ``index`` module by module and return its quantized output (the
        next layer's input)."""
        col, self._col = self._col, None
        tensors: dict[str, torch.Tensor] = {}
        records: list[LinearRecord] = []
        lp = f"{self.prefix}{index}."
        linear_names = {f"{m}.{n}.{s}" for m, ns in MODULES.items() for n in ns for s in ("weight", "bias")}
        for name, t in layer.state_dict().items():   # norms (incl. q_norm / k_norm) as float16
            if name not in linear_names:
                tensors[lp + name] = _fp16_copy(t, lp + name)
        self._quantize_linears(index, layer, "self_attn", col, tensors, records)
        t0 = time.perf_counter()
        attn, kw = block(layer, "self_attn")
        y_attn = ctx.forward(attn, inputs, with_kwargs=kw, what=f"quantized attention of decoder layer {index}")
        mlp, kw = block(layer, "mlp")
        col = HessianCapture(layer, index, self.prefix, ("mlp.up_proj", "mlp.down_proj"))
        try:
            ctx.forward(mlp, y_attn, with_kwargs=kw, what=f"MLP of decoder layer {index}")
        finally:
            col.remove()
        self.timings.forward += time.perf_counter() - t0
        self._quantize_linears(index, layer, "mlp", col, tensors, records)
        t0 = time.perf_counter()
        y = ctx.forward(mlp, y_attn, with_kwargs=kw, what=f"quantized MLP of decoder layer {index}")
        self.timings.forward += time.perf_counter() - t0
        self.sink(index, tensors, records)
        return y

    @torch.no_grad()
    def quantize_head(self, model, hidden: torch.Tensor, head_qparams: qexl2.QParams,
                      batch_size: int, tensors: dict) -> LinearRecord:
        """Quantize ``lm_head`` of the streaming ``model`` with ``head_qparams``: H from the
        final-norm output of ``hidden`` (the quantized model's last hidden states [rows, seq,
        hidden]); GPTQ, or round-to-nearest above 1e9 weights. With tied embeddings this is
        the embedding matrix, written as a separate quantized ``lm_head``. Adds the EXL2
        tensors to ``tensors``; returns the record."""
        norm, lm_head = model.head()
        t0 = time.perf_counter()
        k = lm_head.in_features
        xtx = torch.zeros(k, k, dtype=torch.float32, device=model.device)
        for a in range(0, hidden.shape[0], batch_size):
            x = norm(hidden[a:a + batch_size].to(model.device, model.dtype)).float().reshape(-1, k)
            if not all_finite(x):
                raise InputError("non-finite activations (NaN/Inf) at the input of lm_head")
            xtx.addmm_(x.T, x)
        H = xtx / float(hidden.shape[0])
        self.timings.forward += time.perf_counter() - t0
        name = model.lm_head_name
        return quantize_linear(lm_head, name, H, head_qparams, tensors, self.timings,
                               rtn=lm_head.weight.numel() > RTN_HEAD_NUMEL)


def _fp16_copy(t: torch.Tensor, name: str) -> torch.Tensor:
    h = t.detach().to(torch.float16)
    if not all_finite(h):
        raise InputError(f"tensor '{name}' has NaN/Inf or values outside the float16 range")
    return h.cpu()


def _rel_rmse(wq: torch.Tensor, w: torch.Tensor, rows: int = 4096) -> float:
    """‖wq − w‖ / ‖w‖ of two [N, K] weights, in float32 over blocks of ``rows`` output rows
    (a large head is never copied whole in float32)."""
    num = torch.zeros((), dtype=torch.float64, device=w.device)
    den = torch.zeros((), dtype=torch.float64, device=w.device)
    for a in range(0, w.shape[0], rows):
        x = w[a:a + rows].float()
        num += (wq[a:a + rows].float() - x).pow_(2).sum(dtype=torch.float64)
        den += x.pow_(2).sum(dtype=torch.float64)
    return float((num / den.clamp_min(1e-60)).sqrt())


def quantize_linear(lin: nn.Linear, name: str, H: torch.Tensor | HessianFactor, qp: qexl2.QParams,
                    tensors: dict, timings: Timings | None = None, rtn: bool = False) -> LinearRecord:
    """GPTQ-quantize ``lin`` (module ``name``) with Hessian ``H`` float32 [K, K] (or its
    :func:`quantize.gptq.hessian_factor` on the weight's device) and ``qp``;
    set its weight to the fake-quantized one (in place, in its dtype) and add the packed EXL2
    tensors ``name.q_weight`` … ``name.q_invperm`` (+ ``name.bias`` float16) to ``tensors``
    on CPU. Returns its :class:`LinearRecord`."""
    t0 = time.perf_counter()
    w16 = fp16_weight(lin, name)
    res = gptq_quantize(w16, H if isinstance(H, HessianFactor) else H.to(w16.device), qp, rtn=rtn)
    bias = None if lin.bias is None else lin.bias.detach().to(torch.float16)
    for k, v in res.pack(bias).items():
        tensors[f"{name}.{k}"] = v.cpu()
    rel = _rel_rmse(res.weight, w16)
    rec = LinearRecord(name, (lin.out_features, lin.in_features), qp, linear_bits(qp, lin),
                       lin.bias is not None, tensor_digest(res.weight), rel)
    lin.weight.data = res.weight.to(lin.weight.dtype)
    if timings is not None:
        timings.gptq += time.perf_counter() - t0
        timings.search += res.search_seconds
    return rec
