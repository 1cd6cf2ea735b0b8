"""Tiny models with real transformers architectures and random weights, saved as HF
directories with the SmolLM2 tokenizer (so that llama.cpp's converter recognises it), or, for
llama, with a small byte-fallback BPE tokenizer (:func:`small_tokenizer`)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def config_for(arch: str, **over):
    """A transformers config for ``arch`` in {llama, qwen2, qwen3, mixtral}; widths multiples
    of 256. ``mixtral`` is a sparse MoE with 8 experts (gguf arch "llama", expert_count 8)."""
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config

    common = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=16,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                  max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        common.update(over)
        return LlamaConfig(**common)
    if arch == "qwen2":
        common.update(tie_word_embeddings=True)
        common.update(over)
        return Qwen2Config(**common)
    if arch == "qwen3":
        common.update(num_key_value_heads=1, head_dim=64)
        common.update(over)
        return Qwen3Config(**common)
    if arch == "mixtral":
        common.update(num_local_experts=8, num_experts_per_tok=2)
        common.update(over)
        return MixtralConfig(**common)
    raise ValueError(arch)


def make_model(out: Path, arch: str, tokenizer_dir: Path, dtype=torch.float16, seed: int = 0,
               max_shard_size: str | None = None, **over) -> Path:
    """Random-weight model of ``arch`` saved to ``out`` in ``dtype`` with the tokenizer files
    of ``tokenizer_dir``. ``max_shard_size`` (e.g. "20MB") makes a sharded checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = config_for(arch, **over)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norms around 1, biases small: realistic and never all-equal
                p.copy_((1.0 if "norm" in name else 0.0) + 0.05 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    model = model.to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    for f in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / f).exists():
            shutil.copy(Path(tokenizer_dir) / f, out / f)
    return out


#: the smallest vocabulary :func:`small_tokenizer` makes: <unk>, <s>, </s> and the 256 byte
#: tokens a byte-fallback BPE needs, plus merges
SMALL_VOCAB = 384


def _corpus() -> list[str]:
    """Deterministic English text to learn merges from: docstrings of a few stdlib modules."""
    import collections
    import inspect
    import string
    import textwrap

    lines: list[str] = []
    for mod in (collections, inspect, string, textwrap, json):
        for name, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj) if not name.startswith("_") else None
            if doc:
                lines.extend(s for s in doc.splitlines() if s.strip())
    return lines


def small_tokenizer(out: Path, vocab_size: int = SMALL_VOCAB) -> Path:
    """A Llama-2-style byte-fallback BPE tokenizer (``tokenizer.json`` with merges learnt by
    the ``tokenizers`` library, no ``tokenizer.model``) of ``vocab_size`` tokens written to the
    directory ``out``, with a tokenizer_config.json and a chat template.

    Why this kind: llama.cpp's converter (and ours) identify a GPT-2-style BPE by the hash of
    its tokenization of a fixed text, which only the full vocabularies they list give (a
    trimmed SmolLM2 tokenizer is refused as an unknown pre-tokenizer); a byte-fallback BPE
    (``LlamaHfVocab``, llama only) has no such check, and every text still tokenizes (bytes
    not covered by merges fall back to ``<0xNN>``). ValueError if ``vocab_size`` is below 259
    (the specials and the byte tokens)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    if vocab_size < len(specials):
        raise ValueError(f"vocab_size {vocab_size}: at least {len(specials)} (specials and byte tokens)")
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                           show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "add_prefix_space": True,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"},
        indent=2), encoding="utf-8")
    return out


def make_small_vocab_llama(out: Path, **over) -> Path:
    """:func:`make_model` ``llama`` with :func:`small_tokenizer` (vocab_size = its size) in
    ``out``: the same decoder as the SmolLM2-tokenizer model, the embedding and the head 384
    rows instead of 49,152."""
    tok_dir = small_tokenizer(Path(out).parent / f"{Path(out).name}-tokenizer")
    n = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))["model"]["vocab"]
    return make_model(Path(out), "llama", tok_dir, vocab_size=len(n), **over)
