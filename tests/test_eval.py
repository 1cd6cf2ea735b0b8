"""``quantize eval``: perplexity / KL math against direct computations, the GGUF loader against
the HF checkpoint and llama.cpp's converter, perplexity against transformers (FP16 SmolLM2) and
against llama.cpp's own ``llama-perplexity`` (Q8_0 GGUF made by llama.cpp), bad input."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from quantpress import assets
import llamacpp_tools
import make
import synth
from quantpress.calibration import data
from quantpress.calibration import eval as ceval
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.convert import gguf_arch, gguf_load
from quantpress.errors import InputError

CTX, CHUNKS = 512, 3


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    """The first 20k characters of the held-out split (≈4.5k SmolLM2 tokens; 3 chunks used)."""
    p = tmp_path_factory.mktemp("eval_text") / "heldout-head.txt"
    p.write_text(data.heldout_text(assets.standard_cal_data())[:20000], encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def smollm2_q8() -> Path:
    """SmolLM2 Q8_0 made by llama.cpp itself (convert_hf_to_gguf f16 + llama_model_quantize)."""
    return llamacpp_tools.smollm2_gguf("q8_0")


# --------------------------------------------------------------------------------------------
# Math on logits

def test_chunks_follow_llama_perplexity():
    toks = torch.arange(10, 10 + 2600)
    c = ceval.make_chunks(toks, 512)
    assert c.shape == (5, 512) and torch.equal(c.reshape(-1), toks[:2560])
    c = ceval.make_chunks(toks, 512, n_chunks=2, bos_id=1)
    assert c.shape == (2, 512) and (c[:, 0] == 1).all() and torch.equal(c[:, 1:], toks[:1024].view(2, 512)[:, 1:])
    t = ceval.scored_targets(c)
    assert t.shape == (2, 255) and torch.equal(t, c[:, 257:])
    assert ceval.scored_slice(512) == slice(256, 511)
    with pytest.raises(InputError, match=r"text too short: 1023 tokens, at least 1024 needed"):
        ceval.make_chunks(toks[:1023], 512)


def test_perplexity_and_kl_equal_direct_computation():
    g = torch.Generator().manual_seed(0)
    base = 3 * torch.randn(3, 40, 500, generator=g)
    q = base + 0.3 * torch.randn(3, 40, 500, generator=g)
    tgt = torch.randint(0, 500, (3, 40), generator=g)
    p = ceval.PerplexityStats()
    for r in range(3):  # batch by batch equals all at once
        p.update(base[r:r + 1], tgt[r:r + 1])
    ce = F.cross_entropy(base.reshape(-1, 500).double(), tgt.reshape(-1))
    res = p.result()
    assert res["tokens"] == 120
    assert res["ppl"] == pytest.approx(float(ce.exp()), rel=1e-6)

    k = ceval.KLStats()
    k.update(base[:2], q[:2], tgt[:2])
    k.update(base[2:], q[2:], tgt[2:])
    r = k.result()
    lb, lq = base.double().log_softmax(-1), q.double().log_softmax(-1)
    kl = F.kl_div(lq, lb, log_target=True, reduction="none").sum(-1).reshape(-1)
    assert r["kld_mean"] == pytest.approx(float(kl.mean()), rel=1e-5)
    assert r["kld_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-5)
    assert r["kld_max"] == pytest.approx(float(kl.max()), rel=1e-5)
    assert r["same_top"] == pytest.approx(float((lb.argmax(-1) == lq.argmax(-1)).double().mean()))
    assert k.perplexity()["ppl"] == pytest.approx(
        float(F.cross_entropy(q.reshape(-1, 500).double(), tgt.reshape(-1)).exp()), rel=1e-6)
    assert r["ln_ppl_ratio"] == pytest.approx(float(F.cross_entropy(q.reshape(-1, 500).double(), tgt.reshape(-1))
                                                    - ce), rel=1e-5)
    # per-position KL bit for bit the plain form's, through the reused float64 scratch (a
    # 2-row batch, then a 1-row one in a slice of it)
    assert torch.equal(torch.cat(k.kld_values), ceval.token_kl(base, q).reshape(-1))
    assert k.scratch.numel() == 2 * 40 * 500
    same = ceval.KLStats()
    same.update(base, base, tgt)
    assert same.result()["kld_max"] == 0 and same.result()["same_top"] == 1
    bad = base.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(InputError, match="out.gguf: the logits hold NaN"):
        ceval.KLStats().update(base, bad, tgt, what="out.gguf")


# --------------------------------------------------------------------------------------------
# GGUF loader: the inverse of the converter

def test_unpermute_inverts_the_converter():
    g = torch.Generator().manual_seed(1)
    cfg = {"num_attention_heads": 9, "num_key_value_heads": 3}
    for name, rows in (("model.layers.0.self_attn.q_proj.weight", 576),
                       ("model.layers.0.self_attn.k_proj.weight", 192),
                       ("model.layers.0.self_attn.k_proj.bias", 192)):
        x = torch.randn(rows, *([] if name.endswith("bias") else [40]), generator=g)
        y = gguf_arch.transform_tensor(name, x, cfg, "llama")
        assert not torch.equal(x, y)
        heads = 9 if "q_proj" in name else 3
        assert torch.equal(gguf_load.unpermute_rows(y, heads), x)


def test_tensor_names_invert(smollm2_dir, synth_qwen3_dir, synth_qwen2_dir):
    from safetensors import safe_open

    for d, arch in ((smollm2_dir, "llama"), (synth_qwen3_dir, "qwen3"), (synth_qwen2_dir, "qwen2")):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        for n in names + ["lm_head.weight"]:
            g = gguf_arch.gguf_tensor_name(n, arch)
            assert gguf_load.hf_tensor_name(g, arch) == n
    assert gguf_load.hf_tensor_name("rope_freqs.weight", "llama") is None
    with pytest.raises(InputError, match="blk.0.ssm_conv1d.weight"):
        gguf_load.hf_tensor_name("blk.0.ssm_conv1d.weight", "llama")


def test_llamacpp_f16_gguf_loads_as_the_checkpoint(smollm2_dir):
    """llama.cpp's own F16 conversion of SmolLM2, read back: every tensor equals the FP16
    checkpoint bit for bit (names, un-permuted Q/K, shapes), and the rebuilt config matches."""
    from quantpress.calibration.engine import SafetensorsDir

    from gguf import GGUFReader

    path = llamacpp_tools.smollm2_gguf("f16")
    w = gguf_load.GGUFWeights(path)
    r = GGUFReader(str(path))  # our header parser against gguf-py's
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v = w.metadata[k]
        if isinstance(v, gguf_load.StringArray):
            assert int(v) == len(f.contents()) > gguf_load.MAX_STRING_ARRAY, k
        else:
            assert v == pytest.approx(f.contents()) if isinstance(v, float) else v == f.contents(), k
    assert [(t.name, int(t.data_offset), int(t.n_bytes)) for t in r.tensors] == \
        [(w.gguf_names[n], w.info(n).offset, w.info(n).n_bytes) for n in w.keys()]
    hf = SafetensorsDir(smollm2_dir)
    assert set(w.keys()) == set(hf.keys())
    for n in hf.keys():
        assert torch.equal(w.get(n), hf.get(n).float()), n
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    mine = w.hf_config()
    for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
              "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert mine[k] == cfg[k], k
    assert mine["rms_norm_eps"] == pytest.approx(cfg["rms_norm_eps"])
    assert mine["rope_parameters"]["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert w.add_bos() is False


# --------------------------------------------------------------------------------------------
# Perplexity against transformers and llama.cpp

@pytest.fixture(scope="module")
def smollm2_eval(smollm2_dir, smollm2_q8, text_file):
    return make.evaluate(smollm2_dir, [smollm2_q8], text=text_file, ctx=CTX, chunks=CHUNKS)


def test_fp16_perplexity_equals_transformers(smollm2_dir, text_file, smollm2_eval):
    """quantize eval on the FP16 directory = exp(cross-entropy) of a plain transformers forward
    on the same chunks (second half of each 512-token chunk), float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor(tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    chunks = ids[: CHUNKS * CTX].view(CHUNKS, CTX)  # SmolLM2 adds no BOS
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(chunks).logits
    first = CTX // 2
    loss = F.cross_entropy(logits[:, first:-1].reshape(-1, logits.shape[-1]).double(),
                           chunks[:, first + 1:].reshape(-1))
    ref = float(loss.exp())
    ours = smollm2_eval.models[0].ppl
    assert ours["tokens"] == CHUNKS * (CTX - first - 1)
    assert abs(ours["ppl"] - ref) / ref < 1e-4, (ours["ppl"], ref)


def test_q8_perplexity_agrees_with_llama_perplexity(smollm2_q8, text_file, smollm2_eval):
    """The Q8_0 GGUF evaluated by dequantizing its weights into transformers agrees within 1%
    with llama.cpp's llama-perplexity binary on the same text file, -c 512, --chunks 3.

    Two known differences keep this from being tighter: llama.cpp tokenizes the text itself
    (its "smollm" pre-tokenizer merges "\n\n" before a digit, which the HF tokenizer splits:
    4 differences in 5k tokens here, shifting later chunk boundaries), and its Q8_0 dot
    products also quantize the activations to Q8_0, which dequantized weights in float32 do
    not (see the F16 test below for the harness itself)."""
    args = ["-c", str(CTX), "-b", str(CTX), "--chunks", str(CHUNKS), "-t", "2"]

    def run() -> dict:   # (cached by the files' bytes, the arguments and the tool build)
        r = subprocess.run([str(llamacpp_tools.tool("llama-perplexity")), "-m", str(smollm2_q8), "-f",
                            str(text_file), *args], capture_output=True, text=True, check=True)
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
        assert m, (r.stdout + r.stderr)[-2000:]
        return {"ppl": m.group(1),
                "chunks": f"calculating perplexity over {CHUNKS} chunks, n_ctx={CTX}" in r.stdout + r.stderr}

    got = llamacpp_tools.cached_value("tools", ["llama-perplexity", *args], [smollm2_q8, text_file], run)
    assert got["chunks"]
    ref = float(got["ppl"])
    q8 = smollm2_eval.models[1]
    assert abs(q8.ppl["ppl"] - ref) / ref < 0.01, (q8.ppl["ppl"], ref)
    kl = q8.kl
    assert 0 < kl["kld_mean"] < kl["kld_p99"] < kl["kld_max"]
    assert 0.9 < kl["same_top"] <= 1
    assert q8.ppl["ppl"] != smollm2_eval.models[0].ppl["ppl"]


def test_same_chunks_through_llamacpp(smollm2_dir, text_file, smollm2_eval):
    """The harness itself: llama.cpp (llama_cpp.Llama, logits_all) on llama.cpp's own F16
    conversion, fed exactly our chunks and scored with llama-perplexity's rule, gives our FP16
    perplexity within 0.1% (F16 weights are exact; llama.cpp rounds activations to F16)."""
    import llama_cpp
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = torch.tensor(tok(text_file.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
    chunks = ceval.make_chunks(ids, CTX, CHUNKS)
    llm = llama_cpp.Llama(str(llamacpp_tools.smollm2_gguf("f16")), n_ctx=CTX, n_batch=CTX,
                          logits_all=True, n_threads=2, verbose=False)
    st = ceval.PerplexityStats()
    for row in chunks:
        llm.reset()
        llm.eval(row.tolist())
        logits = torch.from_numpy(np.array(llm.scores[:CTX], dtype=np.float32))
        st.update(logits[ceval.scored_slice(CTX)], row[CTX // 2 + 1:])
    del llm
    ref = st.result()["ppl"]
    ours = smollm2_eval.models[0].ppl["ppl"]
    assert abs(ours - ref) / ref < 1e-3, (ours, ref)


def test_cli_eval_table_and_json(smollm2_dir, smollm2_q8, text_file, smollm2_eval, capsys):
    """The CLI prints the side-by-side table and, with --json, the same figures as the API."""
    args = ["eval", str(smollm2_dir), str(smollm2_q8), "--text", str(text_file), "--ctx", "256",
            "--chunks", "2", "--device", "cpu", "--quiet"]
    assert quantize_main(args + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["n_chunks"] == 2 and js["n_ctx"] == 256 and len(js["models"]) == 2
    assert js["models"][0]["tokens"] == 2 * 127 and js["models"][1]["kl"]["tokens"] == 2 * 127
    assert quantize_main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"SmolLM2-135M-Instruct\s+hf\s+\d+\.\d{4} ± ", out)
    assert re.search(r"SmolLM2-135M-Instruct-Q8_0\.gguf\s+gguf\s+.*%", out)
    assert "KLD 99%" in out and "top-1" in out


# --------------------------------------------------------------------------------------------
# Bad input

def test_eval_bad_input(smollm2_dir, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("Hello world. " * 20)
    with pytest.raises(InputError, match=r"text too short: \d+ tokens, at least 1024 needed"):
        make.evaluate(smollm2_dir, [], text=short, progress=False)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputError, match=r"empty\.txt: text file is empty"):
        make.evaluate(smollm2_dir, [], text=empty, progress=False)
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc" * 100)
    with pytest.raises(InputError, match=r"bin\.txt: not UTF-8 text"):
        make.evaluate(smollm2_dir, [], text=binary, progress=False)
    with pytest.raises(InputError, match=r"nope\.txt: text file not found"):
        make.evaluate(smollm2_dir, [], text=tmp_path / "nope.txt", progress=False)
    with pytest.raises(InputError, match=r"missing\.gguf: no such file or directory"):
        make.evaluate(smollm2_dir, [tmp_path / "missing.gguf"], text=short, progress=False)
    hqq = tmp_path / "hqq"
    hqq.mkdir()
    (hqq / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                 "quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(InputError, match=r"a 'hqq'-quantized directory; no loader for it yet"):
        make.evaluate(smollm2_dir, [hqq], text=short, progress=False)
    awq3 = tmp_path / "awq3"
    awq3.mkdir()
    (awq3 / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "quantization_config": {
        "quant_method": "awq", "bits": 3, "group_size": 64, "zero_point": True, "version": "gemm"}}))
    with pytest.raises(InputError, match=r"awq3: quantization_config .* is not 4-bit GEMM"):
        make.evaluate(smollm2_dir, [awq3], text=short, progress=False)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 10)
    with pytest.raises(InputError, match=r"junk\.gguf: not a readable GGUF file"):
        make.evaluate(smollm2_dir, [junk], text=short, progress=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llamacpp_tools.smollm2_gguf("f16").read_bytes()[:200_000])
    with pytest.raises(InputError, match=r"cut\.gguf: not a readable GGUF file \(truncated"):
        make.evaluate(smollm2_dir, [cut], text=short, progress=False)
    # the CLI: one line, exit 2
    assert quantize_main(["eval", str(smollm2_dir), "--text", str(short), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: text too short")


def test_eval_vocab_mismatch_and_nonfinite(smollm2_dir, tmp_path, text_file):
    """Models with another vocabulary are refused before any computation; NaN/Inf activations
    name the decoder layer."""
    from safetensors.torch import load_file, save_file

    small = synth.make_model(tmp_path / "v8k", "llama", smollm2_dir, num_hidden_layers=2, vocab_size=8192)
    with pytest.raises(InputError, match=r"v8k: vocabulary of 8192 tokens, the base model has 49152"):
        make.evaluate(smollm2_dir, [small], text=text_file, progress=False)
    bad = synth.make_model(tmp_path / "inf", "llama", smollm2_dir, num_hidden_layers=2)
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.1.post_attention_layernorm.weight"][0] = float("inf")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=r"decoder layer 1"):
        make.evaluate(bad, [], text=text_file, ctx=128, chunks=1, progress=False)


def test_outputs_scored_side_by_side_equal_one_by_one(smollm2_dir, tmp_path, text_file, monkeypatch):
    """Evaluation.report(side_by_side=2) scores two outputs in two threads at once (on one
    torch thread each, as a batch's last scoring does) and reports exactly the figures of
    scoring them one after the other."""
    import threading

    from quantpress.calibration import engine
    from quantpress.targets.base import ComputeOptions
    from quantpress.targets.eval import EvalOptions, Evaluation

    base = synth.make_model(tmp_path / "base", "llama", smollm2_dir, num_hidden_layers=2, seed=3)
    outs = [synth.make_model(tmp_path / f"o{i}", "llama", smollm2_dir, num_hidden_layers=2, seed=4 + i)
            for i in range(2)]
    opts = EvalOptions(str(text_file), 128, 2)
    monkeypatch.setattr(engine, "side_by_side_threads", lambda device, n: min(n, 2))
    seen = set()
    real = Evaluation._score

    def spy(self, *a):
        seen.add(threading.current_thread().name)
        return real(self, *a)
    monkeypatch.setattr(Evaluation, "_score", spy)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reports = []
        for k in (2, 1):
            ev = Evaluation(base, opts, ComputeOptions(device="cpu"), progress=False)
            try:
                reports.append(ev.report(outs, side_by_side=k))
            finally:
                ev.close()
            if k == 2:
                assert len(seen) == 2 and threading.current_thread().name not in seen
    finally:
        torch.set_num_threads(n)
    together, alone = reports
    assert [(m.path, m.ppl, m.kl) for m in together.models] == [(m.path, m.ppl, m.kl) for m in alone.models]
    assert together.models[1].kl["kld_mean"] != together.models[2].kl["kld_mean"]
