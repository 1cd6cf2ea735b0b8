"""`quantize awq` end to end: the per-layer algorithm on tiny llama / qwen2 / qwen3 models
(scale folding keeps the FP16 function, the v→o group only under multi-head attention, layers
that cannot be quantized stay FP16), the GEMM directory layout and config, sharding, the round
trip that is part of the command, and bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import make
import synth
from quantpress.calibration import awq as cawq
from quantpress.calibration import engine
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.convert import awq_dir
from quantpress.quantize import awq as qawq



@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir):
    """2-layer random models: llama (GQA), llama with MHA (v→o group), qwen2 (q/k/v biases,
    tied embeddings), qwen3 (q/k norms); hidden 256, intermediate 576 (not a multiple of 128)."""
    root = tmp_path_factory.mktemp("awq_models")
    kw = dict(num_hidden_layers=2, intermediate_size=576)
    return {"llama": synth.make_model(root / "llama", "llama", smollm2_dir, **kw),
            "llama_mha": synth.make_model(root / "llama_mha", "llama", smollm2_dir, seed=1,
                                          num_key_value_heads=4, **kw),
            "qwen2": synth.make_model(root / "qwen2", "qwen2", smollm2_dir, seed=2, **kw),
            "qwen3": synth.make_model(root / "qwen3", "qwen3", smollm2_dir, seed=3, **kw)}


def _all_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_directory_layout_and_roundtrip(models, tmp_path, name):
    src = models[name]
    out = tmp_path / "out"
    s = make.awq(src, out, group_size=64)
    d = s.details
    assert s.roundtrip.startswith("ok") and d["linears_quantized"] == d["linears"] == 14
    assert not d["modules_to_not_convert"] and s.kind == "awq" and s.target == "w4g64"
    assert s.files == {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 64,
                                          "zero_point": True, "version": "gemm",
                                          "modules_to_not_convert": None}
    assert cfg["torch_dtype"] == "float16"
    src_cfg = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k not in ("quantization_config", "torch_dtype", "dtype")} == \
        {k: v for k, v in src_cfg.items() if k not in ("torch_dtype", "dtype")}
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes()
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not list(out.glob(".*")) and not list(tmp_path.glob(".out*"))

    t = _all_tensors(out)
    src_t = _all_tensors(src)
    tied = bool(src_cfg.get("tie_word_embeddings"))
    assert ("lm_head.weight" in t) == (not tied)
    for k, v in src_t.items():
        mod = k.rsplit(".", 1)[0]
        if k.endswith(".weight") and v.ndim == 2 and "layers." in k:
            o, i = v.shape
            assert k not in t
            assert t[mod + ".qweight"].dtype == torch.int32 and t[mod + ".qweight"].shape == (i, o // 8)
            assert t[mod + ".qzeros"].dtype == torch.int32 and t[mod + ".qzeros"].shape == (i // 64, o // 8)
            assert t[mod + ".scales"].dtype == torch.float16 and t[mod + ".scales"].shape == (i // 64, o)
        else:
            assert t[k].dtype == torch.float16 and t[k].shape == v.shape, k
    # embeddings and the final norm are copied unchanged; biases too (no v→o group under GQA)
    assert torch.equal(t["model.embed_tokens.weight"], src_t["model.embed_tokens.weight"])
    assert torch.equal(t["model.norm.weight"], src_t["model.norm.weight"])
    for k in src_t:
        if k.endswith(".bias"):
            assert torch.equal(t[k], src_t[k]), k
    # the folded norms changed (AWQ scaled them) and are written
    assert not torch.equal(t["model.layers.0.input_layernorm.weight"], src_t["model.layers.0.input_layernorm.weight"])


def test_folding_keeps_the_fp16_function(models):
    """Dividing the norm (or v_proj's rows) by s and multiplying the next layers' columns by s
    leaves the decoder layer's output unchanged up to float16 rounding: checked for all four
    groups of a multi-head llama with random scales (no quantization involved)."""
    sm = engine.StreamingModel(models["llama_mha"], dtype=torch.float32)
    layer = sm.load_layer(0)
    spec = cawq.arch_spec("llama")
    kw = sm.layer_kwargs(0, 2, 16)
    x = torch.randn(2, 16, sm.hidden_size)
    ref = layer(x, **kw)
    ref = ref[0] if isinstance(ref, tuple) else ref
    lq = cawq.LayerQuantizer(spec, cawq.AWQSettings(group_size=64), sm.layer_prefix, lambda *a: None)
    t16 = lq.float16_tensors(0, layer)
    shapes = {n: tuple(t16[n + ".weight"].shape) for n in spec.linears}
    g = torch.Generator().manual_seed(0)
    applied = 0
    for grp in spec.groups:
        assert lq.group_applies(grp, shapes)  # MHA: v→o included
        k = t16[grp.layers[0] + ".weight"].shape[1]
        s = (torch.rand(k, generator=g) * 1.5 + 0.5).half()
        caches = {spec.input_of(grp.layers[0]): torch.ones(1, 1, k)}
        lq.fold(grp, s, t16, caches)
        assert torch.allclose(caches[spec.input_of(grp.layers[0])][0, 0], 1 / s.float(), rtol=1e-3)
        applied += 1
    assert applied == 4
    layer.load_state_dict({k: v.float() for k, v in t16.items()}, strict=False)
    got = layer(x, **kw)
    got = got[0] if isinstance(got, tuple) else got
    assert torch.allclose(got, ref, atol=2e-2, rtol=1e-2)
    assert float((got - ref).abs().max()) > 0  # the weights did change
    gqa = cawq.arch_spec("qwen2")
    shapes_gqa = {"self_attn.v_proj": (128, 256), "self_attn.o_proj": (256, 256)}
    assert not lq.group_applies(gqa.groups[1], shapes_gqa)


def test_search_groups_and_clip_skips(models, monkeypatch):
    """Which groups are searched and which linears are clipped: MHA has 4 groups, GQA 3;
    q/k are never clipped; a group whose layers cannot be quantized is skipped."""
    seen = []
    orig = cawq.LayerQuantizer.search_scale

    def spy(self, g, *a):
        seen.append(g.inspect)
        return orig(self, g, *a)

    clipped = []
    orig_clip = qawq.best_clip

    def spy_clip(w, x, *a, **k):
        clipped.append(tuple(w.shape))
        return orig_clip(w, x, *a, **k)

    monkeypatch.setattr(cawq.LayerQuantizer, "search_scale", spy)
    monkeypatch.setattr(qawq, "best_clip", spy_clip)
    make.awq(models["llama_mha"], Path(models["llama_mha"]).parent / "o_mha", group_size=64, force=True)
    assert seen == ["self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj"] * 2
    # v, o, gate, up, down clipped per layer (q, k skipped): shapes [out, in]
    assert clipped == [(256, 256), (256, 256), (576, 256), (576, 256), (256, 576)] * 2
    seen.clear()
    # g128: in 576 is not a multiple, so down_proj stays FP16 and its group is not searched
    s = make.awq(models["llama"], Path(models["llama"]).parent / "o_g128", group_size=128, force=True)
    assert seen == ["self_attn", "mlp"] * 2
    not_converted = s.details["modules_to_not_convert"]
    assert not_converted == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    cfg = json.loads((Path(models["llama"]).parent / "o_g128" / "config.json").read_text())
    assert cfg["quantization_config"]["modules_to_not_convert"] == not_converted
    t = _all_tensors(Path(models["llama"]).parent / "o_g128")
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == torch.float16
    assert "model.layers.0.mlp.down_proj.qweight" not in t


@pytest.mark.parametrize("name,clamp", [("llama_mha", None), ("qwen3", None), ("llama_mha", 0.01)])
def test_pruned_and_gram_search_picks_the_plain_searchs_scale(models, tmp_path, monkeypatch, name,
                                                              clamp):
    """The search's shortcuts change no winner: on every group of a multi-head llama (q/k/v
    and gate/up by pruned slice-by-slice forwards, v→o and down by the Gram matrix) and of a
    qwen3 (grouped-query attention with q/k norms: no v→o group), the scale
    equals the one of the plain search (all 20 grid points in order, each over all rows at
    once, the lowest ``output_loss`` wins), while pruning skipped slices and the Gram form
    scored the linear-only groups. With the outputs' clamp lowered to 0.01 (standing in for
    float16's limit, which the Gram form cannot clamp at) the linear-only groups' outputs may
    reach it, so they run forwards, clamped like the plain search's, with the same winners."""
    monkeypatch.setattr(cawq, "SEARCH_SLICE_TOKENS", 64)  # one row per slice
    if clamp is not None:
        monkeypatch.setattr(cawq, "FP16_MAX", clamp)
    orig = cawq.LayerQuantizer.search_scale
    picked, slices, gram_groups = [], [0], []

    def plain(self, g, layer, t16, caches, ctx):
        o = self.opts
        x = caches[self.spec.input_of(g.layers[0])]
        n = x.shape[0] * x.shape[1]
        x_mean = qawq.input_mean(x.reshape(n, -1).abs().sum(0, dtype=torch.float32), n)
        w16 = [t16[m + ".weight"] for m in g.layers]
        w_mean = qawq.weight_mean(w16, o.group_size)
        inspect = layer.get_submodule(g.inspect)
        mods = [layer.get_submodule(m) for m in g.layers]
        keep = [m.weight.data for m in mods]
        y0 = ctx.forward(inspect, x, with_kwargs=g.kwargs).clamp(-cawq.FP16_MAX, cawq.FP16_MAX)
        best, best_loss, losses = None, float("inf"), []
        for k in range(qawq.N_GRID):
            s = qawq.grid_scales(x_mean, w_mean, k / qawq.N_GRID, o.duo_scaling)
            for m, w in zip(mods, w16):
                m.weight.data = qawq.scaled_fake_quant(w, s, o.bits, o.group_size).float()
            losses.append(qawq.output_loss(y0, ctx.forward(inspect, x, with_kwargs=g.kwargs)
                                           .clamp(-cawq.FP16_MAX, cawq.FP16_MAX)))
            if losses[-1] < best_loss:
                best, best_loss = s, losses[-1]
        for m, w in zip(mods, keep):
            m.weight.data = w
        return best, sorted(losses)

    def spy(self, g, layer, t16, caches, ctx):
        ref, losses = plain(self, g, layer, t16, caches, ctx)
        got = orig(self, g, layer, t16, caches, ctx)
        picked.append((g.inspect, torch.equal(got, ref), losses[1] / losses[0] - 1))
        return got

    count_slices = qawq.squared_errors

    def counting(*a):
        slices[0] += 1
        return count_slices(*a)

    gram_loss = qawq.linear_output_loss

    def gram_spy(d, gram, tokens):
        gram_groups.append(tuple(d.shape))
        return gram_loss(d, gram, tokens)

    monkeypatch.setattr(cawq.LayerQuantizer, "search_scale", spy)
    monkeypatch.setattr(qawq, "squared_errors", counting)
    monkeypatch.setattr(qawq, "linear_output_loss", gram_spy)
    summary = make.awq(models[name], tmp_path / "o", samples=12, seqlen=64, group_size=64,
                       clip=False)
    linear_only = {"llama_mha": [(256, 256), (256, 576)], "qwen3": [(256, 576)]}[name]
    groups = ["self_attn", "self_attn.o_proj", "mlp", "mlp.down_proj"] if name == "llama_mha" else \
        ["self_attn", "mlp", "mlp.down_proj"]
    assert [p[0] for p in picked] == groups * 2
    assert all(p[1] for p in picked), picked
    if clamp is not None:  # every group by forwards: 2 layers x 4 groups x 20 x 12 slices
        assert not gram_groups and summary.details["search"]["gram"] == 0
        assert summary.details["search"]["slices"] == 2 * 4 * 20 * 12
        assert 0 < slices[0] < 2 * 4 * 20 * 12
        return
    # pruned: q/k/v and gate/up of two layers, 20 candidates x 12 one-row slices unpruned
    assert 0 < slices[0] < 4 * 20 * 12
    assert summary.details["search"] == {"slices": 4 * 20 * 12, "slices_run": slices[0],
                                         "gram": 2 * 20 * len(linear_only)}
    assert any(line.startswith("search     ") and "pruned" in line for line in summary.lines)
    # v→o [256, 256] and down [256, 576] of both layers by the Gram form (768 tokens > in)
    assert gram_groups == [shape for shape in linear_only for _ in range(20)] * 2


def test_awq_beats_rtn_on_the_calibrated_outputs(models, tmp_path):
    """On the model's own activations, AWQ's layers reproduce the FP16 outputs better than
    round-to-nearest (the objective the search minimizes)."""
    from quantpress.targets import CalibOptions, calibration_rows

    src = models["llama"]
    a = make.awq(src, tmp_path / "awq", group_size=64)
    r = make.awq(src, tmp_path / "rtn", group_size=64, rtn=True)
    assert a.details["method"] == "awq" and r.details["method"] == "rtn"
    assert r.details["calibration"]["rows"] == 0 and "tokenize" not in r.stages
    rows, _ = calibration_rows(src, CalibOptions(samples=8, seqlen=64, seed=1), progress=False)
    base = engine.StreamingModel(src, dtype=torch.float32)
    ref = base.final_logits(engine.run(base, rows, progress=False))
    errs = {}
    for name in ("awq", "rtn"):
        sm = awq_dir.streaming_model(tmp_path / name, dtype=torch.float32)
        errs[name] = float((sm.final_logits(engine.run(sm, rows, progress=False)) - ref).pow(2).mean())
    assert errs["awq"] < errs["rtn"], errs


def test_sharded_output_and_cli(models, tmp_path, capsys):
    src = models["qwen3"]
    out = tmp_path / "sharded"
    code = quantize_main(["awq", str(src), "-o", str(out), "--group-size", "64", "--samples", "4",
                          "--seqlen", "64", "--max-shard-size", "8MB", "--quiet", "--device", "cpu",
                          "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["roundtrip"].startswith("ok") and summary["details"]["linears_quantized"] == 14
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    t = {}
    from safetensors import safe_open

    for name in shards:
        with safe_open(str(out / name), framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == name
                t[k] = f.get_tensor(k)
    assert set(index["weight_map"]) == set(t)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t.values())
    assert summary["bpw"] == pytest.approx(8 * index["metadata"]["total_size"] / summary["parameters"], rel=1e-3)
    assert summary["files"] == {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    # an existing output needs --force
    assert quantize_main(["awq", str(src), "-o", str(out), "--rtn", "--quiet"]) == 2
    assert "already exists (use --force" in capsys.readouterr().err
    assert quantize_main(["awq", str(src), "-o", str(out), "--rtn", "--group-size", "64", "--quiet",
                          "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 64
    assert not (out / "model.safetensors.index.json").exists()  # the old directory was replaced


def _fails(args, capsys, match: str) -> None:
    assert quantize_main(args + ["--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err


def test_bad_input(models, tmp_path, capsys, smollm2_dir):
    src = str(models["llama"])
    out = tmp_path / "o"
    base = ["awq", src, "-o", str(out)]
    _fails(base + ["--bits", "3"], capsys, "--bits 3: only 4-bit AWQ is supported")
    _fails(base + ["--group-size", "100"], capsys,
           "--group-size 100 divides no linear layer's in_features (256, 576)")
    _fails(base + ["--group-size", "0"], capsys, "--group-size 0: must be a positive")
    short = tmp_path / "short.txt"
    short.write_text("Just a few words of text.")
    _fails(base + ["--group-size", "64", "--calib", str(short)], capsys, "calibration text too short")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    _fails(["awq", str(gpt2), "-o", str(out)], capsys,
           "architecture GPT2LMHeadModel (model_type 'gpt2'): no AWQ scale groups known")
    _fails(["awq", str(tmp_path / "missing"), "-o", str(out)], capsys, "missing: no such file or directory")
    _fails(["awq", src, "-o", str(tmp_path / "nodir" / "o")], capsys, "output directory does not exist")
    bad = tmp_path / "inf"
    shutil.copytree(src, bad)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][3, 3] = float("inf")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _fails(["awq", str(bad), "-o", str(out), "--group-size", "64", "--samples", "4", "--seqlen", "64"],
           capsys, "non-finite")
    assert not out.exists() and not list(tmp_path.glob(".o.*"))


def test_failed_roundtrip_leaves_nothing(models, tmp_path, monkeypatch, capsys):
    """A dequantizer that disagrees with the quantizer fails the command (exit 3) and leaves
    no directory."""
    real = awq_dir.dequantize_gemm

    def broken(*a, **k):
        w = real(*a, **k)
        w[0, 0] = w[0, 0] + 1
        return w

    monkeypatch.setattr(awq_dir, "dequantize_gemm", broken)
    out = tmp_path / "o"
    code = quantize_main(["awq", str(models["llama"]), "-o", str(out), "--rtn", "--group-size", "64",
                          "--quiet"])
    assert code == 3
    assert "round trip failed" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_a_zero_scale_fails_the_round_trip():
    """The AWQ / GPTQ round trip's scale check (``hfdir.nonzero_scales``) names the linear whose
    stored scales hold a zero, and passes scales without one."""
    from types import SimpleNamespace

    from quantpress.errors import RoundTripError
    from quantpress.targets import hfdir

    stored = {"a.scales": torch.ones(2, 4, dtype=torch.float16),
              "b.scales": torch.tensor([[1.0, 0.0]], dtype=torch.float16)}
    check = hfdir.nonzero_scales(SimpleNamespace(raw=stored))
    check(SimpleNamespace(name="a"))
    with pytest.raises(RoundTripError, match=r"^round trip: 'b.scales' holds a zero scale$"):
        check(SimpleNamespace(name="b"))

