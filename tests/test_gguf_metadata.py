"""GGUF metadata, tensor names and tensor transforms compared with llama.cpp itself.

Every case is converted by the reference ``convert_hf_to_gguf.py`` (llama.cpp 0c1e57098,
vendored in llama-cpp-python 0.3.36) in a subprocess; the resulting file is read with
``gguf.GGUFReader`` and compared with what ``convert.gguf_arch`` / ``convert.gguf_tokenizer``
produce for the same directory:

* KVs: same keys, in the same relative order, with the same GGUF types and values, and no
  reference KV that we lack (apart from ``REFERENCE_ONLY_KEYS``);
* the same KVs written through gguf's ``GGUFWriter.add_key_value`` give byte-identical
  KV records;
* tensors: ``gguf_tensor_name`` + ``transform_tensor`` (+ ``generated_tensors``) reproduce
  every reference tensor's name, shape and data (F16 / F32 bytes).

Cases: SmolLM2-135M-Instruct (real, BPE "smollm", tied), the synthetic llama / qwen2 / qwen3
fixtures, and three variants built here: Qwen3 with YaRN + sentence-transformers pooling, a
SentencePiece llama (tokenizer.model, linear RoPE), and a byte-fallback BPE llama without
tokenizer.model (llama.cpp's LlamaHfVocab path) with Llama-3 RoPE, a model card and sampling
defaults.

The synthetic qwen2 fixture is a special case: transformers 5 loads any ``model_type: qwen2``
tokenizer as ``Qwen2Tokenizer`` (Qwen2 split regex over the SmolLM2 vocabulary), whose check
hash llama.cpp does not know, so the reference itself refuses it. The test asserts that we
refuse it with the same hash, and compares everything else against a reference run whose
unknown-hash error is replaced by the name "qwen2" (``pre_tokenizer="qwen2"`` on our side).
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import llamacpp_tools
import synth
from quantpress.convert.gguf_arch import (UnknownTensorName, UnsupportedArchitecture,
                               count_parameters, generated_tensors, gguf_arch, gguf_tensor_name,
                               is_skipped_tensor, load_hf_config, model_metadata, transform_tensor)
from quantpress.convert.gguf_tokenizer import UnknownPreTokenizer, tokenizer_metadata
from quantpress.errors import InputError

# Written by GGUFWriter itself (not part of our metadata lists). Provenance keys that only the
# reference's command-line options produce (--metadata override file, --remote repo id) do
# not occur in these conversions, so nothing else is excluded.
REFERENCE_ONLY_KEYS = frozenset({"general.architecture"})

F16 = 1  # llama ftype MOSTLY_F16, as --outtype f16

# Runs convert_hf_to_gguf.py with an unknown BPE pre-tokenizer hash mapped to argv[1]
# instead of raising (the original function still logs the hash first).
_WRAPPER = r'''
import runpy, sys
name = sys.argv.pop(1)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
from conversion.base import TextModel
_orig = TextModel.get_vocab_base_pre
def _patched(self, tokenizer):
    try:
        return _orig(self, tokenizer)
    except NotImplementedError:
        return name
TextModel.get_vocab_base_pre = _patched
runpy.run_path(script, run_name="__main__")
'''


# --------------------------------------------------------------------------------------
# variant model directories


def _corpus() -> list[str]:
    """Deterministic English-ish training text: docstrings of a few stdlib modules."""
    import collections
    import inspect
    import string
    import textwrap

    lines: list[str] = []
    for mod in (collections, inspect, re, string, textwrap, json):
        for name, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj) if not name.startswith("_") else None
            if doc:
                lines.extend(s for s in doc.splitlines() if s.strip())
    return lines


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False), encoding="utf-8")


def _make_qwen3_yarn_pool(root: Path, smol: Path) -> Path:
    """Qwen3 with YaRN RoPE scaling and a sentence-transformers last-token pooling module."""
    d = synth.make_model(root / "qwen3-yarn-embed", "qwen3", smol, num_hidden_layers=2,
                         max_position_embeddings=2048,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 512, "rope_theta": 1e6,
                                          "beta_fast": 32.0, "beta_slow": 1.0})
    _write_json(d / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    (d / "1_Pooling").mkdir()
    _write_json(d / "1_Pooling" / "config.json", {"word_embedding_dimension": 256,
                                                  "pooling_mode_lasttoken": True})
    return d


def _make_spm_llama(root: Path) -> Path:
    """A llama with a freshly trained SentencePiece tokenizer.model (byte fallback,
    user-defined and control pieces, added_tokens.json, added_tokens_decoder), vocab padded."""
    import sentencepiece as spm

    tok_dir = root / "spm_tokenizer"
    tok_dir.mkdir()
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=512, model_type="unigram",
        byte_fallback=True, user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        control_symbols=["<ctrl>"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        num_threads=1)
    (tok_dir / "tokenizer.model").write_bytes(buf.getvalue())
    _write_json(tok_dir / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "legacy": False, "tokenizer_class": "LlamaTokenizer",
        "added_tokens_decoder": {
            "3": {"content": "<|im_start|>", "special": True, "normalized": False,
                  "lstrip": False, "rstrip": False, "single_word": False},
            "4": {"content": "<|im_end|>", "special": False, "normalized": False,
                  "lstrip": False, "rstrip": False, "single_word": False},
            "514": {"content": "\u2581extra\u2581token", "special": False, "normalized": True,
                    "lstrip": False, "rstrip": False, "single_word": False}},
    })
    (tok_dir / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
        encoding="utf-8")
    d = synth.make_model(root / "spm-llama", "llama", tok_dir, num_hidden_layers=2, vocab_size=520,
                         rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    shutil.copy(tok_dir / "tokenizer.model", d / "tokenizer.model")
    _write_json(d / "added_tokens.json", {"<tool>": 513, "<too_big>": 900})
    return d


def _make_llama_hf_bpe(root: Path) -> Path:
    """A llama with a Llama-2-style byte-fallback BPE tokenizer.json and no tokenizer.model
    (llama.cpp's LlamaHfVocab path), Llama-3 RoPE (rope_freqs tensor), a README model card,
    sampling defaults in generation_config.json, and a directory name with parts."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok_dir = root / "bpe_tokenizer"
    tok_dir.mkdir()
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                           show_progress=False))
    tok.add_tokens(["<|user|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(tok_dir / "tokenizer.json"))
    _write_json(tok_dir / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "add_prefix_space": True,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    d = synth.make_model(root / "Tiny-Llama-3.2-1B-Instruct-v0.2", "llama", tok_dir, num_hidden_layers=2,
                         vocab_size=701, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024,
                                          "rope_theta": 500000.0})
    # model card and sampling defaults feed general.* keys; the name has size/finetune/version parts
    (d / "README.md").write_text(
        "---\nlicense: apache-2.0\nlanguage:\n- en\n- fr\ntags:\n- test\n- tiny\n"
        "base_model: HuggingFaceTB/SmolLM2-135M-Instruct\ndatasets:\n- HuggingFaceTB/smoltalk\n"
        "pipeline_tag: text-generation\n---\n\n# Tiny llama\n", encoding="utf-8")
    _write_json(d / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True,
                                               "temperature": 0.6, "top_p": 0.9, "top_k": 40,
                                               "repetition_penalty": 1.1})
    return d


# --------------------------------------------------------------------------------------
# reference runs


class Case:
    def __init__(self, name: str, model_dir: Path, future: Future, pre_tokenizer: str | None = None):
        self.name = name
        self.model_dir = model_dir
        self._future = future
        self.pre_tokenizer = pre_tokenizer
        self._reader = None
        self._ours = None

    @property
    def stderr(self) -> str:
        return self._future.result()[1]

    @property
    def reader(self) -> gguf.GGUFReader:
        if self._reader is None:
            out, err = self._future.result()
            assert out is not None, f"reference conversion of {self.model_dir} failed:\n{err[-3000:]}"
            self._reader = gguf.GGUFReader(out)
        return self._reader

    @property
    def config(self) -> dict:
        return load_hf_config(self.model_dir)

    def ours(self) -> list:
        if self._ours is None:
            cfg = self.config
            arch = gguf_arch(cfg)
            self._ours = (model_metadata(cfg, self.model_dir, arch, F16)
                          + tokenizer_metadata(self.model_dir, cfg, arch, pre_tokenizer=self.pre_tokenizer))
        return self._ours


def _convert(src: Path, model_dir: Path, out: Path, wrapper: Path | None, fallback: str | None):
    """(``out`` or None if the converter failed, its stderr): kept in the cache when it
    succeeds (``llamacpp_tools.cached_files``: the model directory's files and name, the
    fallback and the wrapper's text), its stderr beside it as ``OUT.stderr``."""
    def run(o: Path) -> str:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1",
                   TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable]
        if fallback is not None:
            cmd += [str(wrapper), fallback]
        cmd += [str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f16", "--outfile", str(o)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not o.is_file():
            raise _Failed(proc.stderr)
        o.with_name(o.name + ".stderr").write_text(proc.stderr, encoding="utf-8")
        return proc.stderr

    try:
        llamacpp_tools.cached_files("convert", ["convert-metadata", model_dir.name, fallback or "",
                                                _WRAPPER if fallback else ""], [model_dir], out, run)
    except _Failed as e:
        return None, e.stderr
    return out, out.with_name(out.name + ".stderr").read_text(encoding="utf-8")


class _Failed(Exception):
    def __init__(self, stderr: str):
        super().__init__("convert_hf_to_gguf.py failed")
        self.stderr = stderr


CASE_NAMES = ["smollm2", "synth_llama", "synth_qwen2", "synth_qwen3",
              "qwen3_yarn_pool", "spm_llama", "llama_hf_bpe"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory, llamacpp_src, smollm2_dir, synth_llama_dir, synth_qwen2_dir,
          synth_qwen3_dir) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("gguf_meta")
    wrapper = root / "ref_wrapper.py"
    wrapper.write_text(_WRAPPER, encoding="utf-8")
    pool = ThreadPoolExecutor(max_workers=2)
    result: dict[str, Case] = {}

    def submit(name: str, d: Path, pre: str | None = None) -> None:
        fut = pool.submit(_convert, llamacpp_src, d, root / f"{name}.gguf", wrapper, pre)
        result[name] = Case(name, d, fut, pre)

    # the largest first, so that building the variants overlaps with it
    submit("smollm2", smollm2_dir)
    submit("synth_llama", synth_llama_dir)
    submit("synth_qwen2", synth_qwen2_dir, pre="qwen2")
    submit("synth_qwen3", synth_qwen3_dir)
    variants = root / "models"
    variants.mkdir()
    submit("qwen3_yarn_pool", _make_qwen3_yarn_pool(variants, smollm2_dir))
    submit("spm_llama", _make_spm_llama(variants))
    submit("llama_hf_bpe", _make_llama_hf_bpe(variants))
    yield result
    pool.shutdown(wait=True)


def _py_value(field: gguf.ReaderField):
    return field.contents()


def _as_stored(value, vtype: gguf.GGUFValueType, sub_type):
    """Our value as the reader would return it (float32 rounding)."""
    if vtype == gguf.GGUFValueType.FLOAT32:
        return float(np.float32(value))
    if vtype == gguf.GGUFValueType.ARRAY and sub_type == gguf.GGUFValueType.FLOAT32:
        return [float(x) for x in np.asarray(value, dtype=np.float32)]
    if vtype == gguf.GGUFValueType.ARRAY and sub_type == gguf.GGUFValueType.STRING:
        return [x.decode("utf-8") if isinstance(x, (bytes, bytearray)) else x for x in value]
    return value


# --------------------------------------------------------------------------------------
# tests against the reference


@pytest.mark.parametrize("name", CASE_NAMES)
def test_kvs_match_reference(cases, name):
    case = cases[name]
    ours = case.ours()
    ref_fields = [f for f in case.reader.fields.values() if not f.name.startswith("GGUF.")]
    ref_keys = [f.name for f in ref_fields if f.name not in REFERENCE_ONLY_KEYS]
    our_keys = [k for k, *_ in ours]

    assert len(set(our_keys)) == len(our_keys), "duplicate keys"
    assert set(our_keys) - set(ref_keys) == set(), "keys the reference does not write"
    assert set(ref_keys) - set(our_keys) == set(), "reference keys we do not produce"
    assert our_keys == ref_keys, "KV order differs"

    by_name = {f.name: f for f in ref_fields}
    for key, value, vtype, sub_type in ours:
        field = by_name[key]
        ref_types = [gguf.GGUFValueType(t) for t in field.types]
        assert ref_types == [vtype] + ([sub_type] if sub_type is not None else []), key
        assert _as_stored(value, vtype, sub_type) == _py_value(field), key


@pytest.mark.parametrize("name", ["smollm2", "spm_llama", "llama_hf_bpe", "qwen3_yarn_pool"])
def test_kv_records_bytes_through_gguf_writer(cases, name, tmp_path):
    """Our tuples, fed to GGUFWriter.add_key_value, give the reference's KV bytes (a subset
    of the cases that covers every value type and both tokenizer families, to save time)."""
    case = cases[name]
    arch = gguf_arch(case.config)
    out = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(out, arch)
    for key, value, vtype, sub_type in case.ours():
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    mine = gguf.GGUFReader(out)

    def records(reader):
        return [(f.name, b"".join(p.tobytes() for p in f.parts)) for f in reader.fields.values()
                if not f.name.startswith("GGUF.")]

    assert records(mine) == records(case.reader)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_tensors_match_reference(cases, name):
    from safetensors import safe_open

    case = cases[name]
    cfg = case.config
    arch = gguf_arch(cfg)
    ref = {t.name: t for t in case.reader.tensors}
    produced: list[str] = []

    def check(gname: str, t: torch.Tensor) -> None:
        r = ref[gname]
        assert [int(n) for n in r.shape] == list(reversed(t.shape)), gname
        if r.tensor_type == gguf.GGMLQuantizationType.F32:
            expect = t.to(torch.float32).numpy()
        else:
            assert r.tensor_type == gguf.GGMLQuantizationType.F16, gname
            expect = t.to(torch.float16).numpy()
        assert np.asarray(r.data).tobytes() == expect.tobytes(), gname
        produced.append(gname)

    for gname, t in generated_tensors(cfg, arch):
        assert t.dtype == torch.float32
        check(gname, t)
    for part in sorted(case.model_dir.glob("model*.safetensors")):
        with safe_open(str(part), framework="pt") as f:
            for hf_name in f.keys():
                if is_skipped_tensor(hf_name):
                    continue
                gname = gguf_tensor_name(hf_name, arch, n_layers=cfg["num_hidden_layers"])
                check(gname, transform_tensor(hf_name, f.get_tensor(hf_name), cfg, arch))

    assert len(produced) == len(set(produced))
    assert sorted(produced) == sorted(ref), "tensor sets differ"
    # general.size_label comes from this count when the directory name has no size
    assert count_parameters(case.model_dir, cfg, arch) == sum(int(np.prod(t.shape)) for t in case.reader.tensors)


def test_case_coverage(cases):
    """The variants exercise what they were built for (guards against silent fallbacks)."""
    kv = {name: {k: v for k, v, *_ in cases[name].ours()} for name in
          ("smollm2", "qwen3_yarn_pool", "spm_llama", "llama_hf_bpe")}
    assert kv["smollm2"]["tokenizer.ggml.pre"] == "smollm"
    assert kv["smollm2"]["general.size_label"] == "135M"
    assert "rope_freqs.weight" in {t.name for t in cases["llama_hf_bpe"].reader.tensors}
    assert kv["llama_hf_bpe"]["general.sampling.penalty_repeat"] == pytest.approx(1.1)
    assert kv["llama_hf_bpe"]["general.base_model.count"] == 1
    assert kv["qwen3_yarn_pool"]["qwen3.rope.scaling.type"] == "yarn"
    assert kv["qwen3_yarn_pool"]["qwen3.pooling_type"] == 3
    assert kv["spm_llama"]["tokenizer.ggml.model"] == "llama"
    assert kv["spm_llama"]["llama.rope.scaling.type"] == "linear"
    assert len(kv["spm_llama"]["tokenizer.ggml.tokens"]) == 520
    assert set(kv["spm_llama"]["tokenizer.ggml.token_type"]) >= {1, 2, 3, 4, 5, 6}
    assert kv["llama_hf_bpe"]["tokenizer.ggml.model"] == "llama"
    assert kv["llama_hf_bpe"]["tokenizer.ggml.add_space_prefix"] is True
    assert "tokenizer.ggml.scores" in kv["llama_hf_bpe"]


def test_unknown_pretokenizer_hash_matches_reference(cases):
    """synth_qwen2: llama.cpp does not know the hash; we refuse it too, naming the same hash."""
    case = cases["synth_qwen2"]
    m = re.search(r"chkhsh:\s+([0-9a-f]{64})", case.stderr)
    assert m, "reference did not report an unknown pre-tokenizer hash"
    cfg = case.config
    with pytest.raises(UnknownPreTokenizer) as exc:
        tokenizer_metadata(case.model_dir, cfg, gguf_arch(cfg))
    assert isinstance(exc.value, InputError)  # bad input: exit 2
    assert exc.value.chkhsh == m.group(1)
    assert m.group(1) in str(exc.value)


# --------------------------------------------------------------------------------------
# errors and unit behaviour


def test_unsupported_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitecture) as exc:
        gguf_arch({"architectures": ["GPT2LMHeadModel"]})
    msg = str(exc.value)
    assert "GPT2LMHeadModel" in msg
    for hf in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert hf in msg
    assert isinstance(exc.value, InputError)
    with pytest.raises(UnsupportedArchitecture, match="experts"):
        gguf_arch({"architectures": ["MistralForCausalLM"], "num_local_experts": 8})
    with pytest.raises(UnsupportedArchitecture, match="Qwen3ForCausalLM"):
        gguf_arch({})


def test_missing_tokenizer_files_named(tmp_path, synth_llama_dir):
    d = tmp_path / "no_tokenizer"
    d.mkdir()
    shutil.copy(synth_llama_dir / "config.json", d / "config.json")
    cfg = load_hf_config(d)
    with pytest.raises(InputError) as exc:
        tokenizer_metadata(d, cfg, gguf_arch(cfg))
    msg = str(exc.value)
    assert str(d) in msg and "tokenizer.model" in msg and "tokenizer.json" in msg


def test_missing_config(tmp_path):
    with pytest.raises(InputError, match="config.json"):
        load_hf_config(tmp_path)


def test_tensor_name_errors():
    assert gguf_tensor_name("model.layers.7.self_attn.q_norm.weight", "qwen3") == "blk.7.attn_q_norm.weight"
    assert gguf_tensor_name("model.layers.7.self_attn.v_proj.bias", "qwen2") == "blk.7.attn_v.bias"
    assert gguf_tensor_name("lm_head.weight", "llama") == "output.weight"
    for bad, arch, kw in (("model.layers.0.self_attn.q_norm.weight", "llama", {}),
                          ("model.layers.0.mlp.experts.0.w1.weight", "llama", {}),
                          ("model.layers.4.mlp.up_proj.weight", "llama", {"n_layers": 4}),
                          ("visual.blocks.0.attn.qkv.weight", "qwen2", {})):
        with pytest.raises(UnknownTensorName) as exc:
            gguf_tensor_name(bad, arch, **kw)
        assert bad in str(exc.value)
        assert isinstance(exc.value, KeyError) and isinstance(exc.value, InputError)
    with pytest.raises(UnsupportedArchitecture):
        gguf_tensor_name("model.norm.weight", "gpt2")
    assert is_skipped_tensor("model.layers.0.self_attn.rotary_emb.inv_freq")
    assert not is_skipped_tensor("model.layers.0.self_attn.q_proj.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_transform_tensor_permutation(dtype):
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2}
    hd = 8
    q = torch.arange(4 * hd * 3).reshape(4 * hd, 3).to(dtype)
    k = torch.arange(2 * hd).to(dtype)  # a bias
    pq = transform_tensor("model.layers.0.self_attn.q_proj.weight", q, cfg, "llama")
    pk = transform_tensor("model.layers.0.self_attn.k_proj.bias", k, cfg, "llama")
    assert pq.dtype == dtype and pq.shape == q.shape and pk.shape == k.shape
    for t, p, n in ((q, pq, 4), (k, pk, 2)):
        for h in range(n):
            for i in range(hd // 2):
                for j in range(2):  # adjacent pairs <- (first half, second half)
                    assert torch.equal(p[h * hd + 2 * i + j], t[h * hd + j * hd // 2 + i])
    v = torch.randn(2 * hd, 3).to(dtype)
    assert transform_tensor("model.layers.0.self_attn.v_proj.weight", v, cfg, "llama") is v
    assert transform_tensor("model.layers.0.self_attn.q_proj.weight", q, cfg, "qwen2") is q
    assert transform_tensor("model.layers.0.self_attn.q_proj.weight", q, cfg, "qwen3") is q
    meta = torch.empty(4 * hd, 5, device="meta", dtype=dtype)
    assert transform_tensor("model.layers.0.self_attn.q_proj.weight", meta, cfg, "llama").device.type == "meta"


def test_generated_tensors_only_for_llama3():
    base = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    l3 = dict(base, rope_parameters={"rope_type": "llama3", "factor": 32.0, "rope_theta": 500000.0,
                                     "original_max_position_embeddings": 8192})
    [(name, t)] = generated_tensors(l3, "llama")
    assert name == "rope_freqs.weight" and t.dtype == torch.float32 and t.shape == (32,)
    assert t[0] == 1 and t[-1] == 32
    assert generated_tensors(l3, "qwen2") == []
    assert generated_tensors(dict(base, rope_parameters={"rope_type": "default"}), "llama") == []
