"""The GPTQ v1 checkpoint container (convert/gptq_dir.py):

* the packer and the reference dequantization against GPTQModel 7.7 itself: its packers
  (``PackableQuantLinear.pack_original`` and ``pack_block``, then
  ``convert_gptq_v2_to_v1_format_module``, what ``gptqmodel/utils/model.py`` ``pack_module``
  does before saving a "gptq" checkpoint) produce the same ``qweight``/``qzeros`` bytes from the
  same codes, and its torch kernel (``TorchLinear.dequantize_weight`` after the v1 → v2 load
  conversion) dequantizes our tensors to the same float16 bits as ``dequantize_gptq``;
* the layout against bit arithmetic on Python ints (each column one little-endian bit stream;
  v1 zeros stored as zero − 1);
* a writer round trip on a tiny directory (shards + index, config, copied files) read back
  with ``GPTQWeights``; GPTQModel's and transformers' config parsers accept the block;
* GPTQModel 7.7 (``GPTQModel.load``, CPU) loads a tiny llama written here, act-order,
  asymmetric, one linear left float16, and dequantizes every module to our bits;
* bad input raises ValueError / InputError naming the tensor or module.
"""
from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from quantpress.convert import gptq_dir
from quantpress.errors import InputError

BITS = (2, 3, 4, 8)


def _case(bits: int, k: int, n: int, gs: int, act: bool, seed: int = 0):
    """Random codes [K, N], zeros [G, N] (with 0 and maxq present), float16 scales [G, N] and
    g_idx (i // gs, or a random act-order assignment with the same group sizes)."""
    g = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    groups = 1 if gs == -1 else k // gs
    g_idx = torch.arange(k) // (k if gs == -1 else gs)
    if act:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    codes = torch.randint(0, maxq + 1, (k, n), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, maxq + 1, (groups, n), generator=g, dtype=torch.uint8)
    zeros[0, : n // 2] = 0  # v1's zero − 1 borrows here
    zeros[-1, n // 2:] = maxq
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 1e-3).to(torch.float16)
    return codes, zeros, scales, g_idx.to(torch.int32)


def _exact_weight(codes, zeros, scales, g_idx) -> torch.Tensor:
    """float32 [K, N] = scales·(codes − zeros) per row's group: exact in float32 (an 11-bit
    significand times a ≤ 9-bit integer)."""
    gi = g_idx.long()
    return scales.float()[gi] * (codes.float() - zeros.float()[gi])


def _gptqmodel_linear(bits, gs, act, k, n, register=False):
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear

    return TorchLinear(bits=bits, group_size=gs, sym=False, desc_act=act, in_features=k,
                       out_features=n, bias=False, pack_dtype=torch.int32,
                       register_buffers=register)


def _gptqmodel_pack(bits, gs, act, codes, zeros, scales, g_idx, packer: str):
    """GPTQModel 7.7's "gptq" export of one linear: its packer fed with an nn.Linear holding the
    exact dequantized weight (it re-derives the codes as round((W + zeros·scales) / scales)),
    then its v2 → v1 qzeros conversion."""
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module

    k, n = codes.shape
    lin = nn.Linear(k, n, bias=False)
    lin.weight.data = _exact_weight(codes, zeros, scales, g_idx).T.contiguous()
    m = _gptqmodel_linear(bits, gs, act, k, n)
    args = (lin, scales.float().T.contiguous(), zeros.float().T.contiguous(), g_idx.clone())
    if packer == "original":
        m.pack_original(*args)
    else:
        m.pack_block(*args)
    convert_gptq_v2_to_v1_format_module(m, SimpleNamespace(bits=bits, pack_dtype=torch.int32))
    return m.qweight, m.qzeros


def _gptqmodel_dequant(bits, gs, act, t: dict) -> torch.Tensor:
    """GPTQModel 7.7's torch kernel on our tensors as it loads a "gptq" checkpoint: buffers
    set, v1 → v2 qzeros conversion, eval-mode ``dequantize_weight`` → float16 [K, N]."""
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module

    k, n = t["g_idx"].numel(), t["scales"].shape[1]
    m = _gptqmodel_linear(bits, gs, act, k, n, register=True)
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        setattr(m, name, t[name].clone())
    convert_gptq_v1_to_v2_format_module(m, bits=bits, pack_dtype=torch.int32)
    m.eval()
    with torch.no_grad():
        return m.dequantize_weight()


@pytest.mark.parametrize("act", [False, True], ids=["seq", "act"])
@pytest.mark.parametrize("gs", [32, 128, -1])
@pytest.mark.parametrize("bits", BITS)
def test_pack_and_dequant_equal_gptqmodel(bits, gs, act):
    k, n = 256, 96 if bits != 3 else 64  # 3 bits: N a multiple of 32 for qzeros
    codes, zeros, scales, g_idx = _case(bits, k, n, gs, act, seed=bits * 10 + (gs % 7) + act)
    ours = gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits)
    assert ours["qweight"].dtype == torch.int32 and tuple(ours["qweight"].shape) == (k * bits // 32, n)
    assert ours["qzeros"].dtype == torch.int32
    assert tuple(ours["qzeros"].shape) == (zeros.shape[0], n * bits // 32)
    assert ours["scales"].dtype == torch.float16 and torch.equal(ours["scales"], scales)
    assert ours["g_idx"].dtype == torch.int32 and torch.equal(ours["g_idx"], g_idx)

    qw, qz = _gptqmodel_pack(bits, gs, act, codes, zeros, scales, g_idx, "original")
    assert torch.equal(ours["qweight"], qw)
    assert torch.equal(ours["qzeros"], qz)

    theirs = _gptqmodel_dequant(bits, gs, act, ours)  # [K, N]
    mine = gptq_dir.dequantize_gptq(ours["qweight"], ours["qzeros"], ours["scales"], ours["g_idx"], bits)
    assert theirs.dtype == mine.dtype == torch.float16 and tuple(mine.shape) == (n, k)
    assert torch.equal(mine.view(torch.int16), theirs.T.contiguous().view(torch.int16))
    # and both are the float16 rounding of the exact weight
    want = _exact_weight(codes, zeros, scales, g_idx).T.to(torch.float16)
    assert torch.equal(mine.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_equals_gptqmodel_pack_block(bits, monkeypatch):
    """``pack_block`` (GPTQModel's default CPU packer, ``pack_impl="auto"`` without CUDA), in
    its Python path."""
    monkeypatch.setenv("GPTQMODEL_DISABLE_PACK_EXT", "1")
    codes, zeros, scales, g_idx = _case(bits, 256, 96, 64, True, seed=bits)
    ours = gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits)
    qw, qz = _gptqmodel_pack(bits, 64, True, codes, zeros, scales, g_idx, "block")
    assert torch.equal(ours["qweight"], qw) and torch.equal(ours["qzeros"], qz)


def _stream_words(values: list[int], bits: int) -> list[int]:
    """Python ints: the values as one little-endian bit stream, cut into 32-bit words."""
    acc = sum(v << (bits * i) for i, v in enumerate(values))
    return [(acc >> (32 * w)) & 0xFFFFFFFF for w in range(len(values) * bits // 32)]


@pytest.mark.parametrize("bits", BITS)
def test_layout_on_python_ints(bits):
    """qweight: each column's codes as one bit stream along the input; qzeros: each group's
    zero − 1 as one bit stream along the output (every zero ≥ 1 here: the per-field v1
    offset, what every v1 reader expects); symmetric zeros give the familiar constant words."""
    k, n, maxq = 64, 32, (1 << bits) - 1
    codes, _, scales, g_idx = _case(bits, k, n, 32, False, seed=7)
    zeros = torch.randint(1, maxq + 1, (2, n), generator=torch.Generator().manual_seed(8), dtype=torch.uint8)
    t = gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits)
    qw = t["qweight"].to(torch.int64) & 0xFFFFFFFF
    for col in (0, 5, n - 1):
        assert qw[:, col].tolist() == _stream_words(codes[:, col].tolist(), bits)
    qz = t["qzeros"].to(torch.int64) & 0xFFFFFFFF
    for grp in range(2):
        assert qz[grp].tolist() == _stream_words([z - 1 for z in zeros[grp].tolist()], bits)
    sym = torch.full((2, n), 1 << (bits - 1), dtype=torch.uint8)
    qs = gptq_dir.pack_gptq(codes, sym, scales, g_idx, bits)["qzeros"].to(torch.int64) & 0xFFFFFFFF
    want = _stream_words([(1 << (bits - 1)) - 1] * n, bits)  # 4 bits: 0x77777777 words
    assert qs[0].tolist() == qs[1].tolist() == want
    if bits == 4:
        assert want == [0x77777777] * 4


@pytest.mark.parametrize("bits", BITS)
def test_large_linear_unpacks_to_its_codes(bits):
    """A linear of realistic size (4096 × 512) through the packer and the reader's unpacking."""
    k, n = 4096, 512
    codes, zeros, scales, g_idx = _case(bits, k, n, 128, False, seed=3)
    t = gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits)
    assert torch.equal(gptq_dir.unpack_gptq_rows(t["qweight"], bits), codes.to(torch.int16))
    assert torch.equal(gptq_dir.v1_zeros(t["qzeros"], bits), zeros.to(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits", BITS)
def test_pack_and_dequant_on_cuda_equal_cpu(bits):
    codes, zeros, scales, g_idx = _case(bits, 512, 256, 128, True, seed=4)
    cpu = gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits)
    gpu = gptq_dir.pack_gptq(codes.cuda(), zeros.cuda(), scales.cuda(), g_idx.cuda(), bits)
    for k in cpu:
        assert gpu[k].is_cuda and torch.equal(gpu[k].cpu(), cpu[k]), k
    d = gptq_dir.dequantize_gptq(gpu["qweight"], gpu["qzeros"], gpu["scales"], gpu["g_idx"], bits)
    want = gptq_dir.dequantize_gptq(cpu["qweight"], cpu["qzeros"], cpu["scales"], cpu["g_idx"], bits)
    assert d.is_cuda and torch.equal(d.cpu().view(torch.int16), want.view(torch.int16))


# ---------------------------------------------------------------------------------------------
# Writer round trip

LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj")
KEPT = "model.layers.1.mlp.down_proj"


def _source_dir(p):
    p.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "torch_dtype": "bfloat16", "dtype": "bfloat16", "num_hidden_layers": 2}
    (p / "config.json").write_text(json.dumps(cfg))
    (p / "tokenizer.json").write_text('{"version": "1.0"}')
    (p / "generation_config.json").write_text('{"do_sample": false}')
    (p / "quantize_config.json").write_text('{"bits": 8}')  # a stale one must not be copied
    save_file({"x": torch.zeros(2)}, str(p / "model.safetensors"))
    return p, cfg


def test_writer_round_trip(tmp_path):
    src, src_cfg = _source_dir(tmp_path / "src")
    bits, gs, k, n = 4, 32, 64, 64
    w = gptq_dir.dir_writer(tmp_path / "out", max_shard_bytes=4096)
    expect, stored = {}, {}
    for i, name in enumerate(LAYERS):
        codes, zeros, scales, g_idx = _case(bits, k, n, gs, act=bool(i), seed=20 + i)
        t = {f"{name}.{kk}": v for kk, v in gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits).items()}
        t[f"{name}.bias"] = torch.randn(n).to(torch.float16)
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.rand(k).to(torch.float16)
        if i == 1:
            t[f"{KEPT}.weight"] = torch.randn(k, n * 2).to(torch.float16)
        w.add(t)
        stored.update(t)
        expect[name] = _exact_weight(codes, zeros, scales, g_idx).T.to(torch.float16)
    cfg = gptq_dir.gptq_config(src_cfg, bits=bits, group_size=gs, desc_act=True, sym=False,
                               damp_percent=0.05, true_sequential=True, modules_not_quantized=[KEPT])
    shards = w.finish(cfg, src)
    out = tmp_path / "out"

    assert len(shards) > 1 and [p.name for p in shards] == \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in stored.values())
    for p in shards:
        with safe_open(str(p), framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
    assert sorted(f.name for f in out.iterdir() if not f.name.endswith(".safetensors")) == \
        ["config.json", "generation_config.json", "model.safetensors.index.json",
         "quantize_config.json", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()

    written = json.loads((out / "config.json").read_text())
    q = written["quantization_config"]
    assert written["torch_dtype"] == written["dtype"] == "float16"
    assert written["hidden_size"] == 64 and src_cfg["torch_dtype"] == "bfloat16"
    assert (q["quant_method"], q["checkpoint_format"], q["format"], q["bits"], q["group_size"],
            q["desc_act"], q["sym"], q["lm_head"]) == ("gptq", "gptq", "gptq", 4, 32, True, False, False)
    assert (q["damp_percent"], q["true_sequential"], q["static_groups"]) == (0.05, True, False)
    assert q["meta"]["quantizer"][0] == "gptqmodel:7.7.0"
    assert q["meta"]["quantizer"][1].startswith("quantpress:")
    # transformers' loader (optimum) ignores `dynamic`: the writer lists what it quantized
    assert q["modules_in_block_to_quantize"] == [sorted(LAYERS)]
    assert "modules_in_block_to_quantize" not in cfg["quantization_config"]  # input not modified
    assert json.loads((out / "quantize_config.json").read_text()) == q
    assert gptq_dir.read_gptq_config(out) == q and gptq_dir.is_gptq_dir(out)
    assert not gptq_dir.is_gptq_dir(src)

    # the skip rule: exactly KEPT (vLLM's get_dynamic_override uses re.match on the key's regex)
    (pattern,) = q["dynamic"]
    assert pattern.startswith("-:") and q["dynamic"][pattern] == {}
    assert re.match(pattern[2:], KEPT)
    assert not re.match(pattern[2:], KEPT.replace("layers.1", "layers.11"))
    assert not re.match(pattern[2:], LAYERS[1])

    r = gptq_dir.GPTQWeights(out)
    try:
        assert (r.bits, r.group_size, r.desc_act, r.sym) == (4, 32, True, False)
        for name in LAYERS:
            assert f"{name}.weight" in r and r.is_quantized(f"{name}.weight")
            assert f"{name}.qweight" not in r and f"{name}.g_idx" not in r.keys()
            got = r.dequantized(name)
            assert torch.equal(got.view(torch.int16), expect[name].view(torch.int16))
            assert torch.equal(r.get(f"{name}.weight", dtype=torch.float32), expect[name].float())
            assert torch.equal(r.raw.get(f"{name}.qzeros"), stored[f"{name}.qzeros"])
            assert torch.equal(r.get(f"{name}.bias"), stored[f"{name}.bias"])
        assert f"{KEPT}.weight" in r and not r.is_quantized(f"{KEPT}.weight")
        assert torch.equal(r.get(f"{KEPT}.weight"), stored[f"{KEPT}.weight"])
    finally:
        r.close()


def test_consumers_parse_the_config(tmp_path):
    """GPTQModel 7.7's ``QuantizeConfig.from_quant_config`` (what its loader and transformers'
    GPTQ integration build) and transformers' ``GPTQConfig`` read our block; GPTQModel's
    ``dynamic_get`` skips exactly the listed module."""
    from gptqmodel.quantization import FORMAT
    from gptqmodel.quantization.config import QuantizeConfig, dynamic_get
    from transformers.utils.quantization_config import GPTQConfig

    q = gptq_dir.gptq_config({"model_type": "llama"}, bits=8, group_size=-1, desc_act=False,
                             sym=True, damp_percent=0.1, true_sequential=False,
                             modules_not_quantized=[KEPT])["quantization_config"]
    c = QuantizeConfig.from_quant_config(json.loads(json.dumps(q)))
    assert (c.bits, c.group_size, c.desc_act, c.sym, c.format, c.lm_head) == \
        (8, -1, False, True, FORMAT.GPTQ, False)
    assert c.damp_percent == 0.1 and c.true_sequential is False
    assert dynamic_get(c.dynamic, KEPT) is False
    assert dynamic_get(c.dynamic, KEPT.replace("layers.1", "layers.11")) is None
    assert dynamic_get(c.dynamic, LAYERS[1]) is None
    h = GPTQConfig.from_dict(json.loads(json.dumps(q)))
    assert (h.bits, h.group_size, h.desc_act, h.sym, h.format, h.damp_percent) == \
        (8, -1, False, True, "gptq", 0.1)
    q0 = gptq_dir.gptq_config({}, bits=4, group_size=128, desc_act=False, sym=True, damp_percent=0.01,
                              true_sequential=True, modules_not_quantized=[])["quantization_config"]
    assert "dynamic" not in q0
    src = tmp_path / "src"
    src.mkdir()
    w = gptq_dir.dir_writer(tmp_path / "out", 0)
    w.add({f"{LAYERS[0]}.{k}": v for k, v in gptq_dir.pack_gptq(*_case(4, 64, 32, 32, False), 4).items()})
    w.finish({"quantization_config": q0}, src)
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written == q0  # nothing skipped: no modules_in_block_to_quantize


# ---------------------------------------------------------------------------------------------
# Bad input

def test_pack_rejects_bad_input():
    codes, zeros, scales, g_idx = _case(4, 64, 32, 32, False)
    with pytest.raises(ValueError, match=r"codes: K = 60 .* multiple of 8"):
        gptq_dir.pack_gptq(codes[:60], zeros, scales, g_idx[:60], 4)
    c3, z3, s3, g3 = _case(3, 64, 32, 32, False)
    with pytest.raises(ValueError, match=r"codes: K = 56 .* multiple of 32"):
        gptq_dir.pack_gptq(c3[:56], z3, s3, g3[:56], 3)
    with pytest.raises(ValueError, match=r"codes: N = 28 .* multiple of 32"):
        gptq_dir.pack_gptq(c3[:, :28], z3[:, :28], s3[:, :28], g3, 3)
    with pytest.raises(ValueError, match=r"zeros: shape \(3, 32\), expected \[G, N\] = \(2, 32\)"):
        gptq_dir.pack_gptq(codes, torch.cat([zeros, zeros[:1]]), scales, g_idx, 4)
    with pytest.raises(ValueError, match=r"scales: shape \(2, 16\)"):
        gptq_dir.pack_gptq(codes, zeros, scales[:, :16], g_idx, 4)
    with pytest.raises(ValueError, match=r"g_idx: shape \(63,\)"):
        gptq_dir.pack_gptq(codes, zeros, scales, g_idx[:63], 4)
    with pytest.raises(ValueError, match=r"g_idx: values outside \[0, 2\)"):
        gptq_dir.pack_gptq(codes, zeros, scales, g_idx + 1, 4)
    with pytest.raises(ValueError, match=r"codes: values outside 0 … 15"):
        gptq_dir.pack_gptq(codes + 16, zeros, scales, g_idx, 4)
    with pytest.raises(ValueError, match=r"zeros: values outside 0 … 3"):
        gptq_dir.pack_gptq(codes & 3, zeros, scales, g_idx, 2)
    with pytest.raises(ValueError, match="scales: expected a float16"):
        gptq_dir.pack_gptq(codes, zeros, scales.float(), g_idx, 4)
    with pytest.raises(ValueError, match="zeros: dtype torch.float32"):
        gptq_dir.pack_gptq(codes, zeros.float(), scales, g_idx, 4)
    with pytest.raises(ValueError, match="bits 5"):
        gptq_dir.pack_gptq(codes, zeros, scales, g_idx, 5)


def test_dequantize_rejects_bad_input():
    t = gptq_dir.pack_gptq(*_case(4, 64, 32, 32, False), 4)
    qw, qz, sc, gi = t["qweight"], t["qzeros"], t["scales"], t["g_idx"]
    with pytest.raises(ValueError, match=r"qzeros: shape \(1, 4\)"):
        gptq_dir.dequantize_gptq(qw, qz[:1], sc, gi, 4)
    with pytest.raises(ValueError, match=r"qzeros: shape \(2, 3\)"):
        gptq_dir.dequantize_gptq(qw, qz[:, :3], sc, gi, 4)
    with pytest.raises(ValueError, match=r"g_idx: shape \(32,\), expected \[K\] = \(64,\)"):
        gptq_dir.dequantize_gptq(qw, qz, sc, gi[:32], 4)
    with pytest.raises(ValueError, match=r"qzeros: shape \(2, 4\), expected \[G, N·8/32\] = \(2, 8\)"):
        gptq_dir.dequantize_gptq(qw, qz, sc, gi, 8)  # read with the wrong bit width
    with pytest.raises(ValueError, match=r"g_idx: values outside \[0, 2\)"):
        gptq_dir.dequantize_gptq(qw, qz, sc, gi * 2, 4)
    with pytest.raises(ValueError, match="scales: torch.float32"):
        gptq_dir.dequantize_gptq(qw, qz, sc.float(), gi, 4)
    with pytest.raises(ValueError, match=r"qweight: shape \(8, 32\): 8 rows"):
        gptq_dir.dequantize_gptq(qw, qz, sc, gi, 3)


def test_reader_rejects_bad_directories(tmp_path):
    src, src_cfg = _source_dir(tmp_path / "src")
    name = LAYERS[0]
    t = {f"{name}.{k}": v for k, v in gptq_dir.pack_gptq(*_case(4, 64, 32, 32, False), 4).items()}
    cfg = gptq_dir.gptq_config(src_cfg, bits=4, group_size=32, desc_act=False, sym=True,
                               damp_percent=0.01, true_sequential=True)

    def write(d, tensors, config):
        w = gptq_dir.dir_writer(tmp_path / d, 0)
        w.add(tensors)
        w.finish(config, src)
        return tmp_path / d

    no_gidx = write("a", {k: v for k, v in t.items() if not k.endswith("g_idx")}, cfg)
    with pytest.raises(InputError, match=rf"'{re.escape(name)}.qweight' without '{re.escape(name)}.g_idx'"):
        gptq_dir.GPTQWeights(no_gidx)
    bad_dtype = write("b", {**t, f"{name}.scales": t[f"{name}.scales"].float()}, cfg)
    r = gptq_dir.GPTQWeights(bad_dtype)
    with pytest.raises(InputError, match=rf"'{re.escape(name)}' has dtypes .*scales torch.float32"):
        r.dequantized(name)
    r.close()
    v2 = json.loads(json.dumps(cfg))
    v2["quantization_config"]["checkpoint_format"] = "gptq_v2"
    d = write("c", t, v2)
    with pytest.raises(InputError, match="not a GPTQ v1"):
        gptq_dir.GPTQWeights(d)
    with pytest.raises(InputError, match="no GPTQ quantization_config"):
        gptq_dir.read_gptq_config(src)
    with pytest.raises(ValueError, match="no quantization_config"):
        gptq_dir.dir_writer(tmp_path / "e", 0).finish(src_cfg, src)
    with pytest.raises(ValueError, match="group_size 0"):
        gptq_dir.gptq_config(src_cfg, bits=4, group_size=0, desc_act=False, sym=True,
                             damp_percent=0.01, true_sequential=True)


# ---------------------------------------------------------------------------------------------
# A consumer: GPTQModel 7.7 loads a directory written here

def test_gptqmodel_loads_the_directory(tmp_path, smollm2_dir):
    """GPTQModel 7.7 (``GPTQModel.load``, CPU torch kernel) loads a tiny llama written by
    ``dir_writer`` (4 bits, sym false, act-order, group 64, one linear left float16, shards):
    it builds a quantized module for every quantized linear, a plain Linear for the skipped one,
    and every module dequantizes to our float16 bits. (transformers 5.23 would load it through
    optimum + gptqmodel; optimum is not part of the test stack.)"""
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    src = tmp_path / "src"
    LlamaForCausalLM(cfg).to(torch.float16).save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # its loader reads one
        if (smollm2_dir / f).is_file():
            shutil.copy(smollm2_dir / f, src / f)
    sd = LlamaForCausalLM(cfg).to(torch.float16).state_dict()
    skip = "model.layers.1.mlp.down_proj"
    bits, gs = 4, 64
    w = gptq_dir.dir_writer(tmp_path / "out", max_shard_bytes=200_000)
    ours, tensors = {}, {}
    for i, (name, t) in enumerate(sd.items()):
        mod = name[: -len(".weight")]
        if ".layers." in name and t.ndim == 2 and mod != skip:
            n, k = t.shape
            codes, zeros, scales, g_idx = _case(bits, k, n, gs, act=True, seed=100 + i)
            p = gptq_dir.pack_gptq(codes, zeros, scales, g_idx, bits)
            tensors.update({f"{mod}.{kk}": v for kk, v in p.items()})
            ours[mod] = _exact_weight(codes, zeros, scales, g_idx).T.to(torch.float16)
        else:
            tensors[name] = t
    w.add(tensors)
    w.finish(gptq_dir.gptq_config(json.loads((src / "config.json").read_text()), bits=bits,
                                  group_size=gs, desc_act=True, sym=False, damp_percent=0.05,
                                  true_sequential=True, modules_not_quantized=[skip]), src)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()

    m = GPTQModel.load(str(tmp_path / "out"), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    seen = set()
    for name, mod in m.model.named_modules():
        if isinstance(mod, BaseQuantLinear):
            mod.eval()
            with torch.no_grad():
                theirs = type(mod).dequantize_weight(mod).T.contiguous()  # eager (not compiled)
            assert torch.equal(theirs.view(torch.int16), ours[name].view(torch.int16)), name
            seen.add(name)
    assert seen == set(ours) and len(seen) == 13
    kept = m.model.get_submodule(skip)
    assert type(kept) is nn.Linear and torch.equal(kept.weight.data, sd[f"{skip}.weight"])
