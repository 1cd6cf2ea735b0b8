"""GGUF with importance weights (``--imatrix``), the IQ4_NL / IQ4_XS / Q2_K_S policies and
llama-quantize's per-tensor controls, against ``llama-quantize`` itself (built from the pinned
llama.cpp source, tools in scripts/llamacpp_tools.py) on llama.cpp's own F16 conversions.

Every comparison is of whole files: tensor types, order and bytes, the KVs (the
``quantize.imatrix.*`` keys included) and finally the file bytes. The imatrix of the synthetic
models is ours (``quantize imatrix`` on a few rows), SmolLM2's is llama-imatrix's (GGUF and
legacy ``.dat``), so both readers are exercised. Bad input: one line, exit 2, nothing written.
"""
from __future__ import annotations

import struct
from pathlib import Path

import pytest

import llamacpp_tools
import make
from quantpress import assets
from quantpress.calibration import data
from quantpress.cli.convert_main import main as convert_main
from quantpress.cli.quantize_main import main as quantize_main
import refs
from refs import kvs_of, tensors_of

POLICIES = ["Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q4_0", "Q4_K_S", "Q4_K_M", "Q5_1", "Q5_K_M",
            "Q6_K", "IQ4_NL", "IQ4_XS"]
# every policy on the synthetic llama; on qwen3 (gqa 4) and SmolLM2 (576-wide rows: the
# Q5_0/Q5_1/Q8_0/IQ4_NL fallbacks, tied embeddings, llama-imatrix's file) the policies whose
# types depend on what those models add (each case ~25 s: the CI budget)
CASES = ([("llama", p) for p in POLICIES] + [("qwen3", "Q2_K_S"), ("qwen3", "IQ4_NL")]
         + [("smollm2", "Q4_K_M"), ("smollm2", "IQ4_XS"), ("smollm2", "Q2_K")])


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, small_vocab_llama_dir, synth_qwen3_dir):
    """F16 GGUFs by llama.cpp's converter and an imatrix per model: ours for the synthetic
    models (4 rows of 64 tokens; the llama with a 384-token byte-fallback BPE tokenizer,
    ``small_vocab_llama_dir``, see :func:`test_small_vocabulary_plans_the_same_types`), llama-imatrix's for SmolLM2 (2 chunks of 128 tokens), in
    GGUF and legacy .dat. The calibration text and the imatrix files lie at paths given by
    their bytes (``llamacpp_tools.stable_copy``): llama-quantize records the imatrix's path
    and llama-imatrix the text's, so the same inputs give the same reference bytes and
    llama.cpp's outputs come from the cache on a second run."""
    d = tmp_path_factory.mktemp("gguf_imatrix")
    text = d / "calib.txt"
    text.write_text("\n\n".join(a.strip() for a in data.calibration_articles(assets.standard_cal_data())[:4]),
                    encoding="utf-8")
    text = llamacpp_tools.stable_copy(text)
    f16 = {"llama": llamacpp_tools.convert_hf(small_vocab_llama_dir, d / "llama-f16.gguf"),
           "qwen3": llamacpp_tools.convert_hf(synth_qwen3_dir, d / "qwen3-f16.gguf"),
           "smollm2": llamacpp_tools.smollm2_gguf("f16")}
    im = {}
    for key, hf in (("llama", small_vocab_llama_dir), ("qwen3", synth_qwen3_dir)):
        made = d / f"{key}.imatrix.gguf"
        make.imatrix(hf, made, samples=4, seqlen=64, device="cpu", calib=str(text))
        im[key] = llamacpp_tools.stable_copy(made)
    for key, fmt in (("smollm2", "gguf"), ("smollm2.dat", "dat")):
        made = refs.llama_imatrix(f16["smollm2"], text, d / f"smollm2.imatrix.{fmt}", "-c", "128", "-b", "128",
                                  "--chunks", "2", "--no-ppl", "-t", "2", "--output-format", fmt)
        im[key] = llamacpp_tools.stable_copy(made)
    return {"f16": f16, "imatrix": im, "dir": d}


def llama_quantize(src: Path, out: Path, policy: str, *flags: str) -> Path:
    """``llama-quantize [flags] SRC OUT POLICY 2`` (:func:`refs.llama_quantize`, cached; the
    files named in ``flags`` are part of its key)."""
    files = tuple(Path(f) for f in flags if Path(f).is_file())
    return refs.llama_quantize(src, out, policy, *flags, inputs=files)


def assert_same_file(ours: Path, ref: Path) -> None:
    """Tensor types, order and bytes, then KVs (keys, types, values, order), then every byte."""
    ot, rt = tensors_of(ours), tensors_of(ref)
    assert list(ot) == list(rt)
    bad = [f"{n}: {ot[n][0]} vs llama.cpp {rt[n][0]}" for n in rt if ot[n][:2] != rt[n][:2]]
    assert not bad, bad[:10]
    bad = [f"{n} ({rt[n][0]})" for n in rt if ot[n][2] != rt[n][2]]
    assert not bad, f"{len(bad)} tensors' bytes differ from llama-quantize: {bad[:10]}"
    ok, rk = kvs_of(ours), kvs_of(ref)
    assert list(ok) == list(rk)
    assert ok == rk
    assert ours.read_bytes() == ref.read_bytes()


def ours_quantize(src: Path, out: Path, policy: str, *flags: str) -> None:
    assert quantize_main(["gguf", str(src), "--policy", policy, "-o", str(out), "--quiet",
                          "--device", "cpu", *flags]) == 0


def test_small_vocabulary_plans_the_same_types(inputs):
    """The small-vocabulary llama stands for the SmolLM2-tokenizer one: with its embedding and
    head given 49,152 rows (the only tensors that differ), every policy here plans the same
    type for every tensor (llama-quantize's rules read row widths, layer counts and heads;
    test_gguf_policy.py checks ``plan_types`` against llama-quantize on the 49,152-row model),
    and the tokenizer is a real one: its tokens and merges are in the file."""
    from dataclasses import replace

    from quantpress.convert.gguf_policy import ModelParams, plan_types
    from refs import gguf_header

    kv, tensors = gguf_header(inputs["f16"]["llama"])
    small = [(n, shape) for n, _, shape, _ in tensors]
    vocab = {n: shape[0] for n, shape in small if n in ("token_embd.weight", "output.weight")}
    assert set(vocab.values()) == {384}, vocab
    big = [(n, (49152, *shape[1:]) if n in vocab else shape) for n, shape in small]
    params = ModelParams(arch="llama", n_layer=16, n_head=4, n_head_kv=2, has_output=True)
    for policy in POLICIES:
        p = replace(params, has_imatrix=True)
        assert plan_types(policy, small, p) == plan_types(policy, big, p), policy
    assert kv["tokenizer.ggml.model"] == "llama" and kv["llama.vocab_size"] == 384
    meta = kvs_of(inputs["f16"]["llama"])
    assert len(meta["tokenizer.ggml.tokens"][1]) == 384 and "<0x41>" in meta["tokenizer.ggml.tokens"][1]


@pytest.mark.parametrize("model,policy", CASES)
def test_imatrix_quantize_equals_llama_quantize(inputs, tmp_path, model, policy):
    src, im = inputs["f16"][model], inputs["imatrix"][model]
    ref = llama_quantize(src, tmp_path / "ref.gguf", policy, "--imatrix", str(im))
    ours_quantize(src, tmp_path / "ours.gguf", policy, "--imatrix", str(im))
    assert_same_file(tmp_path / "ours.gguf", ref)
    kv = kvs_of(ref)
    assert kv["quantize.imatrix.file"][1] == str(im)
    assert kv["quantize.imatrix.entries_count"][1] > 0


@pytest.mark.parametrize("model,policy,flags", [("llama", "Q4_K_M", ()), ("qwen3", "Q4_0", ()),
                                                ("llama", "Q3_K_S", ("--exclude-weights", "blk.0.ffn_down.weight"))])
def test_windows_of_tensors_equal_llama_quantize(inputs, tmp_path, monkeypatch, model, policy, flags):
    """The accelerator path of write_gguf_many on the CPU: tensors read ahead into windows of
    ~400k elements (several tensors, of several types, weighted and not) and each window
    encoded in one pass per type, the round trip in three checker processes, still write
    llama-quantize's bytes."""
    from quantpress.convert import gguf_file, gguf_roundtrip

    monkeypatch.setattr(gguf_file, "_window_elements", lambda device: 400_000)
    monkeypatch.setattr(gguf_roundtrip, "checkers_for", lambda device: 3)
    seen = []
    real = gguf_file.encode_many

    def spy(items, device):
        seen.append(len(items))
        return real(items, device)
    monkeypatch.setattr(gguf_file, "encode_many", spy)
    src, im = inputs["f16"][model], inputs["imatrix"][model]
    ref = llama_quantize(src, tmp_path / "ref.gguf", policy, "--imatrix", str(im), *flags)
    ours_quantize(src, tmp_path / "ours.gguf", policy, "--imatrix", str(im), *flags)
    assert max(seen) > 5 and len(seen) < len(tensors_of(ref)) / 3, seen
    assert_same_file(tmp_path / "ours.gguf", ref)


def test_legacy_dat_imatrix_and_filters(inputs, tmp_path):
    """llama-imatrix's legacy .dat, and --include-weights / --exclude-weights."""
    src, dat = inputs["f16"]["smollm2"], inputs["imatrix"]["smollm2.dat"]
    for i, flags in enumerate([("--imatrix", str(dat), "--exclude-weights", "ffn_down"),
                               ("--imatrix", str(dat), "--include-weights", "attn_v",
                                "--include-weights", "blk.3.")]):
        ref = llama_quantize(src, tmp_path / f"ref{i}.gguf", "Q4_K_M", *flags)
        ours_quantize(src, tmp_path / f"ours{i}.gguf", "Q4_K_M", *flags)
        assert_same_file(tmp_path / f"ours{i}.gguf", ref)
    # the filters changed what was weighted: 30 layers x 7 linears, less 30 ffn_down; 30 attn_v
    # and blk.3's other 6
    counts = [kvs_of(tmp_path / f"ref{i}.gguf")["quantize.imatrix.entries_count"][1] for i in range(2)]
    assert counts == [180, 36]


def test_hf_to_gguf_with_imatrix_equals_convert_then_quantize(inputs, small_vocab_llama_dir, tmp_path, capsys):
    im = inputs["imatrix"]["llama"]
    ref = llama_quantize(inputs["f16"]["llama"], tmp_path / "ref.gguf", "Q4_K_M", "--imatrix", str(im))
    out = tmp_path / "ours.gguf"
    assert convert_main(["hf-to-gguf", str(small_vocab_llama_dir), "--policy", "Q4_K_M", "--imatrix", str(im),
                         "-o", str(out), "--quiet", "--device", "cpu"]) == 0
    # tensors as llama-quantize's; the KVs keep the converter's order (general.file_type where
    # convert_hf_to_gguf.py puts it, not moved last as llama-quantize moves it), so compare
    # the imatrix keys, which both append last
    assert tensors_of(out) == tensors_of(ref)
    ok, rk = kvs_of(out), kvs_of(ref)
    q = [k for k in rk if k.startswith("quantize.imatrix.")]
    assert len(q) == 4 and list(ok)[-4:] == list(rk)[-4:] == q
    assert {k: ok[k] for k in q} == {k: rk[k] for k in q}
    capsys.readouterr()
    assert convert_main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    for key in ("quantize.imatrix.file", "quantize.imatrix.dataset", "quantize.imatrix.entries_count",
                "quantize.imatrix.chunks_count"):
        assert key in shown


OVERRIDES = [
    ("Q4_K_M", ("--tensor-type", "attn_v=q8_0", "--tensor-type", r"blk\.[0-3]\.ffn_down=Q5_K")),
    ("Q3_K_M", ("--output-tensor-type", "q8_0", "--token-embedding-type", "q4_k", "--pure")),
    ("IQ4_XS", ("--leave-output-tensor", "--tensor-type", "ffn_up=iq4_nl")),
]


@pytest.mark.parametrize("policy,flags", OVERRIDES, ids=[" ".join(f) for _, f in OVERRIDES])
def test_overrides_equal_llama_quantize(inputs, tmp_path, policy, flags, capsys):
    src = inputs["f16"]["llama"]
    ref = llama_quantize(src, tmp_path / "ref.gguf", policy, *flags)
    capsys.readouterr()
    ours_quantize(src, tmp_path / "ours.gguf", policy, *flags)
    summary = capsys.readouterr().out
    assert_same_file(tmp_path / "ours.gguf", ref)
    plain = tensors_of(llama_quantize(src, tmp_path / "plain.gguf", policy))
    changed = [n for n, (t, _, _) in tensors_of(ref).items() if plain[n][0] != t]
    assert changed  # every case changes something ...
    assert f"overrides  {len(changed)} tensors changed" in summary  # ... and the summary says so


def test_tied_model_output_type_follows_output_tensor_type(inputs, tmp_path):
    """SmolLM2 (tied embeddings): --output-tensor-type reaches token_embd."""
    src = inputs["f16"]["smollm2"]
    ref = llama_quantize(src, tmp_path / "ref.gguf", "Q4_0", "--output-tensor-type", "q5_0")
    ours_quantize(src, tmp_path / "ours.gguf", "Q4_0", "--output-tensor-type", "q5_0")
    assert_same_file(tmp_path / "ours.gguf", ref)
    assert tensors_of(ref)["token_embd.weight"][0] == "Q5_0"


# --------------------------------------------------------------------------- bad input

def _refused(capsys, args: list[str], match: str, out: Path) -> None:
    assert quantize_main(args + ["-o", str(out), "--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err
    assert list(out.parent.iterdir()) == []


def test_bad_imatrix_and_options(inputs, tmp_path, capsys):
    smol, llama_im = str(inputs["f16"]["smollm2"]), inputs["imatrix"]["llama"]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "o.gguf"
    base = ["gguf", smol, "--policy", "Q4_K_M"]
    # an imatrix of another model: the first tensor whose width disagrees is named
    _refused(capsys, base + ["--imatrix", str(llama_im)], "imatrix size 256 is different from tensor size 576 "
             "for blk.0.attn_k.weight", out)
    # names that match no tensor
    bogus = tmp_path / "bogus.dat"
    name = b"model.layers.0.self_attn.q_proj.weight"
    bogus.write_bytes(struct.pack("<i", 1) + struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, 4)
                      + struct.pack("<4f", 1, 2, 3, 4))
    _refused(capsys, base + ["--imatrix", str(bogus)], "imatrix entry 'model.layers.0.self_attn.q_proj.weight' "
             "names no tensor", out)
    # a truncated GGUF imatrix, a GGUF that is not an imatrix, a .dat with a bad count
    trunc = tmp_path / "trunc.imatrix.gguf"
    trunc.write_bytes(inputs["imatrix"]["smollm2"].read_bytes()[:5000])
    _refused(capsys, base + ["--imatrix", str(trunc)], str(trunc), out)
    _refused(capsys, base + ["--imatrix", str(inputs["f16"]["llama"])], "missing imatrix metadata", out)
    bad_count = tmp_path / "bad.dat"
    bad_count.write_bytes(struct.pack("<i", 0))
    _refused(capsys, base + ["--imatrix", str(bad_count)], "legacy entry count 0", out)
    short = tmp_path / "short.dat"
    short.write_bytes(inputs["imatrix"]["smollm2.dat"].read_bytes()[:3000])
    _refused(capsys, base + ["--imatrix", str(short)], "truncated legacy imatrix", out)
    _refused(capsys, base + ["--imatrix", str(tmp_path / "none.gguf")], "cannot read the imatrix", out)
    # --tensor-type: a bad pattern, an unknown type (the known ones are listed), no '='
    _refused(capsys, base + ["--tensor-type", "attn_v(=q8_0"], "bad regular expression", out)
    _refused(capsys, base + ["--tensor-type", "attn_v=q9_9"], "unknown ggml type 'q9_9'; choose one of", out)
    _refused(capsys, base + ["--tensor-type", "attn_v"], "expected PATTERN=TYPE", out)
    _refused(capsys, base + ["--output-tensor-type", "Q7_K"], "--output-tensor-type: unknown ggml type", out)
    # Q2_K_S without an imatrix is refused, as llama-quantize refuses it
    _refused(capsys, ["gguf", smol, "--policy", "Q2_K_S"], "needs an importance matrix", out)
    _refused(capsys, base + ["--imatrix", str(llama_im), "--include-weights", "a", "--exclude-weights", "b"],
             "cannot be used together", out)


def test_imatrix_auto_computes_keeps_and_uses_it(tiny_llama_dir, tmp_path):
    """--imatrix auto: OUT.imatrix.gguf is written (verified) beside the output, and the GGUF
    equals hf-to-gguf given that file."""
    out = tmp_path / "auto.gguf"
    common = ["--policy", "Q4_K_M", "--quiet", "--device", "cpu"]
    assert convert_main(["hf-to-gguf", str(tiny_llama_dir), "-o", str(out), "--imatrix", "auto",
                         "--samples", "2", "--seqlen", "32", *common]) == 0
    im = tmp_path / "auto.gguf.imatrix.gguf"
    assert im.is_file()
    again = tmp_path / "again.gguf"
    assert convert_main(["hf-to-gguf", str(tiny_llama_dir), "-o", str(again), "--imatrix", str(im), *common]) == 0
    assert out.read_bytes() == again.read_bytes()
    plain = tmp_path / "plain.gguf"
    assert convert_main(["hf-to-gguf", str(tiny_llama_dir), "-o", str(plain), *common]) == 0
    weighted, unweighted = tensors_of(out), tensors_of(plain)
    assert weighted["blk.0.attn_q.weight"][2] != unweighted["blk.0.attn_q.weight"][2]
    assert kvs_of(out)["quantize.imatrix.chunks_count"][1] == 2


def test_imatrix_improves_quality_on_smollm2(smollm2_dir, tmp_path):
    """On held-out text (quantize eval, 4 chunks of 512), our imatrix (16 × 256 calibration
    tokens) lowers the KL divergence of Q4_K_M and of IQ4_XS by more than 15%."""
    im = tmp_path / "smollm2.imatrix.gguf"
    make.imatrix(smollm2_dir, im, samples=16, seqlen=256)
    files = {}
    for policy in ("Q4_K_M", "IQ4_XS"):
        for use in (False, True):
            files[policy, use] = tmp_path / f"{policy}-{use}.gguf"
            make.gguf(smollm2_dir, files[policy, use], policy, imatrix=im if use else None)
    rep = make.evaluate(smollm2_dir, list(files.values()), chunks=4)
    kld = {k: m.kl["kld_mean"] for k, m in zip(files, rep.models[1:])}
    # measured with 8 chunks: Q4_K_M 0.0508 -> 0.0291, IQ4_XS -> 0.102 with the imatrix; with
    # 20 chunks and 32 x 512 tokens (scripts/gguf_imatrix_quality.py) 0.0516 -> 0.0294 and
    # 0.181 -> 0.098
    for policy in ("Q4_K_M", "IQ4_XS"):
        assert kld[policy, True] < 0.85 * kld[policy, False], kld
