"""llama.cpp (llama-cpp-python 0.3.36) loads our Q4_K_M SmolLM2, tokenizes like the HF
tokenizer and generates."""
from __future__ import annotations

import pytest

from make import gguf

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "  Leading spaces, tabs\tand\nnewlines; numbers 1234567 and 3.14159!",
    "Ünïcödé: naïve café, 東京, Привет, emoji 🙂 — dashes…",
    "def f(x):\n    return x**2  # code\n",
    "<|im_start|>user\nHello<|im_end|>",
]


@pytest.fixture(scope="module")
def q4km(tmp_path_factory, smollm2_dir):
    out = tmp_path_factory.mktemp("q4km") / "smollm2-Q4_K_M.gguf"
    gguf(smollm2_dir, out, "Q4_K_M")
    return out


def test_llamacpp_loads_tokenizes_and_generates(q4km, smollm2_dir):
    import llama_cpp
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_dir)
    llm = llama_cpp.Llama(model_path=str(q4km), n_ctx=256, n_threads=2, verbose=False)
    for text in SAMPLES:
        ours = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert ours == hf.encode(text, add_special_tokens=False), text
    assert llm.token_bos() == hf.bos_token_id and llm.token_eos() == hf.eos_token_id
    out = llm("The capital of France is", max_tokens=8, temperature=0.0, top_k=1)
    text = out["choices"][0]["text"]
    assert "Paris" in text, text
