"""``quantize gguf`` (requantizing an F16 GGUF, llama-quantize's job) against llama.cpp itself:
on llama.cpp's own F16 conversions, every tensor's type and bytes, the tensor order and the KVs
(keys, types, values, order) equal ``llama_model_quantize``'s output, for a split model (its
first file) too; an already quantized input and a split model's bad splits are refused,
naming the tensor or file, and nothing is written."""
from __future__ import annotations

import shutil

import pytest
import torch

import llamacpp_tools
import make
from quantpress.cli.quantize_main import main as quantize_main
from refs import kvs_of, ref_quantize, tensors_of


@pytest.fixture(scope="module")
def f16(tmp_path_factory, synth_qwen3_dir):
    """llama.cpp's F16 files: SmolLM2 (tied embeddings, 576-wide rows with fallbacks) and the
    synthetic qwen3 (q/k norms, GQA); and its BF16 file of the qwen3 (loaded as bfloat16)."""
    d = tmp_path_factory.mktemp("requant_f16")
    return {"smollm2": llamacpp_tools.smollm2_gguf("f16"),
            "qwen3": llamacpp_tools.convert_hf(synth_qwen3_dir, d / "qwen3-f16.gguf"),
            "qwen3-bf16": llamacpp_tools.convert_hf(synth_qwen3_dir, d / "qwen3-bf16.gguf", "bf16")}


@pytest.mark.parametrize("model,policy", [("smollm2", "Q4_K_M"), ("qwen3", "Q3_K_S"),
                                          ("qwen3", "Q5_K_M"), ("qwen3", "Q4_0"),
                                          ("qwen3-bf16", "Q4_K_M"), ("qwen3-bf16", "F16")])
def test_requantize_equals_llama_quantize(f16, tmp_path, model, policy):
    src = f16[model]
    if model.endswith("bf16"):
        assert {t for t, _, _ in tensors_of(src).values()} == {"BF16", "F32"}
    ref = ref_quantize(src, tmp_path / "ref.gguf", policy)
    s = make.gguf(src, tmp_path / "ours.gguf", policy)
    assert s.roundtrip.startswith("ok") and s.kind == "gguf" and s.target == policy
    ours_t, ref_t = tensors_of(tmp_path / "ours.gguf"), tensors_of(ref)
    assert list(ours_t) == list(ref_t)  # llama-quantize's order
    for name, (rtype, rshape, rdata) in ref_t.items():
        otype, oshape, odata = ours_t[name]
        assert (otype, oshape) == (rtype, rshape), name
        assert odata == rdata, f"{name} ({otype}): bytes differ from llama-quantize"
    ours_kv, ref_kv = kvs_of(tmp_path / "ours.gguf"), kvs_of(ref)
    assert list(ours_kv) == list(ref_kv)  # same keys in the same order
    for k, (types, value) in ref_kv.items():
        assert ours_kv[k][0] == types, k
        assert ours_kv[k][1] == value, k
    assert (tmp_path / "ours.gguf").stat().st_size == ref.stat().st_size


def test_already_quantized_input_is_refused(tmp_path, capsys):
    q8 = llamacpp_tools.smollm2_gguf("q8_0")
    capsys.readouterr()  # llama.cpp's log, if it made the file just now
    out = tmp_path / "o.gguf"
    assert quantize_main(["gguf", str(q8), "--policy", "Q4_K_M", "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'token_embd.weight' is already quantized (Q8_0)" in err[0], err
    assert "start from an F32/F16/BF16 file" in err[0]
    assert list(tmp_path.iterdir()) == []
    assert quantize_main(["gguf", str(tmp_path / "none.gguf"), "--policy", "Q4_K_M", "-o", str(out),
                          "--quiet"]) == 2
    assert "none.gguf: no such file" in capsys.readouterr().err


def _rss_file_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile")) / 1024


def test_reading_the_source_does_not_keep_its_pages(f16):
    """Each source tensor's pages of the input's memory map are released once copied, so that
    the process's RSS does not grow with the input file (SmolLM2's F16 embedding: 54 MiB)."""
    from quantpress.targets.gguf import plan_from_gguf

    plan = plan_from_gguf(f16["smollm2"], "Q4_K_M")
    emb = next(t for t in plan.tensors if t.name == "token_embd.weight")
    before = _rss_file_mib()
    x = emb.load()
    grown = _rss_file_mib() - before
    assert x.shape == (49152, 576) and x.dtype.is_floating_point
    assert grown < 4, f"RssFile grew by {grown:.1f} MiB reading a 54 MiB tensor"


@pytest.fixture(scope="module")
def split_f16(tmp_path_factory, synth_qwen3_dir):
    """The synthetic qwen3 as llama.cpp's converter splits it (``convert_hf_to_gguf.py
    --split-max-tensors 60``): its files in split order."""
    d = tmp_path_factory.mktemp("split_f16")
    llamacpp_tools.convert_hf(synth_qwen3_dir, d / "qwen3-f16.gguf", extra=("--split-max-tensors", "60"))
    files = sorted(d.glob("qwen3-f16-*-of-*.gguf"))
    assert len(files) >= 3 and files[0].name.endswith("-00001-of-%05d.gguf" % len(files))
    return files


def test_split_input_equals_llama_quantize(split_f16, f16, tmp_path):
    """A split model given by its first file: every split's tensors quantized into one file,
    byte for byte llama-quantize's from the same split files (KVs of the first split without
    its split keys, llama.cpp's tensor order), and the same tensors as from the model's
    unsplit conversion; the GGUF reader of eval and calibration sees the whole model too."""
    from quantpress.convert import gguf_load

    ref = ref_quantize(split_f16[0], tmp_path / "ref.gguf", "Q4_K_M")
    s = make.gguf(split_f16[0], tmp_path / "ours.gguf", "Q4_K_M")
    assert s.roundtrip.startswith("ok")
    ours_t, ref_t = tensors_of(tmp_path / "ours.gguf"), tensors_of(ref)
    assert list(ours_t) == list(ref_t) and ours_t == ref_t
    ours_kv, ref_kv = kvs_of(tmp_path / "ours.gguf"), kvs_of(ref)
    assert list(ours_kv) == list(ref_kv) and ours_kv == ref_kv
    assert not any(k.startswith("split.") for k in ours_kv)
    whole = make.gguf(f16["qwen3"], tmp_path / "whole.gguf", "Q4_K_M")
    assert whole.roundtrip.startswith("ok") and tensors_of(tmp_path / "whole.gguf") == ours_t

    split_w, whole_w = gguf_load.GGUFWeights(split_f16[0]), gguf_load.GGUFWeights(f16["qwen3"])
    assert list(split_w.keys()) == list(whole_w.keys())
    assert split_w.metadata == whole_w.metadata
    last = gguf_load.read_header(split_f16[-1])[1][-1].name
    name = next(k for k in split_w.keys() if split_w.gguf_names[k] == last)
    assert torch.equal(split_w.get(name), whole_w.get(name))


def test_split_input_errors(split_f16, tmp_path, capsys):
    """A split model's bad input, each refused with exit 2 in one line naming the file, nothing
    written: a later split given instead of the first, the first renamed (its splits cannot
    be found), a missing split, a split with another split.no in its place."""
    out = tmp_path / "out" / "o.gguf"
    out.parent.mkdir()
    n = len(split_f16)

    def refused(src, *expect):
        capsys.readouterr()
        assert quantize_main(["gguf", str(src), "--policy", "Q4_K_M", "-o", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(e in err[0] for e in expect), err
        assert list(out.parent.iterdir()) == []

    refused(split_f16[1], f"split 2 of {n} of a split model; pass its first file ({split_f16[0].name})")
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(split_f16[0], renamed)
    refused(renamed, f"renamed.gguf: the first of {n} splits", f"'-00001-of-{n:05d}.gguf'")
    d = tmp_path / "missing"
    d.mkdir()
    for f in split_f16[:-1]:
        (d / f.name).symlink_to(f)
    refused(d / split_f16[0].name, f"{d / split_f16[-1].name}: split of {split_f16[0].name} missing")
    (d / split_f16[-1].name).symlink_to(split_f16[1])
    refused(d / split_f16[0].name, f"{d / split_f16[-1].name}: split.no is 1, expected {n - 1}")


def test_check_splits_rules(tmp_path):
    """llama_model_loader's checks of a split model, each naming the file: a tensor in two
    splits, split.tensors.count against the tensors found, a split without split.no; a
    consistent split model and a single file pass."""
    from quantpress.convert.gguf_load import check_splits
    from quantpress.errors import InputError

    files = [tmp_path / f"m-{i:05d}-of-00002.gguf" for i in (1, 2)]
    check_splits(files[0], files, [0, 1], [["a", "b"], ["c"]], 3)
    check_splits(files[0], files[:1], [None], [["a", "b"]], None)
    with pytest.raises(InputError, match=f"{files[1]}: tensor 'b' is also in an earlier split"):
        check_splits(files[0], files, [0, 1], [["a", "b"], ["b"]], 3)
    with pytest.raises(InputError, match=f"{files[0]}: split.tensors.count is 4, but its splits hold 3"):
        check_splits(files[0], files, [0, 1], [["a", "b"], ["c"]], 4)
    with pytest.raises(InputError, match=f"{files[1]}: no split.no key"):
        check_splits(files[0], files, [0, None], [["a"], ["c"]], 2)
