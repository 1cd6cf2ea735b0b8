"""GGUF tokenizer metadata (``tokenizer.*`` KVs) for llama / qwen2 / qwen3 checkpoints.

Reproduces llama.cpp 0c1e57098 convert_hf_to_gguf.py: ``LlamaModel.set_vocab`` /
``Qwen2Model.set_vocab`` choosing between ``_set_vocab_sentencepiece`` (tokenizer.model),
``_set_vocab_llama_hf`` (llama only: byte-fallback BPE tokenizer.json) and
``_set_vocab_gpt2`` (byte-level BPE; ``get_vocab_base`` + ``get_vocab_base_pre``), followed by
gguf-py's ``SpecialVocab`` (merges, special token ids, add_*_token flags, chat template,
normalizer flags) as vendored at that version.

The BPE pre-tokenizer table (sha256 of the token ids of a fixed check text -> name) is data
in ``configs/gguf_pretokenizers.toml``.
"""
from __future__ import annotations

import functools
import json
import re
import string
from hashlib import sha256
from pathlib import Path
from typing import Any, Iterable

from gguf import GGUFValueType

from quantpress.configs import load_toml
from quantpress.errors import InputError
from quantpress.convert.gguf_arch import KV, arch_info, first_present, KVList

__all__ = ["tokenizer_metadata", "pretokenizer_name", "UnknownPreTokenizer"]

# token types (gguf.TokenType / SentencePieceTokenTypes)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPIECE_UNDERLINE = "\u2581"
_STR = GGUFValueType.STRING
_I32 = GGUFValueType.INT32
_F32 = GGUFValueType.FLOAT32

# SpecialVocab handlers that exist on GGUFWriter at the reference version: type -> key.
_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id", "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id", "mask": "tokenizer.ggml.mask_token_id",
    "eot": "tokenizer.ggml.eot_token_id", "eom": "tokenizer.ggml.eom_token_id",
}
_ADD_KEYS = {"bos": "tokenizer.ggml.add_bos_token", "eos": "tokenizer.ggml.add_eos_token",
             "sep": "tokenizer.ggml.add_sep_token"}


class UnknownPreTokenizer(InputError, NotImplementedError):
    """The BPE pre-tokenizer hash is not in the table (llama.cpp raises NotImplementedError
    too); bad input, exit 2."""

    def __init__(self, chkhsh: str, model_dir: Path | None = None):
        self.chkhsh = chkhsh
        where = f" of {model_dir}" if model_dir is not None else ""
        super().__init__(
            f"BPE pre-tokenizer{where} was not recognized (chkhsh: {chkhsh}); llama.cpp at the "
            "reference version has no tokenizer.ggml.pre for it. Add the hash to "
            "configs/gguf_pretokenizers.toml only if llama.cpp implements that pre-tokenizer "
            "(see convert_hf_to_gguf_update.py, ggml-org/llama.cpp PR #6920).")


@functools.lru_cache(maxsize=1)
def _pretok_table() -> dict:
    return load_toml("gguf_pretokenizers.toml")


def pretokenizer_name(tokenizer: Any, model_dir: Path | None = None) -> str:
    """``tokenizer.ggml.pre`` for an HF tokenizer (``TextModel.get_vocab_base_pre``).

    sha256 of ``str(tokenizer.encode(check_text))`` looked up in
    ``configs/gguf_pretokenizers.toml``.

    Raises:
        UnknownPreTokenizer (an InputError and NotImplementedError): the hash is unknown; the message names it.
    """
    table = _pretok_table()
    ids = tokenizer.encode(table["check_text"])
    chkhsh = sha256(str(ids).encode()).hexdigest()
    entry = table["hashes"].get(chkhsh)
    if entry is None:
        raise UnknownPreTokenizer(chkhsh, model_dir)
    return entry["name"]


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _looks_special(token: str) -> bool:
    """``TextModel.does_token_look_special``."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


# --------------------------------------------------------------------------------------
# SpecialVocab (gguf-py vocab.py at the reference version)


class _SpecialVocab:
    """What ``gguf.SpecialVocab(path, load_merges, special_token_types, n_vocab)`` collects."""

    def __init__(self, path: Path, load_merges: bool = False,
                 special_token_types: Iterable[str] | None = None, n_vocab: int | None = None,
                 tokenizer_json: dict | None = None):
        self.path = path
        self._tok_json = tokenizer_json  # already parsed tokenizer.json (read-only use)
        self.n_vocab = n_vocab
        self.load_merges = load_merges
        self.types: tuple[str, ...] = tuple(special_token_types) if special_token_types is not None else (
            "bos", "eos", "unk", "sep", "pad", "cls", "mask")
        self.merges: list[str] = []
        self.ids: dict[str, int] = {}
        self.add: dict[str, bool] = {}
        self.chat_template: Any = None
        self.lowercase: bool | None = None
        self.strip_accents: bool | None = None
        self._from_tokenizer_files()
        self._from_config_json()
        if self.load_merges and not self.merges:
            self._merges_txt()

    # -- ids
    def set_id(self, typ: str, tid: Any) -> None:
        if not isinstance(tid, int):
            return
        if tid < 0:
            raise InputError(f"tokenizer: invalid id for special token type {typ}: {tid}")
        if self.n_vocab is not None and tid >= self.n_vocab:
            return  # out of range: skipped with a warning by the reference
        self.ids.setdefault(typ, tid)

    # -- merges
    def _merges_txt(self) -> None:
        path = self.path / "merges.txt"
        if not path.is_file():
            return
        merges = []
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()  # text-mode line splitting, as the reference iterates the file
        if lines and lines[0].strip().startswith("#"):
            lines = lines[1:]  # "#version: ..." header
        for line in lines:
            line = line.strip()
            parts = line.split(None, 3)
            if line and len(parts) == 2:  # malformed lines are skipped (with a warning upstream)
                merges.append(f"{parts[0]} {parts[1]}")
        self.merges = merges

    @staticmethod
    def _merge_pairs(merges: list) -> list[str]:
        if isinstance(merges[0], str):
            return merges
        if isinstance(merges[0], list) and len(merges[0]) == 2 and isinstance(merges[0][0], str):
            # [a, b] pairs (transformers >= 4.45): a space inside a part is stored as
            # chr(ord(" ") + 256) == "\u0120", as the byte-level alphabet writes it
            return [" ".join(p.replace(" ", "\u0120") for p in pair) for pair in merges]
        raise InputError("tokenizer.json: unknown merges format")

    def _normalizer(self, norm: dict) -> None:
        kind = norm.get("type")
        if kind == "Lowercase":
            self.lowercase = True
        elif kind == "StripAccents":
            self.strip_accents = True
        elif kind == "BertNormalizer":
            if "lowercase" in norm:
                self.lowercase = norm["lowercase"]
            if "strip_accents" in norm:
                self.strip_accents = norm["strip_accents"]
        elif kind == "Sequence":
            for sub in norm.get("normalizers", []):
                self._normalizer(sub)

    # -- tokenizer.json / tokenizer_config.json
    def _from_tokenizer_files(self) -> None:
        tok_json = None
        added_tokens: Any = {}
        if (self.path / "tokenizer.json").is_file():
            tok_json = self._tok_json if self._tok_json is not None else _read_json(self.path / "tokenizer.json")
            if self.load_merges:
                merges = tok_json.get("model", {}).get("merges")
                if isinstance(merges, list) and merges:
                    self.merges = self._merge_pairs(merges)
            if norm := tok_json.get("normalizer"):
                self._normalizer(norm)
            added_tokens = tok_json.get("added_tokens", {})
        tc = None
        if (self.path / "tokenizer_config.json").is_file():
            tc = _read_json(self.path / "tokenizer_config.json")
        if tok_json:
            self._post_processor(tok_json, tc)
        if not tc:
            return
        self._chat_template(tc)
        for typ in self.types:
            add_entry = tc.get(f"add_{typ}_token")
            if isinstance(add_entry, bool) and typ not in self.add:
                self.add[typ] = add_entry
            entry = tc.get(f"{typ}_token")
            if isinstance(entry, dict):
                entry = entry.get("content")
            if not isinstance(entry, str):
                continue
            tid = next((t.get("id") for t in added_tokens if t.get("content") == entry), None)
            self.set_id(typ, tid)

    def _post_processor(self, tok_json: dict, tc: dict | None) -> None:
        """The add_bos/add_eos/add_sep inference from tokenizer.json's post_processor.

        ``tc`` (tokenizer_config.json, possibly None) is updated in place exactly like the
        reference does, because later steps read the token names from it.
        """
        cfg = tc or {}
        bos, cls_, eos, sep = cfg.get("bos_token"), cfg.get("cls_token"), cfg.get("eos_token"), cfg.get("sep_token")
        if not bos and cls_ and tc:
            tc["bos_token"] = bos = cls_
        if not eos and sep and tc:
            tc["eos_token"] = eos = sep
        post = tok_json.get("post_processor")
        if not post:
            return
        for proc in post.get("processors", [post]):
            ptype = proc.get("type")
            if ptype == "ByteLevel":
                self.add.setdefault("bos", False)
                self.add.setdefault("eos", False)
            elif ptype == "RobertaProcessing":
                self.add["bos"] = self.add["eos"] = self.add["sep"] = True
                if not cls_ and tc:
                    cls_ = proc.get("cls", [bos])[0]
                    tc["cls_token"] = cls_
                if not sep and tc:
                    sep = proc.get("sep", [eos])[0]
                    tc["sep_token"] = sep
            elif ptype == "TemplateProcessing":
                bos, cls_, eos, sep = self._template_processing(proc, tc, bos, cls_, eos, sep)

    def _template_processing(self, proc: dict, tc: dict | None, bos, cls_, eos, sep):
        single = proc.get("single", [])
        pair = proc.get("pair", [])
        first = last = None
        if len(single) > 1:
            first = single[0].get("SpecialToken", {}).get("id")
            if first:
                if not tc:
                    bos = first
                elif first not in (bos, cls_):
                    if not bos:
                        tc["bos_token"] = bos = first
                    if not cls_:
                        tc["cls_token"] = cls_ = first
                self.add["bos"] = first in (bos, cls_)
            last = single[-1].get("SpecialToken", {}).get("id")
            if last:
                if not tc:
                    eos = last
                elif last != eos:
                    if "eot" not in self.types:
                        self.types = self.types + ("eot",)
                        tc["eot_token"] = eos
                    elif "eom" not in self.types:
                        self.types = self.types + ("eom",)
                        tc["eom_token"] = eos
                    tc["eos_token"] = eos = last
                self.add["eos"] = last == eos
        if pair:
            start = 1 if first and pair[0].get("SpecialToken", {}).get("id") == first else 0
            stop = -1 if last and pair[-1].get("SpecialToken", {}).get("id") == last else None
            pair = pair[slice(start, stop)]
            if pair:
                a = pair[0].get("Sequence", {}).get("id")
                b = pair[-1].get("Sequence", {}).get("id")
                if a == "A" and b == "B":
                    middle = pair[1:-1]
                    if middle:
                        add_sep = False
                        entry = middle[0].get("SpecialToken", {}).get("id")
                        if entry and entry in (sep, eos) and not last:
                            add_sep = True
                        if len(middle) == 2:
                            entry = middle[1].get("SpecialToken", {}).get("id")
                            if entry and entry in (sep, eos):
                                add_sep = True
                        self.add["sep"] = add_sep
                        if add_sep and not sep and tc:
                            tc["sep_token"] = eos
        return bos, cls_, eos, sep

    def _chat_template(self, tc: dict) -> None:
        alt: Any = None
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            alt = jinja.read_text(encoding="utf-8")
            extra = list((self.path / "additional_chat_templates").glob("*.jinja"))
            if extra:
                alt = [{"name": "default", "template": alt}]
                for p in extra:
                    alt.append({"name": p.stem, "template": p.read_text(encoding="utf-8")})
        elif (self.path / "chat_template.json").is_file():
            alt = _read_json(self.path / "chat_template.json").get("chat_template")
        tmpl = tc.get("chat_template", alt)
        if tmpl is None or isinstance(tmpl, (str, list)):
            self.chat_template = tmpl

    # -- config.json
    def _from_config_json(self) -> None:
        path = self.path / "config.json"
        if not path.is_file():
            return
        cfg = _read_json(path)
        for typ in self.types:
            tid = cfg.get(f"{typ}_token_id")
            if tid is None and "text_config" in cfg:
                tid = cfg["text_config"].get(f"{typ}_token_id")
            self.set_id(typ, tid)

    # -- output (SpecialVocab.add_to_gguf)
    def emit(self, kv: KVList) -> None:
        if self.merges:
            kv.array("tokenizer.ggml.merges", self.merges, _STR)
        for typ, tid in self.ids.items():
            if typ in _ID_KEYS:
                kv.u32(_ID_KEYS[typ], tid)
        for typ, value in self.add.items():
            if typ in _ADD_KEYS:
                kv.boolean(_ADD_KEYS[typ], value)
        if self.chat_template is not None:
            _emit_chat_template(kv, self.chat_template)
        if self.lowercase is not None:
            kv.boolean("tokenizer.ggml.normalizer.lowercase", self.lowercase)
        if self.strip_accents is not None:
            kv.boolean("tokenizer.ggml.normalizer.strip_accents", self.strip_accents)


def _emit_chat_template(kv: KVList, value: Any) -> None:
    """``GGUFWriter.add_chat_template``: a string, or named templates (``default`` -> the plain
    key, the rest -> ``tokenizer.chat_template.<name>`` plus the ``tokenizer.chat_templates``
    name list; the reference builds that list from a set, its order here is file order)."""
    if not isinstance(value, str):
        default = None
        names: list[str] = []
        for choice in value:
            name = "".join(c if c in string.ascii_letters + string.digits else "_" for c in choice.get("name", ""))
            template = choice.get("template")
            if name and template is not None:
                if name == "default":
                    default = template
                else:
                    if name not in names:
                        names.append(name)
                    kv.string(f"tokenizer.chat_template.{name}", template)
        if names:
            kv.array("tokenizer.chat_templates", names, _STR)
        if default is None:
            return
        value = default
    kv.string("tokenizer.chat_template", value)


# --------------------------------------------------------------------------------------
# vocabularies


def _sentencepiece_vocab(model_dir: Path, config: dict, kv: KVList, tok_json: dict | None) -> None:
    """``TextModel._set_vocab_sentencepiece`` / ``_create_vocab_sentencepiece``."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model_dir / "tokenizer.model"))
    n_sp = sp.vocab_size()
    vocab_size = first_present(config, ["vocab_size_per_layer_input", "vocab_size"]) or n_sp

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [-10000.0] * vocab_size
    types = [UNUSED] * vocab_size
    for tid in range(min(n_sp, vocab_size)):
        if sp.IsUnknown(tid):
            ttype = UNKNOWN
        elif sp.IsControl(tid):
            ttype = CONTROL
        elif sp.IsUnused(tid):
            ttype = UNUSED
        elif sp.IsByte(tid):
            ttype = BYTE
        else:
            ttype = NORMAL
        tokens[tid] = sp.IdToPiece(tid)
        scores[tid] = sp.GetScore(tid)
        types[tid] = ttype

    if (model_dir / "added_tokens.json").is_file():
        for text, tid in _read_json(model_dir / "added_tokens.json").items():
            if tid >= vocab_size:
                continue
            tokens[tid] = text
            scores[tid] = -1000.0
            types[tid] = USER_DEFINED

    if (model_dir / "tokenizer_config.json").is_file():
        decoder = _read_json(model_dir / "tokenizer_config.json").get("added_tokens_decoder", {})
        for key, data in decoder.items():
            tid = int(key)
            if tid >= vocab_size:
                continue
            text = data["content"]
            if data.get("special") or _looks_special(text):
                types[tid] = CONTROL
            else:
                text = text.replace(_SPIECE_UNDERLINE, " ")
                types[tid] = USER_DEFINED
            scores[tid] = -1000.0
            tokens[tid] = text
    # (the reference's final padding step never triggers: the lists already have vocab_size entries)

    kv.string("tokenizer.ggml.model", "llama")
    kv.string("tokenizer.ggml.pre", "default")
    kv.array("tokenizer.ggml.tokens", tokens, _STR)
    kv.array("tokenizer.ggml.scores", scores, _F32)
    kv.array("tokenizer.ggml.token_type", types, _I32)
    _SpecialVocab(model_dir, n_vocab=len(tokens), tokenizer_json=tok_json).emit(kv)


def _llama_hf_applies(tj: dict | None) -> bool:
    """The pre-check of gguf-py ``LlamaHfVocab.__init__`` on the parsed tokenizer.json."""
    if tj is None:
        return False
    model = tj["model"]
    if model["type"] == "BPE" and model.get("ignore_merges", False) and not model.get("byte_fallback", True):
        return False  # "Llama 3 must be converted with BpeVocab"
    decoder = tj.get("decoder")
    if model["type"] != "BPE" or not model.get("byte_fallback", False):
        return False
    # a null decoder makes the reference fail with TypeError, which also falls back to gpt2
    return isinstance(decoder, dict) and decoder.get("type") == "Sequence"


def _llama_hf_vocab(model_dir: Path, kv: KVList, tok_json: dict) -> None:
    """``TextModel._set_vocab_llama_hf`` with gguf-py ``LlamaHfVocab``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, cache_dir=model_dir, local_files_only=True)
    base_size = tok.vocab_size
    added = [(t, i) for t, i in sorted(tok.get_added_vocab().items(), key=lambda x: x[1]) if i >= base_size]
    added_ids = {i for _, i in added}
    vocab = tok.get_vocab()
    specials = {t: vocab[t] for t in tok.all_special_tokens}
    special_ids = set(tok.all_special_ids)
    reverse = {i: t for t, i in vocab.items()}

    def ttype(tid: int, text: str) -> int:
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            return BYTE
        return CONTROL if tid in special_ids else NORMAL

    tokens, types = [], []
    for tid in range(base_size):
        if tid in added_ids:
            continue
        text = reverse[tid]
        tokens.append(text)
        types.append(ttype(tid, text))
    for text, _ in added:
        tokens.append(text)
        types.append(ttype(specials[text], "") if text in specials else USER_DEFINED)

    kv.string("tokenizer.ggml.model", "llama")
    kv.string("tokenizer.ggml.pre", "default")
    kv.array("tokenizer.ggml.tokens", tokens, _STR)
    kv.array("tokenizer.ggml.scores", [-1000.0] * len(tokens), _F32)
    kv.array("tokenizer.ggml.token_type", types, _I32)
    _SpecialVocab(model_dir, n_vocab=len(tokens), tokenizer_json=tok_json).emit(kv)


def _gpt2_vocab(model_dir: Path, config: dict, kv: KVList, tok_json: dict | None,
                pre_tokenizer: str | None = None) -> None:
    """``TextModel._set_vocab_gpt2`` (``get_vocab_base`` + ``get_vocab_base_pre``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    vocab = tok.vocab
    vocab_size = config.get("vocab_size", len(vocab))
    if max(vocab.values()) >= vocab_size:
        raise InputError(f"{model_dir}: tokenizer has ids up to {max(vocab.values())} but vocab_size is {vocab_size}")
    pre = pre_tokenizer if pre_tokenizer is not None else pretokenizer_name(tok, model_dir)

    reverse = {i: t for t, i in vocab.items()}
    added_vocab = tok.get_added_vocab()
    added_decoder = tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        text = reverse[i]
        if text in added_vocab:
            # llama.cpp expects CONTROL / USER_DEFINED tokens pre-normalized
            if not added_decoder[i].normalized:
                text = tok.decode(tok.encode(text, add_special_tokens=False))
            if added_decoder[i].special or _looks_special(text):
                types.append(CONTROL)
            else:
                text = text.replace(_SPIECE_UNDERLINE, " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(text)

    kv.string("tokenizer.ggml.model", "gpt2")
    kv.string("tokenizer.ggml.pre", pre)
    kv.array("tokenizer.ggml.tokens", tokens, _STR)
    kv.array("tokenizer.ggml.token_type", types, _I32)
    _SpecialVocab(model_dir, load_merges=True, tokenizer_json=tok_json).emit(kv)


_EXPECTED = ("tokenizer.model (SentencePiece)", "tokenizer.json (Hugging Face fast tokenizer)",
             "vocab.json + merges.txt (GPT-2 BPE)")


def tokenizer_metadata(model_dir: Path | str, config: dict, arch: str, *,
                       pre_tokenizer: str | None = None) -> list[KV]:
    """The ``tokenizer.*`` KVs convert_hf_to_gguf writes for ``model_dir``, in its order.

    * tokenizer.model present -> SentencePiece: ``tokenizer.ggml.model = "llama"``,
      ``.pre = "default"``, ``.tokens`` (padded to ``vocab_size`` with ``[PADi]``),
      ``.scores`` (f32), ``.token_type`` (i32), special ids.
    * llama only, a byte-fallback BPE tokenizer.json (Llama-2 style without tokenizer.model)
      -> the same keys via transformers (``LlamaHfVocab``; scores -1000).
    * otherwise byte-level BPE via ``transformers.AutoTokenizer``: ``model = "gpt2"``,
      ``.pre`` from the pre-tokenizer hash table, ``.tokens`` padded with ``[PADi]``,
      ``.token_type`` (1 normal, 3 control, 4 user-defined, 5 unused), ``.merges``.

    Then gguf-py ``SpecialVocab``: bos/eos/unknown/seperator/padding/mask token ids (u32),
    ``add_bos_token``/``add_eos_token``/``add_sep_token`` (bool), ``tokenizer.chat_template``
    (tokenizer_config.json, else chat_template.jinja / chat_template.json), normalizer flags.
    For llama: ``add_space_prefix`` first when tokenizer_config.json sets ``add_prefix_space``;
    ``eot_token_id`` 32010 for CodeLlama's 32016 vocab; ``add_bos_token = False`` when
    ``vocab_size == 49152`` (SmolLM/granite small models).

    Args:
        model_dir: HF directory with the tokenizer files.
        config: :func:`convert.gguf_arch.load_hf_config` of ``model_dir``.
        arch: :func:`convert.gguf_arch.gguf_arch` of ``config``.
        pre_tokenizer: BPE only: use this ``tokenizer.ggml.pre`` instead of detecting it
            from the hash (an escape hatch for tokenizers llama.cpp does not list; the result
            is only correct if llama.cpp's pre-tokenizer of that name matches the model's).

    Returns:
        ``[(key, value, GGUFValueType, sub_type_or_None), ...]`` for ``GGUFWriter.add_key_value``.

    Raises:
        InputError: no tokenizer files (the message names the directory and the files), tokenizer
            kinds the reference handles specially (HybridDNA), tokenizer ids beyond ``vocab_size``.
        UnknownPreTokenizer (InputError): BPE pre-tokenizer hash not recognized.

    """
    model_dir = Path(model_dir)
    info = arch_info(arch)
    has_spm = (model_dir / "tokenizer.model").is_file()
    has_json = (model_dir / "tokenizer.json").is_file()
    has_bpe_files = (model_dir / "vocab.json").is_file() and (model_dir / "merges.txt").is_file()
    if not (has_spm or has_json or has_bpe_files):
        raise InputError(
            f"no tokenizer files in {model_dir}: expected one of " + ", ".join(_EXPECTED))

    tok_json = _read_json(model_dir / "tokenizer.json") if has_json else None
    kv = KVList()
    tc_path = model_dir / "tokenizer_config.json"
    if arch == "llama" and tc_path.is_file():
        tc = _read_json(tc_path)
        if (aps := tc.get("add_prefix_space")) is not None:
            kv.boolean("tokenizer.ggml.add_space_prefix", aps)
        if tc.get("tokenizer_class") == "HybridDNATokenizer":
            raise InputError(f"{model_dir}: HybridDNA tokenizers are not supported")

    for kind in info["tokenizer_order"]:
        if kind == "sentencepiece" and has_spm:
            _sentencepiece_vocab(model_dir, config, kv, tok_json)
            break
        if kind == "llama_hf" and _llama_hf_applies(tok_json):
            _llama_hf_vocab(model_dir, kv, tok_json)
            break
        if kind == "gpt2":
            _gpt2_vocab(model_dir, config, kv, tok_json, pre_tokenizer)
            break

    if arch == "llama":
        vocab_size = config.get("vocab_size", 32000)
        if vocab_size == 32016:  # CodeLlama infill tokens; only eot has a GGUFWriter handler
            sv = _SpecialVocab(model_dir, load_merges=False, special_token_types=["prefix", "suffix", "middle", "eot"],
                               tokenizer_json=tok_json)
            for typ, tid in (("prefix", 32007), ("suffix", 32008), ("middle", 32009), ("eot", 32010)):
                sv.set_id(typ, tid)
            sv.emit(kv)
        if vocab_size == 49152:
            kv.boolean("tokenizer.ggml.add_bos_token", False)
    return kv.items()
