"""The plan of a GGUF file (:class:`GGUFPlan`): the tensor list (name, shape, a loader), the
metadata and one ggml type per tensor, from an HF directory (:func:`plan_from_hf`, as
``convert_hf_to_gguf.py`` + ``llama-quantize``) or from an F32/F16/BF16 GGUF
(:func:`plan_from_gguf`, as ``llama-quantize``), with the imatrix and per-tensor controls of
:class:`quantpress.targets.gguf_options.GGUFOptions` (:func:`finish_plan`)."""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from quantpress.convert import gguf_arch, gguf_load, gguf_policy, gguf_tokenizer
from quantpress.convert.gguf_ahead import PendingKVs
from quantpress.convert.gguf_checks import SourceTensor
from quantpress.convert.gguf_reading import drop_pages, open_reader, reader_raw
from quantpress.convert.hf import HFModel
from quantpress.convert.imatrix_file import Importance, load_importance
from quantpress.errors import InputError
from quantpress.quantize import ggml
from quantpress.targets.gguf_options import FLOAT_TYPES, GGUFOptions
from quantpress.workers import fork_call


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
    a :class:`quantpress.convert.gguf_ahead.PendingKVs`, which the writer waits for while it
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


