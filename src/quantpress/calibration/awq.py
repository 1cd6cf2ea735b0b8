"""AWQ per decoder layer, on the layer-streaming engine (:mod:`calibration.engine`).

For every decoder layer (AutoAWQ 0.2.9 ``awq/quantize/quantizer.py`` ``AwqQuantizer.quantize``):

1. **Capture.** Forward pre-hooks keep the input of the first linear of each set of linears
   that share an input (q/k/v, o, gate/up, down; ``configs/awq_arch.toml``) for all calibration
   rows, while the engine runs the unmodified layer.
2. **Scale search** of every scale group against the original weights
   (``_search_best_scale``): x_mean, w_mean, the 20-point grid with or without duo scaling,
   the loss measured on the group's inspect module (``self_attn`` with the layer's mask and
   rotary embeddings, ``mlp``, or the linear). Two exact shortcuts, not in AutoAWQ, keep its
   winner (:meth:`LayerQuantizer.search_scale`): candidates stop once their error so far
   exceeds the best loss, and a linear-only group is scored from its inputs' Gram matrix.
3. **Folding** (``awq/quantize/scale.py`` ``apply_scale``): the norm (or previous linear's
   last rows and bias) is divided by s, the group's input columns multiplied by s, the
   captured inputs divided by s.
4. **Clipping search** (``_search_best_clip``) on the scaled weights and inputs, q/k
   skipped; then
5. **fake quantization and GEMM packing** (``pseudo_quantize_tensor``,
   ``WQLinear_GEMM.from_linear``) of every linear whose shape allows it.

**The next layer is fed the FP16 output of the unmodified layer**, as AutoAWQ does (the
engine computes the layer's output before this module changes anything): each layer is
calibrated on the activations of the original model, without error propagation; the search
itself accounts for the quantization of the layer it scores.

Weights are handled in float16 (the model's values; a BF16 checkpoint is cast, and a value
outside float16's range is an InputError naming the tensor); forward passes run in the
engine's compute dtype (float32 on CPU by default), in which the scale losses and the
clipping error are computed.
"""
from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from quantpress.configs import load_toml
from quantpress.quantize import awq as qawq
from quantpress.errors import InputError

FP16_MAX = torch.finfo(torch.float16).max
SUPPORTED_BITS = (4,)


@dataclass
class AWQSettings:
    """``bits`` (4 only: the GEMM layout), ``group_size`` (input columns per scale and zero),
    ``duo_scaling`` (s = x^r / w^(1−r), AutoAWQ's default; False: llm-awq's s = x^r),
    ``clip`` (the clipping search), ``rtn`` (no calibration: plain round-to-nearest of every
    linear with the same quantizer and packing, the baseline)."""

    bits: int = 4
    group_size: int = 128
    duo_scaling: bool = True
    clip: bool = True
    rtn: bool = False


@dataclass
class ScaleGroup:
    """One AWQ scale group (``configs/awq_arch.toml``)."""

    prev_op: str
    layers: list[str]
    inspect: str
    kwargs: bool
    when: str | None = None


@dataclass
class ArchSpec:
    """How to scale one decoder-layer family: linears sharing inputs, groups, clip skips."""

    model_type: str
    inputs: list[list[str]]
    groups: list[ScaleGroup]
    clip_skip: list[str]

    @property
    def linears(self) -> list[str]:
        """Every linear of the layer (relative names), in input-set order."""
        return [n for s in self.inputs for n in s]

    def input_of(self, linear: str) -> str:
        """The captured linear whose input ``linear`` shares."""
        for s in self.inputs:
            if linear in s:
                return s[0]
        raise KeyError(linear)

    def clipped(self, linear: str) -> bool:
        """Whether the clipping search treats ``linear`` (AutoAWQ skips q/k)."""
        return not any(k in linear for k in self.clip_skip)


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    return load_toml("awq_arch.toml")


def supported_model_types() -> list[str]:
    """model_types with AWQ scale groups."""
    t = _table()
    return sorted([k for k in t if k != "aliases"] + list(t.get("aliases", {})))


def arch_spec(model_type: str, architecture: str | None = None) -> ArchSpec:
    """The :class:`ArchSpec` of a transformers ``model_type``. Raises InputError naming the
    architecture when quantpress does not know how to scale its layers."""
    t = _table()
    key = t.get("aliases", {}).get(model_type, model_type)
    if key not in t or key == "aliases":
        raise InputError(f"architecture {architecture or '?'} (model_type '{model_type}'): no AWQ "
                         f"scale groups known for it; supported model types: "
                         f"{', '.join(supported_model_types())}")
    a = t[key]
    return ArchSpec(model_type, [list(s) for s in a["inputs"]],
                    [ScaleGroup(g["prev_op"], list(g["layers"]), g["inspect"], bool(g["kwargs"]),
                                g.get("when")) for g in a["groups"]],
                    list(a.get("clip_skip", [])))


@dataclass
class LinearResult:
    """What happened to one linear: ``name`` (full module name), ``shape`` [out, in],
    ``quantized`` (False: kept FP16, ``reason`` says why), ``digest`` (SHA-256 of the
    fake-quantized float16 weight, for the round trip), ``rel_rmse`` of the fake-quantized
    weight against the (scaled, unclipped) float16 weight."""

    name: str
    shape: tuple[int, int]
    quantized: bool
    reason: str = ""
    digest: str = ""
    rel_rmse: float = 0.0


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (CPU, contiguous), dtype and shape included."""
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


LayerSink = Callable[[int, dict, list], None]

#: tokens per slice of the scale search's candidate forwards on CPU (the unit of its pruning):
#: float32 matmuls of SmolLM2's shapes reach their full rate from 512 tokens up (slower at
#: 256), and the search with 1,024-token slices was as fast as with 512 (within noise) and
#: faster than unsliced; figures and the command in docs/benchmarks.md, "Figures behind the
#: code", ``calibration/awq.py``
SEARCH_SLICE_TOKENS = 1024


def search_slice_rows(seqlen: int, batch_rows: int, device: torch.device) -> int:
    """Rows per slice of the scale search's candidate forwards: about
    :data:`SEARCH_SLICE_TOKENS` tokens on CPU (at least one row, at most ``batch_rows``, the
    engine's forward batch); the whole batch on an accelerator, where small slices would
    leave it idle and each bound check waits for the device. ``device``: the compute device."""
    if torch.device(device).type != "cpu":
        return batch_rows
    return max(1, min(batch_rows, SEARCH_SLICE_TOKENS // max(1, seqlen)))


@dataclass
class LayerQuantizer:
    """AWQ of every decoder layer streamed by :func:`calibration.engine.run`.

    Use :meth:`hooks` as the engine's ``hooks_factory`` and :meth:`on_layer` as its
    ``on_layer`` (or :meth:`quantize_layer` directly with ``opts.rtn``). For each layer the
    ``sink(index, tensors, results)`` receives the layer's tensors to write under their
    checkpoint names (``{prefix}{i}.self_attn.q_proj.qweight``, ``.qzeros``, ``.scales``,
    biases and norms in float16, FP16 ``.weight`` for linears that cannot be quantized) and
    its :class:`LinearResult` list. ``rows``/``seqlen``: the calibration batch shape.
    ``timings`` accumulates seconds per stage ("search", "clip", "quantize"); ``search_work``
    counts the scale search's work: "slices" of candidate forwards a plain search runs,
    "slices_run" of them run (the rest pruned), "gram" candidates scored from the Gram
    matrix (see :meth:`search_scale`)."""

    spec: ArchSpec
    opts: AWQSettings
    prefix: str
    sink: LayerSink
    rows: int = 0
    seqlen: int = 0
    timings: dict = field(default_factory=lambda: {"search": 0.0, "clip": 0.0, "quantize": 0.0})
    search_work: dict = field(default_factory=lambda: {"slices": 0, "slices_run": 0, "gram": 0})
    _caches: dict = field(default_factory=dict)
    _fill: dict = field(default_factory=dict)
    _last_best: dict = field(default_factory=dict)  # grid index that won, per inspect module

    # ---- capture -------------------------------------------------------------------------

    def hooks(self, index: int, layer: nn.Module):
        """Forward pre-hooks on the first linear of each input set; they copy every batch's
        input into a buffer [rows, seqlen, in_features] on the hidden-state device (the
        caches AutoAWQ keeps per layer). Returns the hook handles."""
        self._caches.clear()
        self._fill.clear()
        handles = []
        for s in self.spec.inputs:
            name = s[0]
            try:
                mod = layer.get_submodule(name)
            except AttributeError:
                raise InputError(f"decoder layer {index} has no module '{name}' (model_type "
                                 f"{self.spec.model_type})") from None

            def pre(m, args, name=name):
                x = args[0]
                buf = self._caches.get(name)
                if buf is None:
                    buf = torch.empty(self.rows, self.seqlen, x.shape[-1], dtype=x.dtype, device=x.device)
                    self._caches[name] = buf
                    self._fill[name] = 0
                a = self._fill[name]
                buf[a:a + x.shape[0]].copy_(x)
                self._fill[name] = a + x.shape[0]

            handles.append(mod.register_forward_pre_hook(pre))
        return handles

    # ---- per layer -----------------------------------------------------------------------

    def on_layer(self, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                 ctx) -> None:
        """Engine callback: scale, clip, quantize and hand over layer ``index``. Returns None,
        so the next layer gets this layer's FP16 (unquantized) output."""
        caches, self._caches = self._caches, {}
        try:
            self.quantize_layer(index, layer, caches, ctx)
        finally:
            caches.clear()

    @torch.no_grad()
    def quantize_layer(self, index: int, layer: nn.Module, caches: dict | None = None, ctx=None) -> None:
        """AWQ (or RTN with ``opts.rtn``) of one decoder layer. ``caches``: captured inputs
        by linear name (needed unless ``opts.rtn``); ``ctx``: the engine's
        :class:`~calibration.engine.LayerContext` (runs modules over all rows)."""
        o = self.opts
        t16 = self.float16_tensors(index, layer)
        shapes = {n: tuple(t16[n + ".weight"].shape) for n in self.spec.linears}
        why = {n: qawq.check_shape(*shapes[n], o.group_size) for n in self.spec.linears}
        if not o.rtn:
            if caches is None or ctx is None:
                raise ValueError("AWQ needs the captured inputs and the layer context")
            t0 = time.perf_counter()
            found = []
            for g in self.spec.groups:
                if not self.group_applies(g, shapes) or any(why[n] for n in g.layers):
                    continue
                found.append((g, self.search_scale(g, layer, t16, caches, ctx)))
            for g, s in found:
                self.fold(g, s, t16, caches)
            self.timings["search"] += time.perf_counter() - t0
            if o.clip:
                t0 = time.perf_counter()
                for n in self.spec.linears:
                    if why[n] is None and self.spec.clipped(n):
                        x = caches[self.spec.input_of(n)]
                        mx = qawq.best_clip(t16[n + ".weight"], x, o.bits, o.group_size)
                        t16[n + ".weight"] = qawq.apply_clip(t16[n + ".weight"], mx, o.group_size)
                self.timings["clip"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        out, results = {}, []
        lp = f"{self.prefix}{index}."
        for local, t in t16.items():
            mod_name = local.rsplit(".", 1)[0]
            if local.endswith(".weight") and mod_name in why and why[mod_name] is None:
                gq = qawq.pseudo_quantize(t, o.bits, o.group_size)
                for k, v in qawq.pack_gemm(gq).items():
                    out[f"{lp}{mod_name}.{k}"] = v.cpu()
                d = (gq.w_fq.float() - t.float())
                rel = float(d.pow(2).mean().sqrt() / t.float().pow(2).mean().sqrt().clamp_min(1e-30))
                results.append(LinearResult(lp + mod_name, shapes[mod_name], True,
                                            digest=tensor_digest(gq.w_fq), rel_rmse=rel))
                del gq, d
            else:
                out[lp + local] = t.cpu()
                if local.endswith(".weight") and mod_name in why:
                    results.append(LinearResult(lp + mod_name, shapes[mod_name], False, why[mod_name]))
        self.timings["quantize"] += time.perf_counter() - t0
        self.sink(index, out, results)

    def float16_tensors(self, index: int, layer: nn.Module) -> dict[str, torch.Tensor]:
        """The layer's tensors (local names) in float16, on the layer's device: the values AWQ
        scales, clips and quantizes (AutoAWQ works on the fp16 model). Raises InputError naming
        the tensor when a value is outside float16's range, or when a linear of the
        architecture's spec is missing."""
        t16 = {}
        for name, p in layer.state_dict().items():
            h = p.detach().to(torch.float16)
            if not bool(torch.isfinite(h).all()) and bool(torch.isfinite(p).all()):
                raise InputError(f"tensor '{self.prefix}{index}.{name}' has values outside the "
                                 f"float16 range (max |w| = {float(p.abs().max()):.4g}); AWQ "
                                 f"checkpoints are float16")
            t16[name] = h
        for n in self.spec.linears:
            if n + ".weight" not in t16:
                raise InputError(f"decoder layer {index} has no linear '{n}' (model_type "
                                 f"{self.spec.model_type})")
        return t16

    @staticmethod
    def group_applies(g: ScaleGroup, shapes: dict) -> bool:
        """Whether scale group ``g`` is searched for a layer with these linear ``shapes``
        ({local name: (out, in)}): ``when = "same_shape"`` (v→o) only when v_proj and o_proj
        have the same shape, i.e. multi-head attention (AutoAWQ ``LlamaAWQForCausalLM``
        ``get_layers_for_scaling``)."""
        if g.when is None:
            return True
        if g.when == "same_shape":
            return shapes.get(g.prev_op) == shapes[g.layers[0]]
        raise ValueError(f"unknown condition '{g.when}' in awq_arch.toml")

    def search_scale(self, g: ScaleGroup, layer: nn.Module, t16: dict, caches: dict, ctx) -> torch.Tensor:
        """The best scale of group ``g``, float32 [in_features] (AutoAWQ ``_search_best_scale``):
        the 20-point grid of :func:`quantpress.quantize.awq.grid_scales`, each scored by the
        MSE between the group's inspect module's output with fake-quantized scaled weights and
        its output with the original weights (``t16``) over all captured inputs (``caches``),
        run through ``ctx`` (the engine's :class:`~quantpress.calibration.engine.LayerContext`).
        The lowest loss wins, the lowest grid index among equal losses; when every loss is
        NaN the scale is all ones. The layer's own weight tensors are put back afterwards.

        Two exact shortcuts (the same FLOPs AutoAWQ and llm-compressor spend, less of them):

        - **Pruning** (branch and bound, :meth:`_forward_scorer`): a candidate runs over the
          rows slice by slice and stops once its squared errors so far exceed the best
          complete loss; the grid is visited from the index that won this group in the
          previous layer outwards, so a good bound comes early. A candidate that is not
          pruned gets :func:`~quantpress.quantize.awq.output_loss`'s value bit for bit where
          the slices' forwards equal one batch's row by row (torch 2.13's CPU matmuls and
          attention do for every shape of SmolLM2 and the test models), so the winner is the
          plain search's (tests/test_awq.py compares them).
        - **Gram matrix** (:meth:`_gram_scorer`): when the inspect module is the group's only
          linear (down_proj; o_proj of multi-head attention) and it has fewer input features
          than calibration tokens, the loss is ``Σ (ΔW·XᵀX) ∘ ΔW`` from XᵀX computed once
          (:func:`~quantpress.quantize.awq.linear_output_loss`): the same loss up to
          float32 rounding, in in/tokens of the multiply-adds, for every candidate whose
          outputs are provably below float16's limit (the others run forwards)."""
        o = self.opts
        x = caches[self.spec.input_of(g.layers[0])]
        n_tok = x.shape[0] * x.shape[1]
        x_mean = qawq.input_mean(x.reshape(n_tok, -1).abs().sum(0, dtype=torch.float32), n_tok)
        w_orig = [t16[n + ".weight"] for n in g.layers]
        w_mean = qawq.weight_mean(w_orig, o.group_size)
        mods = [layer.get_submodule(n) for n in g.layers]
        dtype = mods[0].weight.dtype
        originals = [m.weight.data for m in mods]
        forward = functools.partial(self._forward_scorer, g, layer, mods, x, ctx)
        score = self._gram_scorer(g, mods, x, forward) or forward()
        start = self._last_best.get(g.inspect, qawq.N_GRID // 2)
        order = sorted(range(qawq.N_GRID), key=lambda k: (abs(k - start), k))
        best, best_k, best_loss = None, qawq.N_GRID, float("inf")
        try:
            for k in order:
                s = qawq.grid_scales(x_mean.to(x.device), w_mean.to(x.device), k / qawq.N_GRID, o.duo_scaling)
                wq = [qawq.scaled_fake_quant(w, s.to(w.device), o.bits, o.group_size).to(dtype)
                      for w in w_orig]
                loss = score(wq, best_loss)
                if loss is not None and (loss < best_loss or (loss == best_loss and k < best_k)):
                    best, best_k, best_loss = s.clone(), k, loss
        finally:  # the layer's own tensors back: other consumers of the pass read them
            for m, w in zip(mods, originals):
                m.weight.data = w
        if best is None:  # every loss was NaN: keep the identity
            return torch.ones_like(x_mean)
        self._last_best[g.inspect] = best_k
        return best

    def _forward_scorer(self, g: ScaleGroup, layer: nn.Module, mods: list, x: torch.Tensor, ctx):
        """``score(weights, best_loss)`` of :meth:`search_scale` by forwards of the inspect
        module: sets the group's linears to ``weights``, runs the slices of
        :func:`search_slice_rows` rows and returns the loss, or None as soon as the squared
        errors so far exceed ``best_loss`` by a relative 1e-6 (far above float64's summation
        error, so a pruned candidate's loss is surely higher)."""
        inspect = layer.get_submodule(g.inspect)
        what = f"{g.inspect} of decoder layer {ctx.index}"
        y0 = ctx.forward(inspect, x, with_kwargs=g.kwargs, what=what).clamp(-FP16_MAX, FP16_MAX)
        # one output buffer and one float64 loss scratch for every grid point (at 128 x 512
        # tokens fresh [rows, seq, hidden] temporaries per point were mapped and faulted anew)
        y = torch.empty_like(y0)
        scratch = torch.empty(y0.shape, dtype=torch.float64, device=y0.device)
        rows, step = x.shape[0], search_slice_rows(x.shape[1], ctx.batch_size, ctx.model.device)
        work = self.search_work

        def score(weights: list, best_loss: float) -> float | None:
            for m, w in zip(mods, weights):
                m.weight.data = w
            bound, so_far = best_loss * (1 + 1e-6) * y0.numel(), 0.0
            work["slices"] += -(-rows // step)
            for a in range(0, rows, step):
                ya = ctx.forward(inspect, x[a:a + step], with_kwargs=g.kwargs, what=what,
                                 out=y[a:a + step], first_row=a).clamp_(-FP16_MAX, FP16_MAX)
                so_far += qawq.squared_errors(y0[a:a + step], ya, scratch[a:a + step])
                work["slices_run"] += 1
                if so_far > bound:
                    return None
            return float(scratch.sum()) / y0.numel()
        return score

    def _gram_scorer(self, g: ScaleGroup, mods: list, x: torch.Tensor, fallback):
        """``score(weights, best_loss)`` of :meth:`search_scale` from the inputs' Gram matrix,
        or None when it does not apply: the inspect module must be the group's only linear,
        with fewer input features than tokens. The Gram form equals the forward form only
        while no output reaches float16's limit (where the forward form clamps), so each
        candidate's outputs are bounded first, by the smaller of max‖x_t‖·max‖w_o‖ and
        max_o Σ_i max_t|x_ti|·|w_oi| (plus max |bias|); a candidate (or an original weight)
        whose bound reaches FP16_MAX is scored by ``fallback()``'s forward scorer instead."""
        if len(g.layers) != 1 or g.inspect != g.layers[0] or not isinstance(mods[0], nn.Linear):
            return None
        lin = mods[0]
        xf = x.reshape(-1, x.shape[-1])
        if xf.shape[1] >= xf.shape[0]:
            return None
        x_norm = float(torch.linalg.vector_norm(xf, dim=1, dtype=torch.float32).max())
        x_absmax = xf.abs().amax(0).float()
        b_max = float(lin.bias.abs().max()) if lin.bias is not None else 0.0

        def reach(w: torch.Tensor) -> float:
            wf = w.float()
            by_norm = x_norm * float(torch.linalg.vector_norm(wf, dim=1).max())
            by_channel = float((wf.abs() @ x_absmax.to(wf.device)).max())
            return min(by_norm, by_channel) + b_max

        limit = FP16_MAX * (1 - 1e-3)  # room for the float32 rounding of the bound itself
        w0 = lin.weight.data.float()
        if not reach(w0) < limit:  # also False for NaN
            return None
        gram = qawq.input_gram(xf)
        forward = []

        def score(weights: list, best_loss: float) -> float | None:
            if not reach(weights[0]) < limit:
                if not forward:
                    forward.append(fallback())
                return forward[0](weights, best_loss)
            self.search_work["gram"] += 1
            return qawq.linear_output_loss(weights[0].float() - w0, gram, xf.shape[0])
        return score

    def fold(self, g: ScaleGroup, s: torch.Tensor, t16: dict, caches: dict) -> None:
        """Apply scale ``s`` [in_features] of group ``g`` in place (AutoAWQ ``apply_scale``):
        the previous op (a norm, or the last ``len(s)`` output rows and bias of a linear) is
        divided by s, the group's input columns multiplied by s, in float16; the captured
        inputs in ``caches`` are divided by s."""
        s = s.to(torch.float16)
        prev_w = g.prev_op + ".weight"
        pw = t16[prev_w]
        sv = s.to(pw.device)
        if pw.ndim == 1:  # a norm
            t16[prev_w] = pw / sv
            if g.prev_op + ".bias" in t16:
                t16[g.prev_op + ".bias"] = t16[g.prev_op + ".bias"] / sv
        else:  # a linear: its last len(s) output rows and their bias
            n = s.numel()
            pw = pw.clone()
            pw[-n:] = pw[-n:] / sv.view(-1, 1)
            t16[prev_w] = pw
            if g.prev_op + ".bias" in t16:
                b = t16[g.prev_op + ".bias"].clone()
                b[-n:] = b[-n:] / sv
                t16[g.prev_op + ".bias"] = b
        for n in g.layers:
            w = t16[n + ".weight"]
            t16[n + ".weight"] = w * s.to(w.device).view(1, -1)
        x = caches[self.spec.input_of(g.layers[0])]
        x.div_(s.to(x.device, x.dtype).view(1, 1, -1))
