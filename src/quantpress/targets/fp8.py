"""FP8 E4M3 directories in the compressed-tensors format (``quantize fp8``): an HF model
directory → a verified directory that vLLM (``compressed-tensors``) and transformers load, as
llm-compressor 0.14 writes it with the FP8_DYNAMIC, FP8 or FP8_BLOCK preset.

Stages: the decoder layers streamed one at a time — ``dynamic`` and ``block`` read each
layer's tensors from the checkpoint (no forward pass, no calibration); ``static`` runs the
calibration rows through the layer-streaming engine on the reference hidden states (a pass
that ``quantize batch`` shares with the other calibrated outputs of the model), capturing the
largest |x| at every linear's input (:class:`quantpress.calibration.stats.StatsCollector`,
kind ``amax``). That forward pass runs in the compute dtype, which ``quantize fp8`` fixes at
float32 whatever the checkpoint's dtype (it offers no ``--dtype``), so that the input scales
do not depend on an option; in a batch, the pass is the model's shared one, in the job's
``dtype`` (float32 unless the job sets it) — each linear quantized by the codec :mod:`quantpress.quantize.fp8` in the
checkpoint's own dtype, on the compute device → :func:`quantpress.convert.fp8_dir.dir_writer`
(a part file per layer, then shards, index, config, tokenizer files) → the round trip (every
linear re-read from the final files and dequantized by the container's reference procedure,
:func:`quantpress.convert.fp8_dir.dequantize_reference`; it must equal the codec's own
dequantized weight bit for bit) → rename into place (by the runner).
"""
from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from quantpress.calibration.awq import tensor_digest
from quantpress.calibration.stats import StatsCollector
from quantpress.convert import awq_dir, fp8_dir
from quantpress.errors import InputError, RoundTripError
from quantpress.quantize import fp8
from quantpress.memory import bound_heap, trim_heap
from quantpress.targets import hfdir
from quantpress.targets.base import Run, Summary, Target, WriterShare, reference_pass
from quantpress.targets.options import option
from quantpress.targets.registry import Estimate, Verb

#: what the activations become at inference, per scheme (the config's input_activations)
ACTIVATIONS = {"dynamic": "dynamic per token", "static": "static per tensor (input_scale)",
               "block": "dynamic per group of 128"}
#: linears vLLM fuses into one: each group must be all quantized or all ignored
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class FP8Options:
    """``scheme``: ``dynamic`` (per-output-channel weight scales, activations scaled per token
    at run time; no calibration), ``static`` (one weight scale per tensor and one calibrated
    ``input_scale`` per linear, max |x| / 448 over the calibration rows in a float32 forward
    pass, stored in the checkpoint's dtype) or ``block`` (one
    scale per 128 × 128 weight block, activations per group of 128 at run time; no
    calibration). ``ignore``: more linears to keep in the source precision besides
    ``lm_head`` (module names, or ``re:REGEX`` matched from the start of the name, as
    compressed-tensors matches them; q/k/v and gate/up go together since vLLM fuses them).
    ``max_shard_size``: safetensors shard size ("5GB", "500MB", "2GiB" or bytes).
    ``lm_head``: quantize lm_head too, with the same scheme (with tied embeddings the output
    gets its own FP8 ``lm_head`` and ``tie_word_embeddings: false``; the embedding stays)."""

    scheme: str = option("dynamic", flag="--scheme",
                         help="dynamic: per-channel weight scales, per-token activation scales at run "
                              "time (default; no calibration); static: per-tensor weight scales and "
                              "input_scale calibrated by a float32 forward pass; block: one scale per "
                              "128x128 weight block")
    ignore: tuple[str, ...] = option((), flag="--ignore", nargs="+", metavar="NAME",
                                     help="more linears to keep unquantized besides lm_head: module "
                                          "names or re:REGEX")
    max_shard_size: str = option("5GB", flag="--max-shard-size",
                                 help="safetensors shard size (default {default})")
    lm_head: bool = option(False, flag="--lm-head",
                           help="quantize lm_head too (tied embeddings: a separate FP8 lm_head, the "
                                "embedding kept)")

    def validate(self) -> None:
        """InputError naming the option: an unknown scheme, an ignore entry that is not a
        non-empty string or a bad ``re:`` regex, a shard size that is no size."""
        if self.scheme not in fp8.SCHEMES:
            raise InputError(f"--scheme {self.scheme!r}: choose dynamic (per-channel weights, dynamic "
                             f"per-token activations), static (per-tensor weights and calibrated "
                             f"activation scales) or block (128x128 weight blocks)")
        if isinstance(self.ignore, str) or not isinstance(self.ignore, (tuple, list)):
            raise InputError(f"--ignore {self.ignore!r}: expected a list of module names or re:REGEX")
        for p in self.ignore:
            if not isinstance(p, str) or not p or p == "re:":
                raise InputError(f"--ignore {p!r}: expected a module name or re:REGEX")
            if p.startswith("re:"):
                try:
                    re.compile(p[3:])
                except re.error as e:
                    raise InputError(f"--ignore {p!r}: not a regular expression ({e})") from None
        awq_dir.parse_size(self.max_shard_size)
        if not isinstance(self.lm_head, bool):
            raise InputError(f"--lm-head {self.lm_head!r}: expected true or false")

    @property
    def label(self) -> str:
        """``FP8-<scheme>``: FP8-dynamic, FP8-static or FP8-block (``-head`` with ``lm_head``)."""
        return f"FP8-{self.scheme}" + ("-head" if self.lm_head else "")


@dataclass
class FP8Linear:
    """One linear of the output: ``name`` (full module name), ``shape`` [N, K], ``quantized``
    (False: kept in the source precision, listed in ``ignore``), ``digest`` (SHA-256 of the
    codec's dequantized weight, for the round trip), ``scale_dtype``, ``rel_rmse`` of the
    dequantized weight against the source weight, ``input_scale`` (static)."""

    name: str
    shape: tuple[int, int]
    quantized: bool
    digest: str = ""
    scale_dtype: str = ""
    rel_rmse: float = 0.0
    input_scale: float | None = None


def _linears(layer: nn.Module) -> list[str]:
    return [n for n, m in layer.named_modules() if isinstance(m, nn.Linear)]


def verify_fp8_dir(path: Path, scheme: str, records: list[FP8Linear], ignore: list[str],
                   shapes: dict[str, tuple[int, ...]]) -> str:
    """Round trip of a written FP8 directory: its config must say ``scheme``'s weight strategy
    and activations and list ``ignore``; every quantized linear of ``records`` is read back
    from the final files (float8_e4m3fn weight, finite positive scales of the recorded dtype,
    an ``input_scale`` [1] equal to the recorded one for ``static``), dequantized by
    :func:`quantpress.convert.fp8_dir.dequantize_reference` (independent of the codec), and its
    SHA-256 must equal the digest of the codec's dequantized weight; every linear kept in the
    source precision and every other tensor of ``shapes`` (name → shape, what the model
    needs) must be there with its shape. Raises RoundTripError naming the first tensor that
    differs."""
    try:
        w = fp8_dir.FP8Weights(path)
    except InputError as e:
        raise RoundTripError(f"round trip: {e}") from None
    f = w.format
    if f.strategy != fp8.WEIGHT_STRATEGY[scheme] or f.static_inputs != (scheme == "static"):
        raise RoundTripError(f"round trip: {path}/config.json says weight strategy {f.strategy}, static "
                             f"inputs {f.static_inputs}; expected the {scheme} scheme")
    if list(f.ignore) != list(ignore):
        raise RoundTripError(f"round trip: {path}/config.json ignores {list(f.ignore)}, expected {ignore}")
    def stored(r):
        wname = r.name + ".weight"
        q = w.raw.get(wname)
        sc = w.raw.get(r.name + ".weight_scale")
        if q.dtype != torch.float8_e4m3fn:
            raise RoundTripError(f"round trip: '{wname}' is stored as {q.dtype}, expected float8_e4m3fn")
        if str(sc.dtype) != r.scale_dtype or not bool(torch.isfinite(sc).all()) or bool((sc <= 0).any()):
            raise RoundTripError(f"round trip: '{r.name}.weight_scale' is {sc.dtype} with a non-positive or "
                                 f"non-finite scale, or not {r.scale_dtype}")
        if scheme == "static":
            key = r.name + ".input_scale"
            if key not in w.raw:
                raise RoundTripError(f"round trip: '{key}' is missing from {path}")
            s_in = w.raw.get(key)
            if tuple(s_in.shape) != (1,) or str(s_in.dtype) != r.scale_dtype or float(s_in) != r.input_scale:
                raise RoundTripError(f"round trip: '{key}' is {s_in.dtype} {tuple(s_in.shape)} = "
                                     f"{s_in.flatten()[:1].tolist()}, expected {r.scale_dtype} (1,) = {r.input_scale}")

    n = hfdir.verify_linears(path, w, records, stored)
    for name, shape in shapes.items():
        if name not in w:
            raise RoundTripError(f"round trip: tensor '{name}' is missing from {path}")
        if not w.is_quantized(name) and tuple(w.raw.shape(name)) != tuple(shape):
            raise RoundTripError(f"round trip: '{name}' has shape {tuple(w.raw.shape(name))}, expected {tuple(shape)}")
    w.raw.close()
    return f"ok ({n} linears bit-identical to the codec's dequantized weights)"


class FP8Target(Target, kind="fp8", options=FP8Options, output_is_dir=True):
    """An FP8 E4M3 compressed-tensors directory (:class:`FP8Options`).

    Every ``nn.Linear`` of the decoder layers is quantized but those the options ignore;
    ``lm_head``, the embeddings, the norms and biases are copied as they are. Bad input
    (InputError, before anything is written): a source that is not an HF directory, an
    ``ignore`` entry that matches no linear or splits a group vLLM fuses, compressed-tensors
    missing, too little calibration text (static); later, a NaN/Inf weight or activation
    (naming the tensor or linear)."""

    reference_stage = "layers"
    resumable = True
    writer: fp8_dir.ModelDirWriter | None = None
    # no --dtype: the codec rounds every weight in the checkpoint's own dtype, whatever the
    # compute dtype, and static's calibration pass runs in float32 (the default compute
    # dtype): its input scales are those of one defined dtype, not of an option
    verbs = (Verb("quantize", "fp8", "FP8 E4M3 weights (and activation scales) in the "
                                     "compressed-tensors format (vLLM, transformers)", dtype=False),)
    job_key = "fp8"
    job_order = 50
    runtimes = "vLLM, transformers (compressed-tensors)"
    stream = "reference"
    job_target_format = "{o.scheme}"
    job_path_format = "{name}-{o.label}"

    @classmethod
    def feeds(cls, options: FP8Options) -> str | None:
        return "fp8 static input scales" if options.scheme == "static" else None

    @classmethod
    def estimate(cls, info, options: list[FP8Options]) -> Estimate:
        """One byte per decoder-linear weight, the rest float16; static input scales watch
        the linears' inputs (4X)."""
        return Estimate([int(info.linear + 2 * (info.total - info.linear)) for _ in options],
                        consumers=[16 * info.tokens * info.hidden for o in options if o.scheme == "static"])

    def prepare(self, run: Run) -> None:
        bound_heap()
        src, o = self.source, self.options
        src.require_hf("FP8")
        fp8_dir.require_compressed_tensors()
        self.max_shard = awq_dir.parse_size(o.max_shard_size)
        self.sm = sm = src.streaming_model()
        names = [f"{sm.layer_prefix}{i}.{sub}" for i in range(sm.num_layers)
                 for sub in _linears(sm.layer_skeleton(i))]
        for p in o.ignore:
            if not any(fp8_dir.matches(n, p) for n in names + [sm.lm_head_name]):
                raise InputError(f"--ignore {p!r} matches no linear layer of {src.path} "
                                 f"(e.g. {names[0] if names else sm.lm_head_name})")
        skipped = {n for n in names if any(fp8_dir.matches(n, p) for p in o.ignore)}
        for n in sorted(skipped):
            head, _, leaf = n.rpartition(".")
            for group in FUSED:
                if leaf in group:
                    split = [f"{head}.{g}" for g in group if f"{head}.{g}" in names and f"{head}.{g}" not in skipped]
                    if split:
                        raise InputError(f"--ignore keeps '{n}' unquantized but not {split}: vLLM fuses "
                                         f"{'/'.join(group)} and needs them quantized alike")
        self.skipped = skipped
        if o.lm_head and any(fp8_dir.matches(sm.lm_head_name, p) for p in o.ignore):
            raise InputError(f"--lm-head and --ignore {sm.lm_head_name}: quantize it or keep it, not both")
        #: the config's ignore list: the skipped decoder linears in model order, then the head
        #: unless it is quantized
        self.ignore_list = [n for n in names if n in skipped] + ([] if o.lm_head else [sm.lm_head_name])
        self.rows, self.text = None, ""
        if o.scheme == "static":
            with run.stage("tokenize"):
                self.rows, self.text = src.calibration_rows()
        self.records: list[FP8Linear] = []
        self.timings = {"quantize": 0.0}

    # ---- one layer -------------------------------------------------------------------------

    def _quantize(self, full: str, w: torch.Tensor, amax: dict[str, float] | None, out: dict) -> None:
        """Quantize linear ``full`` (weight ``w`` [N, K] on the compute device) into ``out``
        (weight, weight_scale, input_scale for static) and record it."""
        scheme = self.options.scheme
        name = full + ".weight"
        q, scale = fp8.quantize_fp8(w, scheme, name=name)
        deq = fp8.dequantize_fp8(q, scale, scheme)
        norm = torch.linalg.vector_norm(w, dtype=torch.float32)
        rel = float(torch.linalg.vector_norm(deq - w, dtype=torch.float32) / norm) if float(norm) else 0.0
        rec = FP8Linear(full, tuple(w.shape), True, tensor_digest(deq), str(scale.dtype), rel)
        out[name] = q.cpu()
        out[full + ".weight_scale"] = scale.cpu()
        if scheme == "static":
            if amax is None or full not in amax:
                raise InputError(f"{full}: no activations reached its input in the calibration pass")
            s_in = fp8.input_scale(amax[full], w.dtype)
            out[full + ".input_scale"] = s_in.cpu()
            rec.input_scale = float(s_in)
        self.records.append(rec)

    def _layer(self, index: int, amax: dict[str, float] | None = None) -> dict:
        """Every tensor of decoder layer ``index`` as written: its linears quantized (records
        appended), the rest as stored in the checkpoint."""
        t0 = time.perf_counter()
        sm = self.sm
        prefix = f"{sm.layer_prefix}{index}."
        skel = sm.layer_skeleton(index)
        lin = set(_linears(skel))
        dev = self.source.device
        out = {}
        for local in skel.state_dict():
            name = prefix + local
            mod, _, leaf = local.rpartition(".")
            full = prefix + mod
            if leaf != "weight" or mod not in lin:
                out[name] = sm.weights.get(name, "cpu")
                continue
            if full in self.skipped:
                w = sm.weights.get(name, "cpu")
                out[name] = w
                self.records.append(FP8Linear(full, tuple(w.shape), False))
                continue
            self._quantize(full, sm.weights.get(name, dev), amax, out)
        self.timings["quantize"] += time.perf_counter() - t0
        return out

    def _start(self, tmp: Path, resume: bool = False) -> None:
        """The writer at ``tmp`` (embedding first; with ``resume`` an interrupted one, whose
        parts are adopted when the pass resumes). A stale ``tmp`` of an interrupted run that
        cannot be resumed is removed first."""
        if not resume and tmp.exists():
            shutil.rmtree(tmp)
        self.writer = fp8_dir.dir_writer(tmp, self.max_shard, resume=resume)
        if not resume:
            name = self.sm.embed_name + ".weight"
            self.writer.add({name: fp8_dir.source_rows(self.sm.weights, name)})

    # ---- static: the shared reference pass --------------------------------------------------

    def wants_reference(self) -> bool:
        """Only ``static`` needs the reference hidden states (the activation maxima of the
        calibration rows, as llm-compressor's ``static_minmax`` observer sees them in the
        unquantized model); ``dynamic`` and ``block`` need no forward pass."""
        return self.options.scheme == "static"

    def _hooks(self, index: int, layer: nn.Module):
        """Before layer ``index`` runs: its linear weights must be finite (InputError naming
        the tensor, rather than the NaN activations they would cause), then the input-maximum
        hooks."""
        for sub in _linears(layer):
            mod = layer.get_submodule(sub)
            if f"{self.sm.layer_prefix}{index}.{sub}" not in self.skipped:
                fp8.check_finite(mod.weight, f"{self.sm.layer_prefix}{index}.{sub}.weight")
        return self.collector(index, layer)

    def _on_layer(self, index, layer, inputs, outputs, ctx) -> None:
        prefix = f"{self.sm.layer_prefix}{index}."
        stats = self.collector.stats
        mine = [k for k in stats if k.startswith(prefix)]
        amax = {k: float(stats[k].amax().max()) for k in mine}
        for k in mine:
            del stats[k]
        self.writer.add(self._layer(index, amax))
        if self.options.lm_head and index == self.sm.num_layers - 1:
            # lm_head's input: the final norm of the last layer's output
            # (kept with the timings: a checkpoint saves them with every layer)
            self.timings["head_amax"] = float(self.sm.final_norm(outputs).abs().amax())
        return None

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> WriterShare:
        """Input-maximum hooks on every linear and the layer writer, writing into ``tmp``, with
        its share of a checkpoint."""
        self._start(tmp, resume)
        self.collector = StatsCollector(kinds={"amax"}, prefix=self.sm.layer_prefix)
        return WriterShare(self.writer, self.records, self.sm.layer_prefix, self,
                           hooks=self._hooks, on_layer=self._on_layer)

    # ---- the steps -------------------------------------------------------------------------

    def write(self, tmp: Path, run: Run) -> None:
        sm, o, src = self.sm, self.options, self.source
        if o.scheme == "static":
            if self.writer is None:
                consumer = self.reference_consumer(tmp, run)
                with run.stage("layers"):
                    reference_pass(src, [consumer], run.progress)
            run.split("layers", {"calibration": 0.0, "quantize": self.timings["quantize"]})
        else:
            self._start(tmp)
            with run.stage("quantize"):
                for i in run.bar(range(sm.num_layers), "layers", "layer"):
                    self.writer.add(self._layer(i))
                    trim_heap()
        with run.stage("write"):
            rest = {sm.norm_name + ".weight": sm.weights.get(sm.norm_name + ".weight", "cpu")}
            head = sm.lm_head_name + ".weight"
            config = dict(src.config)
            if o.lm_head:   # the embedding matrix when tied: the output unties them
                stored = sm.embed_name + ".weight" if sm.tied_embeddings else head
                amax = {sm.lm_head_name: self.timings["head_amax"]} if "head_amax" in self.timings else None
                self._quantize(sm.lm_head_name, sm.weights.get(stored, src.device), amax, rest)
                config["tie_word_embeddings"] = False
            elif not sm.tied_embeddings:
                rest[head] = fp8_dir.source_rows(sm.weights, head)
            self.writer.add(rest)
            self.writer.finish(fp8_dir.fp8_config(config, o.scheme, self.ignore_list), src.path)
        self.tensor_bytes = self.writer.total_bytes

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the transformers model needs, by checkpoint name → shape (the head
        left out when it is the embedding)."""
        sm = self.sm
        shapes = sm.skeleton_shapes()
        if sm.tied_embeddings and not self.options.lm_head:
            shapes.pop(sm.lm_head_name + ".weight", None)
        return shapes

    def verify(self, tmp: Path, run: Run) -> str:
        return verify_fp8_dir(tmp, self.options.scheme, self.records, self.ignore_list, self._shapes())

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        o = self.options
        q = [r for r in self.records if r.quantized]
        rel = sum(r.rel_rmse for r in q) / max(1, len(q))
        rows, seqlen = (0, 0) if self.rows is None else tuple(self.rows.shape)
        dtype = q[0].scale_dtype.replace("torch.", "") if q else "source"
        strategy = fp8.WEIGHT_STRATEGY[o.scheme]
        lines = [f"linears    {len(q)} of {len(self.records)} to FP8 E4M3 ({o.scheme}: weights per "
                 f"{strategy}, activations {ACTIVATIONS[o.scheme]}), scales {dtype}; kept as they "
                 f"are: {hfdir.shown(self.ignore_list) or 'none'}",
                 f"calibration {rows} rows x {seqlen} tokens of {self.text}" if rows else
                 "calibration none (activation scales computed at run time)",
                 f"weights    mean relative RMSE of the FP8 weights {rel:.4f}"]
        unaligned = [r.name for r in q if r.shape[0] % fp8.BLOCK or r.shape[1] % fp8.BLOCK]
        if o.scheme == "block" and unaligned:
            lines.append(f"note       {len(unaligned)} linears have a dimension that is not a multiple of "
                         f"{fp8.BLOCK} (e.g. {unaligned[0]} {q[[r.name for r in q].index(unaligned[0])].shape}); "
                         f"vLLM's block kernels may refuse them")
        details = {"scheme": o.scheme, "weight_strategy": strategy, "activations": ACTIVATIONS[o.scheme],
                   "scale_dtype": dtype, "linears_quantized": len(q), "linears": len(self.records),
                   "ignore": list(self.ignore_list), "calibration": {"rows": rows, "seqlen": seqlen},
                   "mean_rel_rmse": rel}
        if o.scheme == "block":
            details["block_unaligned"] = len(unaligned)
        return Summary(self.kind, o.label, out, str(self.source.path), tensor_bytes=self.tensor_bytes,
                       parameters=self.source.parameter_count(), roundtrip=roundtrip, details=details,
                       lines=lines)
