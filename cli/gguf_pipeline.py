"""Pipelines that produce GGUF files: HF directory -> GGUF (``convert hf-to-gguf``) and
GGUF -> requantized GGUF (``quantize gguf``, llama-quantize's job).

A pipeline composes the layers below it: read the source lazily (convert.hf or gguf-py's
reader), plan a ggml type per tensor (convert.gguf_policy), write the file tensor by
tensor to a temporary path (convert.gguf_file), verify it by round trip, rename it.
"""
from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from tqdm import tqdm

from cli.common import check_output
from convert import gguf_arch, gguf_policy, gguf_tokenizer
from convert.gguf_file import (RoundTrip, SourceTensor, pick_device, reader_raw, temp_path_for,
                               verify_gguf, write_gguf)
from convert.hf import HFModel
from quantize import ggml
from quantize.errors import InputError


@dataclass
class Summary:
    """What a GGUF pipeline produced: counts per ggml type, sizes, timing, round trip."""

    output: Path
    policy: str
    types: dict[str, str]
    file_bytes: int
    tensor_bytes: int
    n_elements: int
    seconds: float
    roundtrip: RoundTrip
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def bpw(self) -> float:
        """Effective bits per weight: tensor data bits over all elements (llama.cpp's BPW)."""
        return 8.0 * self.tensor_bytes / max(1, self.n_elements)

    def type_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(self.types.values()).items()))

    def text(self) -> str:
        rt = self.roundtrip
        finite = [t for t in rt.tensors if math.isfinite(t.snr_db)]
        worst = min(finite, key=lambda t: t.snr_db) if finite else None
        lines = [
            f"output     {self.output}",
            f"policy     {self.policy}",
            f"tensors    {len(self.types)}: " + ", ".join(f"{k} x{v}" for k, v in self.type_counts().items()),
            f"size       {self.file_bytes:,} bytes ({self.file_bytes / 2**20:.2f} MiB), "
            f"{self.bpw:.4f} bits per weight over {self.n_elements:,} weights",
            f"time       {self.seconds:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items()) + ")",
            f"round trip {'OK' if rt.ok else 'FAILED'}: {len(rt.tensors)} tensors re-read with gguf-py, "
            f"dequantized bit-identically by gguf-py and quantpress",
        ]
        if rt.tensors:
            se = sum(t.rmse ** 2 * math.prod(t.shape) for t in rt.tensors)
            lines.append(f"error      overall RMSE {math.sqrt(se / max(1, self.n_elements)):.3e}, "
                         f"max |err| {max(t.max_abs_err for t in rt.tensors):.3e}"
                         + (f", lowest SNR {worst.snr_db:.1f} dB ({worst.name}, {worst.type})" if worst else ", lossless"))
        lines += [f"mismatch   {m}" for m in rt.mismatches[:10]]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "output": str(self.output), "policy": self.policy, "file_bytes": self.file_bytes,
            "tensor_bytes": self.tensor_bytes, "n_elements": self.n_elements, "bpw": self.bpw,
            "seconds": self.seconds, "timings": self.timings, "type_counts": self.type_counts(),
            "roundtrip_ok": self.roundtrip.ok, "mismatches": self.roundtrip.mismatches,
            "tensors": [{"name": t.name, "type": t.type, "shape": list(t.shape), "bytes": t.n_bytes,
                         "bpw": t.bpw, "rmse": t.rmse, "max_abs_err": t.max_abs_err,
                         "snr_db": t.snr_db if math.isfinite(t.snr_db) else None}
                        for t in self.roundtrip.tensors],
        }


def _finish(tmp: Path, out: Path, summary_args: dict, tensors, types, device, show, t0, timings,
            report: Path | None) -> Summary:
    t1 = time.perf_counter()
    rt = verify_gguf(tmp, tensors, types, device, progress=_bar(show, "verify"))
    timings["verify"] = time.perf_counter() - t1
    if not rt.ok:
        raise RuntimeError(f"{out}: round-trip check failed, no output written: " + "; ".join(rt.mismatches[:5]))
    os.replace(tmp, out)
    s = Summary(output=out, types=types, file_bytes=out.stat().st_size,
                tensor_bytes=sum(t.n_bytes for t in rt.tensors),
                n_elements=sum(st.numel for st in tensors), seconds=time.perf_counter() - t0,
                roundtrip=rt, timings=timings, **summary_args)
    if report is not None:
        Path(report).write_text(json.dumps(s.to_json(), indent=1))
    return s


def _bar(show: bool, desc: str):
    return lambda it: tqdm(it, desc=desc, unit="tensor", disable=not show, leave=False)


def _run(out: Path, force: bool, body) -> Summary:
    out = Path(out)
    check_output(out, force)
    tmp = temp_path_for(out)
    try:
        return body(tmp)
    finally:
        if tmp.exists():
            tmp.unlink()


def hf_to_gguf(model_dir: Path, out: Path, policy: str = "F16", *, force: bool = False,
               device: str = "auto", report: Path | None = None, progress: bool = True) -> Summary:
    """Convert a Hugging Face llama/qwen2/qwen3 directory to a verified GGUF file.

    ``policy`` is a llama.cpp ftype name (F32, F16, BF16, Q8_0, Q4_0 ... Q4_K_M, Q6_K); the
    per-tensor types follow llama-quantize (``llama_tensor_get_type``), the data is byte-
    identical to ``convert_hf_to_gguf.py --outtype f16`` followed by ``llama-quantize``.
    Tensors are read, quantized and written one at a time. Raises InputError for bad input
    (naming file or tensor) and RuntimeError if the round trip fails; in both cases no
    output file is left. Returns a :class:`Summary`.
    """
    t0 = time.perf_counter()
    if policy not in gguf_policy.POLICIES:
        raise InputError(f"unknown policy {policy!r}; choose one of: {', '.join(gguf_policy.POLICIES)}")
    check_output(Path(out), force)
    dev = pick_device(device)
    model = HFModel(model_dir)  # validates config.json and the safetensors files
    cfg = gguf_arch.load_hf_config(model.dir)  # transformers' parsed config, as llama.cpp reads it
    arch = gguf_arch.gguf_arch(cfg)
    kvs = (gguf_arch.model_metadata(cfg, model.dir, arch, gguf_policy.ftype_id(policy))
           + gguf_tokenizer.tokenizer_metadata(model.dir, cfg, arch))

    sources: list[SourceTensor] = [
        SourceTensor(name, tuple(t.shape), (lambda t=t: t)) for name, t in gguf_arch.generated_tensors(cfg, arch)]
    for hf_name in model.names:
        if gguf_arch.is_skipped_tensor(hf_name):
            continue
        name = gguf_arch.gguf_tensor_name(hf_name, arch, n_layers=cfg["num_hidden_layers"])

        def load(hf_name=hf_name):
            return gguf_arch.transform_tensor(hf_name, model.tensor(hf_name), cfg, arch)
        sources.append(SourceTensor(name, model.shape(hf_name), load))

    params = gguf_policy.ModelParams(
        arch=arch, n_layer=cfg["num_hidden_layers"], n_head=cfg["num_attention_heads"],
        n_head_kv=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        n_expert=cfg.get("num_local_experts") or cfg.get("num_experts") or 0,
        has_output=any(s.name == "output.weight" for s in sources))
    types = gguf_policy.plan_types(policy, [(s.name, s.shape) for s in sources], params)
    if policy not in ("F32", "F16", "BF16"):  # llama-quantize's output order
        order = {n: i for i, n in enumerate(gguf_policy.tensor_order([s.name for s in sources]))}
        sources.sort(key=lambda s: order[s.name])

    def body(tmp: Path) -> Summary:
        timings = {"prepare": time.perf_counter() - t0}
        t1 = time.perf_counter()
        write_gguf(tmp, arch, kvs, sources, types, dev, progress=_bar(progress, f"{policy}"))
        timings["quantize+write"] = time.perf_counter() - t1
        return _finish(tmp, Path(out), {"policy": policy}, sources, types, dev, progress, t0, timings, report)

    return _run(Path(out), force, body)


FLOAT_TYPES = ("F32", "F16", "BF16")


def _reader_kvs(reader: GGUFReader) -> list[tuple]:
    """The input's KVs in order, minus the ones the writer or the policy sets."""
    skip = {"general.architecture", "general.file_type", "general.quantization_version",
            "split.no", "split.count", "split.tensors.count"}
    out = []
    for key, f in reader.fields.items():
        if key in skip or key.startswith("GGUF."):
            continue
        vtype = GGUFValueType(f.types[0])
        sub = GGUFValueType(f.types[1]) if vtype == GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    return out


def gguf_requantize(src: Path, out: Path, policy: str, *, force: bool = False, device: str = "auto",
                    report: Path | None = None, progress: bool = True) -> Summary:
    """Requantize an F32/F16/BF16 GGUF file with a llama.cpp policy, as ``llama-quantize``.

    KVs are copied in order, then ``general.quantization_version`` and ``general.file_type``
    are appended last (llama-quantize's remove-then-append); tensors come out in
    llama-quantize's order with its types and bytes. A tensor that is already quantized is
    refused (InputError naming it), as llama-quantize does without --allow-requantize.
    """
    t0 = time.perf_counter()
    if policy not in gguf_policy.POLICIES:
        raise InputError(f"unknown policy {policy!r}; choose one of: {', '.join(gguf_policy.POLICIES)}")
    check_output(Path(out), force)
    src = Path(src)
    if not src.is_file():
        raise InputError(f"{src}: no such file")
    try:
        reader = GGUFReader(str(src))
    except Exception as e:  # gguf-py raises ValueError/struct errors on bad files
        raise InputError(f"{src}: not a readable GGUF file ({e})") from None
    dev = pick_device(device)
    field_arch = reader.get_field("general.architecture")
    if field_arch is None:
        raise InputError(f"{src}: no general.architecture key")
    arch = field_arch.contents()

    def kv(key, default=None):
        f = reader.get_field(f"{arch}.{key}")
        return f.contents() if f is not None else default

    sources = []
    for rt in reader.tensors:
        tname = GGMLQuantizationType(rt.tensor_type).name
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        if tname not in FLOAT_TYPES:
            raise InputError(f"{src}: tensor '{rt.name}' is already quantized ({tname}); "
                             "requantizing is not supported, start from an F32/F16/BF16 file")

        def load(rt=rt, tname=tname, shape=shape):
            return ggml.dequantize(torch.from_numpy(reader_raw(rt).copy()), tname).reshape(shape)
        sources.append(SourceTensor(rt.name, shape, load))
    n_head = kv("attention.head_count")
    params = gguf_policy.ModelParams(arch=arch, n_layer=kv("block_count"), n_head=n_head,
                                     n_head_kv=kv("attention.head_count_kv", n_head),
                                     n_expert=kv("expert_count", 0) or 0,
                                     has_output=any(s.name == "output.weight" for s in sources))
    types = gguf_policy.plan_types(policy, [(s.name, s.shape) for s in sources], params)
    order = {n: i for i, n in enumerate(gguf_policy.tensor_order([s.name for s in sources]))}
    sources.sort(key=lambda s: order[s.name])
    kvs = _reader_kvs(reader) + [
        ("general.quantization_version", 2, GGUFValueType.UINT32, None),
        ("general.file_type", gguf_policy.ftype_id(policy), GGUFValueType.UINT32, None)]

    def body(tmp: Path) -> Summary:
        timings = {"prepare": time.perf_counter() - t0}
        t1 = time.perf_counter()
        write_gguf(tmp, arch, kvs, sources, types, dev, progress=_bar(progress, policy))
        timings["quantize+write"] = time.perf_counter() - t1
        return _finish(tmp, Path(out), {"policy": policy}, sources, types, dev, progress, t0, timings, report)

    return _run(Path(out), force, body)
