"""``quantize gptq``: GPTQ checkpoint directories.

* on synthetic llama / qwen2 (biases) models: the layout gptqmodel writes (qweight / qzeros /
  scales / g_idx dtypes and shapes, float16 rest, config), the round trip, act-order's g_idx,
  the stream: every layer's quantized linears equal GPTQ of that layer run on the hidden
  states of the already-quantized earlier layers;
* on SmolLM2: transformers 5.23 with gptqmodel 7.7 loads the output (desc_act false and true)
  and its logits agree with our dequantized model; GPTQ beats round-to-nearest on held-out
  text;
* bad input: exit 2 with one line naming the option or file, nothing written.
"""
from __future__ import annotations

import json

import make
import pytest
import torch

from quantpress.calibration import engine
from quantpress.calibration.stats import StatsCollector
from quantpress.cli import quantize_main
from quantpress.convert import gptq_dir
from quantpress.quantize.gptq_linear import gptq_quantize_linear
from quantpress.targets import CalibOptions, ComputeOptions, GPTQOptions, Source, produce
from quantpress.targets.eval import EvalOptions, evaluate

CAL = CalibOptions(samples=4, seqlen=64)
CPU = ComputeOptions(device="cpu")


def _src(path, calib=CAL):
    return Source(path, compute=CPU, calib=calib)


@pytest.fixture(scope="module")
def tiny_gptq(tiny_llama_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("gptq")
    return {act: produce(GPTQOptions(group_size=64, act_order=act), _src(tiny_llama_dir),
                         d / f"act{int(act)}", progress=False) for act in (False, True)}


def test_layout_and_config(tiny_gptq, tiny_llama_dir):
    for act, s in tiny_gptq.items():
        assert s.roundtrip.startswith("ok (14 linears")
        w = gptq_dir.GPTQWeights(s.output)
        name = "model.layers.1.mlp.down_proj"
        qw, qz, sc, gi = (w.raw.get(f"{name}.{k}") for k in ("qweight", "qzeros", "scales", "g_idx"))
        # down_proj: in 768, out 256, 4 bits, group 64
        assert qw.dtype == torch.int32 and tuple(qw.shape) == (768 // 8, 256)
        assert qz.dtype == torch.int32 and tuple(qz.shape) == (768 // 64, 256 // 8)
        assert sc.dtype == torch.float16 and tuple(sc.shape) == (768 // 64, 256)
        assert gi.dtype == torch.int32 and tuple(gi.shape) == (768,)
        monotone = bool((gi[1:] >= gi[:-1]).all())
        assert monotone != act  # act-order scatters the groups over the inputs
        assert torch.equal(torch.bincount(gi.long()), torch.full((12,), 64))
        for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                  "model.layers.0.input_layernorm.weight"):
            assert w.raw.get(k).dtype == torch.float16, k
        assert f"{name}.weight" not in w.raw.keys()
        w.close()
        q = json.loads((s.output / "config.json").read_text())["quantization_config"]
        assert (q["quant_method"], q["bits"], q["group_size"], q["desc_act"], q["sym"],
                q["checkpoint_format"]) == ("gptq", 4, 64, act, True, "gptq")
        assert s.details["marlin_eligible"] is (not act)
        assert [m.split(":")[0] for m in q["meta"]["quantizer"]] == ["quantpress"]
        assert (s.output / "tokenizer.json").is_file()


def test_layers_see_the_quantized_stream(tiny_gptq, tiny_llama_dir):
    """Layer 1's q_proj is GPTQ with the Hessian of layer 0's *quantized* outputs: recompute it
    here from the stored layer 0 and compare bytes; the Hessian of the unquantized layer 0's
    outputs gives other codes."""
    s = tiny_gptq[False]
    rows, _ = _src(tiny_llama_dir).calibration_rows()
    ref = engine.StreamingModel(tiny_llama_dir, device="cpu")
    deq = gptq_dir.streaming_model(s.output, device="cpu", dtype=ref.dtype)
    name = "model.layers.1.self_attn.q_proj"

    def hessian_after_layer0(sm):
        col = StatsCollector(kinds={"hessian"}, prefix="model.layers.", offload=False)

        def hooks(i, layer):
            return col(i, layer) if i == 1 else None
        engine.run(sm, rows, hooks_factory=hooks, progress=False)
        return col[name].hessian()

    w = ref.weights.get(name + ".weight", "cpu").to(torch.float16)
    stored = gptq_dir.GPTQWeights(s.output)
    want = stored.raw.get(name + ".qweight")
    stored.close()
    got = {}
    for tag, sm in (("quantized", deq), ("reference", ref)):
        r = gptq_quantize_linear(w, hessian_after_layer0(sm), bits=4, group_size=64)
        got[tag] = gptq_dir.pack_gptq(r.codes, r.zeros, r.scales, r.g_idx, 4)["qweight"]
    assert torch.equal(got["quantized"], want)
    assert not torch.equal(got["reference"], want)


def test_biases_and_tied_embeddings(synth_qwen2_dir, tmp_path):
    s = produce(GPTQOptions(group_size=128, sym=False), _src(synth_qwen2_dir), tmp_path / "q2",
                progress=False)
    assert s.roundtrip.startswith("ok")
    w = gptq_dir.GPTQWeights(s.output)
    assert w.raw.get("model.layers.0.self_attn.q_proj.bias").dtype == torch.float16
    assert "lm_head.weight" not in w.raw.keys()  # tied: the embedding is the head
    z = w.raw.get("model.layers.0.self_attn.q_proj.qzeros")
    w.close()
    assert json.loads((s.output / "config.json").read_text())["quantization_config"]["sym"] is False
    assert int(z.view(torch.uint8).unique().numel()) > 2  # asymmetric zero points vary


def test_linears_that_do_not_fit_stay_fp16_and_load(smollm2_dir, tmp_path):
    """A llama with intermediate size 576: group size 128 does not divide down_proj's 576
    inputs, so it stays float16, is listed in the summary and the config, and transformers
    with gptqmodel loads the mix (logits equal ours in float32)."""
    import synth
    from transformers import AutoModelForCausalLM

    src = synth.make_model(tmp_path / "src", "llama", smollm2_dir, num_hidden_layers=1,
                           intermediate_size=576)
    s = produce(GPTQOptions(group_size=128), _src(src), tmp_path / "mix", progress=False)
    assert s.details["not_quantized"] == ["model.layers.0.mlp.down_proj"]
    assert s.details["linears_quantized"] == 6
    w = gptq_dir.GPTQWeights(s.output)
    assert w.raw.get("model.layers.0.mlp.down_proj.weight").dtype == torch.float16
    assert "model.layers.0.mlp.up_proj.qweight" in w.raw.keys()
    w.close()
    q = json.loads((s.output / "config.json").read_text())["quantization_config"]
    assert list(q["dynamic"]) == [r"-:^model\.layers\.0\.mlp\.down_proj$"]
    model = AutoModelForCausalLM.from_pretrained(s.output, dtype=torch.float32, device_map="cpu")
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(1))
    theirs, ours = make.logits_both(model, gptq_dir.streaming_model(s.output, dtype=torch.float32), ids)
    assert float((theirs - ours).abs().max()) < 1e-3


def test_bad_input_exit_2(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "o"
    for args, needle in ((["--group-size", "20"], "--group-size 20"),
                         (["--group-size", "48"], "the sizes gptqmodel's kernels load"),
                         (["--bits", "3"], "--bits 3"),
                         (["--damp", "0"], "--damp 0"),
                         (["--group-size", "512"], "divides no linear")):
        rc = quantize_main.main(["gptq", str(tiny_llama_dir), "-o", str(out), "--device", "cpu",
                                 "--samples", "2", "--seqlen", "32", "--quiet", *args])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and needle in err[0], (args, err)
        assert not out.exists() and not list(tmp_path.iterdir())
    rc = quantize_main.main(["gptq", str(tmp_path / "missing"), "-o", str(out), "--quiet"])
    assert rc == 2 and "missing" in capsys.readouterr().err


def test_nan_weight_names_the_tensor(tiny_llama_dir, tmp_path, capsys):
    import shutil
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    f = next(bad.glob("*.safetensors"))
    t = load_file(f)
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, f, metadata={"format": "pt"})
    rc = quantize_main.main(["gptq", str(bad), "-o", str(tmp_path / "o"), "--device", "cpu",
                             "--samples", "2", "--seqlen", "32", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.layers.1.mlp.up_proj" in err, err
    assert not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad"]


# ---------------------------------------------------------------------------------------------
# SmolLM2: a real consumer

#: GPTQ's Hessians need tokens: with 4 x 128 (the other SmolLM2 tests' calibration) the
#: 1536 x 1536 Hessians of down_proj have rank <= 512 and GPTQ lost to round-to-nearest (KLD
#: 0.465 against 0.451 on 6 chunks); with 8 x 256 it wins clearly (0.345 against 0.451)
GPTQ_CAL = CalibOptions(samples=8, seqlen=256)


@pytest.fixture(scope="module")
def smollm2_gptq(smollm2_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("smollm2_gptq")
    cal = GPTQ_CAL
    out = {}
    for tag, o in (("gptq", GPTQOptions(group_size=64)), ("act", GPTQOptions(group_size=64, act_order=True)),
                   ("rtn", GPTQOptions(group_size=64, rtn=True))):
        out[tag] = produce(o, _src(smollm2_dir, cal), d / tag, progress=False)
    return out


@pytest.mark.parametrize("tag", ["gptq", "act"])
def test_transformers_gptqmodel_loads_and_agrees(smollm2_gptq, tag):
    """transformers 5.23 with gptqmodel 7.7 (its CPU torch kernel) reads our directory, with
    desc_act false and true; in float32 its logits equal our dequantized model's within 1e-3
    (the kernel dequantizes the same integers and scales; the rest is summation order)."""
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from transformers import AutoModelForCausalLM

    s = smollm2_gptq[tag]
    assert s.details["linears_quantized"] == s.details["linears"] == 30 * 7
    model = AutoModelForCausalLM.from_pretrained(s.output, dtype=torch.float32, device_map="cpu")
    qlin = model.model.layers[0].self_attn.q_proj
    assert isinstance(qlin, BaseQuantLinear), type(qlin)
    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    theirs, ours = make.logits_both(model, gptq_dir.streaming_model(s.output, dtype=torch.float32), ids)
    diff = float((theirs - ours).abs().max())
    assert diff < 1e-3, diff
    assert float(ours.abs().max()) > 1.0


def test_gptq_beats_round_to_nearest(smollm2_gptq, smollm2_dir):
    res = evaluate(smollm2_dir, [smollm2_gptq[k].output for k in ("gptq", "act", "rtn")],
                   EvalOptions(ctx=512, chunks=6), CPU, progress=False)
    base, g, a, r = res.models
    # measured: GPTQ 0.345, round-to-nearest 0.451 (0.76x)
    assert g.kl["kld_mean"] < 0.85 * r.kl["kld_mean"], (g.kl, r.kl)
    assert a.kl["kld_mean"] < 0.85 * r.kl["kld_mean"], (a.kl, r.kl)
    assert base.ppl["ppl"] < g.ppl["ppl"] < r.ppl["ppl"]
