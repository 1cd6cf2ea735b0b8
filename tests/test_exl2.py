"""`quantize exl2` end to end on tiny random models (hidden 256, ffn 576, a 512-token BPE
vocabulary so that the head is small): measurement.json from --measure-only and its reuse,
allocation to several targets, the directory layout and config, kernel constraints of every
stored tensor, sharding, tied embeddings, the bitwise round trip that is part of the command,
`quantize eval` on the output, and bad input."""
from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import make
import synth
from quantpress.calibration import exl2_alloc, exl2_measure
from quantpress.calibration.exl2_measurement import read_measurement, slot_keys
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.errors import InputError
from quantpress.quantize import exl2 as qexl2

CAL = ["--samples", "4", "--seqlen", "64", "--device", "cpu", "--quiet"]
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the many small ops of GPTQ and of tiny forwards run several times
    faster than with OpenMP spin-waits on 2 busy cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer of 512 tokens trained on calibration articles (the head and
    the embedding stay small: 512 x 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from quantpress.calibration import data as cdata
    from quantpress.targets.base import default_cal_dir

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(cdata.calibration_articles(default_cal_dir())[:200], trainer)
    d = tmp_path_factory.mktemp("exl2_tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def models(tmp_path_factory, tok_dir):
    """llama (2 layers, GQA, untied), the same shapes with tied embeddings, qwen2 (1 layer,
    q/k/v biases, tied embeddings)."""
    root = tmp_path_factory.mktemp("exl2_models")
    kw = dict(intermediate_size=576, vocab_size=512)
    return {"llama": synth.make_model(root / "llama", "llama", tok_dir, num_hidden_layers=2, **kw),
            "tied": synth.make_model(root / "tied", "llama", tok_dir, seed=1, num_hidden_layers=2,
                                     tie_word_embeddings=True, **kw),
            "qwen2": synth.make_model(root / "qwen2", "qwen2", tok_dir, seed=2, num_hidden_layers=1, **kw)}


def _shapes(model_dir: Path) -> dict:
    """(in, out, bias) of each decoder linear, from the checkpoint itself."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for n in ATTN + MLP:
            mode = "self_attn" if n in ATTN else "mlp"
            o, i = f.get_slice(f"model.layers.0.{mode}.{n}.weight").get_shape()
            out[n] = (i, o, f"model.layers.0.{mode}.{n}.bias" in keys)
    return out


GPTQ_RUNS = {}


@pytest.fixture(scope="module")
def measured(models, tmp_path_factory) -> Path:
    """measurement.json of the llama by ``--measure-only``; GPTQ runs counted by weight shape
    and setting."""
    path = tmp_path_factory.mktemp("exl2_meas") / "measurement.json"
    real = exl2_measure.gptq_quantize_many

    def counting(w, h, qps, **k):
        for qp in qps:
            GPTQ_RUNS[(tuple(w.shape), qp)] = GPTQ_RUNS.get((tuple(w.shape), qp), 0) + 1
        return real(w, h, qps, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exl2_measure, "gptq_quantize_many", counting)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert quantize_main(["exl2", str(models["llama"]), "--measure-only", str(path), "--json"]
                                 + CAL) == 0
    MEASURE_SUMMARY.update(json.loads(buf.getvalue()))
    return path


MEASURE_SUMMARY: dict = {}


def test_measurement_reports_seconds_per_layer(measured, models):
    """The summary splits the measurement's time per decoder layer into GPTQ (and the scale
    searches inside it), forwards and Hessian accumulation; the layers add up to the totals."""
    d = MEASURE_SUMMARY["details"]
    layers = d["measurement_layers"]
    n = json.loads((models["llama"] / "config.json").read_text())["num_hidden_layers"]
    parts = ("gptq", "forward", "hessian", "search")
    assert len(layers) == n and all(v[k] > 0 for v in layers for k in parts)
    assert all(v["search"] < v["gptq"] for v in layers)
    for k in parts:
        assert abs(sum(v[k] for v in layers) - d["detail"][f"measurement_{k}"]) < 0.001 * n + 1e-6


@pytest.mark.parametrize("threads", (1, 2))
def test_modules_measured_side_by_side_or_in_order_agree(models, measured, tmp_path, monkeypatch, threads):
    """A layer's attention and MLP options measured side by side (two threads, each on its own
    copy of the layer's parameters) or one after the other give the same measurement.json,
    byte for byte (``measured`` ran with what the machine allows), and the same GPTQ count."""
    import threading

    from quantpress.calibration import engine

    monkeypatch.setattr(engine, "side_by_side_threads", lambda device, n: min(n, threads))
    where = {}
    real = exl2_measure.Measurer.measure_module

    def spy(self, index, layer, mode, *a, **k):
        where[(index, mode)] = threading.current_thread().name
        return real(self, index, layer, mode, *a, **k)

    monkeypatch.setattr(exl2_measure.Measurer, "measure_module", spy)
    path = tmp_path / "measurement.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert quantize_main(["exl2", str(models["llama"]), "--measure-only", str(path), "--json"] + CAL) == 0
    assert path.read_bytes() == measured.read_bytes()
    summary = json.loads(buf.getvalue())["details"]
    assert len(summary["measurement_layers"]) == 2
    main = [k for k, v in where.items() if v == "MainThread"]
    assert sorted(where) == [(i, m) for i in range(2) for m in ("mlp", "self_attn")]
    assert main == ([] if threads == 2 else list(where))


@pytest.fixture(scope="module")
def outs(models, measured, tmp_path_factory):
    """The llama quantized at 3.0 and 6.0 bpw from the measurement (6.0 in 0.25 MB shards),
    with the measurement pass replaced by a failure: reuse must not run it."""
    root = tmp_path_factory.mktemp("exl2_outs")
    res = {}

    def boom(*a, **k):
        raise AssertionError("the measurement pass ran although --measurement was given")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exl2_measure.Measurer, "on_layer", boom)
        for bpw, extra in ((3.0, []), (6.0, ["--max-shard-size", "0.25"])):
            out = root / f"q{bpw}"
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                code = quantize_main(["exl2", str(models["llama"]), "--bpw", str(bpw), "-o", str(out),
                                      "--measurement", str(measured), "--json"] + CAL + extra)
            assert code == 0
            res[bpw] = (out, json.loads(buf.getvalue()))
    return res


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    t = {}
    for f in sorted(d.glob("*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(t)
        t.update(part)
    return t


def _q_modules(t: dict) -> list[str]:
    return sorted(k[: -len(".q_weight")] for k in t if k.endswith(".q_weight"))


def _file_bits(t: dict, module: str) -> tuple[int, int]:
    """(cost in bits, as exllamav2 0.3.2 ``QParams.total_bits`` counts it; K·N_pad) of one
    stored linear, from its tensors alone: group bit widths and rows from q_groups and the
    packed-row offsets."""
    qg = t[module + ".q_groups"].to(torch.int64).view(-1, 2)
    n_words, n_pad = t[module + ".q_weight"].shape
    k = t[module + ".q_invperm"].numel()
    bits, off = qg[:, 0].tolist(), qg[:, 1].tolist() + [n_words]
    rows = [(off[g + 1] - off[g]) * 32 // bits[g] for g in range(len(bits))]
    rows[-1] = k - sum(rows[:-1])
    G = len(bits)
    total = sum(r * n_pad * b for r, b in zip(rows, bits)) + 16 * G + 32 * G + 4 * G * n_pad + 32 * k
    if module + ".bias" in t:
        total += 16 * n_pad
    return total, k * n_pad


# --------------------------------------------------------------------------------------------


def test_measurement_file(measured, models):
    """--measure-only writes a measurement.json that validates against the model: 19 / 17
    options per layer with the costs exllamav2 0.3.2's ``QParams.total_bits`` gives for the
    model's shapes; more bits measure better."""
    shapes = _shapes(models["llama"])
    m = read_measurement(measured, expect_layers=2, expect_shapes=shapes)
    raw = json.loads(measured.read_text())
    assert raw["last_module_idx"] == 6
    assert raw["measurement"]["model.norm.norm"] is None and raw["measurement"]["lm_head.linear"] is None
    assert list(raw["measurement"])[:4] == slot_keys(2)
    for key in slot_keys(2):
        opts = m.modules[key]
        names = ATTN if key.endswith("self_attn") else MLP
        assert len(opts) == (19 if names == ATTN else 17)
        for o in opts:
            assert 0.0 < o["accuracy"] <= 1.0 and set(o) == {"accuracy", "total_bits", *names}
        # the 8-bit option beats the cheapest one, and accuracy grows overall with cost
        acc = [o["accuracy"] for o in opts]
        assert acc[-1] > 0.99 and acc[-1] > acc[0] + 0.05
        cost = [o["total_bits"] for o in opts]
        order = sorted(range(len(opts)), key=cost.__getitem__)
        assert acc[order[-1]] > acc[order[len(order) // 2]] > acc[order[0]]
    # each linear quantized once per unique setting in each layer: q/k/o 14, v 15, gate/up 13,
    # down 14 (q and o share a shape, so do gate and up)
    per_layer = {(256, 256): 14 + 14, (128, 256): 14 + 15, (576, 256): 13 + 13, (256, 576): 14}
    counts = {}
    for (shape, _qp), n in GPTQ_RUNS.items():
        assert n in (2, 4)  # 2 layers (x 2 linears of that shape using the same setting)
        counts[shape] = counts.get(shape, 0) + n
    assert counts == {k: 2 * v for k, v in per_layer.items()}
    # a total_bits that disagrees with the shapes is refused by the reader
    raw["measurement"]["model.layers.1.mlp"][3]["total_bits"] += 1
    bad = measured.with_name("bad.json")
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="another model"):
        read_measurement(bad, expect_layers=2, expect_shapes=shapes)


def test_mlp_accuracy_matches_an_independent_forward(measured, models):
    """The MLP options of layer 0, recomputed with plain transformers: input = the residual
    stream after the attention (hooked at post_attention_layernorm), H = Σ_rows XᵀX / rows of
    up_proj's and down_proj's inputs, y = the layer's output; accuracy = 1 − mean over rows of
    ‖y_q − y‖_F / ‖y‖_F."""
    from transformers import AutoModelForCausalLM

    from quantpress.quantize.gptq import gptq_quantize
    from quantpress.targets import CalibOptions, calibration_rows

    src = models["llama"]
    rows, _ = calibration_rows(src, CalibOptions(samples=4, seqlen=64), progress=False)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layer = model.model.layers[0]
    got = {}
    hooks = [layer.post_attention_layernorm.register_forward_pre_hook(lambda m, a: got.__setitem__("h", a[0])),
             layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: got.__setitem__("d", a[0]))]
    with torch.no_grad():
        y = model(rows, output_hidden_states=True).hidden_states[1]
    for h in hooks:
        h.remove()
    h = got["h"]
    x = layer.post_attention_layernorm(h).detach()
    H = {"up": torch.einsum("rtk,rtl->kl", x, x) / 4, "down": torch.einsum("rtk,rtl->kl", got["d"], got["d"]) / 4}
    meas = json.loads(measured.read_text())["measurement"]["model.layers.0.mlp"]
    for j in (0, 8, 16):
        opt = meas[j]
        mlp = layer.mlp
        saved = {n: getattr(mlp, n).weight.data.clone() for n in MLP}
        for n in MLP:
            qp = qexl2.QParams.from_dict(opt[n])
            w = saved[n].half()
            getattr(mlp, n).weight.data = gptq_quantize(w, H["down" if n == "down_proj" else "up"], qp).weight.float()
        with torch.no_grad():
            yq = h + mlp(layer.post_attention_layernorm(h))
        for n in MLP:
            getattr(mlp, n).weight.data = saved[n]
        rel = ((yq - y).flatten(1).norm(dim=1) / y.flatten(1).norm(dim=1)).mean()
        assert opt["accuracy"] == pytest.approx(1 - float(rel), abs=2e-4), j


def test_measurement_drives_several_targets(measured, models):
    """One measurement, many targets: the allocation lands in [target − 0.05, target]."""
    shapes = _shapes(models["llama"])
    m = read_measurement(measured, expect_layers=2, expect_shapes=shapes)
    numel = 2 * sum(k * (n + (-n % 32)) for k, n, _ in shapes.values())
    for target in (2.6, 3.0, 3.5, 4.0, 4.25, 5.0, 6.0, 7.0):
        a = exl2_alloc.allocate(m.slots(), int(numel * target))
        assert target - 0.05 <= a.total_bits / numel <= target, target


@pytest.mark.parametrize("threads", (1, 2))
def test_targets_of_one_source_fail_alone(models, measured, tmp_path, monkeypatch, threads):
    """EXL2 targets written together (side by side with two threads, in order with one): one
    that fails leaves the other made, byte-identical to a target written alone and timed in
    the same stages."""
    from quantpress.calibration import engine
    from quantpress.targets import EXL2Options
    from quantpress.targets.base import produce_many
    from quantpress.targets.exl2 import EXL2Target

    monkeypatch.setattr(engine, "side_by_side_threads", lambda device, n: min(n, threads))
    real = EXL2Target.write

    def write(self, tmp, run):
        if self.options.bpw == 3.0:
            raise InputError("refused on purpose")
        return real(self, tmp, run)

    monkeypatch.setattr(EXL2Target, "write", write)
    src = make.source(models["llama"])
    got = produce_many([(EXL2Options(bpw=b, measurement=str(measured)), tmp_path / f"x{b}")
                        for b in (3.0, 6.0)], src, progress=False)
    assert isinstance(got[0].error, InputError) and not (tmp_path / "x3.0").exists()
    assert got[1].ok and list(got[1].summary.stages)[-3:] == ["head", "write", "verify"]
    monkeypatch.setattr(EXL2Target, "write", real)
    alone = make.exl2(src, tmp_path / "alone", bpw=6.0, measurement=str(measured))
    assert make.digests(tmp_path / "x6.0") == make.digests(tmp_path / "alone")
    assert list(got[1].summary.stages) == list(alone.stages)


def test_passes_side_by_side_only_as_memory_allows(models, measured, tmp_path, monkeypatch):
    """EXL2 passes run side by side only as far as half the available memory holds their
    working sets: pass_bytes counts the larger of a layer's and the head's (its float32
    weight and GPTQ's work, 15 bytes per weight)."""
    from quantpress.calibration import engine
    from quantpress.targets import EXL2Options
    from quantpress.targets import exl2 as xp
    from quantpress.targets.base import produce_many

    monkeypatch.setattr(engine, "side_by_side_threads", lambda device, n: n)
    free = {"factor": 0}
    seen = []
    real = xp.EXL2Target.side_by_side.__func__

    def spy(cls, targets):
        need = max(t.pass_bytes() for t in targets)
        head = targets[0].m.sm.head_skeleton()
        assert need >= 15 * head.in_features * head.out_features
        monkeypatch.setattr(xp, "available_memory", lambda: free["factor"] * need)
        seen.append(real(cls, targets))
        return seen[-1]

    monkeypatch.setattr(xp.EXL2Target, "side_by_side", classmethod(spy))
    src = make.source(models["llama"])
    for factor in (4, 3):               # two passes need 2 x need in half the free memory
        free["factor"] = factor
        got = produce_many([(EXL2Options(bpw=b, measurement=str(measured)), tmp_path / f"{factor}-{b}")
                            for b in (3.0, 6.0)], src, progress=False)
        assert all(o.ok for o in got)
    assert seen == [2, 1]


def test_reuse_skips_measurement_and_roundtrip(outs):
    for bpw, (out, s) in outs.items():
        d = s["details"]
        assert d["measurement"].endswith("measurement.json") and "measurement" not in s["stages"]
        assert s["roundtrip"].startswith("ok (15 linears bit-identical")
        assert bpw - 0.05 <= d["decoder_bpw"] <= bpw and s["kind"] == "exl2" and s["target"] == str(bpw)
        assert list(s["stages"]) == ["tokenize", "allocation", "quantization", "head", "write", "verify"]
        assert len(d["layers"]) == 2
        assert not list(out.parent.glob(".*"))


def test_roundtrip_digest_by_row_blocks(outs, monkeypatch):
    """The round trip reconstructs VERIFY_ROWS output rows at a time; its digest equals the
    whole reconstruction's, for blocks that split the head unevenly, and changes with a
    stored scale."""
    from quantpress.calibration.awq import tensor_digest
    from quantpress.convert.exl2_dir import EXL2Weights
    from quantpress.targets import exl2_verify as xv

    out, _ = outs[3.0]
    w = EXL2Weights(out)
    t = w.q_tensors("lm_head")
    N = t["q_weight"].shape[1]  # vocabulary 512: no column padding
    full = qexl2.reconstruct(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"],
                             t["q_invperm"], N)
    whole = tensor_digest(full)
    for rows in (32, 96, 4096):
        monkeypatch.setattr(xv, "VERIFY_ROWS", rows)
        assert xv.reconstructed_digest("lm_head", t, tuple(full.shape)) == whole
    t2 = dict(t)
    t2["q_scale_max"] = t["q_scale_max"].clone()
    t2["q_scale_max"][-1] *= 2
    monkeypatch.setattr(xv, "VERIFY_ROWS", 32)
    assert xv.reconstructed_digest("lm_head", t2, tuple(full.shape)) != whole
    w.close()


def test_layout_config_and_kernel_constraints(outs, models):
    src = models["llama"]
    src_t = _tensors(src)
    src_cfg = json.loads((src / "config.json").read_text())
    rel_err = {}
    for bpw, (out, s) in outs.items():
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["quantization_config"] == {"quant_method": "exl2", "version": "0.3.2", "bits": bpw,
                                              "head_bits": 6, "calibration": {
                                                  "rows": 4, "length": 64, "dataset": "(default)"}}
        assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
        for f in src.iterdir():
            if f.name not in ("config.json", "model.safetensors"):
                assert (out / f.name).read_bytes() == f.read_bytes(), f.name
        assert not list(out.glob("*.json.index*")) and not (out / "model.safetensors.index.json").exists()
        t = _tensors(out)
        mods = _q_modules(t)
        assert len(mods) == 15 and "lm_head" in mods
        bits = numel = 0
        errs = []
        for m in mods:
            qw, qs, qm, qg, ip = (t[m + ".q_weight"], t[m + ".q_scale"], t[m + ".q_scale_max"],
                                  t[m + ".q_groups"], t[m + ".q_invperm"])
            qexl2.check_kernel_constraints(qw, qs, qm, qg, ip)
            w = src_t[m + ".weight"]
            assert qw.shape[1] == w.shape[0] + (-w.shape[0] % 32) and ip.numel() == w.shape[1]
            deq = qexl2.reconstruct(qw, qs, qm, qg, ip, w.shape[0])
            errs.append(float((deq.float() - w.float()).norm() / w.float().norm()))
            if m.startswith("model.layers."):
                b, n = _file_bits(t, m)
                bits, numel = bits + b, numel + n
        # decoder bpw recomputed from the stored tensors = the summary's, within the target
        assert bits == s["details"]["decoder_bits"] and numel == s["details"]["decoder_numel"]
        assert bpw - 0.05 <= bits / numel <= bpw
        rel_err[bpw] = max(errs)
        # FP16 tensors: embedding and norms, unchanged
        for k, v in src_t.items():
            if v.ndim == 1 or "embed_tokens" in k:
                assert t[k].dtype == torch.float16 and torch.equal(t[k], v), k
        assert "lm_head.weight" not in t
        assert set(t) == {k for k in src_t if not k.endswith("proj.weight") and k != "lm_head.weight"} | \
            {f"{m}.{sfx}" for m in mods for sfx in ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")}
    # more bits, closer weights
    assert rel_err[6.0] < rel_err[3.0] < 0.5


def test_sharding(outs):
    out3, out6 = outs[3.0][0], outs[6.0][0]
    assert [p.name for p in out3.glob("*.safetensors")] == ["output.safetensors"]
    shards = sorted(p.name for p in out6.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"output-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    from safetensors import safe_open

    for name in shards:
        with safe_open(str(out6 / name), framework="pt") as f:
            assert not f.metadata()
            size = sum(math.prod(f.get_slice(k).get_shape()) * f.get_tensor(k).element_size() for k in f.keys())
            assert size <= 0.25 * 1024 ** 2
    t = _tensors(out6)
    assert set(t) == set(_tensors(out3))


def test_eval_loads_exl2_and_kl_rises_as_bpw_falls(outs, models, capsys):
    out3, out6 = outs[3.0][0], outs[6.0][0]
    code = quantize_main(["eval", str(models["llama"]), str(out3), str(out6), "--ctx", "64",
                          "--chunks", "4", "--device", "cpu", "--quiet", "--json"])
    assert code == 0
    r = json.loads(capsys.readouterr().out)
    kinds = [m["kind"] for m in r["models"]]
    assert kinds == ["hf", "exl2", "exl2"]
    kl3, kl6 = (m["kl"]["kld_mean"] for m in r["models"][1:])
    assert 0 < kl6 < kl3


def test_tied_embeddings_separate_head(models, measured, tmp_path):
    """Tied embeddings: the FP16 embedding and a separate quantized lm_head; eval uses the
    quantized head."""
    out = tmp_path / "tied"
    s = make.exl2(models["tied"], out, bpw=4.0, head_bits=4, measurement=str(measured), objective="max")
    d = s.details
    assert s.roundtrip.startswith("ok") and d["objective"] == "max"
    # the minimax allocation: no other choice within the budget has a smaller max error
    m = read_measurement(measured)
    ref = exl2_alloc.allocate(m.slots(), int(d["decoder_numel"] * 4.0))
    assert d["err_max"] <= ref.err_max and d["decoder_bits"] <= int(d["decoder_numel"] * 4.0)
    t = _tensors(out)
    src = _tensors(models["tied"])
    assert "lm_head.weight" not in src and "lm_head.weight" not in t
    assert torch.equal(t["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    assert t["lm_head.q_weight"].dtype == torch.int32
    # head bits 4: 6/4 (.15/.85) g32 -> groups at 6 then 4 bits
    assert set(t["lm_head.q_groups"].view(-1, 2)[:, 0].tolist()) == {6, 4}
    from quantpress.convert import exl2_dir

    sm = exl2_dir.streaming_model(out)
    _, head = sm.head()
    deq = qexl2.reconstruct(t["lm_head.q_weight"], t["lm_head.q_scale"], t["lm_head.q_scale_max"],
                            t["lm_head.q_groups"], t["lm_head.q_invperm"], 512)
    assert torch.equal(head.weight, deq.float())
    assert not torch.equal(head.weight, src["model.embed_tokens.weight"].float())


def test_full_run_qwen2_biases(models, tmp_path, capsys):
    """Measurement and quantization in one command on qwen2 (q/k/v biases, tied): biases
    stored as float16, total_bits count them, the round trip passes."""
    out = tmp_path / "q"
    assert quantize_main(["exl2", str(models["qwen2"]), "--bpw", "5.0", "-o", str(out), "--json"] + CAL) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["details"]["measurement"] == "measured" and s["stages"]["measurement"] > 0
    assert s["roundtrip"].startswith("ok (8 linears") and 4.95 <= s["details"]["decoder_bpw"] <= 5.0
    assert "measurement.json" in s["files"] and "output.safetensors" in s["files"]
    t = _tensors(out)
    src = _tensors(models["qwen2"])
    for n in ("q_proj", "k_proj", "v_proj"):
        k = f"model.layers.0.self_attn.{n}.bias"
        assert t[k].dtype == torch.float16 and torch.equal(t[k], src[k])
    bits = sum(_file_bits(t, m)[0] for m in _q_modules(t) if m.startswith("model.layers."))
    assert bits == s["details"]["decoder_bits"]
    assert "lm_head.q_weight" in t and "model.embed_tokens.weight" in t
    # the measurement made is kept with the model, valid, and drives a second target alone
    from quantpress.calibration import exl2_measurement as mfile

    m = json.loads((out / "measurement.json").read_text())
    assert m["last_module_idx"] == 4 and len(m["measurement"]) == 4  # 1 layer: attn, mlp, norm, head
    mfile.read_measurement(out / "measurement.json")
    out2 = tmp_path / "q2"
    assert quantize_main(["exl2", str(models["qwen2"]), "--bpw", "4.0", "-o", str(out2), "--json",
                          "--measurement", str(out / "measurement.json")] + CAL) == 0
    s2 = json.loads(capsys.readouterr().out)
    assert "measurement" not in s2["stages"] and 3.95 <= s2["details"]["decoder_bpw"] <= 4.0
    # the content shares come from the file (no forward pass of their own), and the directory
    # carries the measurement it used
    assert set(m[mfile.CONTENT_KEY]) == {"model.layers.0.self_attn", "model.layers.0.mlp"}
    assert "allocation_forward" not in s2["details"]["detail"]
    assert (out2 / "measurement.json").read_bytes() == (out / "measurement.json").read_bytes()
    # measured here or reused: the same directory, byte for byte
    out3 = tmp_path / "q3"
    assert quantize_main(["exl2", str(models["qwen2"]), "--bpw", "4.0", "-o", str(out3), "--quiet"] + CAL) == 0
    files = sorted(p.relative_to(out2) for p in out2.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(out3) for p in out3.rglob("*") if p.is_file())
    for f in files:
        assert (out2 / f).read_bytes() == (out3 / f).read_bytes(), f


def test_failed_roundtrip_leaves_nothing(models, measured, tmp_path, monkeypatch, capsys):
    real = qexl2.reconstruct

    def broken(*a, **k):
        w = real(*a, **k)
        w[0, 0] = w[0, 0] + 1
        return w

    monkeypatch.setattr(qexl2, "reconstruct", broken)
    out = tmp_path / "o"
    code = quantize_main(["exl2", str(models["llama"]), "--bpw", "4.0", "-o", str(out),
                          "--measurement", str(measured)] + CAL)
    assert code == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "round trip failed" in err[0]
    assert list(tmp_path.iterdir()) == []


def _fails(args, capsys, match: str) -> str:
    assert quantize_main(args + ["--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    return err[0]


def test_bad_input(models, measured, tmp_path, capsys, tok_dir):
    src = str(models["llama"])
    out = tmp_path / "o"
    base = ["exl2", src, "-o", str(out), "--measurement", str(measured)]
    # bpw outside the reachable range: the message gives it, and both ends are reachable
    msg = _fails(base + ["--bpw", "1.5"], capsys, "outside the reachable range [")
    lo, hi = (float(x) for x in msg.split("range [")[1].split("]")[0].split(","))
    _fails(base + ["--bpw", "9.5"], capsys, f"outside the reachable range [{lo:.2f}, {hi:.2f}]")
    m = read_measurement(measured)
    shapes = _shapes(models["llama"])
    numel = 2 * sum(k * (n + (-n % 32)) for k, n, _ in shapes.values())
    a = exl2_alloc.allocate(m.slots(), int(numel * lo))
    assert lo - 0.05 <= a.total_bits / numel <= lo
    # at the top the most accurate choice may cost less than the most expensive one
    a = exl2_alloc.allocate(m.slots(), int(numel * hi))
    assert a.total_bits <= int(numel * hi) and a.total_bits / numel > lo + 5
    _fails(base + ["--bpw", "4", "--head-bits", "7"], capsys, "--head-bits 7: choose one of 2, 3, 4, 5, 6, 8")
    # a measurement of another model: other layer count, other shapes; a truncated file
    raw = json.loads(Path(measured).read_text())
    one = {"measurement": {k: v for k, v in raw["measurement"].items() if ".layers.1." not in k},
           "last_module_idx": 4}
    p1 = tmp_path / "one_layer.json"
    p1.write_text(json.dumps(one))
    _fails(["exl2", src, "-o", str(out), "--bpw", "4", "--measurement", str(p1)], capsys,
           "the measurement has 1 decoder layers, the model has 2")
    other = synth.make_model(tmp_path / "other", "llama", tok_dir, num_hidden_layers=2,
                             intermediate_size=640, vocab_size=512)
    capsys.readouterr()
    _fails(["exl2", str(other), "-o", str(out), "--bpw", "4", "--measurement", str(measured)], capsys,
           "a measurement of another model?")
    p2 = tmp_path / "trunc.json"
    text = Path(measured).read_text()
    p2.write_text(text[: len(text) // 2])
    _fails(["exl2", src, "-o", str(out), "--bpw", "4", "--measurement", str(p2)], capsys,
           "trunc.json: truncated or not JSON")
    # in_features not a multiple of 32 (ffn 600 → down_proj) and > 65535 (from config.json:
    # checked on the meta skeleton before any weight is read)
    odd = synth.make_model(tmp_path / "odd", "llama", tok_dir, num_hidden_layers=1,
                           intermediate_size=600, vocab_size=512)
    capsys.readouterr()
    _fails(["exl2", str(odd), "-o", str(out), "--bpw", "4"], capsys,
           "down_proj has in_features 600, not a multiple of 32")
    wide = tmp_path / "wide"
    shutil.copytree(odd, wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["intermediate_size"] = 65568
    (wide / "config.json").write_text(json.dumps(cfg))
    _fails(["exl2", str(wide), "-o", str(out), "--bpw", "4"], capsys,
           "down_proj has in_features 65568 > 65535")
    # too little calibration text
    short = tmp_path / "short.txt"
    short.write_text("Just a few words of text.")
    _fails(base + ["--bpw", "4", "--calib", str(short)], capsys, "calibration text too short")
    # option conflicts, missing arguments, an existing output
    _fails(["exl2", src, "--measure-only", str(tmp_path / "m.json"), "--measurement", str(measured)],
           capsys, "exclude each other")
    _fails(["exl2", src, "-o", str(out)], capsys, "--bpw is required")
    _fails(["exl2", src, "--bpw", "4"], capsys, "-o/--output is required")
    out.mkdir()
    _fails(base + ["--bpw", "4"], capsys, "already exists (use --force")
    out.rmdir()
    _fails(["exl2", src, "--measure-only", str(measured)], capsys, "already exists (use --force")
    assert not out.exists() and not list(tmp_path.glob(".o*")) and not (tmp_path / "m.json").exists()
