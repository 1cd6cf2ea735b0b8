"""Shared fixtures: the real SmolLM2 directory, llama.cpp's reference source, and tiny
synthetic models with real transformers architectures (random weights)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))

import llamacpp_tools  # noqa: E402
import synth  # noqa: E402
from quantpress import assets  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """FP16 HF directory of SmolLM2-135M-Instruct (cached under .cache/models)."""
    return assets.smollm2_dir()


@pytest.fixture(scope="session")
def llamacpp_src() -> Path:
    """llama.cpp source vendored in llama-cpp-python 0.3.36 (convert_hf_to_gguf.py lives here)."""
    return llamacpp_tools.llamacpp_src()


@pytest.fixture(scope="session")
def synth_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Synthetic llama: 16 layers, hidden 256, ffn 768, 4 heads / 2 KV heads (GQA), untied."""
    return synth.make_model(tmp_path_factory.mktemp("synth_llama"), "llama", smollm2_dir)


@pytest.fixture(scope="session")
def synth_qwen3_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Synthetic qwen3: 16 layers, hidden 256, ffn 768, 4 heads / 1 KV head, q/k norms, untied."""
    return synth.make_model(tmp_path_factory.mktemp("synth_qwen3"), "qwen3", smollm2_dir)


@pytest.fixture(scope="session")
def synth_qwen2_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Synthetic qwen2 (q/k/v biases): 16 layers, hidden 256, GQA, tied embeddings."""
    return synth.make_model(tmp_path_factory.mktemp("synth_qwen2"), "qwen2", smollm2_dir)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Synthetic llama with 2 layers (fast), hidden 256, GQA, untied."""
    return synth.make_model(tmp_path_factory.mktemp("tiny_llama"), "llama", smollm2_dir, num_hidden_layers=2)


# SmolLM2 runs shared by test_exl2_smollm2, test_awq_smollm2 and test_batch_smollm2
# (tests/smollm2_runs.py): made once per session

@pytest.fixture(scope="session")
def exl2_smollm2_measurement(smollm2_dir) -> Path:
    """SmolLM2's measurement.json (4 × 128 calibration tokens, CPU; cached by content key)."""
    import smollm2_runs

    return smollm2_runs.measurement(smollm2_dir)


@pytest.fixture(scope="session")
def exl2_smollm2_quality(exl2_smollm2_measurement, smollm2_dir, tmp_path_factory):
    """scripts/exl2_quality.py's outputs from that measurement (:func:`smollm2_runs.quality`)."""
    import smollm2_runs

    return smollm2_runs.quality(exl2_smollm2_measurement, smollm2_dir,
                                tmp_path_factory.mktemp("exl2_smollm2"))


@pytest.fixture(scope="session")
def smollm2_awq_pair(smollm2_dir, tmp_path_factory):
    """SmolLM2 AWQ w4g64 and its round-to-nearest baseline (:func:`smollm2_runs.awq_pair`)."""
    import smollm2_runs

    return smollm2_runs.awq_pair(smollm2_dir, tmp_path_factory.mktemp("smollm2_awq"))
