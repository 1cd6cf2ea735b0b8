"""``quantize awq``: an HF model directory → a verified AutoAWQ GEMM directory.

Stages: calibration rows (:func:`cli.calib_pipeline.calibration_rows`) → the layer-streaming
engine with :class:`calibration.awq.LayerQuantizer` (capture, scale search, folding, clipping,
fake quantization and packing per layer) → :class:`convert.awq_dir.AWQDirWriter` (a part file
per layer in a temporary directory, then shards, index, config, tokenizer files) → the round
trip (every quantized linear re-read from the final files and dequantized by the reference
procedure of :func:`convert.awq_dir.dequantize_gemm`; it must equal the quantizer's
fake-quantized float16 weight bit for bit) → rename into place.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from calibration import awq as cawq
from calibration import engine
from cli import calib_pipeline as cp
from cli.common import check_output_dir
from convert import awq_dir
from convert.shards import checked_float16, float16_rows
from quantize.errors import InputError


@dataclass
class AWQSummary:
    """What ``quantize awq`` did: output path, linears quantized / total, those kept FP16,
    file bytes, bits per weight of the whole model (8·tensor bytes / parameters of the source
    model), calibration shape, seconds per stage, the round-trip result."""

    out: Path
    method: str
    bits: int
    group_size: int
    quantized: int
    linears: int
    not_converted: list[str]
    tensor_bytes: int
    parameters: int
    rows: int
    seqlen: int
    seconds: float
    stages: dict = field(default_factory=dict)
    roundtrip: str = ""
    mean_rel_rmse: float = 0.0

    @property
    def bpw(self) -> float:
        """Bits per weight of the whole file (embeddings and head included)."""
        return 8 * self.tensor_bytes / max(1, self.parameters)

    def to_json(self) -> dict:
        """The summary as a JSON-able dict."""
        return {"output": str(self.out), "method": self.method, "bits": self.bits,
                "group_size": self.group_size, "linears_quantized": self.quantized,
                "linears": self.linears, "modules_to_not_convert": self.not_converted,
                "tensor_bytes": self.tensor_bytes, "parameters": self.parameters,
                "bpw": round(self.bpw, 4), "calibration": {"rows": self.rows, "seqlen": self.seqlen},
                "seconds": round(self.seconds, 2),
                "stages": {k: round(v, 2) for k, v in self.stages.items()},
                "roundtrip": self.roundtrip, "mean_rel_rmse": self.mean_rel_rmse}

    def text(self) -> str:
        """Human-readable summary."""
        st = ", ".join(f"{k} {v:.1f} s" for k, v in self.stages.items())
        lines = [f"wrote {self.out}",
                 f"  {self.method} w{self.bits} g{self.group_size}: {self.quantized} of {self.linears} "
                 f"linears quantized; {len(self.not_converted)} kept FP16",
                 f"  {self.tensor_bytes / 2 ** 20:.1f} MiB of tensors, {self.bpw:.3f} bits per weight "
                 f"(whole model, {self.parameters / 1e6:.1f}M parameters)",
                 f"  calibration: {self.rows} rows x {self.seqlen} tokens" if self.rows else
                 "  calibration: none (round-to-nearest)",
                 f"  time {self.seconds:.1f} s ({st})",
                 f"  round trip: {self.roundtrip}; mean relative RMSE of the quantized weights "
                 f"{self.mean_rel_rmse:.4f}"]
        if self.not_converted:
            shown = ", ".join(self.not_converted[:4]) + (" ..." if len(self.not_converted) > 4 else "")
            lines.insert(3, f"  kept FP16: {shown}")
        return "\n".join(lines)


def _check_options(opts: cawq.AWQOptions, in_features: list[int], model_dir: Path) -> None:
    if opts.bits not in cawq.SUPPORTED_BITS:
        raise InputError(f"--bits {opts.bits}: only 4-bit AWQ is supported (the GEMM layout "
                         f"that vLLM and transformers load packs eight 4-bit values per int32)")
    if opts.group_size <= 0:
        raise InputError(f"--group-size {opts.group_size}: must be a positive number of input columns")
    if not any(k % opts.group_size == 0 for k in in_features):
        raise InputError(f"--group-size {opts.group_size} divides no linear layer's in_features "
                         f"({', '.join(map(str, sorted(set(in_features))))}) of {model_dir}; "
                         f"try 32, 64 or 128")


def quantize_awq(model: str | Path, out: str | Path, bits: int = 4, group_size: int = 128,
                 duo_scaling: bool = True, clip: bool = True, rtn: bool = False,
                 calib: str | Path | None = None, calib_field: str = "text", samples: int = 128,
                 seqlen: int = 512, seed: int = 0, device: str = "auto", dtype: str | None = None,
                 batch_tokens: int = cp.DEFAULT_BATCH_TOKENS, max_shard_size: str = "5GB",
                 force: bool = False, progress: bool = True,
                 cal_dir: str | Path | None = None) -> AWQSummary:
    """Quantize the HF model directory ``model`` with AWQ (or plain round-to-nearest with
    ``rtn``) into the AutoAWQ GEMM directory ``out``.

    Calibration: ``samples`` rows of ``seqlen`` tokens (:func:`cli.calib_pipeline.calibration_rows`;
    default text the calibration split of exllamav2's wiki.utf8), run through the streaming
    engine in ``dtype`` (default float32) on ``device``, ``batch_tokens`` tokens per forward.
    Linears whose shape does not fit the group size stay FP16 and are listed in
    ``modules_to_not_convert``. The directory is built under a temporary sibling name,
    verified (round trip) and renamed; an existing ``out`` needs ``force``.

    Raises InputError for bad input (bits ≠ 4, a group size that divides no linear, too little
    calibration text, an architecture without AWQ scale groups, values outside float16), and
    RuntimeError when the round trip fails (nothing is left behind in either case)."""
    t_start = time.perf_counter()
    cp.bound_heap()
    src = Path(model)
    out = Path(out)
    check_output_dir(out, force)
    ld = cp.find_loader(src)
    if ld.kind != "hf":
        raise InputError(f"{src}: AWQ needs a Hugging Face model directory (FP16/BF16/F32 "
                         f"safetensors), not a {ld.kind} input")
    cfg = ld.hf_config(src)
    model_type = str(cfg.get("model_type", ""))
    spec = cawq.arch_spec(model_type, (cfg.get("architectures") or ["?"])[0])
    opts = cawq.AWQOptions(bits, group_size, duo_scaling, clip, rtn)
    max_shard = awq_dir.parse_size(max_shard_size)

    dev = cp.pick_device(device)
    sm = ld.open(src, dev, cp.pick_dtype(dtype))
    layer0 = sm._decoder.layers[0]  # meta skeleton: shapes without reading weights
    in_features = [layer0.get_submodule(n).in_features for n in spec.linears]
    _check_options(opts, in_features, src)

    stages: dict[str, float] = {}
    rows = None
    if not rtn:
        t0 = time.perf_counter()
        rows, _ = cp.calibration_rows(src, calib, calib_field, samples, seqlen, seed, cal_dir, progress)
        stages["tokenize"] = time.perf_counter() - t0

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    results: list[cawq.LinearResult] = []
    try:
        writer = awq_dir.AWQDirWriter(tmp, max_shard)
        w = sm.weights
        emb = sm._embed_name + ".weight"
        writer.add({emb: float16_rows(w, emb)})

        def sink(index, tensors, res):
            writer.add(tensors)
            results.extend(res)

        lq = cawq.LayerQuantizer(spec, opts, sm.layer_prefix, sink, after_step=cp.trim_heap)
        t0 = time.perf_counter()
        if rtn:
            from tqdm.auto import tqdm

            for i in tqdm(range(sm.num_layers), desc="layers", unit="layer", disable=not progress):
                lq.quantize_layer(i, sm.load_layer(i))
                cp.trim_heap()
        else:
            lq.rows, lq.seqlen = rows.shape
            bs = cp._rows_per_batch(batch_tokens, rows.shape[1])

            def on_layer(i, layer, inputs, outputs, ctx):
                lq.on_layer(i, layer, inputs, outputs, ctx)
                cp.trim_heap()

            engine.run(sm, rows, hooks_factory=lq.hooks, on_layer=on_layer, batch_size=bs,
                       progress=progress)
        t_layers = time.perf_counter() - t0
        inner = sum(lq.timings.values())
        if not rtn:
            stages["calibration"] = t_layers - inner
            stages["search"] = lq.timings["search"]
            stages["clip"] = lq.timings["clip"]
        stages["quantize+pack"] = lq.timings["quantize"] + (t_layers - inner if rtn else 0.0)

        t0 = time.perf_counter()
        norm = sm._norm_name + ".weight"
        tail = {norm: checked_float16(w.get(norm, "cpu"), norm)}
        tied = bool(getattr(sm.config, "tie_word_embeddings", False))
        head = sm._lm_head_name + ".weight"
        if not tied:
            tail[head] = float16_rows(w, head)
        writer.add(tail)
        not_converted = [r.name for r in results if not r.quantized]
        config = awq_dir.awq_config(cfg, bits, group_size, not_converted)
        writer.finish(config, src)
        stages["write"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        roundtrip = verify_awq_dir(tmp, results, group_size)
        stages["verify"] = time.perf_counter() - t0
        awq_dir.replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(_numel_of(sm, src))
    q = [r for r in results if r.quantized]
    return AWQSummary(out, "rtn" if rtn else "awq", bits, group_size, len(q), len(results),
                      not_converted, writer.total_bytes, n_params,
                      0 if rows is None else rows.shape[0], 0 if rows is None else rows.shape[1],
                      time.perf_counter() - t_start, stages, roundtrip,
                      sum(r.rel_rmse for r in q) / max(1, len(q)))


def _numel_of(sm: engine.StreamingModel, src: Path):
    """Parameter counts of the source checkpoint's tensors (without reading data)."""
    from safetensors import safe_open

    for f in sorted(set(sm.weights._files.values())):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                n = 1
                for d in h.get_slice(k).get_shape():
                    n *= d
                yield n


def verify_awq_dir(path: Path, results: list[cawq.LinearResult], group_size: int) -> str:
    """Round trip of a written AWQ directory: every quantized linear of ``results`` is read
    back from the final files and dequantized by :func:`convert.awq_dir.dequantize_gemm`
    (independent of the packer); its SHA-256 must equal the digest of the quantizer's
    fake-quantized float16 weight, no scale may be zero, and every linear kept FP16 must be
    there as ``.weight``. Raises RuntimeError naming the first linear that differs."""
    w = awq_dir.AWQWeights(path)
    if w.group_size != group_size:
        raise RuntimeError(f"round trip: {path}/config.json says group_size {w.group_size}, "
                           f"expected {group_size}")
    n = 0
    for r in results:
        if not r.quantized:
            if r.name + ".weight" not in w or w.is_quantized(r.name + ".weight"):
                raise RuntimeError(f"round trip: '{r.name}.weight' (kept FP16) is missing from {path}")
            continue
        if not w.is_quantized(r.name + ".weight"):
            raise RuntimeError(f"round trip: '{r.name}' has no qweight in {path}")
        sc = w.raw.get(r.name + ".scales")
        if bool((sc == 0).any()):
            raise RuntimeError(f"round trip: '{r.name}.scales' holds a zero scale")
        deq = w.dequantized(r.name)
        if tuple(deq.shape) != tuple(r.shape):
            raise RuntimeError(f"round trip: '{r.name}' dequantizes to {tuple(deq.shape)}, "
                               f"expected {tuple(r.shape)}")
        if cawq.tensor_digest(deq) != r.digest:
            raise RuntimeError(f"round trip failed: '{r.name}' dequantized from {path} differs "
                               f"from the quantizer's fake-quantized weights")
        n += 1
    w.raw.close()
    return f"ok ({n} linears bit-identical to the fake-quantized weights)"
