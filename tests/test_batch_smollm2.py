"""``quantize batch`` on the real SmolLM2-135M: GGUF Q4_K_M and Q8_0, AWQ w4g64, EXL2 4.0 and
5.0 bpw, evaluation. The manifest and the model card describe the outputs, and every output
is byte-identical to the single command that makes it: the session's runs with the same
calibration (tests/smollm2_runs.py: scripts/exl2_quality.py's ``quantize exl2 --measurement``
directories and its Q4_K_M GGUF, the AWQ fixture) and one ``convert hf-to-gguf --policy Q8_0``.

For CI time the EXL2 targets reuse the session's cached measurement (``exl2_measurement``, as
``quantize exl2 --measurement``); the measurement made inside a batch's shared pass is compared
with the single verb on tiny models (tests/test_batch.py)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import make
from quantpress.cli.quantize_main import main as quantize_main
from smollm2_runs import ROWS, SEQLEN

EVAL_CHUNKS, EVAL_CTX = 2, 256


_digests = make.digests


@pytest.fixture(scope="module")
def smollm2_batch(tmp_path_factory, smollm2_dir, exl2_smollm2_measurement):
    root = tmp_path_factory.mktemp("batch_smollm2")
    job = root / "jobs.toml"
    job.write_text(f"""
[defaults]
device = "cpu"
calib = {{ samples = {ROWS}, seqlen = {SEQLEN} }}

[[model]]
source = "{smollm2_dir}"
name = "smollm2"
gguf = ["Q4_K_M", "Q8_0"]
awq = [{{ group_size = 64 }}]
exl2 = [{{ bpw = 4.0 }}, {{ bpw = 5.0 }}]
exl2_measurement = "{exl2_smollm2_measurement}"
eval = {{ ctx = {EVAL_CTX}, chunks = {EVAL_CHUNKS} }}
""")
    out = root / "out"
    code = quantize_main(["batch", str(job), "-o", str(out), "--quiet"])
    return code, out / "smollm2"


def test_outputs_equal_the_single_commands(smollm2_batch, exl2_smollm2_quality, smollm2_awq_pair,
                                           smollm2_dir, tmp_path):
    code, d = smollm2_batch
    assert code == 0
    _, _, summaries, gguf, _, _ = exl2_smollm2_quality
    awq, _ = smollm2_awq_pair
    q8 = make.gguf(smollm2_dir, tmp_path / "q8.gguf", "Q8_0").output
    pairs = {"smollm2-Q4_K_M.gguf": gguf, "smollm2-Q8_0.gguf": q8, "smollm2-AWQ-w4g64": awq.output,
             "smollm2-EXL2-4.0bpw": Path(summaries[4.0][0]), "smollm2-EXL2-5.0bpw": Path(summaries[5.0][0])}
    for name, single in pairs.items():
        a, b = _digests(d / name), _digests(single)
        if (d / name).is_file():
            a, b = list(a.values()), list(b.values())
        assert a == b, name


def test_manifest_and_model_card(smollm2_batch):
    _, d = smollm2_batch
    m = json.loads((d / "manifest.json").read_text())
    assert [(o["kind"], o["target"]) for o in m["outputs"]] == [
        ("gguf", "Q4_K_M"), ("gguf", "Q8_0"), ("awq", "w4g64"), ("exl2", "4.0"), ("exl2", "5.0")]
    for o in m["outputs"]:
        assert o["roundtrip"] == "ok" and o["files"] == _digests(d / o["path"])
    ev = {o["target"]: o["eval"] for o in m["outputs"]}
    assert m["eval_base"]["n_chunks"] == EVAL_CHUNKS and m["eval_base"]["n_ctx"] == EVAL_CTX
    assert ev["Q8_0"]["kld"] < ev["Q4_K_M"]["kld"] and ev["5.0"]["kld"] < ev["4.0"]["kld"]
    assert all(e["ppl"] > m["eval_base"]["ppl"] * 0.95 for e in ev.values())
    card = (d / "README.md").read_text()
    for o in m["outputs"]:
        assert f"`{o['path']}" in card
    assert "llama.cpp, Ollama, LM Studio" in card and "ExLlamaV2" in card and "vLLM" in card
