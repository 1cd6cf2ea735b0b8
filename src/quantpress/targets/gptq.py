"""GPTQ checkpoint directories (``quantize gptq``): an HF model directory → a verified directory
that transformers (with gptqmodel) and vLLM (``gptq`` / ``gptq_marlin``) load.

Stages: calibration rows (the :class:`~quantpress.targets.base.Source`'s) → the layer-streaming
engine with :class:`quantpress.calibration.gptq.LayerQuantizer` (Hessians on the quantized
model's hidden states, GPTQ of every linear, the quantized layer's outputs to the next layer)
→ :func:`quantpress.convert.gptq_dir.pack_gptq` and the directory writer (a part file per
layer, then shards, index, config, tokenizer files) → the round trip (every quantized linear
re-read from the final files and dequantized by the reference procedure
:func:`quantpress.convert.gptq_dir.dequantize_gptq`; it must equal the quantizer's
fake-quantized float16 weight bit for bit) → rename into place (by the runner).
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from quantpress.calibration import engine
from quantpress.calibration import gptq as cgptq
from quantpress.calibration.awq import LinearResult
from quantpress.convert import awq_dir, gptq_dir
from quantpress.errors import InputError, RoundTripError
from quantpress.memory import bound_heap, trim_heap
from quantpress.targets import hfdir
from quantpress.targets.awq import group_bytes
from quantpress.targets.base import Run, Summary, Target, WriterShare, options_json
from quantpress.targets.options import option
from quantpress.targets.registry import Estimate, Verb


#: group sizes a GPTQ checkpoint may have here: those gptqmodel 7.7's kernels load
#: (``nn_modules/qlinear/torch.py`` ``SUPPORTS_GROUP_SIZE``)
GROUP_SIZES = (-1, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class GPTQOptions:
    """``bits`` (4 or 8; 4-bit symmetric without act-order is what vLLM's Marlin kernel
    takes), ``group_size`` (input rows per scale and zero point; −1: one per output column),
    ``sym`` (symmetric: zero point 2^(bits−1)), ``act_order`` (``desc_act``: inputs quantized
    by descending Hessian diagonal, stored with their ``g_idx``), ``damp`` (fraction of the
    mean Hessian diagonal added to it), ``rtn`` (no calibration: round to nearest with the same
    groups, the baseline), ``max_shard_size``."""

    bits: int = option(4, flag="--bits", help="weight bits: {default} (default) or 8")
    group_size: int = option(128, flag="--group-size",
                             help="input rows per scale and zero point: {default} (default), 32, 64, "
                                  "or -1 (one per column)")
    sym: bool = option(True, flag="--sym", off="--asym",
                       help="symmetric quantization, zero point 2^(bits-1) (default; what Marlin takes)",
                       off_help="asymmetric (min-max zero points)")
    act_order: bool = option(False, flag="--act-order",
                             help="quantize inputs by descending Hessian diagonal (desc_act: true, "
                                  "with g_idx)")
    damp: float = option(0.01, flag="--damp", help="damping: fraction of the mean Hessian diagonal "
                                                   "added to it (default {default})")
    rtn: bool = option(False, flag="--rtn", help="plain round-to-nearest (no calibration), same "
                                                 "groups and packing: the baseline")
    max_shard_size: str = option("5GB", flag="--max-shard-size",
                                 help="safetensors shard size (default {default})")

    def validate(self) -> None:
        """InputError naming the option: bits other than 4/8, a group size not in
        :data:`GROUP_SIZES`, a damping outside (0, 1), a shard size that is no size."""
        if isinstance(self.bits, bool) or self.bits not in (4, 8):
            raise InputError(f"--bits {self.bits}: GPTQ checkpoints here are 4 or 8 bits "
                             f"(the widths gptqmodel's and vLLM's kernels load)")
        g = self.group_size
        if isinstance(g, bool) or g not in GROUP_SIZES:
            raise InputError(f"--group-size {g}: expected one of {', '.join(map(str, GROUP_SIZES))} "
                             f"(-1: one group per output column; the sizes gptqmodel's kernels "
                             f"load; vLLM's Marlin takes -1, 32, 64 and 128)")
        if isinstance(self.damp, bool) or not isinstance(self.damp, (int, float)) or not 0 < self.damp < 1:
            raise InputError(f"--damp {self.damp}: expected a fraction of the mean Hessian "
                             f"diagonal in (0, 1), e.g. 0.01")
        awq_dir.parse_size(self.max_shard_size)

    @property
    def label(self) -> str:
        """``w<bits>g<group_size>`` (``w4g128``; ``w4gc`` for one group per column), with
        ``-act`` for act-order and ``-asym`` for asymmetric."""
        g = "c" if self.group_size == -1 else str(self.group_size)
        return f"w{self.bits}g{g}" + ("-act" if self.act_order else "") + ("" if self.sym else "-asym")

    def settings(self) -> cgptq.GPTQSettings:
        """The algorithm's settings (:class:`quantpress.calibration.gptq.GPTQSettings`)."""
        return cgptq.GPTQSettings(self.bits, self.group_size, self.sym, self.act_order,
                                  float(self.damp), self.rtn)


def verify_gptq_dir(path: Path, records: list[LinearResult], bits: int, group_size: int,
                    desc_act: bool) -> str:
    """Round trip of a written GPTQ directory: config.json must say what was made; every
    quantized linear of ``records`` is read back from the final files and dequantized by
    :func:`quantpress.convert.gptq_dir.dequantize_gptq` (independent of the packer); its
    SHA-256 must equal the digest of the quantizer's fake-quantized float16 weight; no scale
    may be zero; every linear kept float16 must be there as ``.weight``. Raises RoundTripError
    naming the first linear that differs."""
    q = gptq_dir.read_gptq_config(path)
    want = {"bits": bits, "group_size": group_size, "desc_act": desc_act}
    for k, v in want.items():
        if q.get(k) != v:
            raise RoundTripError(f"round trip: {path}/config.json says {k} {q.get(k)!r}, expected {v!r}")
    w = gptq_dir.GPTQWeights(path)
    try:
        n = hfdir.verify_linears(path, w, records, hfdir.nonzero_scales(w))
    finally:
        w.close()
    return f"ok ({n} linears bit-identical to the fake-quantized weights)"


class GPTQTarget(Target, kind="gptq", options=GPTQOptions, output_is_dir=True):
    """A GPTQ checkpoint directory (:class:`GPTQOptions`; ``checkpoint_format: gptq``).

    Linears whose shape does not fit the group size or the packing stay float16 and are
    listed. Bad input (InputError, before anything is written): a source that is not an HF
    directory, a group size that divides no linear's in_features, too little calibration
    text; later, a weight outside float16 or NaN/Inf activations (naming the tensor or
    layer), a Hessian that cannot be factored (naming the linear)."""

    resumable = True
    verbs = (Verb("quantize", "gptq", "GPTQ (Hessian-based, layer by layer) to a GPTQ checkpoint "
                                      "directory (vLLM gptq/Marlin, transformers with gptqmodel)"),)
    job_key = "gptq"
    job_order = 40
    runtimes = "vLLM (gptq / Marlin), transformers with gptqmodel"
    memory_stages = ("GPTQ pass",)
    plan_words = "{n} GPTQ pass(es)"
    job_marks = ("rtn",)
    job_path_format = "{name}-GPTQ-{target}"

    @classmethod
    def estimate(cls, info, options: list[GPTQOptions]) -> Estimate:
        """Packed codes and group parameters; one pass at a time over its quantized stream
        (:func:`quantpress.targets.exl2.pass_memory`'s layer part)."""
        from quantpress.targets.exl2 import pass_memory

        return Estimate([group_bytes(info, o.bits, o.group_size) for o in options],
                        {"GPTQ pass": pass_memory(info.tokens, info.hidden, info.layer // 4, 0)[0]})

    def prepare(self, run: Run) -> None:
        bound_heap()
        src, o = self.source, self.options
        src.require_hf("GPTQ")
        self.max_shard = awq_dir.parse_size(o.max_shard_size)
        self.sm = src.streaming_model()
        st = o.settings()
        dims = [(m.out_features, m.in_features) for m in self.sm.layer_skeleton(0).modules()
                if isinstance(m, nn.Linear)]
        if not any(st.fits(k, nn_) for nn_, k in dims):
            raise InputError(f"--group-size {o.group_size} divides no linear layer's in_features "
                             f"({', '.join(map(str, sorted({k for _, k in dims})))}) of {src.path}; "
                             f"try 32, 64, 128 or -1")
        self.rows, self.text = None, ""
        if not o.rtn:
            with run.stage("tokenize"):
                self.rows, self.text = src.calibration_rows()

    def write(self, tmp: Path, run: Run) -> None:
        sm, o, src = self.sm, self.options, self.source
        self.records: list[LinearResult] = []
        ckpt = None if o.rtn else self.checkpoint({"options": options_json(o)})
        first = ckpt.start()[0] if ckpt is not None else 0
        if not first and tmp.exists():  # an interrupted run's directory without a checkpoint
            shutil.rmtree(tmp)
        writer = gptq_dir.dir_writer(tmp, self.max_shard, resume=bool(first))
        if not first:
            writer.add(hfdir.embedding_fp16(sm))

        def sink(index, kept, quantized, records):
            tensors = dict(kept)
            for name, (r, bias) in quantized.items():
                for k, v in gptq_dir.pack_gptq(r.codes, r.zeros, r.scales, r.g_idx, o.bits).items():
                    tensors[f"{name}.{k}"] = v
                if bias is not None:
                    tensors[f"{name}.bias"] = bias
            writer.add(tensors)
            self.records.extend(records)

        lq = cgptq.LayerQuantizer(o.settings(), sm.layer_prefix, sink)
        self.lq = lq
        with run.stage("layers"):
            if o.rtn:
                for i in run.bar(range(sm.num_layers), "layers", "layer"):
                    lq.quantize_layer(i, sm.load_layer(i))
                    trim_heap()
            else:
                rows = self.rows

                def on_layer(*args):
                    y = lq.on_layer(*args)
                    trim_heap()
                    return y

                engine.run(sm, rows, hooks_factory=lq.hooks, on_layer=on_layer,
                           batch_size=src.batch_rows(rows.shape[1]), progress=run.progress,
                           checkpoint=ckpt, state=WriterShare(writer, self.records, sm.layer_prefix, lq))
        self.resumed_at = first
        run.split("layers", {"gptq": lq.timings.gptq, "forward": lq.timings.forward})
        with run.stage("write"):
            writer.add({**hfdir.norm_fp16(sm), **hfdir.head_fp16(sm)})
            self.not_quantized = [r.name for r in self.records if not r.quantized]
            writer.finish(gptq_dir.gptq_config(src.config, bits=o.bits, group_size=o.group_size,
                                               desc_act=o.act_order, sym=o.sym, damp_percent=float(o.damp),
                                               true_sequential=False,
                                               modules_not_quantized=self.not_quantized),
                          src.path)
            sm.release()
        self.tensor_bytes = writer.total_bytes
        # the checkpoint stays until the output is verified and installed (produce_many)

    def verify(self, tmp: Path, run: Run) -> str:
        o = self.options
        return verify_gptq_dir(tmp, self.records, o.bits, o.group_size, o.act_order)

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        o = self.options
        q = [r for r in self.records if r.quantized]
        rel = sum(r.rel_rmse for r in q) / max(1, len(q))
        rows, seqlen = (0, 0) if self.rows is None else tuple(self.rows.shape)
        method = "rtn" if o.rtn else "gptq"
        marlin = o.bits in (4, 8) and o.sym and not o.act_order and o.group_size in (-1, 32, 64, 128)
        lines = [f"linears    {len(q)} of {len(self.records)} quantized ({method} {o.label}, "
                 f"{'symmetric' if o.sym else 'asymmetric'}, desc_act {str(o.act_order).lower()}, "
                 f"damp {o.damp}); {len(self.not_quantized)} kept FP16",
                 f"calibration {rows} rows x {seqlen} tokens of {self.text}" if rows else
                 "calibration none (round-to-nearest)",
                 f"weights    mean relative RMSE of the quantized weights {rel:.4f}",
                 f"vLLM       {'Marlin-eligible' if marlin else 'not Marlin-eligible (gptq kernel)'}"]
        if self.not_quantized:
            lines.insert(1, f"kept FP16  {hfdir.shown(self.not_quantized)}")
        details = {"method": method, "bits": o.bits, "group_size": o.group_size, "sym": o.sym,
                   "desc_act": o.act_order, "damp": o.damp, "linears_quantized": len(q),
                   "linears": len(self.records), "not_quantized": self.not_quantized,
                   "calibration": {"rows": rows, "seqlen": seqlen}, "mean_rel_rmse": rel,
                   "marlin_eligible": marlin}
        return Summary(self.kind, o.label + (" (rtn)" if o.rtn else ""), out, str(self.source.path),
                       tensor_bytes=self.tensor_bytes, parameters=self.source.parameter_count(),
                       roundtrip=roundtrip, details=details, lines=lines)

