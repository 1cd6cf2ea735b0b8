"""Tiny models with real transformers architectures and random weights, saved as HF
directories with the SmolLM2 tokenizer (so that llama.cpp's converter recognises it)."""
from __future__ import annotations

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
