"""quantize fp8: the codec against compressed-tensors 0.20's own functions, the directory on tiny
synthetic models (layout, dtypes, shapes, config, calibration), SmolLM2 loaded by transformers
5.23 with compressed-tensors, and bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import synth
from quantpress.convert import fp8_dir
from quantpress.errors import InputError, RoundTripError
from quantpress.quantize import fp8
from quantpress.targets.base import CalibOptions, Source, produce, produce_many
from quantpress.targets.fp8 import FP8Options

ct_q = pytest.importorskip("compressed_tensors.quantization")
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

SCHEMES = ("dynamic", "static", "block")
CALIB = CalibOptions(samples=4, seqlen=64)


def preset(scheme: str):
    return ct_q.preset_name_to_scheme(fp8_dir.PRESETS[scheme], ["Linear"])


def ct_weight_scale(w: torch.Tensor, scheme: str):
    """llm-compressor's memoryless min-max observer of a weight, then compressed-tensors'
    calculate_qparams: (scale, zero point) as llm-compressor stores them on the module."""
    if scheme == "dynamic":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif scheme == "static":
        lo, hi = w.amin(), w.amax()
    else:
        n, k = w.shape
        b = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128))
        b = b.reshape(b.shape[0] // 128, 128, b.shape[1] // 128, 128)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    return calculate_qparams(lo, hi, preset(scheme).weights)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def awkward_weight(shape, dtype, seed=0) -> torch.Tensor:
    """Random weights with a zero row, -0.0 entries, subnormal and tiny rows, huge values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[1] = 0.0
    w[2, : max(1, shape[1] // 2)] = -0.0
    w[3] = torch.finfo(dtype).tiny / 8 * torch.sign(torch.randn(shape[1], generator=g))  # subnormal
    w[4] *= 1e-4
    w[5, 0] = torch.finfo(dtype).max / 2  # one huge value: the rest of its row/block underflows
    w[6, -1] = -3e4
    return w.to(dtype)


# --------------------------------------------------------------------------------------------
# (1) the codec, bit for bit against compressed-tensors

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (130, 1)])
def test_codec_bit_identical_to_compressed_tensors(scheme, dtype, shape):
    w = awkward_weight(shape, dtype)
    q, scale = fp8.quantize_fp8(w, scheme)
    ct_scale, ct_zp = ct_weight_scale(w, scheme)
    assert scale.dtype == ct_scale.dtype == dtype
    assert tuple(scale.shape) == tuple(ct_scale.shape)
    assert torch.equal(bits(scale), bits(ct_scale))
    # what llm-compressor's save runs: the compressor, with the module's zero weight_zero_point
    sd = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": ct_scale, "weight_zero_point": ct_zp},
                                              preset(scheme))
    assert sd["weight"].dtype == q.dtype == torch.float8_e4m3fn
    assert torch.equal(bits(q), bits(sd["weight"]))
    assert "weight_zero_point" not in sd
    # quantize() without a zero point differs only where w / scale is -0.0 (a -0.0 weight, or
    # an underflow): fp8 -0 (0x80) there, +0 with llm-compressor's zero point
    q_nozp = quantize(w, ct_scale, None, preset(scheme).weights, dtype=torch.float8_e4m3fn)
    differ = bits(q) != bits(q_nozp)
    assert bool((bits(q_nozp)[differ] == 0x80).all()) and not bool(bits(q)[differ].any())
    assert bool(differ[(w == 0) & torch.signbit(w)].all()) and bool(differ.any())
    # dequantization: compressed-tensors, the codec and the container's reference agree
    d_ct = FloatQuantizationCompressor.decompress({"weight": q, "weight_scale": scale}, preset(scheme))["weight"]
    d = fp8.dequantize_fp8(q, scale, scheme)
    d_ref = fp8_dir.dequantize_reference(q, scale, fp8.WEIGHT_STRATEGY[scheme], (128, 128))
    assert d.dtype == d_ct.dtype == d_ref.dtype == dtype
    assert torch.equal(bits(d), bits(d_ct)) and torch.equal(bits(d), bits(d_ref))
    assert torch.equal(bits(d), bits(dequantize(q, scale, None, preset(scheme).weights)))
    # the zero row: eps scale (dynamic), zeros everywhere
    assert not bool(d[1].any()) and bool(torch.isfinite(d).all())
    if scheme == "dynamic":
        assert float(scale[1, 0]) == torch.finfo(dtype).eps
    # on ordinary weights, the error is FP8's (3 mantissa bits: ~2.5% relative RMS)
    w = (torch.randn(shape) * 0.02).to(dtype)
    d = fp8.dequantize_fp8(*fp8.quantize_fp8(w, scheme), scheme)
    assert float((d.float() - w.float()).norm() / w.float().norm()) < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_saturation_and_rounding(dtype):
    """Values beyond ±448·scale saturate at ±448, ties round to even, as compressed-tensors'
    quantize with the same scale. (torch 2.13's CPU cast saturates by itself; the codec clamps
    first, as compressed-tensors does, so it does not depend on that.)"""
    scale = torch.tensor([[0.5], [1.0]], dtype=dtype)
    w = torch.tensor([[1e4, -1e4, 224.0, 224.25, 0.5 * 9.5, 0.5 * 10.5, 0.5 * 464.0, -0.0],
                      [448.0, -449.0, 464.0, 480.0, 0.0087890625, 1.0625, -1.0625, 1.1875]], dtype=dtype)
    q = fp8.quantize_with_scale(w, scale, "dynamic")
    args = preset("dynamic").weights
    assert torch.equal(bits(q), bits(quantize(w, scale, torch.zeros_like(scale, dtype=torch.float8_e4m3fn),
                                              args, dtype=torch.float8_e4m3fn)))
    f = q.float()
    assert f[0, :2].tolist() == [448.0, -448.0] and f[1, :4].tolist() == [448.0, -448.0, 448.0, 448.0]
    assert f[0, 4:7].tolist() == [10.0, 10.0, 448.0]  # 9.5 → 10, 10.5 → 10 (ties to even), 464 → 448
    assert f[1, 4:8].tolist() == [0.0078125, 1.0, -1.0, 1.25]  # subnormal 4.5·2⁻⁹ → 4·2⁻⁹; ties to even
    assert not bool(torch.isnan(f).any())


def test_input_scale_matches_static_minmax():
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(8, 64, 96) * 3).to(dtype)
        want, _ = calculate_qparams(x.amin(), x.amax(), preset("static").input_activations)
        got = fp8.input_scale(x.abs().amax().float(), dtype)
        assert got.dtype == dtype and tuple(got.shape) == (1,) and torch.equal(bits(got), bits(want))
        assert float(fp8.input_scale(0.0, dtype)) == torch.finfo(dtype).eps
    assert torch.isfinite(fp8.input_scale(1e6, torch.float16)).all()  # beyond float16: clamped, finite
    with pytest.raises(ValueError):
        fp8.input_scale(float("nan"), torch.float16)


def test_nan_weight_names_the_tensor():
    w = torch.randn(300, 200, dtype=torch.bfloat16)
    w[131, 7] = float("nan")
    for scheme in SCHEMES:
        with pytest.raises(InputError, match=r"'blk\.w' \(row 131\) holds NaN"):
            fp8.quantize_fp8(w, scheme, name="blk.w")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_codec_cuda_equals_cpu():
    for dtype in (torch.bfloat16, torch.float16):
        w = awkward_weight((1000, 700), dtype)
        for scheme in SCHEMES:
            q, s = fp8.quantize_fp8(w, scheme)
            qc, sc = fp8.quantize_fp8(w.cuda(), scheme)
            assert qc.is_cuda and torch.equal(bits(q), bits(qc.cpu())) and torch.equal(bits(s), bits(sc.cpu()))
            assert torch.equal(bits(fp8.dequantize_fp8(q, s, scheme)), bits(fp8.dequantize_fp8(qc, sc, scheme).cpu()))


# --------------------------------------------------------------------------------------------
# (2) directories of tiny synthetic models

@pytest.fixture(scope="module")
def bf16_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    return synth.make_model(tmp_path_factory.mktemp("bf16_llama"), "llama", smollm2_dir,
                            dtype=torch.bfloat16, num_hidden_layers=2, seed=3)


def _headers(d: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (s.get_dtype(), s.get_shape())
    return out


def _tensor(d: Path, name: str) -> torch.Tensor:
    idx = d / "model.safetensors.index.json"
    f = d / (json.loads(idx.read_text())["weight_map"][name] if idx.exists() else "model.safetensors")
    with safe_open(str(f), "pt") as h:
        return h.get_tensor(name)


def _capture_amax(model_dir: Path, rows: torch.Tensor) -> dict[str, float]:
    """max |x| at each linear's input over ``rows``, from a plain transformers forward."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    amax, hooks = {}, []
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_hook(
                lambda mod, a, o, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), float(a[0].abs().max())))))
    with torch.no_grad():
        m(rows)
    return amax


@pytest.mark.parametrize("scheme,model,shard", [("dynamic", "fp16", "5GB"), ("static", "fp16", "5GB"),
                                                ("block", "fp16", "15MB"), ("dynamic", "bf16", "5GB")])
def test_tiny_directory(scheme, model, shard, tiny_llama_dir, bf16_llama_dir, tmp_path):
    src_dir = tiny_llama_dir if model == "fp16" else bf16_llama_dir
    dtype = torch.float16 if model == "fp16" else torch.bfloat16
    src = Source(src_dir, calib=CALIB, progress=False)
    out = tmp_path / "out"
    s = produce(FP8Options(scheme=scheme, max_shard_size=shard), src, out, progress=False)
    assert s.kind == "fp8" and s.target == f"FP8-{scheme}" and s.roundtrip.startswith("ok (14 linears")
    assert s.details["linears_quantized"] == 14 and s.details["ignore"] == ["lm_head"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary sibling left
    # config: compressed-tensors validates it; the group is the preset, as llm-compressor records it
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization_config"]
    qc = ct_q.QuantizationConfig.model_validate(q)
    assert (q["quant_method"], q["format"], q["quantization_status"]) == ("compressed-tensors", "float-quantized", "compressed")
    assert q["ignore"] == ["lm_head"] and list(q["config_groups"]) == ["group_0"]
    g = qc.config_groups["group_0"]
    assert g.targets == ["Linear"] and g.format == "float-quantized"
    assert g.weights == preset(scheme).weights and g.input_activations == preset(scheme).input_activations
    assert (out / "config.json").read_text() == json.dumps(cfg, indent=2, sort_keys=True)
    src_cfg = json.loads((src_dir / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    assert (out / "tokenizer.json").read_bytes() == (src_dir / "tokenizer.json").read_bytes()
    # layout
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    if shard == "15MB":
        assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
        wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(wm.values()) == set(shards) and not any("@" in k for k in wm)
    else:
        assert shards == ["model.safetensors"]
    head = _headers(out)
    src_head = _headers(src_dir)
    dn = {torch.float16: "F16", torch.bfloat16: "BF16"}[dtype]
    linears = [k[: -len(".weight")] for k in src_head if k.startswith("model.layers.") and k.endswith("_proj.weight")]
    assert len(linears) == 14
    expected = {}
    for k, (dt, shp) in src_head.items():
        m = k[: -len(".weight")]
        if m in linears:
            n, kk = shp
            expected[k] = ("F8_E4M3", shp)
            sshape = {"dynamic": [n, 1], "static": [1], "block": [-(-n // 128), -(-kk // 128)]}[scheme]
            expected[m + ".weight_scale"] = (dn, sshape)
            if scheme == "static":
                expected[m + ".input_scale"] = (dn, [1])
        else:
            expected[k] = (dt, shp)
    assert head == expected
    # every stored linear is what compressed-tensors makes of the source weight; the rest is copied
    rows = src.calibration_rows()[0] if scheme == "static" else None
    amax = _capture_amax(src_dir, rows) if scheme == "static" else {}
    src_t = {}
    for f in src_dir.glob("*.safetensors"):
        src_t.update(load_file(f))
    for k, t in src_t.items():
        m = k[: -len(".weight")]
        if m not in linears:
            assert torch.equal(bits(_tensor(out, k)), bits(t)), k
            continue
        ct_scale, ct_zp = ct_weight_scale(t, scheme)
        want = FloatQuantizationCompressor.compress({"weight": t, "weight_scale": ct_scale, "weight_zero_point": ct_zp},
                                                    preset(scheme))["weight"]
        assert torch.equal(bits(_tensor(out, k)), bits(want)), k
        assert torch.equal(bits(_tensor(out, m + ".weight_scale")), bits(ct_scale)), k
        if scheme == "static":
            got = _tensor(out, m + ".input_scale")
            a = torch.tensor(amax[m], dtype=dtype)
            want_in, _ = calculate_qparams(-a, a, preset("static").input_activations)
            assert torch.allclose(got.float(), want_in.float(), rtol=2 ** -9, atol=0), (m, got, want_in)
    # the reader gives the same weights a dense model needs
    w = fp8_dir.FP8Weights(out)
    assert sorted(w.keys()) == sorted(src_t)
    assert w.get(linears[0] + ".weight").dtype == dtype


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_lm_head_when_asked_with_tied_embeddings(scheme, smollm2_dir, tmp_path):
    """``lm_head=True`` on a model with tied embeddings: lm_head is stored as FP8 (what
    compressed-tensors makes of the embedding matrix; static: its input scale from the final
    norm's output, as a transformers forward sees it), the embedding stays, the config unties
    them and ignores nothing; transformers decompresses lm_head to our weights bit for bit."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    src_dir = synth.make_model(tmp_path / "src", "llama", smollm2_dir, num_hidden_layers=1,
                               tie_word_embeddings=True, seed=4)
    src = Source(src_dir, calib=CALIB, progress=False)
    out = tmp_path / "out"
    s = produce(FP8Options(scheme=scheme, lm_head=True), src, out, progress=False)
    assert s.target == f"FP8-{scheme}-head" and s.roundtrip.startswith("ok (8 linears")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["ignore"] == []
    emb = load_file(next(src_dir.glob("*.safetensors")))["model.embed_tokens.weight"]
    assert torch.equal(bits(_tensor(out, "model.embed_tokens.weight")), bits(emb))
    ct_scale, ct_zp = ct_weight_scale(emb, scheme)
    want = FloatQuantizationCompressor.compress({"weight": emb, "weight_scale": ct_scale,
                                                 "weight_zero_point": ct_zp}, preset(scheme))["weight"]
    assert torch.equal(bits(_tensor(out, "lm_head.weight")), bits(want))
    if scheme == "static":
        a = torch.tensor(_capture_amax(src_dir, src.calibration_rows()[0])["lm_head"], dtype=emb.dtype)
        want_in, _ = calculate_qparams(-a, a, preset("static").input_activations)
        got = _tensor(out, "lm_head.input_scale")
        assert torch.allclose(got.float(), want_in.float(), rtol=2 ** -9, atol=0), (got, want_in)
    m = AutoModelForCausalLM.from_pretrained(out, dtype=emb.dtype, device_map="cpu",
                                             quantization_config=CompressedTensorsConfig(run_compressed=False))
    ours = fp8_dir.FP8Weights(out).get("lm_head.weight")
    assert torch.equal(bits(m.lm_head.weight.detach()), bits(ours))
    assert not torch.equal(bits(m.model.embed_tokens.weight.detach()), bits(ours))


def test_shared_reference_pass_two_static_outputs(tiny_llama_dir, tmp_path):
    """Two static outputs fed by one pass: same input scales; the mlp linears ignored in one."""
    src = Source(tiny_llama_dir, calib=CALIB, progress=False)
    a, b = tmp_path / "a", tmp_path / "b"
    oc = produce_many([(FP8Options(scheme="static"), a),
                       (FP8Options(scheme="static", ignore=("re:.*\\.mlp\\.",)), b)], src, progress=False)
    assert all(o.ok for o in oc), [o.error for o in oc]
    assert oc[1].summary.details["linears_quantized"] == 8
    ign = json.loads((b / "config.json").read_text())["quantization_config"]["ignore"]
    assert ign == [f"model.layers.{i}.mlp.{p}_proj" for i in range(2) for p in ("gate", "up", "down")] + ["lm_head"]
    ha, hb = _headers(a), _headers(b)
    assert hb["model.layers.1.mlp.down_proj.weight"][0] == "F16" and "model.layers.1.mlp.down_proj.input_scale" not in hb
    for k in hb:
        if k.endswith("input_scale"):
            assert torch.equal(_tensor(a, k), _tensor(b, k))
    assert set(ha) - set(hb) == {f"model.layers.{i}.mlp.{p}_proj.{s}" for i in range(2)
                                 for p in ("gate", "up", "down") for s in ("weight_scale", "input_scale")}


def test_static_calibration_runs_in_float32(tiny_llama_dir, tmp_path, capsys):
    """``quantize fp8`` offers no --dtype: static's calibration pass runs in float32 whatever the
    checkpoint's dtype (float16 here), so the command's input scales are those of an explicit
    float32 pass, and differ from a bfloat16 pass's (so the comparison can fail)."""
    from quantpress.cli.quantize_main import main as quantize_main
    from quantpress.targets import ComputeOptions

    with pytest.raises(SystemExit):
        quantize_main(["fp8", "--help"])
    assert "--dtype" not in capsys.readouterr().out
    cli = tmp_path / "cli"
    assert quantize_main(["fp8", str(tiny_llama_dir), "-o", str(cli), "--scheme", "static", "--samples", "4",
                          "--seqlen", "64", "--device", "cpu", "--quiet"]) == 0

    def input_scales(d: Path) -> dict[str, torch.Tensor]:
        t = load_file(d / "model.safetensors")
        return {k: v for k, v in t.items() if k.endswith(".input_scale")}

    got = input_scales(cli)
    assert len(got) == 14 and {v.dtype for v in got.values()} == {torch.float16}   # the checkpoint's
    for dtype, same in (("float32", True), ("bfloat16", False)):
        src = Source(tiny_llama_dir, ComputeOptions(device="cpu", dtype=dtype), CALIB, progress=False)
        produce(FP8Options(scheme="static"), src, tmp_path / dtype, progress=False)
        other = input_scales(tmp_path / dtype)
        assert all(torch.equal(bits(got[k]), bits(other[k])) for k in got) == same, dtype


# --------------------------------------------------------------------------------------------
# (3) SmolLM2 through transformers + compressed-tensors

TEXT = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers "
        "that changed physics: on the photoelectric effect, Brownian motion, special relativity and "
        "the equivalence of mass and energy. Paris is the capital of France, and Berlin is the capital of")


@pytest.fixture(scope="module")
def smollm2_fp8(smollm2_dir, tmp_path_factory):
    """SmolLM2 as FP8-dynamic, FP8-static (4 × 64 calibration tokens) and FP8-block, made once;
    the source model's float32 logits of TEXT."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("smollm2_fp8")
    src = Source(smollm2_dir, calib=CALIB, progress=False)
    outs = {}
    for scheme in SCHEMES:
        outs[scheme] = root / scheme
        produce(FP8Options(scheme=scheme), src, outs[scheme], progress=False)
    ids = AutoTokenizer.from_pretrained(smollm2_dir)(TEXT, return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(ids).logits
    return outs, ids, logits


def _close(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    p, q = torch.log_softmax(ref.float(), -1), torch.log_softmax(logits.float(), -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    top1 = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
    return kl, top1


@pytest.mark.parametrize("scheme", SCHEMES)
def test_smollm2_transformers_loads_bit_identical(scheme, smollm2_fp8):
    """transformers 5.23 dequantizes the output on load (compressed-tensors' decompress): every
    linear equals the container's reference dequantization bit for bit; the logits are finite
    and close to the source model's."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    outs, ids, ref = smollm2_fp8
    m = AutoModelForCausalLM.from_pretrained(outs[scheme], dtype=torch.float16,
                                             quantization_config=CompressedTensorsConfig(dequantize=True))
    w = fp8_dir.FP8Weights(outs[scheme])
    sd = m.state_dict()
    assert len(w.quantized) == 30 * 7
    for name in w.quantized:
        ours = w.dequantized(name)
        assert ours.dtype == torch.float16 and torch.equal(bits(sd[name + ".weight"]), bits(ours)), name
    with torch.no_grad():
        logits = m(ids).logits
    assert bool(torch.isfinite(logits).all())
    kl, top1 = _close(logits, ref)
    assert kl < 0.1 and top1 >= 0.8, (kl, top1)


def test_smollm2_static_runs_with_fp8_activations(smollm2_fp8):
    """Loaded compressed (compressed-tensors' W8A8 fake quantization, the stored input_scale in
    use), the static output still tracks the source model."""
    from transformers import AutoModelForCausalLM

    outs, ids, ref = smollm2_fp8
    m = AutoModelForCausalLM.from_pretrained(outs["static"], dtype=torch.float16)
    q = m.model.layers[3].mlp.down_proj
    assert torch.equal(q.input_scale.data.reshape(1), _tensor(outs["static"], "model.layers.3.mlp.down_proj.input_scale"))
    with torch.no_grad():
        logits = m(ids).logits
    kl, top1 = _close(logits, ref)
    assert bool(torch.isfinite(logits).all()) and kl < 0.15 and top1 >= 0.8, (kl, top1)


# --------------------------------------------------------------------------------------------
# (4) bad input: InputError naming the option or tensor, nothing left behind

@pytest.mark.parametrize("opts,match", [
    (FP8Options(scheme="fp4"), r"--scheme 'fp4'"),
    (FP8Options(ignore=("re:(",)), r"--ignore 're:\('"),
    (FP8Options(ignore=("model.layers.0.q_proj",)), r"--ignore 'model.layers.0.q_proj' matches no linear"),
    (FP8Options(ignore=("model.layers.0.self_attn.q_proj",)), r"vLLM fuses q_proj/k_proj/v_proj"),
    (FP8Options(max_shard_size="lots"), r"--max-shard-size lots"),
])
def test_bad_options(opts, match, tiny_llama_dir, tmp_path):
    with pytest.raises(InputError, match=match):
        produce(opts, Source(tiny_llama_dir, progress=False), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_nan_weight_names_tensor_and_leaves_nothing(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    f = bad / "model.safetensors"
    t = load_file(f)
    t["model.layers.1.mlp.up_proj.weight"][5, 3] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    out = tmp_path / "out"
    for scheme in ("dynamic", "static"):
        with pytest.raises(InputError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' \(row 5\) holds NaN"):
            produce(FP8Options(scheme=scheme), Source(bad, calib=CALIB, progress=False), out, progress=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]


def test_failed_round_trip_leaves_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    real = fp8.dequantize_fp8

    def off_by_one_ulp(q, scale, scheme):
        d = real(q, scale, scheme).clone()
        d.view(torch.int16)[0, 0] += 1
        return d

    monkeypatch.setattr(fp8, "dequantize_fp8", off_by_one_ulp)
    with pytest.raises(RoundTripError, match=r"'model\.layers\.0\.[a-z_.]+' dequantized from .* differs"):
        produce(FP8Options(scheme="block"), Source(tiny_llama_dir, progress=False), tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []
