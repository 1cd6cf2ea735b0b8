"""GGUF file → Hugging Face-named tensors and config: the inverse of what
``convert/gguf_arch.py`` + the GGUF writer do, for llama / qwen2 / qwen3.

- names: ``token_embd.weight`` → ``model.embed_tokens.weight``, ``blk.N.attn_q.weight`` →
  ``model.layers.N.self_attn.q_proj.weight``, ``output.weight`` → ``lm_head.weight``, … (the
  tables of ``configs/gguf_arch.toml`` read backwards; ``rope_freqs.weight`` has no HF
  counterpart and is only checked);
- data: every tensor is dequantized with quantpress's ggml codecs (``quantize.ggml.dequantize``,
  bit-exact with ggml's ``dequantize_row_*``) on the requested device, reshaped to torch order
  (ggml ``ne`` reversed) and, for llama's ``attn_q``/``attn_k`` weights and biases, the
  Q/K row permutation of ``convert_hf_to_gguf.py`` ``LlamaModel.permute`` is undone
  (adjacent-pair RoPE rows back to HF's rotate-half layout);
- config: a transformers config dict rebuilt from the GGUF metadata (``{arch}.block_count``,
  ``.embedding_length``, ``.feed_forward_length``, head counts, ``.rope.freq_base``, RoPE
  scaling keys, RMS epsilon, ``.attention.key_length``, token ids), with
  ``tie_word_embeddings`` true when the file has no ``output.weight``.

:func:`streaming_model` puts the result into the calibration engine's
:class:`~calibration.engine.StreamingModel` (transformers' own decoder-layer classes), which
reads one layer's tensors at a time, so a GGUF file is evaluated or calibrated exactly like
an HF directory, layer by layer, without ever holding the dequantized model.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantpress.configs import load_toml
from quantpress.quantize import ggml
from quantpress.errors import InputError

GGUF_MAGIC = b"GGUF"

#: GGUF architecture → (HF ``architectures[0]``, transformers ``model_type``).
HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"),
                    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                    "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def is_gguf(path: str | Path) -> bool:
    """True when ``path`` is a file starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Header

#: string arrays longer than this are kept as their length only (vocabularies, merges)
MAX_STRING_ARRAY = 4096


@dataclass
class TensorInfo:
    """One tensor of a GGUF file: ``name``, ``ne`` (ggml order, ne[0] = row length), ggml
    ``type`` name, absolute byte ``offset`` in the file holding it (``path``) and
    ``n_bytes``."""

    name: str
    ne: tuple[int, ...]
    type: str
    offset: int
    n_bytes: int
    path: Path

    @property
    def shape(self) -> tuple[int, ...]:
        """Torch order (``ne`` reversed)."""
        return tuple(reversed(self.ne))


class StringArray(int):
    """Placeholder for a long string array (its length); the strings themselves are skipped."""


# --------------------------------------------------------------------------------------------
# Split models (llama.cpp's gguf-split, convert_hf_to_gguf.py --split-max-size)

#: the keys of a split file (llama.cpp ``LLM_KV_SPLIT_*``), which a model's metadata leaves out
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")


def split_files(path: str | Path, split_no: int, split_count: int) -> list[Path]:
    """The files of a split GGUF model given its first, ``PREFIX-00001-of-0000N.gguf``, as
    llama.cpp finds them (``llama_model_loader``, ``llama_get_list_splits`` with
    ``llama_split_prefix`` / ``llama_split_path``: ``"%s-%05d-of-%05d.gguf"``, llama.cpp as
    vendored in llama-cpp-python 0.3.36), in split order; ``[path]`` when ``split_count`` is 0
    or 1 (not split). ``split_no`` / ``split_count``: the file's ``split.no`` and
    ``split.count``. Raises InputError naming the file: not the first split (llama.cpp loads a
    model from its first), a name without the suffix its split keys give, a missing file."""
    p = Path(path)
    if split_count <= 1:
        return [p]
    suffix = f"-{split_no + 1:05d}-of-{split_count:05d}.gguf"
    if split_no != 0:
        first = p.name[:-len(suffix)] + f"-00001-of-{split_count:05d}.gguf" if p.name.endswith(suffix) else None
        raise InputError(f"{p}: split {split_no + 1} of {split_count} of a split model; pass its first "
                         f"file{f' ({first})' if first else ''}")
    if not p.name.endswith(suffix) or len(p.name) == len(suffix):
        raise InputError(f"{p}: the first of {split_count} splits (split.count), but its name does not end "
                         f"in '{suffix}', from which llama.cpp finds the others")
    prefix = str(p)[:-len(suffix)]
    files = [Path(f"{prefix}-{i + 1:05d}-of-{split_count:05d}.gguf") for i in range(split_count)]
    for f in files[1:]:
        if not f.is_file():
            raise InputError(f"{f}: split of {p.name} missing (split.count is {split_count})")
    return files


def check_splits(first: Path, files: list[Path], split_nos: list, names: list[list[str]],
                 tensors_count) -> None:
    """The checks llama.cpp makes of a split model as it loads it (``llama_model_loader``):
    each later split's ``split.no`` is its index, no tensor name is in two splits, and the
    first file's ``split.tensors.count`` is the number of tensors over all splits. ``files``:
    :func:`split_files` of ``first``; ``split_nos[i]`` / ``names[i]``: ``files[i]``'s
    ``split.no`` (None: absent) and tensor names; ``tensors_count`` None: absent. A single file
    passes. Raises InputError naming the file or tensor."""
    seen = set(names[0])
    for i in range(1, len(files)):
        if split_nos[i] is None:
            raise InputError(f"{files[i]}: no split.no key in a split of a split model")
        if int(split_nos[i]) != i:
            raise InputError(f"{files[i]}: split.no is {int(split_nos[i])}, expected {i} for split {i + 1}")
        for n in names[i]:
            if n in seen:
                raise InputError(f"{files[i]}: tensor '{n}' is also in an earlier split")
            seen.add(n)
    if len(files) > 1 and tensors_count is not None and int(tensors_count) != len(seen):
        raise InputError(f"{first}: split.tensors.count is {int(tensors_count)}, but its splits hold "
                         f"{len(seen)} tensors")


def read_model_header(path: str | Path) -> tuple[dict, list[TensorInfo]]:
    """:func:`read_header` of a GGUF model, split or not: the metadata of its first file (the
    split keys left out) and the tensor infos of every split in split order, each with the
    ``path`` of its file (:func:`split_files`, :func:`check_splits`). Raises InputError as
    those do."""
    meta, infos = read_header(path)
    files = split_files(path, int(meta.get("split.no", 0)), int(meta.get("split.count", 0)))
    heads = [(meta, infos)] + [read_header(f) for f in files[1:]]
    check_splits(Path(path), files, [m.get("split.no") for m, _ in heads],
                 [[t.name for t in ts] for _, ts in heads], meta.get("split.tensors.count"))
    return {k: v for k, v in meta.items() if k not in SPLIT_KEYS}, [t for _, ts in heads for t in ts]


def read_header(path: str | Path) -> tuple[dict, list[TensorInfo]]:
    """Metadata (key → value; string arrays longer than :data:`MAX_STRING_ARRAY` become a
    :class:`StringArray` holding their length) and tensor infos of a GGUF v2/v3 file, parsed
    by gguf-py's ``GGUFReader`` (layout: llama.cpp 0c1e570 ``ggml/src/gguf.cpp``). The reader's
    memory map is released before returning; tensor bytes are read later, one tensor at a
    time (:meth:`GGUFWeights.raw`).

    Raises InputError for a file that is not GGUF, is truncated or holds an unknown type."""
    from gguf import GGUFReader, GGUFValueType

    p = Path(path)
    if p.is_file() and p.stat().st_size == 0:
        raise InputError(f"{p}: not a readable GGUF file (empty)")
    if not is_gguf(p):
        raise InputError(f"{p}: not a GGUF file (no GGUF magic)")
    try:
        reader = GGUFReader(str(p))
    except Exception as e:  # gguf-py raises ValueError/IndexError/KeyError on a bad header
        raise InputError(f"{p}: not a readable GGUF file (truncated or corrupt: {e})") from None
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's pseudo-fields (version, counts)
        if (len(field.types) == 2 and field.types[0] == GGUFValueType.ARRAY
                and field.types[1] == GGUFValueType.STRING and len(field.data) > MAX_STRING_ARRAY):
            meta[key] = StringArray(len(field.data))
            continue
        meta[key] = field.contents()
    size = p.stat().st_size
    infos = []
    for rt in reader.tensors:
        ne = tuple(int(d) for d in rt.shape)
        try:
            tname = rt.tensor_type.name
        except AttributeError:
            raise InputError(f"{p}: tensor '{rt.name}' has unknown ggml type id {rt.tensor_type}") from None
        if rt.data_offset + rt.n_bytes > size:
            raise InputError(f"{p}: truncated: tensor '{rt.name}' ends past the end of the file")
        infos.append(TensorInfo(rt.name, ne, tname, int(rt.data_offset), int(rt.n_bytes), p))
    del reader  # drop the memory map
    return meta, infos


# --------------------------------------------------------------------------------------------
# Inverse tensor names and Q/K permutation

@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict, dict, dict]:
    t = load_toml("gguf_arch.toml")
    inv_global = {g: h for h, g in t["tensor_names"]["global"].items()}
    inv_block = {g: h for h, g in t["tensor_names"]["block"].items()}
    return inv_global, inv_block, t["arch"]


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
    """HF checkpoint name of a GGUF tensor name (the inverse of
    ``convert.gguf_arch.gguf_tensor_name``): ``blk.3.attn_q.bias`` →
    ``model.layers.3.self_attn.q_proj.bias``. Returns None for ``rope_freqs.weight`` (generated
    by the converter, no HF tensor). Raises InputError for a name that the architecture's
    tensor map does not produce."""
    inv_global, inv_block, archs = _tables()
    if arch not in archs:
        raise InputError(f"GGUF architecture '{arch}' is not supported (supported: "
                         f"{', '.join(sorted(archs))})")
    if gguf_name == "rope_freqs.weight":
        return None
    allowed = set(archs[arch]["tensors"])
    for suffix in (".weight", ".bias"):
        if not gguf_name.endswith(suffix):
            continue
        base = gguf_name[: -len(suffix)]
        if base in inv_global and base in allowed:
            return inv_global[base] + suffix
        parts = base.split(".", 2)
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in inv_block \
                and parts[2] in allowed:
            return f"model.layers.{int(parts[1])}.{inv_block[parts[2]]}{suffix}"
    raise InputError(f"GGUF tensor '{gguf_name}' has no Hugging Face name for architecture '{arch}'")


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo ``convert.gguf_arch._permute_rows`` (``LlamaModel.permute``): rows grouped per head
    as interleaved (x0, y0, x1, y1, …) pairs → [first halves | second halves]. ``t`` has shape
    ``(n_head · head_dim, ...)``; same shape, dtype and device out. Row ``h·hd + j·hd/2 + i``
    of the result is row ``h·hd + 2i + j`` of ``t``. Raises ValueError if the rows are not
    divisible by 2·n_head."""
    rows = t.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"cannot unpermute {tuple(t.shape)} for {n_head} heads: rows not divisible by 2*n_head")
    return (t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:])
            .transpose(1, 2)
            .reshape(t.shape))


# --------------------------------------------------------------------------------------------
# Reader

class GGUFWeights:
    """The tensors of a GGUF file under their HF names, dequantized one at a time.

    Implements the weights protocol of :class:`calibration.engine.StreamingModel`
    (``keys()``, ``name in w``, ``get(name, device, dtype)``). ``arch``: the GGUF
    architecture; ``metadata``: decoded KVs (key → value); ``types``: HF name → ggml type name.

    Raises InputError when the file is missing or not a readable GGUF, its architecture is not
    llama/qwen2/qwen3, or a tensor name is unknown."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such file")
        self.metadata, infos = read_model_header(self.path)
        self.arch = self.metadata.get("general.architecture")
        if self.arch is None:
            raise InputError(f"{self.path}: no general.architecture key")
        if self.metadata.get("general.type", "model") != "model":
            raise InputError(f"{self.path}: general.type is '{self.metadata['general.type']}', "
                             f"not a model")
        self._tensors: dict[str, TensorInfo] = {}
        self.types: dict[str, str] = {}
        self.gguf_names: dict[str, str] = {}
        self.has_rope_freqs = False
        for ti in infos:
            hf = hf_tensor_name(ti.name, self.arch)
            if hf is None:
                self.has_rope_freqs = True
                continue
            self._tensors[hf] = ti
            self.types[hf] = ti.type
            self.gguf_names[hf] = ti.name

    def keys(self):
        """HF names of the tensors in the file."""
        return self._tensors.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def kv(self, key: str, default=None):
        """Metadata value of ``{arch}.{key}`` (or ``default``)."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def shape(self, name: str) -> tuple[int, ...]:
        """Torch-order shape of HF tensor ``name`` (ggml ``ne`` reversed)."""
        return self._tensors[name].shape

    def info(self, name: str) -> TensorInfo:
        """The :class:`TensorInfo` of HF tensor ``name`` (GGUF name, ne, type, offset, bytes)."""
        return self._tensors[name]

    def raw(self, name: str) -> np.ndarray:
        """Stored bytes of ``name``: uint8 [rows, row_bytes], read from the file into a fresh
        buffer (no map is kept, so pages already used do not stay in the process's RSS)."""
        ti = self._tensors[name]
        t = ggml.get(ti.type)
        data = np.fromfile(ti.path, dtype=np.uint8, count=ti.n_bytes, offset=ti.offset)
        if data.size != ti.n_bytes:
            raise InputError(f"{ti.path}: truncated tensor '{ti.name}'")
        return data.reshape(-1, t.row_bytes(ti.ne[0]))

    def get(self, name: str, device="cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """HF tensor ``name`` dequantized on ``device`` (float32, or ``dtype``), in HF layout
        (llama q/k rows un-permuted). Raises InputError naming the file and tensor when it is
        absent or of a ggml type quantpress cannot dequantize."""
        ti = self._tensors.get(name)
        if ti is None:
            raise InputError(f"{self.path}: tensor '{name}' not found (GGUF name "
                             f"'{_guess_gguf(name, self.arch)}')")
        tname = self.types[name]
        try:
            ggml.get(tname)
        except KeyError:
            raise InputError(f"{self.path}: tensor '{ti.name}' has ggml type {tname}, which "
                             f"quantpress cannot dequantize (supported: {', '.join(ggml.names())})") from None
        raw = torch.from_numpy(self.raw(name)).to(device)
        t = ggml.dequantize(raw, tname).reshape(self.shape(name))
        t = self._unpermute(name, t)
        return t if dtype is None else t.to(dtype)

    def _unpermute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if not _tables()[2][self.arch]["permute_qk"]:
            return t
        if not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            return t
        n_head = int(self.kv("attention.head_count"))
        n_kv = int(self.kv("attention.head_count_kv", n_head))
        heads = n_head if ".q_proj." in name else (n_kv if n_kv != n_head else n_head)
        return unpermute_rows(t, heads)

    def state_dict(self, device="cpu", dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """Every tensor, dequantized, under its HF name (the whole model in memory: for small
        models and tests; the streaming engine reads tensors one at a time instead)."""
        return {n: self.get(n, device, dtype) for n in self.keys()}

    def hf_config(self) -> dict:
        """A transformers ``config.json`` dict rebuilt from the metadata (see the module doc).

        Raises InputError when a required key is missing or the file uses Llama-3 RoPE
        frequency factors (``rope_freqs.weight``: their parameters are not in the metadata;
        evaluate it against an HF base directory, whose config is then used)."""
        a = self.arch
        hf_arch, model_type = HF_ARCHITECTURES[a]

        def need(key):
            v = self.kv(key)
            if v is None:
                raise InputError(f"{self.path}: metadata key '{a}.{key}' is missing")
            return v

        n_head = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        if "model.embed_tokens.weight" not in self:
            raise InputError(f"{self.path}: tensor 'token_embd.weight' not found")
        vocab = self.shape("model.embed_tokens.weight")[0]
        cfg = {
            "architectures": [hf_arch], "model_type": model_type,
            "num_hidden_layers": int(need("block_count")),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(self.kv("attention.head_count_kv", n_head)),
            "head_dim": int(self.kv("attention.key_length", hidden // n_head)),
            "max_position_embeddings": int(self.kv("context_length", 2048)),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "lm_head.weight" not in self,
            "hidden_act": "silu",
        }
        rope = {"rope_type": "default", "rope_theta": float(self.kv("rope.freq_base", 10000.0))}
        scaling = self.kv("rope.scaling.type")
        if scaling == "linear":
            rope.update(rope_type="linear", factor=float(self.kv("rope.scaling.factor")))
        elif scaling == "yarn":
            rope.update(rope_type="yarn", factor=float(self.kv("rope.scaling.factor")),
                        original_max_position_embeddings=int(self.kv("rope.scaling.original_context_length")))
            for key, name in (("rope.scaling.yarn_ext_factor", "extrapolation_factor"),
                              ("rope.scaling.yarn_attn_factor", "attention_factor"),
                              ("rope.scaling.yarn_beta_fast", "beta_fast"),
                              ("rope.scaling.yarn_beta_slow", "beta_slow")):
                if self.kv(key) is not None:
                    rope[name] = float(self.kv(key))
        elif scaling not in (None, "none"):
            raise InputError(f"{self.path}: RoPE scaling '{scaling}' cannot be rebuilt from "
                             f"GGUF metadata; evaluate against the HF base directory")
        if self.has_rope_freqs:
            raise InputError(f"{self.path}: has Llama-3 RoPE factors (rope_freqs.weight) whose "
                             f"parameters are not in the metadata; pass the HF base directory")
        cfg["rope_parameters"] = rope
        if a == "llama":
            cfg["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self
            cfg["mlp_bias"] = "model.layers.0.mlp.up_proj.bias" in self
        elif a == "qwen3":
            cfg["attention_bias"] = "model.layers.0.self_attn.q_proj.bias" in self
        for key, name in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                          ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                          ("tokenizer.ggml.padding_token_id", "pad_token_id")):
            if key in self.metadata:
                cfg[name] = int(self.metadata[key])
        return cfg

    def check_config(self, config: dict) -> None:
        """Raise InputError unless an HF ``config`` (dict) has the shapes of this file (layers,
        width, FFN width, heads, KV heads, vocabulary): used when a GGUF output is evaluated with
        its HF base's config."""
        mine = self.hf_config_shapes()
        for key, v in mine.items():
            theirs = config.get(key)
            if key == "num_key_value_heads" and theirs is None:
                theirs = config.get("num_attention_heads")
            if theirs is not None and int(theirs) != int(v):
                raise InputError(f"{self.path}: {key} is {v} in the GGUF file but {theirs} in the "
                                 f"base model's config.json; not a conversion of that model")

    def hf_config_shapes(self) -> dict:
        """The size hyper-parameters of :meth:`hf_config` (no RoPE checks)."""
        n_head = self.kv("attention.head_count")
        return {"num_hidden_layers": self.kv("block_count"), "hidden_size": self.kv("embedding_length"),
                "intermediate_size": self.kv("feed_forward_length"), "num_attention_heads": n_head,
                "num_key_value_heads": self.kv("attention.head_count_kv", n_head),
                "vocab_size": self.shape("model.embed_tokens.weight")[0]
                if "model.embed_tokens.weight" in self else None}

    def add_bos(self) -> bool:
        """``tokenizer.ggml.add_bos_token`` (llama.cpp's ``llama_vocab_get_add_bos``; the
        default when absent is true for SentencePiece ``llama`` vocabularies, false otherwise)."""
        v = self.metadata.get("tokenizer.ggml.add_bos_token")
        if v is not None:
            return bool(v)
        return self.metadata.get("tokenizer.ggml.model") == "llama"


def _guess_gguf(hf_name: str, arch: str) -> str:
    try:
        from quantpress.convert.gguf_arch import gguf_tensor_name
        return gguf_tensor_name(hf_name, arch)
    except Exception:
        return "?"


def streaming_model(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
                    config: dict | None = None, attn_implementation: str = "sdpa"):
    """A :class:`calibration.engine.StreamingModel` over a GGUF file: transformers' decoder
    layers built from ``config`` (an HF config dict; default: :meth:`GGUFWeights.hf_config`)
    whose tensors are dequantized from the file one layer at a time.

    ``config`` from the HF base model is checked against the file's sizes (InputError on a
    mismatch). The returned model has ``weights`` = the :class:`GGUFWeights` and ``dir`` = the
    GGUF path. Raises InputError for unreadable files, unsupported architectures or types."""
    from quantpress.calibration.engine import StreamingModel

    w = GGUFWeights(path)
    if config is None:
        config = w.hf_config()
    else:
        w.check_config(config)
    return StreamingModel.over_weights(config, w, w.path, device, dtype, attn_implementation)
