"""End-to-end `convert hf-to-gguf` against llama.cpp itself (converter + llama-quantize)."""
from __future__ import annotations

import json

import pytest

from quantpress.cli.convert_main import main as convert_main
from quantpress.convert.gguf_policy import POLICIES
from make import gguf
from llamacpp_tools import convert_hf
from refs import kvs_of, ref_quantize, tensors_of

# Q2_K_S (refused without an importance matrix), IQ4_NL and IQ4_XS: tests/test_gguf_imatrix.py
QUANT_POLICIES = [p for p in POLICIES if p not in ("F32", "F16", "BF16", "Q2_K_S", "IQ4_NL", "IQ4_XS")]
# keys that describe where a file came from, not what it is
PROVENANCE = {"general.name", "general.basename", "general.size_label", "general.finetune",
              "general.source.url", "general.url", "general.repo_url", "general.source.repo_url"}


@pytest.fixture(scope="module")
def ref_f16(tmp_path_factory, synth_llama_dir, synth_qwen3_dir):
    d = tmp_path_factory.mktemp("ref_f16")
    return {"llama": (synth_llama_dir, convert_hf(synth_llama_dir, d / "llama.gguf")),
            "qwen3": (synth_qwen3_dir, convert_hf(synth_qwen3_dir, d / "qwen3.gguf"))}


def assert_same_tensors(ours, ref):
    assert sorted(ours) == sorted(ref)
    for name, (rtype, rshape, rdata) in ref.items():
        otype, oshape, odata = ours[name]
        assert (otype, oshape) == (rtype, rshape), name
        assert odata == rdata, f"{name} ({otype}): bytes differ from llama.cpp"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("policy", QUANT_POLICIES)
def test_policy_types_and_bytes_equal_llama_quantize(tmp_path, ref_f16, arch, policy):
    model_dir, f16 = ref_f16[arch]
    ref = tensors_of(ref_quantize(f16, tmp_path / "ref.gguf", policy))
    s = gguf(model_dir, tmp_path / "ours.gguf", policy)
    assert s.roundtrip.startswith("ok")
    assert_same_tensors(tensors_of(tmp_path / "ours.gguf"), ref)


def test_smollm2_f16_equals_convert_hf_to_gguf(tmp_path, smollm2_dir):
    ref_path = convert_hf(smollm2_dir, tmp_path / "ref.gguf")
    s = gguf(smollm2_dir, tmp_path / "ours.gguf", "F16")
    assert s.roundtrip.startswith("ok") and len(s.details["tensors"]) == 272
    assert_same_tensors(tensors_of(tmp_path / "ours.gguf"), tensors_of(ref_path))
    ours, ref = kvs_of(tmp_path / "ours.gguf"), kvs_of(ref_path)
    ref_keys = [k for k in ref if k not in PROVENANCE]
    our_keys = [k for k in ours if k not in PROVENANCE]
    assert our_keys == ref_keys
    for k in ref_keys:
        assert ours[k] == ref[k], k


@pytest.mark.parametrize("policy", ["Q4_K_M", "Q6_K"])
def test_smollm2_quantized_equals_llama_quantize(tmp_path, smollm2_dir, policy):
    f16 = convert_hf(smollm2_dir, tmp_path / "ref-f16.gguf")
    ref = tensors_of(ref_quantize(f16, tmp_path / "ref.gguf", policy))
    gguf(smollm2_dir, tmp_path / "ours.gguf", policy)
    assert_same_tensors(tensors_of(tmp_path / "ours.gguf"), ref)


def test_sharded_bf16_source(tmp_path, smollm2_dir):
    import torch
    import synth

    src = synth.make_model(tmp_path / "bf16", "llama", smollm2_dir, dtype=torch.bfloat16,
                           max_shard_size="8MB", num_hidden_layers=4)
    assert (src / "model.safetensors.index.json").exists()
    for policy, outtype in (("BF16", "bf16"), ("Q4_K_M", "auto")):
        ref = convert_hf(src, tmp_path / f"ref-{outtype}.gguf", outtype)
        if policy != "BF16":
            ref = ref_quantize(ref, tmp_path / "ref-q.gguf", policy)
        gguf(src, tmp_path / f"ours-{policy}.gguf", policy)
        assert_same_tensors(tensors_of(tmp_path / f"ours-{policy}.gguf"), tensors_of(ref))


def test_cli_summary_report_and_inspect(tmp_path, smollm2_dir, capsys):
    out, rep = tmp_path / "m.gguf", tmp_path / "r.json"
    assert convert_main(["hf-to-gguf", str(smollm2_dir), "--policy", "Q8_0", "-o", str(out),
                         "--report", str(rep), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "round trip ok" in text and "bits per weight" in text and "Q8_0 x" in text
    report = json.loads(rep.read_text())
    assert report["roundtrip"].startswith("ok") and len(report["details"]["tensors"]) == 272
    assert report["files"] == {"m.gguf": out.stat().st_size}
    q8 = [t for t in report["details"]["tensors"] if t["type"] == "Q8_0"]
    assert q8 and all(t["snr_db"] > 30 and t["rmse"] > 0 for t in q8)
    assert convert_main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "general.file_type" in text and "token_embd.weight" in text and "Q8_0" in text
