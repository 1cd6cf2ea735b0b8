"""GPTQ layer by layer on the streaming engine (``quantize gptq``).

The pass (llm-compressor 0.14 ``GPTQModifier`` with its sequential pipeline, GPTQModel 7.7
``GPTQProcessor`` without ``true_sequential``): the calibration rows are streamed through the
decoder layers by :func:`quantpress.calibration.engine.run`; for decoder layer ``i``

1. the unquantized layer runs on the hidden states that the already-quantized layers
   ``0..i−1`` produced, with hooks accumulating the Hessian ``H = 2/n·Σ xᵀx`` of every linear's
   input (:class:`quantpress.calibration.stats.StatsCollector`);
2. each linear whose in_features the group size divides is quantized by
   :func:`quantpress.quantize.gptq_linear.gptq_quantize_linear` and its weight replaced by the
   fake-quantized one; the others stay float16;
3. the quantized layer runs again on the same inputs: its outputs are the next layer's inputs.

So every layer is quantized against the inputs it will see in the quantized model, as GPTQ
does. Embeddings, norms and lm_head are not quantized.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from quantpress.calibration.awq import LinearResult, tensor_digest
from quantpress.calibration.stats import StatsCollector
from quantpress.errors import InputError
from quantpress.quantize.ggml.common import all_finite
from quantpress.quantize.gptq_linear import GPTQLinearResult, HessianFactor, factor_hessian, gptq_quantize_linear

#: ``sink(layer index, float16 tensors kept as they are, {linear name: (result, float16 bias
#: or None)}, records)``
GPTQSink = Callable[[int, dict, dict, list], None]


@dataclass(frozen=True)
class GPTQSettings:
    """``bits``, ``group_size`` (−1: one group per output column), ``sym``, ``act_order``
    (``desc_act``), ``damp`` (fraction of mean diag(H)); ``rtn``: no Hessian (round to
    nearest with the same groups). No defaults here: the options' defaults live once, in
    :class:`quantpress.targets.GPTQOptions`, which builds these."""

    bits: int
    group_size: int
    sym: bool
    act_order: bool
    damp: float
    rtn: bool

    def fits(self, in_features: int, out_features: int) -> bool:
        """Whether a linear can be stored: the group size divides in_features, and the packing
        (32/bits values per int32) divides in_features and out_features."""
        per = 32 // self.bits
        gs = in_features if self.group_size == -1 else self.group_size
        return in_features % gs == 0 and in_features % per == 0 and out_features % per == 0


@dataclass
class Timings:
    """Seconds spent in GPTQ and in the second (quantized) forward of each layer."""

    gptq: float = 0.0
    forward: float = 0.0


def _fp16(t: torch.Tensor, name: str) -> torch.Tensor:
    h = t.detach().to(torch.float16)
    if not all_finite(h):
        if all_finite(t):
            raise InputError(f"tensor '{name}' has values outside the float16 range "
                             f"(max |w| = {float(t.abs().max()):.4g}); GPTQ checkpoints are float16")
        raise InputError(f"tensor '{name}' holds NaN or Inf")
    return h


@dataclass
class LayerQuantizer:
    """The GPTQ pass's consumer for :func:`quantpress.calibration.engine.run` (``hooks`` and
    ``on_layer``). ``prefix``: decoder layer name prefix (``model.layers.``); ``sink``
    receives each finished layer (see :data:`GPTQSink`) on CPU."""

    settings: GPTQSettings
    prefix: str
    sink: GPTQSink
    timings: Timings = field(default_factory=Timings)
    _col: StatsCollector | None = None

    def hooks(self, index: int, layer: nn.Module):
        """Hessian capture on every linear of layer ``index`` (none for ``rtn``). A weight
        that is NaN/Inf or outside float16 is named here, before the layer runs (InputError)."""
        for n, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                _fp16(m.weight, f"{self.prefix}{index}.{n}.weight")
        if self.settings.rtn:
            return None
        self._col = StatsCollector(kinds={"hessian"}, prefix=self.prefix, offload=False)
        return self._col(index, layer)

    @torch.no_grad()
    def on_layer(self, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                 ctx) -> torch.Tensor:
        """Quantize layer ``index`` (:meth:`quantize_layer`, with the Hessians :meth:`hooks`
        captured) and return its quantized outputs (the next layer's inputs)."""
        col, self._col = self._col, None
        self.quantize_layer(index, layer, col)
        t0 = time.perf_counter()
        y = ctx.forward(layer, inputs, what=f"quantized decoder layer {index}")
        self.timings.forward += time.perf_counter() - t0
        return y

    @torch.no_grad()
    def quantize_layer(self, index: int, layer: nn.Module, col: StatsCollector | None = None) -> None:
        """GPTQ every linear of decoder layer ``index`` that fits (Hessians from ``col``; None
        with ``rtn``), replace its weight by the fake-quantized one and hand the layer to the
        sink. InputError naming the tensor for a weight outside float16 or NaN/Inf, or a
        Hessian that cannot be factored."""
        st, lp = self.settings, f"{self.prefix}{index}."
        kept: dict[str, torch.Tensor] = {}
        quantized: dict[str, tuple[GPTQLinearResult, torch.Tensor | None]] = {}
        records: list[LinearResult] = []
        linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
        owned = {f"{n}.{p}" for n in linears for p in ("weight", "bias")}
        for name, t in layer.state_dict().items():
            if name not in owned:
                kept[lp + name] = _fp16(t, lp + name).cpu()
        t0 = time.perf_counter()
        factors: list[tuple[torch.Tensor, HessianFactor]] = []   # linears reading one input share
        for n, lin in linears.items():
            full = lp + n
            w = _fp16(lin.weight, full + ".weight")
            bias = None if lin.bias is None else _fp16(lin.bias, full + ".bias").cpu()
            N, K = w.shape
            if not st.fits(K, N):
                kept[full + ".weight"] = w.cpu()
                if bias is not None:
                    kept[full + ".bias"] = bias
                records.append(LinearResult(full, (N, K), False,
                                            reason=f"group size {st.group_size} / packing does not fit [{N}, {K}]"))
                continue
            H = None
            if not st.rtn:
                s = col.stats.get(full) if col is not None else None
                if s is None or s.count == 0:
                    raise InputError(f"{full}: no activations were captured (0 tokens)")
                H = s.hessian()
            try:
                f = next((f for h, f in factors if h.shape == H.shape and torch.equal(h, H)), None) \
                    if H is not None else None
                if f is None:
                    f = factor_hessian(H, K, act_order=st.act_order, damp=st.damp, device=lin.weight.device)
                    if H is not None:
                        factors.append((H, f))
                r = gptq_quantize_linear(w, None, bits=st.bits, group_size=st.group_size, sym=st.sym,
                                         factor=f)
            except ValueError as e:
                raise InputError(f"GPTQ of '{full}' failed: {e}") from None
            lin.weight.copy_(r.weight.to(lin.weight.dtype))
            x = w.float()
            rel = float(torch.linalg.norm(r.weight.float() - x) / torch.linalg.norm(x).clamp_min(1e-30))
            records.append(LinearResult(full, (N, K), True, digest=tensor_digest(r.weight), rel_rmse=rel))
            quantized[full] = (_to_cpu(r), bias)
        self.timings.gptq += time.perf_counter() - t0
        self.sink(index, kept, quantized, records)


def _to_cpu(r: GPTQLinearResult) -> GPTQLinearResult:
    return GPTQLinearResult(codes=r.codes.cpu(), zeros=r.zeros.cpu(), scales=r.scales.cpu(),
                            g_idx=r.g_idx.cpu(), perm=r.perm.cpu(), weight=r.weight.cpu(), damp=r.damp)
