"""GGUF files: ``convert hf-to-gguf`` (an HF directory) and ``quantize gguf`` (requantizing an
F32/F16/BF16 GGUF, llama-quantize's job), one target for both.

The plan is the tensor list (name, shape, a loader), the metadata and one ggml type per
tensor (:func:`quantpress.convert.gguf_policy.plan_types`, llama.cpp's
``llama_tensor_get_type``); tensors are then read, quantized and written one at a time
(:func:`quantpress.convert.gguf_file.write_gguf_many`) while the round trip re-reads each
tensor from the file with gguf-py beside the writing
(:func:`quantpress.convert.gguf_roundtrip.watch_round_trip`). Several policies of one source
are written together from one read of each source tensor per tensor order
(:meth:`GGUFTarget.write_together`).

- From an HF directory the bytes equal ``convert_hf_to_gguf.py --outtype f16`` followed by
  ``llama-quantize`` (llama.cpp as vendored in llama-cpp-python 0.3.36).
- From a GGUF file the KVs are copied in order, then ``general.quantization_version`` and
  ``general.file_type`` are appended last (llama-quantize's remove-then-append:
  ``llama_model_quantize_impl`` ``gguf_set_kv`` + ``gguf_set_val_u32``), tensors come out in
  llama-quantize's order (``weight_name_comparer``) with its types and bytes; an already
  quantized tensor is refused, as llama-quantize does without ``--allow-requantize``.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from quantpress.convert import gguf_arch, gguf_load, gguf_policy, gguf_tokenizer
from quantpress.convert.gguf_file import PendingKVs, PlanChanged, codecs_leave_a_core, write_gguf_many
from quantpress.convert.gguf_roundtrip import (RoundTrip, SourceTensor, drop_pages, open_reader, reader_raw,
                                               start_checkers)
from quantpress.convert.imatrix_file import Importance, load_importance
from quantpress.convert.hf import HFModel
from quantpress.errors import InputError, RoundTripError
from quantpress.quantize import ggml
from quantpress.quantize.ggml import compiled_searches
from quantpress.quantize.ggml.processes import start_codec_processes
from quantpress.memory import bound_heap
from quantpress.workers import fork_call
from quantpress.targets.base import Run, Summary, Target, check_output
from quantpress.targets.imatrix import ImatrixOptions
from quantpress.targets.options import from_table, option
from quantpress.targets.registry import Estimate, Needs, Step, Verb

#: ggml types of an input GGUF that ``quantize gguf`` accepts
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GGUFOptions:
    """Options of ``convert hf-to-gguf`` / ``quantize gguf``, with llama-quantize's names.

    ``policy``: a llama.cpp ftype name (F32, F16, BF16, Q8_0, Q4_0 … Q4_K_M … Q6_K, Q2_K_S,
    IQ4_NL, IQ4_XS; :data:`quantpress.convert.gguf_policy.POLICIES`).
    ``imatrix``: an importance-matrix file (GGUF or legacy ``.dat``; ``--imatrix``), None for
    none; ``include_weights`` / ``exclude_weights``: substrings of the imatrix entries to use /
    not use (``--include-weights`` / ``--exclude-weights``, not both).
    ``output_tensor_type``, ``token_embedding_type`` (ggml type names, any case),
    ``leave_output_tensor``, ``pure``, ``tensor_type`` (``"REGEX=TYPE"`` strings, first match
    wins): llama-quantize's per-tensor controls
    (:class:`quantpress.convert.gguf_policy.TypeOverrides`)."""

    policy: str = option("F16", flag="--policy", choices=gguf_policy.POLICIES,
                         help="llama.cpp ftype (default {default})")
    imatrix: str | None = option(None, flag="--imatrix", metavar="FILE|auto",
                                 help="importance matrix for the quantizers: a GGUF imatrix (quantize "
                                      "imatrix, llama-imatrix) or a legacy .dat; 'auto' computes one "
                                      "first with the calibration options below and keeps it as "
                                      "OUTPUT.imatrix.gguf")
    include_weights: tuple[str, ...] = option((), flag="--include-weights", append=True, metavar="NAME",
                                              help="use the imatrix only for tensors whose name "
                                                   "contains NAME (repeatable)")
    exclude_weights: tuple[str, ...] = option((), flag="--exclude-weights", append=True, metavar="NAME",
                                              help="do not use the imatrix for tensors whose name "
                                                   "contains NAME (repeatable)")
    output_tensor_type: str | None = option(None, flag="--output-tensor-type", metavar="TYPE",
                                            help="ggml type of output.weight")
    token_embedding_type: str | None = option(None, flag="--token-embedding-type", metavar="TYPE",
                                              help="ggml type of token_embd.weight")
    leave_output_tensor: bool = option(False, flag="--leave-output-tensor",
                                       help="do not quantize output.weight")
    pure: bool = option(False, flag="--pure", help="the policy's default type for every quantized "
                                                   "tensor (no k-quant mixtures)")
    tensor_type: tuple[str, ...] = option((), flag="--tensor-type", append=True, metavar="PATTERN=TYPE",
                                          help="ggml type for the tensors whose name matches the "
                                               "regular expression PATTERN (repeatable, first match "
                                               "wins), e.g. attn_v=q8_0")

    def validate(self) -> None:
        """InputError for a policy llama.cpp does not have (the message lists them), an
        unknown ggml type or malformed ``--tensor-type`` (llama-quantize's
        ``parse_tensor_type``), a bad regular expression, and include with exclude."""
        if self.policy not in gguf_policy.POLICIES:
            raise InputError(f"--policy {self.policy}: unknown; choose one of "
                             f"{', '.join(gguf_policy.POLICIES)}")
        if self.include_weights and self.exclude_weights:
            raise InputError("--include-weights and --exclude-weights cannot be used together")
        if (self.include_weights or self.exclude_weights) and not self.imatrix:
            raise InputError("--include-weights/--exclude-weights need --imatrix")
        self.overrides()

    def overrides(self) -> gguf_policy.TypeOverrides:
        """The :class:`quantpress.convert.gguf_policy.TypeOverrides` of these options
        (InputError for an unknown type, a malformed ``--tensor-type`` or a bad regex)."""
        import re

        def ty(name: str | None, what: str) -> str | None:
            if name is None:
                return None
            try:
                return gguf_policy.parse_ggml_type(name, what)
            except ValueError as e:
                raise InputError(str(e)) from None
        pairs = []
        for spec in self.tensor_type:
            pat, sep, t = spec.partition("=")
            if not sep or not pat or not t:
                raise InputError(f"--tensor-type {spec}: expected PATTERN=TYPE (e.g. attn_v=q8_0)")
            try:
                re.compile(pat.lower())
            except re.error as e:
                raise InputError(f"--tensor-type {spec}: bad regular expression {pat!r} ({e})") from None
            pairs.append((pat, ty(t, f"--tensor-type {spec}")))
        return gguf_policy.TypeOverrides(
            output_tensor_type=ty(self.output_tensor_type, "--output-tensor-type"),
            token_embedding_type=ty(self.token_embedding_type, "--token-embedding-type"),
            leave_output_tensor=self.leave_output_tensor, pure=self.pure, tensor_types=tuple(pairs))


@dataclass
class GGUFPlan:
    """What will be written: ``arch``, ``kvs`` (after ``general.architecture``, in order; a
    ``PendingKVs`` while they are computed beside, :func:`plan_from_hf` with ``overlap``),
    ``tensors`` in output order, ``types`` (GGUF tensor name → ggml type name), ``imatrix``
    (GGUF tensor name → importance weights float32 [n_mat · ne0] for the tensors quantized
    with them), ``base_types`` (the policy's types without the overrides) and the
    :class:`quantpress.convert.imatrix_file.Importance` used, if any."""

    arch: str
    kvs: list[tuple] | PendingKVs
    tensors: list[SourceTensor]
    types: dict[str, str]
    imatrix: dict[str, torch.Tensor] = field(default_factory=dict)
    base_types: dict[str, str] = field(default_factory=dict)
    importance: Importance | None = None
    no_entry: list[str] = field(default_factory=list)


#: convert hf-to-gguf computes the metadata (transformers' config and tokenizer) in a forked
#: process while the writer quantizes the first tensors (:func:`plan_from_hf`'s ``overlap``);
#: False: before any tensor, in this process. Overlapping made the whole command faster for
#: SmolLM2's Q4_K_M (more so with its imatrix) and for the 554M random llama (figures and
#: the command in docs/benchmarks.md, "Figures behind the code", ``targets/gguf.py``)
OVERLAP_METADATA = True


def _model_params(arch: str, n_layer: int, n_head: int, n_head_kv: int | None, n_expert: int,
                  tensors: list[SourceTensor]) -> gguf_policy.ModelParams:
    return gguf_policy.ModelParams(arch=arch, n_layer=n_layer, n_head=n_head,
                                   n_head_kv=n_head_kv or n_head, n_expert=n_expert or 0,
                                   has_output=any(t.name == "output.weight" for t in tensors))


def _in_quantize_order(tensors: list[SourceTensor]) -> list[SourceTensor]:
    order = {n: i for i, n in enumerate(gguf_policy.tensor_order([t.name for t in tensors]))}
    return sorted(tensors, key=lambda t: order[t.name])


def _metadata_kvs(model_dir: Path, cfg: dict, arch: str, ftype: int, repo_id: str | None) -> list[tuple]:
    return (gguf_arch.model_metadata(cfg, model_dir, arch, ftype, repo_id=repo_id)
            + gguf_tokenizer.tokenizer_metadata(model_dir, cfg, arch))


def _tensor_side(model: HFModel, cfg: dict, arch: str) -> tuple:
    """Everything the tensors of an HF plan take from the config: the architecture, the GGUF
    names of the checkpoint's tensors, the generated tensors (names and bytes), the head
    counts of the Q/K permutation and the policy's model parameters."""
    n_layers = cfg["num_hidden_layers"]
    names = tuple(gguf_arch.gguf_tensor_name(n, arch, n_layers=n_layers)
                  for n in model.names if not gguf_arch.is_skipped_tensor(n))
    generated = tuple((name, tuple(t.shape), t.numpy().tobytes())
                      for name, t in gguf_arch.generated_tensors(cfg, arch))
    heads = (gguf_arch.first_present(cfg, ["n_heads", "num_attention_heads"]),
             gguf_arch.first_present(cfg, ["n_kv_heads", "num_key_value_heads"]))
    params = (n_layers, cfg["num_attention_heads"], cfg.get("num_key_value_heads"),
              cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    return arch, names, generated, heads, params


def _hf_metadata(model: HFModel, ftype: int, repo_id: str | None) -> tuple[tuple, list[tuple]]:
    # in the forked process of plan_from_hf(overlap=True): transformers' config and tokenizer
    torch.set_num_threads(1)
    cfg = gguf_arch.load_hf_config(model.dir)
    arch = gguf_arch.gguf_arch(cfg)
    return _tensor_side(model, cfg, arch), _metadata_kvs(model.dir, cfg, arch, ftype, repo_id)


def plan_from_hf(model_dir: Path, policy: str, options: GGUFOptions | None = None, *,
                 overlap: bool = False, repo_id: str | None = None) -> GGUFPlan:
    """The plan of ``convert_hf_to_gguf.py`` + ``llama-quantize`` for an HF llama / qwen2 /
    qwen3 directory: metadata from transformers' parsed config and the tokenizer, tensors
    renamed and transformed as the converter does (Q/K permutation for llama), generated
    tensors (rope factors) first. Raises InputError for an invalid directory, config or
    tokenizer, an unsupported architecture or an unknown tensor (naming it).

    ``overlap``: where this process runs no other thread, compute the metadata (transformers'
    import, config and tokenizer: most of the time before any tensor is read) in a forked
    process (:func:`quantpress.workers.fork_call`) and plan the tensors from ``config.json``
    as it is (:func:`quantpress.convert.gguf_arch.raw_hf_config`); the plan's ``kvs`` is then
    a :class:`quantpress.convert.gguf_file.PendingKVs`, which the writer waits for while it
    quantizes the first tensors, and which raises ``PlanChanged`` if transformers' config
    gives the tensors anything else (the caller plans again without ``overlap``). Errors of
    the metadata are raised by the writer then, as they would be here.

    ``repo_id``: the Hugging Face repo id ``model_dir`` is the cached snapshot of; it becomes
    ``general.name``, as ``convert_hf_to_gguf.py --remote`` sets it."""
    model = HFModel(model_dir)  # validates config.json and the safetensors files
    ftype = gguf_policy.ftype_id(policy)
    kvs = None
    if overlap and threading.active_count() == 1:
        try:
            cfg = gguf_arch.raw_hf_config(model.dir)
            arch = gguf_arch.gguf_arch(cfg)
            side = _tensor_side(model, cfg, arch)
        except Exception:   # noqa: BLE001 -- planned below with transformers, which reports it
            side = None
        if side is not None:
            try:
                call = fork_call(_hf_metadata, model, ftype, repo_id, name="quantpress-metadata")
                kvs = PendingKVs(call, side)
            except OSError:
                kvs = None
    if kvs is None:
        cfg = gguf_arch.load_hf_config(model.dir)
        arch = gguf_arch.gguf_arch(cfg)
        kvs = _metadata_kvs(model.dir, cfg, arch, ftype, repo_id)
    try:
        return _hf_plan(model, cfg, arch, kvs, policy, options)
    except BaseException:
        if isinstance(kvs, PendingKVs):
            kvs.close()     # (e.g. an imatrix of another model: the metadata is not wanted)
        raise


def _hf_plan(model: HFModel, cfg: dict, arch: str, kvs, policy: str,
             options: GGUFOptions | None) -> GGUFPlan:
    tensors = [SourceTensor(name, tuple(t.shape), (lambda t=t: t))
               for name, t in gguf_arch.generated_tensors(cfg, arch)]
    for hf_name in model.names:
        if gguf_arch.is_skipped_tensor(hf_name):
            continue
        name = gguf_arch.gguf_tensor_name(hf_name, arch, n_layers=cfg["num_hidden_layers"])

        def load(hf_name=hf_name):
            return gguf_arch.transform_tensor(hf_name, model.tensor(hf_name), cfg, arch)
        tensors.append(SourceTensor(name, model.shape(hf_name), load))
    params = _model_params(arch, cfg["num_hidden_layers"], cfg["num_attention_heads"],
                           cfg.get("num_key_value_heads"),
                           cfg.get("num_local_experts") or cfg.get("num_experts") or 0, tensors)
    if not gguf_policy.is_float_policy(policy):  # llama-quantize's output order
        tensors = _in_quantize_order(tensors)
    return finish_plan(GGUFPlan(arch, kvs, tensors, {}), params, options or GGUFOptions(policy=policy))


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


def plan_from_gguf(src: Path, policy: str, options: GGUFOptions | None = None) -> GGUFPlan:
    """The plan of ``llama-quantize SRC OUT POLICY`` for an F32/F16/BF16 GGUF file, or the
    first file of a split model (the tensors of every split, the KVs of the first without its
    split keys: one output file, as llama-quantize without ``--keep-split`` writes). Raises
    InputError for a file gguf-py cannot read, no ``general.architecture``, a tensor that is
    already quantized (naming it), a split model's missing or inconsistent split
    (:func:`quantpress.convert.gguf_load.split_files`, ``check_splits``). ``options``: the
    imatrix and per-tensor controls (:func:`finish_plan`)."""
    src = Path(src)
    reader = open_reader(src)

    def kv(key, default=None, r=reader):
        f = r.get_field(key)
        return f.contents() if f is not None else default

    # a split model (llama.cpp's gguf-split): every split's tensors, read from its own file,
    # the KVs of the first (llama-quantize's input as llama_model_loader loads it)
    files = gguf_load.split_files(src, int(kv("split.no", 0)), int(kv("split.count", 0)))
    arch = kv("general.architecture")
    if arch is None:
        raise InputError(f"{src}: no general.architecture key")
    readers = [reader] + [open_reader(f) for f in files[1:]]
    gguf_load.check_splits(src, files, [kv("split.no", r=r) for r in readers],
                           [[rt.name for rt in r.tensors] for r in readers], kv("split.tensors.count"))

    tensors = []
    for path, rd, rt in ((f, r, rt) for f, r in zip(files, readers) for rt in r.tensors):
        tname = GGMLQuantizationType(rt.tensor_type).name
        shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
        if tname not in FLOAT_TYPES:
            raise InputError(f"{path}: tensor '{rt.name}' is already quantized ({tname}); "
                             "requantizing is not supported, start from an F32/F16/BF16 file")

        def load(rt=rt, tname=tname, shape=shape, rd=rd):
            raw = torch.from_numpy(reader_raw(rt).copy())
            drop_pages(rd, rt)   # the source file's pages are not kept mapped
            if tname in ("F16", "BF16"):
                # as it is (the codecs and the round trip widen it exactly, as ggml_fp16_to_fp32
                # and ggml_bf16_to_fp32), as the HF loaders give theirs: half the bytes to copy
                # to a GPU or into a checker's staging area. The 554M random llama's `quantize
                # gguf` on two cores: peak PSS 1,429-1,433 MiB against 1,487-1,543 widened here,
                # time within the host's noise (bench_gguf.py --quantize-only --split,
                # alternating runs)
                return raw.view(torch.float16 if tname == "F16" else torch.bfloat16).reshape(shape)
            return ggml.dequantize(raw, tname).reshape(shape)
        tensors.append(SourceTensor(rt.name, shape, load))
    params = _model_params(arch, kv(f"{arch}.block_count"), kv(f"{arch}.attention.head_count"),
                           kv(f"{arch}.attention.head_count_kv"), kv(f"{arch}.expert_count", 0), tensors)
    kvs = _reader_kvs(readers[0]) + [
        ("general.quantization_version", 2, GGUFValueType.UINT32, None),
        ("general.file_type", gguf_policy.ftype_id(policy), GGUFValueType.UINT32, None)]
    return finish_plan(GGUFPlan(arch, kvs, _in_quantize_order(tensors), {}), params,
                       options or GGUFOptions(policy=policy))


def finish_plan(plan: GGUFPlan, params: gguf_policy.ModelParams, options: GGUFOptions) -> GGUFPlan:
    """Types, importance weights and ``quantize.imatrix.*`` keys of a plan whose tensors and
    KVs are set, as ``llama_model_quantize_impl`` decides them with ``--imatrix`` and the
    per-tensor controls of ``options``:

    - the imatrix (:func:`quantpress.convert.imatrix_file.load_importance`, filtered by
      include/exclude) counts as present when an entry is left (``params.has_imatrix``);
    - every quantized tensor takes its entry by name; a tensor without one is quantized
      without (llama-quantize's "did not find weights", listed in ``no_entry``); an entry
      whose size is not ne0 · n_mat is an error except for token_embd (quantized without);
    - a tensor whose type needs an imatrix (``tensor_requires_imatrix``: Q2_K in Q2_K_S) and
      has none is refused;
    - the ``quantize.imatrix.*`` keys are appended after ``general.file_type``.

    Float policies ignore all of it. Raises InputError naming the file, the tensor or the
    option: an imatrix none of whose entries name a tensor of the model (from another
    model: the first entry is named), a size mismatch, a missing required imatrix."""
    policy = options.policy
    ov = options.overrides()
    imp = None
    if options.imatrix and not gguf_policy.is_float_policy(policy):
        imp = load_importance(options.imatrix).filtered(options.include_weights, options.exclude_weights)
    params = dataclasses.replace(params, has_imatrix=bool(imp and imp.weights))
    shapes = [(t.name, t.shape) for t in plan.tensors]
    try:
        plan.types = gguf_policy.plan_types(policy, shapes, params, ov)
        plan.base_types = gguf_policy.plan_types(policy, shapes, params) if ov else plan.types
    except ValueError as e:
        raise InputError(str(e)) from None
    if gguf_policy.is_float_policy(policy):
        return plan
    quantized = [t for t in plan.tensors if plan.types[t.name] not in FLOAT_TYPES]
    if imp and imp.weights:
        names = {t.name for t in plan.tensors}
        if not any(k in names for k in imp.weights):
            first = sorted(imp.weights)[0]
            raise InputError(f"{options.imatrix}: imatrix entry '{first}' names no tensor of the "
                             f"model (an imatrix of another model?)")
        for t in quantized:
            w = imp.weights.get(t.name)
            if w is None:
                plan.no_entry.append(t.name)
                continue
            ne0 = t.shape[-1]
            n_mat = t.shape[0] if len(t.shape) == 3 else 1
            if w.size != ne0 * n_mat:
                if t.name in ("token_embd.weight", "per_layer_token_embd.weight"):
                    plan.no_entry.append(t.name)
                    continue
                raise InputError(f"{options.imatrix}: imatrix size {w.size} is different from "
                                 f"tensor size {ne0 * n_mat} for {t.name} (an imatrix of another model?)")
            plan.imatrix[t.name] = torch.from_numpy(w)
        plan.importance = imp
        plan.kvs = plan.kvs + [
            (k, v, GGUFValueType.STRING if kind == "str" else GGUFValueType.UINT32, None)
            for k, v, kind in imp.kvs()]
    for t in quantized:
        if t.name not in plan.imatrix and gguf_policy.requires_imatrix(policy, t.name, plan.types[t.name]):
            raise InputError(f"--policy {policy}: tensor {t.name} ({plan.types[t.name]}) needs an "
                             "importance matrix (--imatrix FILE or --imatrix auto), as llama-quantize "
                             "requires")
    return plan


#: ``GGUFOptions.imatrix`` asking for the model's own importance matrix, made first
#: (``--imatrix auto``; ``imatrix = true`` in a job file's GGUF table)
AUTO_IMATRIX = "auto"

_REPORT = "also write the summary with every tensor's round-trip figures (RMSE, max error, SNR) as JSON"


def check_gguf_file(path: str) -> None:
    """``quantize gguf``'s input: InputError unless ``path`` is a file."""
    if not Path(path).is_file():
        raise InputError(f"{path}: no such file (quantize gguf reads a .gguf file; "
                         f"'convert hf-to-gguf' reads Hugging Face directories)")


def check_not_gguf(path: str) -> None:
    """``convert hf-to-gguf``'s input: InputError for a GGUF file."""
    if gguf_load.is_gguf(Path(path)):
        raise InputError(f"{path}: a GGUF file; 'quantize gguf' requantizes GGUF files, "
                         f"hf-to-gguf reads Hugging Face directories")


def gguf_steps(args, options: GGUFOptions) -> list[Step]:
    """The steps of ``convert hf-to-gguf`` / ``quantize gguf``: the GGUF at ``-o``; with
    ``--imatrix auto`` first the importance matrix (``quantize imatrix`` with the calibration
    options, kept as ``OUT.imatrix.gguf``, its summary on stderr), the options checked and the
    output path refused before it is made."""
    out = Path(args.output)
    steps = []
    if options.imatrix == AUTO_IMATRIX:
        im_out = out.with_name(out.name + ".imatrix.gguf")
        options = dataclasses.replace(options, imatrix=str(im_out))
        options.validate()
        check_output(out, False, args.force)
        steps.append(Step(ImatrixOptions(), im_out, aside=True))
    return steps + [Step(options, out, calibrated=False, report=args.report)]


class GGUFTarget(Target, kind="gguf", options=GGUFOptions):
    """A GGUF file from an HF directory or an F32/F16/BF16 GGUF (:class:`GGUFOptions`)."""

    #: the round trip runs beside the writing (:meth:`write_together`); verify only reports it
    verify_stage = "verify (beside writing)"
    verbs = (Verb("convert", "hf-to-gguf", "Hugging Face FP16/BF16 directory -> verified GGUF file",
                  arg="model_dir", arg_help="Hugging Face model directory (config.json, safetensors, "
                                            "tokenizer)",
                  out_help="output .gguf path", report=_REPORT, check_input=check_not_gguf, steps=gguf_steps),
             Verb("quantize", "gguf", "requantize an F32/F16/BF16 GGUF with a llama.cpp policy",
                  input="gguf", arg="input", arg_help="input .gguf (F32/F16/BF16 tensors)",
                  out_help="output .gguf path", report=_REPORT, check_input=check_gguf_file,
                  steps=gguf_steps,
                  overrides={"policy": {"required": True, "help": "llama.cpp ftype, e.g. Q4_K_M"}}))
    job_key = "gguf"
    job_order = 10
    runtimes = "llama.cpp, Ollama, LM Studio"
    packages = ("gguf",)
    stream = "tensors"
    memory_stages = ("gguf",)
    needs = Needs(ImatrixOptions, "imatrix", "the imatrix", when=lambda o: o.imatrix == AUTO_IMATRIX)

    @classmethod
    def job_entries(cls, value, where: str, base: Path) -> list[GGUFOptions]:
        """Policy names, or tables of ``convert hf-to-gguf``'s options where ``imatrix`` is
        true (the model's own imatrix, :data:`AUTO_IMATRIX`), false, or the path of an
        imatrix file (relative: to the job file)."""
        if not isinstance(value, list) or not all(isinstance(v, (str, dict)) for v in value):
            raise InputError(f"{where}: {cls.job_key} = {value!r}: expected a list of policy names "
                             f"or tables of hf-to-gguf options")
        out = []
        for i, item in enumerate(value):
            at = f"{where}: {cls.job_key}[{i}]"
            table = {"policy": item} if isinstance(item, str) else dict(item)
            im = table.get("imatrix")
            if isinstance(im, bool):
                if im:
                    table["imatrix"] = AUTO_IMATRIX
                else:
                    del table["imatrix"]
            elif isinstance(im, str):
                f = Path(im).expanduser()
                f = f if f.is_absolute() else (base / f).resolve()
                if im == AUTO_IMATRIX or not f.is_file():
                    raise InputError(f"{at}: imatrix = {im!r}: expected true (this model's imatrix) "
                                     f"or the path of an imatrix file")
                table["imatrix"] = str(f)
            out.append(from_table(GGUFOptions, table, at))
        return out

    @classmethod
    def job_target(cls, options: GGUFOptions) -> str:
        return options.policy

    @classmethod
    def job_path(cls, name: str, options: GGUFOptions) -> str:
        return f"{name}-{options.policy}.gguf"

    @classmethod
    def describe(cls, options: list[GGUFOptions], waiting: bool = False) -> str:
        return ("GGUF policies with the model's imatrix, once it is made" if waiting
                else "GGUF policies from one read of each tensor")

    @classmethod
    def estimate(cls, info, options: list[GGUFOptions]) -> Estimate:
        """Per policy the planned types' bytes (F16 when the plan fails); working memory: the
        largest tensor in float32, its quantized bytes per policy, and the round trip's float32
        chunks (``convert.gguf_roundtrip.VERIFY_CHUNK_ELEMENTS``, four copies)."""
        from quantpress.convert.gguf_roundtrip import VERIFY_CHUNK_ELEMENTS

        cfg, shapes, numel = info.cfg, info.shapes, info.numel
        sizes, out = [], 0
        for o in options:
            try:
                arch = gguf_arch.gguf_arch(cfg)
                names = [(gguf_arch.gguf_tensor_name(k, arch, n_layers=info.layers), s)
                         for k, s in shapes.items() if not gguf_arch.is_skipped_tensor(k)]
                params = gguf_policy.ModelParams(
                    arch=arch, n_layer=info.layers, n_head=info.heads,
                    n_head_kv=int(cfg.get("num_key_value_heads") or info.heads),
                    n_expert=0, has_output=any(n == "output.weight" for n, _ in names))
                types = gguf_policy.plan_types(o.policy, names, params)
                row_bytes = {n: math.prod(s[:-1]) * ggml.get(types[n]).row_bytes(s[-1]) for n, s in names}
                sizes.append(sum(row_bytes.values()))
                out += max(row_bytes.values())
            except Exception:  # an estimate only: fall back to F16 size
                sizes.append(2 * info.total)
                out += 2 * max(numel.values())
        biggest = max(numel.values())
        return Estimate(sizes, {"gguf": 4 * biggest + out + 4 * 4 * VERIFY_CHUNK_ELEMENTS} if options else {})

    def prepare(self, run: Run) -> None:
        with run.stage("prepare"):
            self.device = self.source.device
            bound_heap()                    # before the checkers are forked: they inherit it
            start_checkers(self.device)     # the round trip's processes start while the plan is made
            p, o = self.source.path, self.options
            # from an HF directory transformers' config and tokenizer are read in a forked
            # process while the writer quantizes the first tensors (plan_from_hf's overlap)
            self.plan = plan = (plan_from_gguf(p, o.policy, o) if p.is_file()
                                else plan_from_hf(p, o.policy, o, overlap=OVERLAP_METADATA,
                                                  repo_id=self.source.repo_id))
            if self.device.type == "cpu" and compiled_searches.worth_it(
                    (plan.types[t.name], t.numel, t.name in plan.imatrix) for t in plan.tensors):
                # many K-quant weights: the searches' steps as compiled loops, compiled (or
                # loaded) before the codec processes are forked, which inherit them
                compiled_searches.enable()
                compiled_searches.warm_up(mad=any(plan.types[t.name] == "Q2_K" and t.name not in plan.imatrix
                                                  for t in plan.tensors))
            if self.device.type == "cpu" and not codecs_leave_a_core(
                    [(None, plan.kvs, plan.types, plan.imatrix)], plan.tensors):
                start_codec_processes()     # the search codecs' slices beside this thread's

    def write(self, tmp: Path, run: Run) -> None:
        self.write_together([self], [tmp], [run])

    @classmethod
    def write_together(cls, targets: list["GGUFTarget"], tmps: list[Path], runs: list[Run]) -> None:
        """Write the files of several prepared GGUF targets of one source, ``targets[i]`` at
        ``tmps[i]`` (no rename, no round trip), each byte-identical to its :meth:`write`.

        Targets are grouped by their plan's tensor order (the tuple of tensor names: the
        converter's for the float policies, llama-quantize's ``weight_name_comparer`` order
        for the quantized ones, :func:`_in_quantize_order`), groups in order of first
        appearance; each group is one :func:`quantpress.convert.gguf_file.write_gguf_many`
        over the loaders of its first target, so each source tensor is read once per group
        and encoded once per distinct ggml type. Stage "quantize+write", one progress bar
        over every tensor of every group, labelled with the policies joined by "+", timed in
        ``runs[0]`` and added to the other runs (the targets share it). Each file's round
        trip runs beside the writing (``write_gguf_many(verify=True)``, checking each tensor
        against the source tensor just read); :meth:`verify` then reports it, and each run
        gets the round trip's checking seconds (wall time) as stage :attr:`verify_stage`, the stage
        :meth:`verify`'s report is then timed in too. A group whose plans came from
        ``config.json`` as it is and which transformers' config changes (``PlanChanged``,
        :func:`plan_from_hf` with ``overlap``; nothing is written then) is planned again
        without the overlap and written.

        Raises ValueError when the lists differ in length or are empty, a target is not
        prepared, the targets are not of one source path, or the plans of a group differ in
        architecture or tensor shapes; InputError as ``write_gguf_many`` (a tensor with
        NaN/Inf or of the wrong shape, naming it). Files already begun are closed, not removed.
        """
        targets, tmps = list(targets), [Path(t) for t in tmps]
        if not targets or len(targets) != len(tmps) or len(runs) != len(targets):
            raise ValueError(f"write_together: {len(targets)} targets for {len(tmps)} paths "
                             f"and {len(runs)} runs")
        for t in targets:
            if getattr(t, "plan", None) is None:
                raise ValueError(f"write_together: the {t.options.policy} target is not prepared")
        src = targets[0].source.path.resolve()
        for t in targets[1:]:
            if t.source.path.resolve() != src:
                raise ValueError(f"write_together: targets of different sources "
                                 f"({targets[0].source.path}, {t.source.path})")
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, t in enumerate(targets):
            groups.setdefault(tuple(st.name for st in t.plan.tensors), []).append(i)
        for idx in groups.values():
            first = targets[idx[0]].plan
            shapes = [tuple(st.shape) for st in first.tensors]
            for i in idx[1:]:
                pl = targets[i].plan
                if pl.arch != first.arch:
                    raise ValueError(f"write_together: architecture {pl.arch} of "
                                     f"{targets[i].options.policy}, {first.arch} of "
                                     f"{targets[idx[0]].options.policy}")
                for st, shape in zip(pl.tensors, shapes):
                    if tuple(st.shape) != shape:
                        raise ValueError(f"write_together: tensor '{st.name}' is {tuple(st.shape)} "
                                         f"in {targets[i].options.policy}, {shape} in "
                                         f"{targets[idx[0]].options.policy}")
        label = "+".join(t.options.policy for t in targets)
        total = sum(len(targets[idx[0]].plan.tensors) for idx in groups.values())
        run = runs[0]
        before = run.stages.get("quantize+write", 0.0)
        with run.stage("quantize+write"):
            bar = run.bar(None, label, "tensor", total=total)

            def progress(it):
                for x in it:
                    yield x
                    bar.update(1)
            try:
                for idx in groups.values():
                    try:
                        trips = cls._write_group([targets[i] for i in idx], [tmps[i] for i in idx], progress)
                    except PlanChanged:
                        # transformers' config gave the tensors another plan than config.json
                        # as it is (plan_from_hf's overlap): nothing was written; plan again
                        for i in idx:
                            t = targets[i]
                            t.plan = plan_from_hf(t.source.path, t.options.policy, t.options,
                                                  repo_id=t.source.repo_id)
                        trips = cls._write_group([targets[i] for i in idx], [tmps[i] for i in idx], progress)
                    for i, trip in zip(idx, trips):
                        targets[i].roundtrip = trip
            finally:
                bar.close()
        shared = run.stages["quantize+write"] - before
        for r in {id(r): r for r in runs[1:] if r is not run}.values():
            r.stages["quantize+write"] = r.stages.get("quantize+write", 0.0) + shared
        for t, r in zip(targets, runs):
            key = t.verify_stage
            r.stages[key] = r.stages.get(key, 0.0) + t.roundtrip.seconds

    @staticmethod
    def _write_group(targets: list["GGUFTarget"], tmps: list[Path], progress) -> list[RoundTrip]:
        first = targets[0].plan
        files = [(tmp, t.plan.kvs, t.plan.types, t.plan.imatrix) for t, tmp in zip(targets, tmps)]
        return write_gguf_many(files, first.arch, first.tensors, targets[0].device,
                               progress=progress, verify=True)

    roundtrip: RoundTrip | None = None

    def verify(self, tmp: Path, run: Run) -> str:
        """The round trip that ran beside :meth:`write_together` (every write goes through
        it): RoundTripError on any mismatch."""
        rt = self.roundtrip
        if rt is None:
            raise RuntimeError(f"{tmp}: verify before write_together (no round trip ran)")
        if not rt.ok:
            raise RoundTripError("round-trip check failed, no output written: "
                                 + "; ".join(rt.mismatches[:5]))
        return (f"ok: {len(rt.tensors)} tensors re-read with gguf-py, dequantized "
                f"bit-identically by gguf-py and quantpress")

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        rt, types = self.roundtrip, self.plan.types
        counts = dict(sorted(Counter(types.values()).items()))
        n_el = sum(t.numel for t in self.plan.tensors)
        lines = [f"tensors    {len(types)}: " + ", ".join(f"{k} x{v}" for k, v in counts.items())]
        finite = [t for t in rt.tensors if math.isfinite(t.snr_db)]
        worst = min(finite, key=lambda t: t.snr_db) if finite else None
        overall = None
        if rt.tensors:
            se = sum(t.rmse ** 2 * math.prod(t.shape) for t in rt.tensors)
            overall = math.sqrt(se / max(1, n_el))
            lines.append(f"error      overall RMSE {overall:.3e}, max |err| "
                         f"{max(t.max_abs_err for t in rt.tensors):.3e}"
                         + (f", lowest SNR {worst.snr_db:.1f} dB ({worst.name}, {worst.type})"
                            if worst else ", lossless"))
        pl = self.plan
        changed = {n: (pl.base_types[n], t) for n, t in types.items() if pl.base_types.get(n, t) != t}
        if changed:
            shown = ", ".join(f"{n} {a}->{b}" for n, (a, b) in list(changed.items())[:8])
            more = f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""
            lines.append(f"overrides  {len(changed)} tensors changed: {shown}{more}")
        if pl.importance is not None:
            lines.append(f"imatrix    {pl.importance.file}: {len(pl.imatrix)} tensors weighted"
                         + (f", {len(pl.no_entry)} without an entry ({', '.join(pl.no_entry[:4])}"
                            + (", ..." if len(pl.no_entry) > 4 else "") + ")" if pl.no_entry else ""))
        details = {
            "policy": self.options.policy, "type_counts": counts, "rmse": overall,
            "roundtrip_checker_processes": rt.checker_processes,
            "overrides": {n: {"policy": a, "written": b} for n, (a, b) in changed.items()},
            "imatrix": None if pl.importance is None else {
                "file": pl.importance.file, "weighted": sorted(pl.imatrix), "no_entry": pl.no_entry},
            "tensors": [{"name": t.name, "type": t.type, "shape": list(t.shape), "bytes": t.n_bytes,
                         "bpw": t.bpw, "rmse": t.rmse, "max_abs_err": t.max_abs_err,
                         "snr_db": t.snr_db if math.isfinite(t.snr_db) else None}
                        for t in rt.tensors]}
        return Summary(self.kind, self.options.policy, out, str(self.source.path),
                       tensor_bytes=sum(t.n_bytes for t in rt.tensors), parameters=n_el,
                       roundtrip=roundtrip, details=details, lines=lines)
