"""GGUF architecture tables and model metadata for llama / qwen2 / qwen3.

Reproduces llama.cpp 0c1e57098 ``convert_hf_to_gguf.py`` (``conversion/base.py`` TextModel,
``conversion/llama.py`` LlamaModel, ``conversion/qwen.py`` Qwen2Model / Qwen3Model) and the
parts of its vendored gguf-py (``GGUFWriter`` typed adders, ``Metadata``) that decide which
KV pairs are written, in which order and with which GGUF value types.

The facts (architecture names, tensor names, per-arch switches) live in
``configs/gguf_arch.toml``; this module only interprets them.

Metadata is returned as a list of ``(key, value, value_type, sub_type)`` tuples, ready for
``GGUFWriter.add_key_value(key, value, value_type, sub_type=sub_type)``. Empty strings and
empty arrays are already dropped (the typed ``add_string``/``add_array`` adders skip them,
``add_key_value`` does not). ``general.architecture`` is not included: ``GGUFWriter``
writes it itself.

The ``config`` argument of every function here is the dict that the reference converter
works on: ``AutoConfig.from_pretrained(dir).to_dict()`` with ``text_config`` merged into the
root -- use :func:`load_hf_config`. A raw ``config.json`` can differ (transformers fills in
``head_dim`` for llama, for example, which makes the reference write
``llama.attention.key_length``), so passing one gives different KVs on older checkpoints.
"""
from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from gguf import GGUFValueType

from quantpress.configs import load_toml
from quantpress.errors import InputError

__all__ = [
    "SUPPORTED_ARCHITECTURES", "UnsupportedArchitecture", "UnknownTensorName", "KV",
    "load_hf_config", "gguf_arch", "gguf_tensor_name", "is_skipped_tensor",
    "transform_tensor", "generated_tensors", "model_metadata", "count_parameters",
    "GGML_QUANT_VERSION",
]

KV = tuple[str, Any, GGUFValueType, "GGUFValueType | None"]

#: ``gguf.GGML_QUANT_VERSION`` at the reference version (written as general.quantization_version).
GGML_QUANT_VERSION = 2


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    return load_toml("gguf_arch.toml")


#: HF ``architectures[0]`` -> GGUF architecture name (dense models only).
SUPPORTED_ARCHITECTURES: dict[str, str] = dict(_table()["architectures"])


class UnsupportedArchitecture(InputError):
    """The HF model's architecture has no GGUF mapping in quantpress (bad input: exit 2)."""


class UnknownTensorName(KeyError, InputError):
    """An HF tensor name that the GGUF tensor map for the architecture does not cover."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------------------
# small helpers


class KVList:
    """Ordered KV collection with GGUFWriter semantics.

    * ``add_string`` / ``add_array`` skip empty values (``skip_empty``),
    * re-adding a key overwrites the value in place (Python dict), keeping its first position,
      which is what ``GGUFWriter.add_key_value`` does with a duplicated key.
    """

    def __init__(self) -> None:
        self._kv: dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]] = {}

    def add(self, key: str, value: Any, vtype: GGUFValueType,
            sub_type: GGUFValueType | None = None) -> None:
        if vtype == GGUFValueType.STRING and not value:
            return
        if vtype == GGUFValueType.ARRAY and len(value) == 0:
            return
        self._kv[key] = (value, vtype, sub_type)

    def u32(self, key: str, value: Any) -> None:
        self.add(key, int(value), GGUFValueType.UINT32)

    def i32(self, key: str, value: Any) -> None:
        self.add(key, int(value), GGUFValueType.INT32)

    def f32(self, key: str, value: Any) -> None:
        self.add(key, float(value), GGUFValueType.FLOAT32)

    def boolean(self, key: str, value: Any) -> None:
        self.add(key, bool(value), GGUFValueType.BOOL)

    def string(self, key: str, value: Any) -> None:
        self.add(key, value, GGUFValueType.STRING)

    def array(self, key: str, values: Sequence[Any], sub_type: GGUFValueType | None = None) -> None:
        values = list(values)
        if values and sub_type is None:
            sub_type = _infer_array_type(values)
        self.add(key, values, GGUFValueType.ARRAY, sub_type)

    def items(self) -> list[KV]:
        return [(k, v, t, s) for k, (v, t, s) in self._kv.items()]


def _infer_array_type(values: Sequence[Any]) -> GGUFValueType:
    """Element type of a GGUF array as ``GGUFValueType.get_type`` picks it (ints -> INT32)."""
    first = values[0]
    if isinstance(first, (str, bytes, bytearray)):
        return GGUFValueType.STRING
    if isinstance(first, bool):
        return GGUFValueType.BOOL
    if isinstance(first, float):
        return GGUFValueType.FLOAT32
    if isinstance(first, int):
        return GGUFValueType.INT32
    raise InputError(f"config value list of {type(first).__name__}: cannot be stored in a GGUF array")


def first_present(config: dict, keys: Iterable[str]) -> Any:
    """``ModelBase.find_hparam(keys, optional=True)``: the value of the first key that is
    present in ``config`` (even when that value is None), else None."""
    for k in keys:
        if k in config:
            return config[k]
    return None


def _required(config: dict, keys: Sequence[str]) -> Any:
    """``ModelBase.find_hparam(keys)``: like :func:`first_present` but an InputError when absent."""
    if not any(k in config for k in keys):
        raise InputError(f"config.json has none of the keys {list(keys)}")
    return first_present(config, keys)


def arch_info(arch: str) -> dict:
    """The ``[arch.<name>]`` table of configs/gguf_arch.toml (tensor map, metadata keys) for a
    GGUF architecture name. Raises UnsupportedArchitecture for an unknown one."""
    try:
        return _table()["arch"][arch]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unknown GGUF architecture {arch!r}; quantpress writes {sorted(_table()['arch'])}") from None


# --------------------------------------------------------------------------------------
# config and architecture


def load_hf_config(model_dir: Path | str) -> dict:
    """The hyper-parameter dict convert_hf_to_gguf works on (``ModelBase.load_hparams`` plus
    ``TextModel.__init__``'s ``text_config`` merge).

    ``transformers.AutoConfig.from_pretrained(dir, trust_remote_code=False).to_dict()``;
    falls back to the raw ``config.json`` when transformers cannot build the config.

    Raises:
        InputError: ``config.json`` is missing.
    """
    model_dir = Path(model_dir)
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False).to_dict()
    except Exception:  # same fallback as the reference: plain JSON
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    return _merged_text_config(config)


def raw_hf_config(model_dir: Path | str) -> dict:
    """:func:`load_hf_config` without transformers: ``config.json`` as it is (the fallback of
    ``ModelBase.load_hparams`` in llama.cpp's convert_hf_to_gguf.py), with the same
    ``text_config`` merge. Keys that transformers' config class
    would fill with defaults are missing, and no value is normalized; used only where the
    result is checked against :func:`load_hf_config`'s later.

    Raises:
        InputError: ``config.json`` is missing or is not a JSON object.
    """
    cfg_path = Path(model_dir) / "config.json"
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise InputError(f"{cfg_path}: cannot read it as JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{cfg_path}: expected a JSON object")
    return _merged_text_config(config)


def _merged_text_config(config: dict) -> dict:
    # TextModel.__init__: a multimodal config's text part merged over its top level
    for alias in ("llm_config", "lm_config", "language_config", "lfm"):
        if alias in config:
            config["text_config"] = config[alias]
    if "thinker_config" in config:
        config["text_config"] = config["thinker_config"]["text_config"]
    if "text_config" in config:
        config = {**config, **config["text_config"]}
    return config


def _hf_architecture(config: dict) -> str | None:
    """``get_model_architecture`` for text models: ``architectures[0]``, overridden by
    ``text_config.architectures[0]`` when present."""
    arch = None
    if archs := config.get("architectures"):
        arch = archs[0]
    text_archs = (config.get("text_config") or {}).get("architectures")
    if text_archs:
        arch = text_archs[0]
    return arch


def gguf_arch(config: dict) -> str:
    """GGUF architecture name (``general.architecture``) for an HF config dict.

    Returns "llama" (LlamaForCausalLM, MistralForCausalLM), "qwen2" (Qwen2ForCausalLM) or
    "qwen3" (Qwen3ForCausalLM), following the ``@ModelBase.register`` tables of
    ``conversion/llama.py`` and ``conversion/qwen.py``.

    Raises:
        UnsupportedArchitecture: the architecture is not one of the supported ones, or the
            checkpoint is a variant quantpress does not convert (mixture of experts,
            EAGLE-3 draft head). The message lists the supported HF architectures.
    """
    hf_arch = _hf_architecture(config)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if hf_arch is None:
        raise UnsupportedArchitecture(
            f"config has no 'architectures' entry; supported HF architectures: {supported}")
    if hf_arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"HF architecture {hf_arch!r} is not supported; supported HF architectures: {supported}")
    n_experts = first_present(config, ["num_local_experts", "num_experts", "n_routed_experts"])
    if n_experts:
        raise UnsupportedArchitecture(
            f"{hf_arch} with {n_experts} experts (mixture of experts) is not supported; "
            f"quantpress converts dense models only ({supported})")
    if "draft_vocab_size" in config and config.get("num_hidden_layers") == 1:
        raise UnsupportedArchitecture(f"{hf_arch}: EAGLE-3 draft checkpoints are not supported")
    return SUPPORTED_ARCHITECTURES[hf_arch]


# --------------------------------------------------------------------------------------
# tensors

_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def is_skipped_tensor(hf_name: str) -> bool:
    """True for checkpoint entries that convert_hf_to_gguf drops without mapping
    (``*.rotary_emb.inv_freq``, ``*.attention.bias``, ``*.attention.masked_bias``;
    ``ModelBase.prepare_tensors``)."""
    return hf_name.endswith(tuple(_table()["skip"]["suffixes"]))


def gguf_tensor_name(hf_name: str, arch: str, *, n_layers: int | None = None) -> str:
    """GGUF tensor name for an HF tensor name, as ``TensorNameMap.get_name(name,
    try_suffixes=(".weight", ".bias"))`` maps it for ``arch`` (gguf-py tensor_mapping.py).

    ``model.embed_tokens.weight`` -> ``token_embd.weight``; ``model.layers.3.self_attn.q_proj.bias``
    -> ``blk.3.attn_q.bias``. The ``.weight``/``.bias`` suffix is carried over.

    Args:
        n_layers: when given, block ids must be below it (the reference builds its map for
            ``num_hidden_layers`` blocks).

    Raises:
        UnknownTensorName (a KeyError and InputError): the name has no mapping for ``arch``.
        UnsupportedArchitecture: ``arch`` is not one of llama, qwen2, qwen3.
    """
    info = arch_info(arch)
    names = _table()["tensor_names"]
    allowed = set(info["tensors"])
    for suffix in ("", ".weight", ".bias"):
        if suffix and not hf_name.endswith(suffix):
            continue
        base = hf_name[: len(hf_name) - len(suffix)] if suffix else hf_name
        if base in names["global"]:
            gname = names["global"][base]
            if gname in allowed:
                return gname + suffix
        m = _BLOCK_RE.match(base)
        if m and m.group(2) in names["block"]:
            bid = int(m.group(1))
            gname = names["block"][m.group(2)]
            if gname in allowed and (n_layers is None or bid < n_layers):
                return f"blk.{bid}.{gname}{suffix}"
    raise UnknownTensorName(f"cannot map tensor {hf_name!r} to a GGUF name for architecture {arch!r}")


def _permute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows grouped per head as [first halves | second halves] -> interleaved pairs.

    ``t`` has shape ``(n_head * head_dim, ...)``; the result has the same shape, dtype and
    device. Row ``h*hd + 2*i + j`` of the result is row ``h*hd + j*hd/2 + i`` of ``t``.
    """
    rows = t.shape[0]
    if rows % (2 * n_head) != 0:
        raise InputError(f"cannot permute {tuple(t.shape)} for {n_head} heads: rows not divisible by 2*n_head")
    return (t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:])
            .transpose(1, 2)
            .reshape(t.shape))


def transform_tensor(hf_name: str, t: torch.Tensor, config: dict, arch: str) -> torch.Tensor:
    """The data transform convert_hf_to_gguf applies to one HF tensor before writing it.

    llama: ``q_proj.{weight,bias}`` are permuted with ``num_attention_heads`` and
    ``k_proj.{weight,bias}`` with ``num_key_value_heads`` (``LlamaModel.permute``; HF's
    rotate-half RoPE layout -> llama.cpp's adjacent-pair layout). Everything else, and every
    qwen2/qwen3 tensor (NEOX RoPE), is returned unchanged (the same object).

    Pure torch: any device, any dtype; the shape is unchanged (``(out_features, in_features)``
    for weights, ``(out_features,)`` for biases). No dtype conversion happens here.

    Raises:
        InputError: the leading dimension is not divisible by 2*heads.
        InputError: a llama q/k tensor but the config lacks the head counts.
    """
    if not arch_info(arch)["permute_qk"]:
        return t
    if not hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return t
    n_head = _required(config, ["n_heads", "num_attention_heads"])
    n_kv_head = _required(config, ["n_kv_heads", "num_key_value_heads"])
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        t = _permute_rows(t, n_head)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        heads = n_kv_head if (n_kv_head is not None and n_kv_head != n_head) else n_head
        t = _permute_rows(t, heads)
    return t


def _rope_parameters(config: dict) -> dict:
    """``TextModel.__init__``'s ``self.rope_parameters`` (a copy; the reference edits in place)."""
    rp = config.get("rope_parameters", config.get("rope_scaling")) or {}
    rp = dict(rp)
    rope_theta = first_present(config, ["global_rope_theta", "rope_global_theta", "rope_theta_global",
                                         "rope_theta", "rotary_emb_base"])
    local_theta = first_present(config, ["local_rope_theta", "rope_local_theta", "rope_theta_local",
                                          "swa_rope_theta", "rope_local_base_freq"])
    partial = first_present(config, ["partial_rotary_factor", "rope_pct", "rope_percent"])
    orig_ctx = first_present(config, ["original_max_position_embeddings"])
    if "full_attention" not in rp and "sliding_attention" not in rp:
        if local_theta is not None:
            rp["sliding_attention"] = {"rope_theta": local_theta}
        if "rope_theta" not in rp and rope_theta is not None:
            rp["rope_theta"] = rope_theta
        if "rope_type" not in rp and rp.get("type") is not None:
            rp["rope_type"] = rp["type"]
        if "partial_rotary_factor" not in rp and partial is not None:
            rp["partial_rotary_factor"] = partial
        if "original_max_position_embeddings" not in rp and orig_ctx is not None:
            rp["original_max_position_embeddings"] = orig_ctx
    return rp


def _head_dim(config: dict) -> int:
    hd = config.get("head_dim")
    if hd is None:
        hd = config["hidden_size"] // config["num_attention_heads"]
    return int(hd)


def _llama3_rope_factors(params: dict, dim: int) -> torch.Tensor:
    """Per-frequency RoPE scale factors of Llama 3.x (``LlamaModel.generate_extra_tensors``).

    Evaluated with the same float32 tensor arithmetic as the reference, one frequency at a
    time, so that every factor has the reference's bits.
    """
    base = params.get("rope_theta", 10000.0)
    factor = params.get("factor", 8.0)
    lo = params.get("low_freq_factor", 1.0)
    hi = params.get("high_freq_factor", 4.0)
    old_ctx = params.get("original_max_position_embeddings", 8192)
    lo_wavelen = old_ctx / lo
    hi_wavelen = old_ctx / hi
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out: list[Any] = []
    for f in inv_freq:  # 0-d float32 tensors, as in the reference loop
        wavelen = 2 * math.pi / f
        if wavelen < hi_wavelen:
            out.append(1)
        elif wavelen > lo_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def generated_tensors(config: dict, arch: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors convert_hf_to_gguf adds that are not in the checkpoint, with GGUF names.

    For llama with ``rope_type == "llama3"`` (case-insensitive): ``rope_freqs.weight``,
    float32 of shape ``(head_dim // 2,)``, the Llama 3 frequency scale factors. Written
    before the checkpoint tensors by the reference. Empty for everything else.
    """
    info = arch_info(arch)
    if not info["llama3_rope_freqs"]:
        return []
    rp = _rope_parameters(config)
    params = rp.get("full_attention", rp)
    if not params or str(params.get("rope_type", "")).lower() != "llama3":
        return []
    return [(_table()["generated"]["rope_freqs"], _llama3_rope_factors(params, _head_dim(config)))]


# --------------------------------------------------------------------------------------
# parameter count (general.size_label)


def _checkpoint_shapes(model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every checkpoint tensor, in the files convert_hf_to_gguf reads."""
    part_names = sorted(p.name for p in model_dir.iterdir()
                        if p.name.startswith("model") and p.name.endswith(".safetensors"))
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            part_names = sorted(set(json.load(f)["weight_map"].values()))
    shapes: list[tuple[str, tuple[int, ...]]] = []
    if part_names:
        from safetensors import safe_open

        for part in part_names:
            with safe_open(str(model_dir / part), framework="pt") as f:
                for name in f.keys():
                    shapes.append((name, tuple(f.get_slice(name).get_shape())))
        return shapes
    bins = sorted(p.name for p in model_dir.iterdir()
                  if p.name.startswith("pytorch_model") and p.name.endswith(".bin"))
    if not bins:
        raise InputError(f"{model_dir}: no model*.safetensors or pytorch_model*.bin weights")
    for part in bins:
        sd = torch.load(str(model_dir / part), map_location="meta", mmap=True, weights_only=True)
        shapes.extend((k, tuple(v.shape)) for k, v in sd.items())
    return shapes


def count_parameters(model_dir: Path | str, config: dict, arch: str) -> int:
    """Total element count of the tensors the reference writes (``GGUFWriter.
    get_total_parameter_count()[0]`` for a dense model): checkpoint tensors minus the
    skipped ones, plus generated tensors. Reads safetensors headers only."""
    total = 0
    for name, shape in _checkpoint_shapes(Path(model_dir)):
        if is_skipped_tensor(name):
            continue
        total += math.prod(shape)
    for _, t in generated_tensors(config, arch):
        total += t.numel()
    return total


# --------------------------------------------------------------------------------------
# model metadata


def _general_metadata(kv: KVList, model_dir: Path, total_params: int, model_name: str | None,
                      repo_id: str | None = None) -> None:
    """``Metadata.load(...)`` + ``Metadata.set_gguf_meta_model`` (gguf-py metadata.py)."""
    from gguf.metadata import Metadata
    from gguf.utility import size_label

    # gguf 0.19.0's heuristics (model card, config _name_or_path, directory name) are the
    # reference's; the only difference is the repetition_penalty fallback, applied below.
    md = Metadata.load(None, model_dir, model_name, total_params)
    gen = Metadata.load_generation_config(model_dir)
    if gen and "penalty_repeat" not in gen and "repetition_penalty" in gen:
        md.sampling_penalty_repeat = gen["repetition_penalty"]
    if repo_id:
        md.name = repo_id
    if md.name is None:
        md.name = model_dir.name
    if md.size_label is None and total_params > 0:
        md.size_label = size_label(total_params, total_params, 0, 0)

    g = "general."
    for attr, key, kind in (
        ("sampling_sequence", "sampling.sequence", "s"), ("sampling_top_k", "sampling.top_k", "i"),
        ("sampling_top_p", "sampling.top_p", "f"), ("sampling_min_p", "sampling.min_p", "f"),
        ("sampling_xtc_probability", "sampling.xtc_probability", "f"),
        ("sampling_xtc_threshold", "sampling.xtc_threshold", "f"),
        ("sampling_temp", "sampling.temp", "f"), ("sampling_penalty_last_n", "sampling.penalty_last_n", "i"),
        ("sampling_penalty_repeat", "sampling.penalty_repeat", "f"),
        ("sampling_mirostat", "sampling.mirostat", "i"), ("sampling_mirostat_tau", "sampling.mirostat_tau", "f"),
        ("sampling_mirostat_eta", "sampling.mirostat_eta", "f"),
    ):
        v = getattr(md, attr)
        if v is not None:
            {"s": kv.string, "i": kv.i32, "f": kv.f32}[kind](g + key, v)

    kv.string(g + "name", md.name)
    for attr in ("author", "version", "organization", "finetune", "basename", "description",
                 "quantized_by", "size_label"):
        if getattr(md, attr) is not None:
            kv.string(g + attr, getattr(md, attr))
    if md.license is not None:
        kv.string(g + "license", ",".join(md.license) if isinstance(md.license, list) else md.license)
    for attr, key in (("license_name", "license.name"), ("license_link", "license.link"),
                      ("url", "url"), ("doi", "doi"), ("uuid", "uuid"), ("repo_url", "repo_url"),
                      ("source_url", "source.url"), ("source_doi", "source.doi"),
                      ("source_uuid", "source.uuid"), ("source_repo_url", "source.repo_url")):
        if getattr(md, attr) is not None:
            kv.string(g + key, getattr(md, attr))
    for entries, prefix in ((md.base_models, "base_model"), (md.datasets, "dataset")):
        if entries is None:
            continue
        kv.u32(f"{g}{prefix}.count", len(entries))
        for i, entry in enumerate(entries):
            for field in ("name", "author", "version", "organization", "description", "url",
                          "doi", "uuid", "repo_url"):
                if field in entry:
                    kv.string(f"{g}{prefix}.{i}.{field}", entry[field])
    if md.tags is not None:
        kv.array(g + "tags", md.tags)
    if md.languages is not None:
        kv.array(g + "languages", md.languages)


def _rope_and_attention(kv: KVList, config: dict, a: str) -> None:
    """The RoPE part of ``TextModel.set_gguf_parameters``."""
    rp = _rope_parameters(config)
    params = rp.get("full_attention", rp)
    rope_type = params.get("rope_type")
    if rope_type is not None:
        factor = params.get("factor")
        if rope_type == "linear" and factor is not None:
            kv.string(f"{a}.rope.scaling.type", "linear")
            kv.f32(f"{a}.rope.scaling.factor", factor)
        elif rope_type == "yarn" and factor is not None:
            kv.string(f"{a}.rope.scaling.type", "yarn")
            kv.f32(f"{a}.rope.scaling.factor", factor)
            kv.u32(f"{a}.rope.scaling.original_context_length", params["original_max_position_embeddings"])
            if (v := params.get("extrapolation_factor")) is not None:
                kv.f32(f"{a}.rope.scaling.yarn_ext_factor", v)
            if (v := params.get("attention_factor", params.get("attn_factor"))) is not None:
                kv.f32(f"{a}.rope.scaling.yarn_attn_factor", v)
            if (v := params.get("beta_fast")) is not None:
                kv.f32(f"{a}.rope.scaling.yarn_beta_fast", v)
            if (v := params.get("beta_slow")) is not None:
                kv.f32(f"{a}.rope.scaling.yarn_beta_slow", v)
        elif rope_type in ("su", "longrope"):
            kv.string(f"{a}.rope.scaling.type", "longrope")
        # "dynamic", "llama3" (rope_freqs tensor), "default" and unknown types: no KV
    if "mrope_section" in rp:
        sections = list(rp["mrope_section"]) + [0] * max(0, 4 - len(rp["mrope_section"]))
        kv.array(f"{a}.rope.dimension_sections", sections[:4])
    if (theta := params.get("rope_theta")) is not None:
        kv.f32(f"{a}.rope.freq_base", theta)
    if (local := rp.get("sliding_attention", {}).get("rope_theta")) is not None:
        kv.f32(f"{a}.rope.freq_base_swa", local)


def _u32_or_array(kv: KVList, key: str, value: Any) -> None:
    if isinstance(value, int):
        kv.u32(key, value)
    else:
        kv.array(key, value)


def _pooling(kv: KVList, config: dict, model_dir: Path, a: str) -> None:
    """``TextModel._try_set_pooling_type`` (sentence-transformers pooling config)."""
    modes = {"mean": 1, "cls": 2, "lasttoken": 3}
    pooling_path = None
    modules = model_dir / "modules.json"
    if modules.is_file():
        with open(modules, encoding="utf-8") as f:
            for mod in json.load(f):
                if mod["type"].endswith("Pooling"):
                    pooling_path = mod["path"]
                    break
    if pooling_path is not None:
        with open(model_dir / pooling_path / "config.json", encoding="utf-8") as f:
            pooling = json.load(f)
        if pooling.get("pooling_mode_mean_tokens"):
            ptype = 1
        elif pooling.get("pooling_mode_cls_token"):
            ptype = 2
        elif pooling.get("pooling_mode_lasttoken"):
            ptype = 3
        elif pooling.get("pooling_mode") in modes:
            ptype = modes[pooling["pooling_mode"]]
        else:
            raise InputError("config: only MEAN, CLS, and LAST pooling types are supported")
        kv.u32(f"{a}.pooling_type", ptype)
    if (cp := config.get("classifier_pooling")) is not None:
        if cp not in ("cls", "mean"):
            raise InputError(f"config.json: unsupported classifier_pooling {cp!r}")
        kv.u32(f"{a}.classifier.pooling_type", modes[cp])


def _is_qwen3_reranker(config: dict, model_dir: Path) -> bool:
    """``Qwen3Model._is_qwen3_reranker``: such checkpoints get a classifier head we do not write."""
    readme = model_dir / "README.md"
    text = readme.read_text(encoding="utf-8").lower() if readme.exists() else ""
    if "# qwen3-reranker" in text or "# qwen3-vl-reranker" in text:
        return True
    origin = (config.get("architectures") or [None])[0] or ""
    hints = [str(model_dir.name), str(config.get("_name_or_path", "")), str(config.get("model_type", "")), origin]
    if any("qwen3-reranker" in h.lower() or "qwen3-vl-reranker" in h.lower() for h in hints if h):
        return True
    return "sequenceclassification" in origin.lower()


def model_metadata(config: dict, model_dir: Path | str, arch: str, file_type: int, *,
                   model_name: str | None = None, total_params: int | None = None,
                   repo_id: str | None = None) -> list[KV]:
    """The non-tokenizer KVs convert_hf_to_gguf writes, in its order, with its types.

    Order (``ModelBase.prepare_metadata``): ``general.type`` ("model"); the authorship and
    sampling keys of gguf-py ``Metadata`` (``general.sampling.*`` from generation_config.json,
    ``general.name``, ``.organization``, ``.finetune``, ``.basename``, ``.size_label``,
    license/tags/languages/base_model/dataset keys from the README.md model card, ...);
    ``TextModel.set_gguf_parameters`` (``{arch}.block_count``, ``.context_length``,
    ``.embedding_length``, ``.feed_forward_length``, ``.attention.head_count``,
    ``.attention.head_count_kv``, RoPE scaling keys, ``.rope.freq_base``,
    ``.attention.layer_norm_rms_epsilon``, ``.attention.key_length``/``.value_length`` when
    the config has ``head_dim``, ``general.file_type``); then ``llama.vocab_size`` and
    ``llama.rope.dimension_count`` (llama) or the pooling keys (qwen2/qwen3, only for
    sentence-transformers checkpoints); finally ``general.quantization_version``.

    ``general.name``/``size_label``/``basename``/``finetune`` come from ``_name_or_path`` in
    config.json or, failing that, the directory name (``SmolLM2-135M-Instruct`` -> name
    "SmolLM2 135M Instruct", basename "SmolLM2", size_label "135M", finetune "Instruct");
    when no size is found there, from the parameter count ("12M").

    Left out (provenance / command-line only): the ``--metadata`` override file.
    ``--model-name`` is the ``model_name`` keyword; ``--remote``'s HF repo id is ``repo_id``
    (``ModelBase.prepare_metadata``: it replaces ``general.name`` after the heuristics, the
    other naming keys still come from the directory). Everything read from the directory itself (generation_config.json,
    README.md model card, config.json) is reproduced.

    Args:
        config: :func:`load_hf_config` of ``model_dir``.
        model_dir: the HF directory (its name feeds ``general.name`` heuristics).
        arch: :func:`gguf_arch` of ``config``.
        file_type: llama ftype for ``general.file_type`` (1 = MOSTLY_F16, 32 = MOSTLY_BF16, ...).
        total_params: element count of the written tensors; counted from the checkpoint
            headers (:func:`count_parameters`) when None.

    Returns:
        ``[(key, value, GGUFValueType, sub_type_or_None), ...]`` for
        ``GGUFWriter.add_key_value``; arrays carry their element type as ``sub_type``.

    Raises:
        UnsupportedArchitecture: unknown ``arch``.
        InputError: a Qwen3 reranker checkpoint, or an unsupported pooling mode.
        KeyError: a required hyper-parameter (``num_hidden_layers``, ``vocab_size`` for llama,
            ``original_max_position_embeddings`` for yarn) is missing.
    """
    info = arch_info(arch)
    model_dir = Path(model_dir)
    if arch == "qwen3" and _is_qwen3_reranker(config, model_dir):
        raise InputError(f"{model_dir}: Qwen3 reranker checkpoints are not supported")
    if total_params is None:
        total_params = count_parameters(model_dir, config, arch)

    kv = KVList()
    kv.string("general.type", "model")
    _general_metadata(kv, model_dir, total_params, model_name, repo_id)

    a = arch
    kv.u32(f"{a}.block_count", _required(config, ["n_layers", "num_hidden_layers", "n_layer", "num_layers"]))
    if (v := first_present(config, ["max_position_embeddings", "n_ctx", "n_positions", "max_length",
                                     "max_sequence_length", "model_max_length"])) is not None:
        kv.u32(f"{a}.context_length", v)
    if (v := first_present(config, ["hidden_size", "n_embd", "dim"])) is not None:
        kv.u32(f"{a}.embedding_length", v)
    if (v := first_present(config, ["prefix_dense_intermediate_size", "dense_intermediate_size",
                                     "intermediate_size", "n_inner", "hidden_dim"])) is not None:
        _u32_or_array(kv, f"{a}.feed_forward_length", v)
    if (v := first_present(config, ["num_attention_heads", "n_head", "n_heads"])) is not None:
        _u32_or_array(kv, f"{a}.attention.head_count", v)
    if (v := first_present(config, ["num_key_value_heads", "n_kv_heads"])) is not None:
        _u32_or_array(kv, f"{a}.attention.head_count_kv", v)
    if config.get("is_causal") is False:
        kv.boolean(f"{a}.attention.causal", False)
    _rope_and_attention(kv, config, a)
    if (v := first_present(config, ["rms_norm_eps", "norm_eps"])) is not None:
        kv.f32(f"{a}.attention.layer_norm_rms_epsilon", v)
    if (v := first_present(config, ["layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"])) is not None:
        kv.f32(f"{a}.attention.layer_norm_epsilon", v)
    if (v := first_present(config, ["num_local_experts", "num_experts", "n_routed_experts"])) is not None:
        kv.u32(f"{a}.expert_count", v)
    if (v := first_present(config, ["num_experts_per_tok", "num_experts_per_token", "top_k_experts"])) is not None:
        _u32_or_array(kv, f"{a}.expert_used_count", v)
    if (v := config.get("n_group")) is not None:
        kv.u32(f"{a}.expert_group_count", v)
    if (v := config.get("topk_group")) is not None:
        kv.u32(f"{a}.expert_group_used_count", v)
    if (v := first_present(config, ["score_function", "scoring_func", "score_func", "moe_router_activation",
                                     "moe_router_activation_func", "expert_selection_fn"])) is not None:
        gating = {"softmax": 1, "sigmoid": 2, "sqrtsoftplus": 4}
        if v not in gating:
            raise InputError(f"config.json: unsupported expert score gating function {v!r}")
        kv.u32(f"{a}.expert_gating_func", gating[v])
    if (head_dim := config.get("head_dim")) is not None:
        kv.u32(f"{a}.attention.key_length", head_dim)
        kv.u32(f"{a}.attention.value_length", head_dim)
    kv.u32("general.file_type", int(file_type))

    if info["vocab_size_key"]:
        kv.u32(f"{a}.vocab_size", config["vocab_size"])
    if info["rope_dim_key"]:
        kv.u32(f"{a}.rope.dimension_count", _head_dim(config))
    if info["pooling"]:
        _pooling(kv, config, model_dir, a)

    kv.u32("general.quantization_version", GGML_QUANT_VERSION)
    return kv.items()
