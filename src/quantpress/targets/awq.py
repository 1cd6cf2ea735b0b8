"""AutoAWQ GEMM directories (``quantize awq``): an HF model directory → a verified directory
that vLLM (``awq`` / ``awq_marlin``) and transformers load.

Stages: calibration rows (the :class:`~quantpress.targets.base.Source`'s) → the layer-streaming
engine with :class:`quantpress.calibration.awq.LayerQuantizer` (capture, scale search, folding,
clipping, fake quantization and packing per layer) → :func:`quantpress.convert.awq_dir.dir_writer`
(a part file per layer, then shards, index, config, tokenizer files) → the round trip (every
quantized linear re-read from the final files and dequantized by the reference procedure of
:func:`quantpress.convert.awq_dir.dequantize_gemm`; it must equal the quantizer's fake-quantized
float16 weight bit for bit) → rename into place (by the runner).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from quantpress.calibration import awq as cawq
from quantpress.convert import awq_dir
from quantpress.errors import InputError, RoundTripError
from quantpress.memory import bound_heap, trim_heap
from quantpress.targets import hfdir
from quantpress.targets.base import Run, Summary, Target, WriterShare, reference_pass
from quantpress.targets.options import option
from quantpress.targets.registry import Estimate, Verb


@dataclass(frozen=True)
class AWQOptions:
    """``bits`` (4: the GEMM layout), ``group_size`` (input columns per scale and zero point),
    ``duo_scaling`` (s = x^r / w^(1−r), AutoAWQ's default; False: llm-awq's s = x^r), ``clip``
    (the clipping search), ``rtn`` (no calibration: plain round-to-nearest of every linear with
    the same quantizer and packing, the baseline), ``max_shard_size`` (safetensors shard size,
    "5GB", "500MB", "2GiB" or bytes)."""

    bits: int = option(4, flag="--bits", help="weight bits (4: the GEMM layout)")
    group_size: int = option(128, flag="--group-size",
                             help="input columns per scale and zero point (default {default}; 64 "
                                  "for widths like 576)")
    duo_scaling: bool = option(True, flag="--duo-scaling", off="--no-duo-scaling",
                               help="s = x^r / w^(1-r) (default, AutoAWQ)",
                               off_help="s = x^r (the original llm-awq grid)")
    clip: bool = option(True, off="--no-clip", off_help="skip the clipping search")
    rtn: bool = option(False, flag="--rtn", help="plain round-to-nearest (no calibration), same "
                                                 "quantizer and packing: the baseline")
    max_shard_size: str = option("5GB", flag="--max-shard-size",
                                 help="safetensors shard size (default {default})")

    def validate(self) -> None:
        """InputError naming the option: bits other than 4, a group size that is not a positive
        integer, a shard size that is no size."""
        if self.bits not in cawq.SUPPORTED_BITS:
            raise InputError(f"--bits {self.bits}: only 4-bit AWQ is supported (the GEMM layout "
                             f"that vLLM and transformers load packs eight 4-bit values per int32)")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0:
            raise InputError(f"--group-size {self.group_size}: must be a positive number of input columns")
        awq_dir.parse_size(self.max_shard_size)

    @property
    def label(self) -> str:
        """``w<bits>g<group_size>``, the usual name of an AWQ output."""
        return f"w{self.bits}g{self.group_size}"

    def settings(self) -> cawq.AWQSettings:
        """The algorithm's settings (:class:`quantpress.calibration.awq.AWQSettings`)."""
        return cawq.AWQSettings(self.bits, self.group_size, self.duo_scaling, self.clip, self.rtn)


def verify_awq_dir(path: Path, results: list[cawq.LinearResult], group_size: int) -> str:
    """Round trip of a written AWQ directory: every quantized linear of ``results`` is read
    back from the final files and dequantized by :func:`quantpress.convert.awq_dir.dequantize_gemm`
    (independent of the packer); its SHA-256 must equal the digest of the quantizer's
    fake-quantized float16 weight, no scale may be zero, and every linear kept FP16 must be
    there as ``.weight``. Raises RoundTripError naming the first linear that differs."""
    w = awq_dir.AWQWeights(path)
    if w.group_size != group_size:
        raise RoundTripError(f"round trip: {path}/config.json says group_size {w.group_size}, "
                             f"expected {group_size}")
    n = hfdir.verify_linears(path, w, results, hfdir.nonzero_scales(w))
    w.raw.close()
    return f"ok ({n} linears bit-identical to the fake-quantized weights)"


def group_bytes(info, bits: int, group_size: int) -> int:
    """Estimated bytes of a checkpoint whose decoder linears take ``bits`` per weight and a
    float16 scale and zero point per ``group_size`` inputs (-1: one group per column), the
    rest float16 (``info``: :class:`~quantpress.targets.registry.ModelInfo`)."""
    g = group_size if group_size > 0 else 1 << 30
    return int(info.linear * (bits / 8 + 2.5 / g) + 2 * (info.total - info.linear))


class AWQTarget(Target, kind="awq", options=AWQOptions, output_is_dir=True):
    """An AutoAWQ GEMM directory (:class:`AWQOptions`).

    Linears whose shape does not fit the group size stay FP16 and are listed in
    ``modules_to_not_convert``. Bad input (InputError, before anything is written): a source
    that is not an HF directory, an architecture without AWQ scale groups, a group size that
    divides no linear's in_features, too little calibration text; later, a weight outside
    float16 or NaN/Inf activations (naming the tensor or layer)."""

    reference_stage = "layers"
    resumable = True
    lq: cawq.LayerQuantizer | None = None
    verbs = (Verb("quantize", "awq", "AWQ (activation-aware) 4-bit quantization to an AutoAWQ GEMM "
                                     "directory (vLLM, transformers)"),)
    job_key = "awq"
    job_order = 30
    runtimes = "vLLM, transformers (AutoAWQ GEMM)"
    stream = "reference"
    job_marks = ("rtn",)
    job_path_format = "{name}-AWQ-{target}"

    @classmethod
    def feeds(cls, options: AWQOptions) -> str | None:
        return None if options.rtn else cls.kind

    @classmethod
    def estimate(cls, info, options: list[AWQOptions]) -> Estimate:
        """Packed codes and a scale and zero point per group; the search holds a
        fake-quantized copy of the layer and its linears' inputs (W + 4X)."""
        return Estimate([group_bytes(info, o.bits, o.group_size) for o in options],
                        consumers=[info.layer + 16 * info.tokens * info.hidden for o in options if not o.rtn])

    def prepare(self, run: Run) -> None:
        bound_heap()
        src, o = self.source, self.options
        src.require_hf("AWQ")
        cfg = src.config
        self.spec = cawq.arch_spec(str(cfg.get("model_type", "")), (cfg.get("architectures") or ["?"])[0])
        self.max_shard = awq_dir.parse_size(o.max_shard_size)
        self.sm = src.streaming_model()
        layer0 = self.sm.layer_skeleton(0)
        in_features = [layer0.get_submodule(n).in_features for n in self.spec.linears]
        if not any(k % o.group_size == 0 for k in in_features):
            raise InputError(f"--group-size {o.group_size} divides no linear layer's in_features "
                             f"({', '.join(map(str, sorted(set(in_features))))}) of {src.path}; "
                             f"try 32, 64 or 128")
        self.rows, self.text = None, ""
        if not o.rtn:
            with run.stage("tokenize"):
                self.rows, self.text = src.calibration_rows()

    def _start(self, tmp: Path, resume: bool = False) -> None:
        """The writer at ``tmp`` (embedding first; with ``resume`` an interrupted one, whose
        parts are adopted when the pass resumes) and the layer quantizer feeding it."""
        sm, o = self.sm, self.options
        self.results: list[cawq.LinearResult] = []
        self.writer = awq_dir.dir_writer(tmp, self.max_shard, resume=resume)
        if not resume:
            self.writer.add(hfdir.embedding_fp16(sm))

        def sink(index, tensors, res):
            self.writer.add(tensors)
            self.results.extend(res)

        self.lq = cawq.LayerQuantizer(self.spec, o.settings(), sm.layer_prefix, sink)
        if not o.rtn:
            self.lq.rows, self.lq.seqlen = self.rows.shape

    def wants_reference(self) -> bool:
        """AWQ's capture and per-layer search run on the reference hidden states (AutoAWQ
        feeds each layer the FP16 output of the unmodified previous one); not with ``rtn``."""
        return not self.options.rtn

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> WriterShare:
        """The layer quantizer, writing into ``tmp``, with its share of a checkpoint."""
        self._start(tmp, resume)
        return WriterShare(self.writer, self.results, self.sm.layer_prefix, self.lq,
                           hooks=self.lq.hooks, on_layer=self.lq.on_layer)

    def write(self, tmp: Path, run: Run) -> None:
        sm, o = self.sm, self.options
        if self.lq is None:
            if tmp.exists():  # an interrupted run's directory: this pass starts afresh
                shutil.rmtree(tmp)
            self._start(tmp)
            with run.stage("layers"):
                if o.rtn:
                    for i in run.bar(range(sm.num_layers), "layers", "layer"):
                        self.lq.quantize_layer(i, sm.load_layer(i))
                        trim_heap()
                else:
                    reference_pass(self.source, [self.lq], run.progress)
        lq, writer = self.lq, self.writer
        t = lq.timings
        run.split("layers", {"quantize+pack": t["quantize"]} if o.rtn else
                  {"calibration": 0.0, "search": t["search"], "clip": t["clip"], "quantize+pack": t["quantize"]})
        with run.stage("write"):
            writer.add({**hfdir.norm_fp16(sm), **hfdir.head_fp16(sm)})
            self.not_converted = [r.name for r in self.results if not r.quantized]
            writer.finish(awq_dir.awq_config(self.source.config, o.bits, o.group_size, self.not_converted),
                          self.source.path)
        self.tensor_bytes = writer.total_bytes

    def verify(self, tmp: Path, run: Run) -> str:
        return verify_awq_dir(tmp, self.results, self.options.group_size)

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        o = self.options
        q = [r for r in self.results if r.quantized]
        rel = sum(r.rel_rmse for r in q) / max(1, len(q))
        rows, seqlen = (0, 0) if self.rows is None else tuple(self.rows.shape)
        method = "rtn" if o.rtn else "awq"
        lines = [f"linears    {len(q)} of {len(self.results)} quantized ({method} w{o.bits} "
                 f"g{o.group_size}); {len(self.not_converted)} kept FP16",
                 f"calibration {rows} rows x {seqlen} tokens of {self.text}" if rows else
                 "calibration none (round-to-nearest)",
                 f"weights    mean relative RMSE of the quantized weights {rel:.4f}"]
        work = self.lq.search_work if self.lq is not None else {}
        if work.get("slices") or work.get("gram"):
            pruned = 1 - work["slices_run"] / max(1, work["slices"])
            lines.append(f"search     {work['slices_run']} of {work['slices']} candidate slices run "
                         f"({pruned:.0%} pruned), {work['gram']} candidates scored by the Gram form")
        if self.not_converted:
            lines.insert(1, f"kept FP16  {hfdir.shown(self.not_converted)}")
        details = {"method": method, "bits": o.bits, "group_size": o.group_size,
                   "duo_scaling": o.duo_scaling, "clip": o.clip, "linears_quantized": len(q),
                   "linears": len(self.results), "modules_to_not_convert": self.not_converted,
                   "calibration": {"rows": rows, "seqlen": seqlen}, "mean_rel_rmse": rel,
                   "search": dict(work)}
        return Summary(self.kind, o.label + (" (rtn)" if o.rtn else ""), out, str(self.source.path),
                       tensor_bytes=self.tensor_bytes, parameters=self.source.parameter_count(),
                       roundtrip=roundtrip, details=details, lines=lines)

