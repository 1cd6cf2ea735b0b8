"""convert/gguf_policy.py against llama.cpp itself.

Each model is converted to an F16 GGUF by llama.cpp's own convert_hf_to_gguf.py (a
subprocess); every quantized policy is then run through llama-cpp-python's
``llama_model_quantize`` (llama.cpp 0c1e570) and the output file's tensor types and tensor
order are compared with ``plan_types`` / ``tensor_order``. The float policies are compared
with convert_hf_to_gguf.py's ``--outtype f32|f16|bf16`` files. Expected types come only
from those files; the model facts given to ``plan_types`` are read from the F16 GGUF.

Models: SmolLM2-135M (30 layers, width 576 -> fallbacks, tied, gqa 3), synthetic llama
(16 layers, gqa 2, untied), qwen3 (gqa 4, q/k norms), a 32-layer llama with gqa 4, an
80-layer llama (LLM_TYPE_70B, tied), an 8-expert mixtral and a 2-layer llama of width 48
(fallbacks down to F16).

Quantized outputs are read with a small GGUF header parser (``read_gguf``) because
gguf.GGUFReader takes ~5 s per file on the 49k-token tokenizer arrays; one test checks the
parser against GGUFReader.
"""
from __future__ import annotations

import ctypes
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import gguf
import pytest

import llamacpp_tools
import synth
from llamacpp_tools import convert_hf
from refs import gguf_header
from quantpress.convert.gguf_policy import (POLICIES, ModelParams, converter_type, default_type,
                                 ftype_id, is_float_policy, is_quantizable, plan_types,
                                 tensor_order)

QUANT_POLICIES = [p for p in POLICIES if not is_float_policy(p)]
FLOAT_POLICIES = [p for p in POLICIES if is_float_policy(p)]

# model key -> (conftest fixture giving the HF directory) or (synth arch, config overrides)
MODELS: dict[str, tuple[str, dict] | str] = {
    "smollm2": "smollm2_dir",
    "llama": "synth_llama_dir",
    "qwen3": "synth_qwen3_dir",
    "llama_gqa4_32l": ("llama", dict(num_hidden_layers=32, num_attention_heads=8,
                                     num_key_value_heads=2)),
    "llama_80l": ("llama", dict(num_hidden_layers=80, intermediate_size=256,
                                tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(num_hidden_layers=8, intermediate_size=256)),
    # rows of 48 (not a multiple of 32): the fallback's last resort, F16
    "llama_w48": ("llama", dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2)),
}
# Every policy on SmolLM2 and the two standard synthetic models; on the extra models only the
# policies whose types depend on what that model adds (gqa >= 4 and 32-layer counters,
# LLM_TYPE_70B, n_expert == 8 with layer numbers parsed from names), to keep the run short.
EXTRA_POLICIES = {
    "llama_gqa4_32l": ["Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M"],
    "llama_80l": ["Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M"],
    "mixtral": ["Q4_0", "Q2_K", "Q3_K_L", "Q4_K_M", "Q5_K_M"],
}
QUANT_CASES = [(m, p) for m in MODELS for p in EXTRA_POLICIES.get(m, QUANT_POLICIES)]
# with an importance matrix (Q4_0/Q5_0 ffn_down and IQ4_NL/IQ4_XS ffn_down depend on it)
IMATRIX_CASES = [("llama", "Q4_0"), ("llama", "Q5_0"), ("mixtral", "Q5_0"), ("llama", "IQ4_XS"),
                 ("smollm2", "IQ4_NL")]
# policies llama-quantize refuses without importance weights (tensor_requires_imatrix): their
# reference runs get an imatrix of ones for every quantizable tensor
NEEDS_IMATRIX = {"Q2_K_S"}
# models also converted with --outtype f32 and bf16 (F16 is compared for every model)
FLOAT_MODELS = ["llama"]


# --------------------------------------------------------------------------- helpers

@dataclass
class GGUFInfo:
    """What the tests read from a GGUF file: tensors in file order, their ggml types and
    numpy-order shapes, and the model facts for ``plan_types``."""

    order: list[str]
    types: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    params: ModelParams
    file_type: int | None

    @property
    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(n, self.shapes[n]) for n in self.order]


def read_gguf(path: Path) -> GGUFInfo:
    kv, tensors = gguf_header(path)
    tensors = [(n, t, shape) for n, t, shape, _ in tensors]
    order = [n for n, _, _ in tensors]
    types = {n: gguf.GGMLQuantizationType(t).name for n, t, _ in tensors}
    shapes = {n: shape for n, _, shape in tensors}
    arch = kv["general.architecture"]
    params = ModelParams(
        arch=arch,
        n_layer=int(kv[f"{arch}.block_count"]),
        n_head=int(kv[f"{arch}.attention.head_count"]),
        n_head_kv=int(kv.get(f"{arch}.attention.head_count_kv", kv[f"{arch}.attention.head_count"])),
        n_expert=int(kv.get(f"{arch}.expert_count", 0)),
        has_output="output.weight" in types,
    )
    return GGUFInfo(order, types, shapes, params, kv.get("general.file_type"))


def read_gguf_with_reader(path: Path) -> GGUFInfo:
    """The same facts through gguf.GGUFReader (slow on real tokenizers)."""
    r = gguf.GGUFReader(path)

    def field(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.contents()

    order = [t.name for t in r.tensors]
    types = {t.name: t.tensor_type.name for t in r.tensors}
    shapes = {t.name: tuple(int(d) for d in reversed(list(t.shape))) for t in r.tensors}
    arch = field("general.architecture")
    params = ModelParams(
        arch=arch,
        n_layer=int(field(f"{arch}.block_count")),
        n_head=int(field(f"{arch}.attention.head_count")),
        n_head_kv=int(field(f"{arch}.attention.head_count_kv", field(f"{arch}.attention.head_count"))),
        n_expert=int(field(f"{arch}.expert_count", 0)),
        has_output="output.weight" in types,
    )
    return GGUFInfo(order, types, shapes, params, field("general.file_type"))


def llama_quantize(src: Path, dst: Path, policy: str, imatrix: bool | GGUFInfo = False) -> None:
    """llama-cpp-python's ``llama_model_quantize`` with default parameters, 2 threads.
    ``imatrix``: True passes an (empty) importance matrix, which only sets has_imatrix; a
    :class:`GGUFInfo` passes importance 1 for every quantizable 2-D tensor of that model."""
    import llama_cpp
    import numpy as np

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{policy}")
    params.nthread = 2
    keep = None
    if imatrix is True:
        keep = (llama_cpp.llama_model_imatrix_data * 1)()  # only the terminator (name NULL)
        params.imatrix = ctypes.cast(keep, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    elif imatrix:
        names = [n for n in imatrix.order if is_quantizable(n, imatrix.shapes[n], imatrix.params.arch)]
        keep = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
        bufs = []
        for i, n in enumerate(names):
            shape = imatrix.shapes[n]
            buf = np.ones(shape[-1] * (shape[0] if len(shape) == 3 else 1), dtype=np.float32)
            bufs += [n.encode(), buf]
            keep[i].name = bufs[-2]
            keep[i].data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            keep[i].size = buf.size
        keep[len(names)].name = None
        params.imatrix = ctypes.cast(keep, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({policy}) failed"
    del keep


def diff_types(planned: dict[str, str], actual: dict[str, str]) -> list[str]:
    assert set(planned) == set(actual)
    return [f"{n}: planned {planned[n]}, llama.cpp {actual[n]}"
            for n in actual if planned[n] != actual[n]]


class References:
    """Lazily built HF directories and convert_hf_to_gguf outputs, shared by the module."""

    def __init__(self, request, tmp_path_factory):
        self._request = request
        self._tmp = tmp_path_factory
        self._dirs: dict[str, Path] = {}
        self._ggufs: dict[tuple[str, str], GGUFInfo | Path] = {}

    def model_dir(self, key: str) -> Path:
        if key not in self._dirs:
            spec = MODELS[key]
            if isinstance(spec, str):
                self._dirs[key] = self._request.getfixturevalue(spec)
            else:
                arch, over = spec
                tok = self._request.getfixturevalue("smollm2_dir")
                self._dirs[key] = synth.make_model(self._tmp.mktemp(f"hf_{key}"), arch, tok, **over)
        return self._dirs[key]

    def gguf_path(self, key: str, outtype: str = "f16") -> Path:
        k = (key, outtype)
        if k not in self._ggufs:
            out = self._tmp.mktemp(f"gguf_{key}") / f"{key}-{outtype}.gguf"
            self._ggufs[k] = convert_hf(self.model_dir(key), out, outtype)
        return self._ggufs[k]

    def info(self, key: str, outtype: str = "f16") -> GGUFInfo:
        k = (key, outtype, "info")
        if k not in self._ggufs:
            self._ggufs[k] = read_gguf(self.gguf_path(key, outtype))
        return self._ggufs[k]


@pytest.fixture(scope="module")
def refs(request, tmp_path_factory) -> References:
    return References(request, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_cpp_mod():
    return pytest.importorskip("llama_cpp")


# --------------------------------------------------------------------------- against llama.cpp

def quantize_and_read(refs: References, model: str, policy: str, tmp_path: Path,
                      imatrix: bool = False, readers=(read_gguf,)):
    """Quantize the model's F16 GGUF with llama.cpp, read the output (with each of
    ``readers``; one reader: its result, else a list), and delete it. With the fast reader
    alone, what it read is kept in the cache (``llamacpp_tools.cached_value``, keyed by the F16
    file's bytes, the policy, the importance weights given and the bindings' libraries), so a
    second run does not quantize again."""
    if readers == (read_gguf,):
        mode = ["empty"] if imatrix else ["none"]
        if policy in NEEDS_IMATRIX:    # the tensors given weights of one (our is_quantizable picks them)
            info = refs.info(model)
            mode = ["ones", *(n for n in info.order if is_quantizable(n, info.shapes[n], info.params.arch))]
        got = llamacpp_tools.cached_value(
            "bindings", ["policy-types", policy, 2, *mode], [refs.gguf_path(model)],
            lambda: _info_to_json(_quantize_and_read(refs, model, policy, tmp_path, imatrix, readers)))
        return _info_from_json(got)
    return _quantize_and_read(refs, model, policy, tmp_path, imatrix, readers)


def _quantize_and_read(refs: References, model: str, policy: str, tmp_path: Path, imatrix, readers):
    dst = tmp_path / f"{model}-{policy}.gguf"
    if policy in NEEDS_IMATRIX:
        imatrix = refs.info(model)
    llama_quantize(refs.gguf_path(model), dst, policy, imatrix=imatrix)
    try:
        infos = [reader(dst) for reader in readers]
    finally:
        dst.unlink(missing_ok=True)
    return infos[0] if len(infos) == 1 else infos


def _info_to_json(info: GGUFInfo) -> dict:
    return {"order": info.order, "types": info.types, "shapes": info.shapes,
            "params": asdict(info.params), "file_type": info.file_type}


def _info_from_json(d: dict) -> GGUFInfo:
    return GGUFInfo(d["order"], d["types"], {n: tuple(s) for n, s in d["shapes"].items()},
                    ModelParams(**d["params"]), d["file_type"])


@pytest.mark.parametrize("model,policy", QUANT_CASES)
def test_quantized_policy_matches_llama_quantize(refs, llama_cpp_mod, tmp_path, model, policy):
    ref = refs.info(model)
    out = quantize_and_read(refs, model, policy, tmp_path)
    params = replace(ref.params, has_imatrix=policy in NEEDS_IMATRIX)
    planned = plan_types(policy, ref.tensors, params)
    bad = diff_types(planned, out.types)
    assert not bad, f"{len(bad)} of {len(planned)} tensors differ:\n" + "\n".join(bad[:40])
    assert tensor_order(ref.order) == out.order
    assert out.file_type == ftype_id(policy)
    assert out.shapes == ref.shapes


@pytest.mark.parametrize("model,policy", IMATRIX_CASES)
def test_imatrix_policy_matches_llama_quantize(refs, llama_cpp_mod, tmp_path, model, policy):
    """With an importance matrix, Q4_0/Q5_0 bump the first ffn_down layers to Q4_1/Q5_1."""
    ref = refs.info(model)
    out = quantize_and_read(refs, model, policy, tmp_path, imatrix=True)
    params = replace(ref.params, has_imatrix=True)
    planned = plan_types(policy, ref.tensors, params)
    bad = diff_types(planned, out.types)
    assert not bad, "\n".join(bad[:40])
    # the imatrix branch must actually have been exercised
    assert planned != plan_types(policy, ref.tensors, ref.params)


def test_header_parser_agrees_with_gguf_reader(refs, llama_cpp_mod, tmp_path):
    """The fast header parser used above reads what gguf.GGUFReader reads."""
    ref = refs.info("smollm2")
    assert ref == read_gguf_with_reader(refs.gguf_path("smollm2"))
    out, out_fast = quantize_and_read(refs, "smollm2", "Q4_K_M", tmp_path,
                                      readers=(read_gguf_with_reader, read_gguf))
    assert out == out_fast
    assert len(set(out.types.values())) >= 5
    # tensors_of (every test's byte comparison) reads what GGUFReader reads, in file order
    import numpy as np

    from refs import tensors_of

    q = tmp_path / "q4km.gguf"
    llama_quantize(refs.gguf_path("smollm2"), q, "Q4_K_M")
    for path in (refs.gguf_path("smollm2"), q):
        r = gguf.GGUFReader(str(path))
        assert list(tensors_of(path).items()) == [
            (t.name, (gguf.GGMLQuantizationType(t.tensor_type).name, tuple(int(d) for d in t.shape),
                      np.asarray(t.data).tobytes())) for t in r.tensors], path


@pytest.mark.parametrize("model", list(MODELS))
def test_f16_policy_matches_convert_hf_to_gguf(refs, model):
    ref = refs.info(model)
    assert plan_types("F16", ref.tensors, ref.params) == ref.types


@pytest.mark.parametrize("policy", [p for p in FLOAT_POLICIES if p != "F16"])
@pytest.mark.parametrize("model", FLOAT_MODELS)
def test_float_policy_matches_convert_hf_to_gguf(refs, model, policy):
    ref = refs.info(model, policy.lower())
    assert plan_types(policy, ref.tensors, ref.params) == ref.types


def test_reference_models_cover_the_branches(refs):
    """The reference models reach the branches the rules distinguish (so that the
    comparisons above are not vacuous): gqa >= 4 and < 4, tied and untied, fallbacks,
    LLM_TYPE_70B and n_expert == 8."""
    facts = {m: refs.info(m).params for m in MODELS}
    assert {p.gqa >= 4 for p in facts.values()} == {True, False}
    assert {p.has_output for p in facts.values()} == {True, False}
    assert facts["mixtral"].n_expert == 8
    assert facts["llama_80l"].n_layer == 80 and facts["llama_80l"].n_head != facts["llama_80l"].n_head_kv
    smol = refs.info("smollm2")
    q4km = Counter(plan_types("Q4_K_M", smol.tensors, smol.params).values())
    assert q4km["Q5_0"] > 0 and q4km["Q8_0"] > 0  # fallbacks
    w48 = refs.info("llama_w48")
    assert "F16" in plan_types("Q4_K_M", w48.tensors, w48.params).values()
    big = refs.info("llama_80l")
    with_70b = plan_types("Q3_K_M", big.tensors, big.params)
    as_79 = plan_types("Q3_K_M", big.tensors, replace(big.params, n_layer=79))
    assert with_70b != as_79


# --------------------------------------------------------------------------- unit tests

def test_policy_ids_match_gguf_and_llama_cpp():
    for p in POLICIES:
        enum_name = "ALL_F32" if p == "F32" else f"MOSTLY_{p}"
        assert ftype_id(p) == int(gguf.LlamaFileType[enum_name]), p
    llama_cpp = pytest.importorskip("llama_cpp")
    for p in POLICIES:
        const = "LLAMA_FTYPE_ALL_F32" if p == "F32" else f"LLAMA_FTYPE_MOSTLY_{p}"
        assert ftype_id(p) == getattr(llama_cpp, const), p


def test_default_types():
    assert default_type("Q4_K_M") == "Q4_K" and default_type("Q2_K") == "Q2_K"
    assert default_type("Q3_K_L") == "Q3_K" and default_type("BF16") == "BF16"


def test_unknown_policy_lists_valid_ones():
    with pytest.raises(ValueError, match="Q4_K_M") as e:
        plan_types("Q4_K_XL", [("blk.0.attn_q.weight", (256, 256))], ModelParams("llama", 1, 4, 4))
    assert "Q4_K_XL" in str(e.value)
    with pytest.raises(ValueError):
        ftype_id("q4_k_m")


def test_tensor_order_is_weight_name_comparer():
    names = ["blk.10.attn_q.weight", "blk.2.ffn_up.weight", "token_embd.weight",
             "blk.2.attn_norm.weight", "output.weight", "output_norm.weight", "blk.0.attn_k.weight"]
    assert tensor_order(names) == [
        "output.weight", "output_norm.weight", "token_embd.weight", "blk.0.attn_k.weight",
        "blk.2.attn_norm.weight", "blk.2.ffn_up.weight", "blk.10.attn_q.weight"]


def test_quantizable_filter():
    assert is_quantizable("blk.0.attn_q.weight", (256, 256))
    assert not is_quantizable("blk.0.attn_norm.weight", (256, 256))
    assert not is_quantizable("blk.0.attn_q.bias", (256, 256))
    assert not is_quantizable("blk.0.ffn_gate_inp.weight", (8, 256))
    assert not is_quantizable("blk.0.attn_q.weight", (256,))
    assert not is_quantizable("blk.0.attn_q.weight", (1, 256))  # ggml_n_dims == 1
    assert converter_type("blk.0.ffn_gate_inp.weight", (8, 256), "llama", "F16") == "F32"
    assert converter_type("blk.0.attn_q.weight", (256, 256), "llama", "BF16") == "BF16"


def test_counter_with_experts_reads_layer_from_name():
    params = ModelParams("llama", 8, 4, 2, n_expert=8, has_output=True)
    tensors = [(f"blk.{i}.ffn_down_exps.weight", (8, 256, 256)) for i in (5, 0, 7)]
    planned = plan_types("Q4_K_M", tensors, params)
    assert planned == {"blk.0.ffn_down_exps.weight": "Q6_K", "blk.5.ffn_down_exps.weight": "Q4_K",
                       "blk.7.ffn_down_exps.weight": "Q6_K"}
    with pytest.raises(ValueError, match="layer"):
        plan_types("Q4_K_M", [("blk.9.ffn_down_exps.weight", (8, 256, 256))], params)


def test_expressions_are_whitelisted():
    from quantpress.convert.gguf_policy import PolicyExpr

    env = {"i": 5, "n": 30}
    assert PolicyExpr("(i - n/8) % 3 == 2")(env) is True
    assert PolicyExpr("-7/2")(env) == -3 and PolicyExpr("-7 % 3")(env) == -1  # C semantics
    for bad in ("__import__('os')", "i.real", "x + 1", "[i for i in n]", "i ** 2", "blck"):
        with pytest.raises(ValueError):
            PolicyExpr(bad)


def test_fallback_chain():
    params = ModelParams("llama", 1, 4, 4)
    plan = plan_types("Q4_K_M", [("blk.0.attn_q.weight", (576, 576)), ("blk.0.attn_k.weight", (48, 48)),
                                 ("blk.0.ffn_down.weight", (256, 96))], params)
    assert plan == {"blk.0.attn_q.weight": "Q5_0",     # Q4_K -> Q5_0
                    "blk.0.attn_k.weight": "F16",      # Q4_K -> Q5_0 -> F16 (48 % 32)
                    "blk.0.ffn_down.weight": "Q8_0"}   # Q6_K (layer 0 of 1) -> Q8_0
    assert plan_types("Q8_0", [("blk.0.attn_q.weight", (48, 48))], params) == {"blk.0.attn_q.weight": "F16"}


def test_tied_embeddings_follow_output_rules():
    tensors = [("token_embd.weight", (1024, 256)), ("blk.0.attn_q.weight", (256, 256))]
    tied = plan_types("Q4_K_M", tensors, ModelParams("llama", 1, 4, 4))  # inferred: no output.weight
    assert tied["token_embd.weight"] == "Q6_K"
    untied = plan_types("Q4_K_M", tensors, ModelParams("llama", 1, 4, 4, has_output=True))
    assert untied["token_embd.weight"] == "Q4_K"
    with pytest.raises(ValueError, match="output.weight"):
        plan_types("Q4_K_M", tensors + [("output.weight", (1024, 256))],
                   ModelParams("llama", 1, 4, 4, has_output=False))
