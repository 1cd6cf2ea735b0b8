"""``quantize imatrix``: our importance matrix against llama.cpp's own ``llama-imatrix`` on the
same model and tokens (file layout byte for byte, values per tensor), accepted by
``llama-quantize --imatrix`` and equal to what ``llama_model_quantize`` gets from it, and bad
input (one-line errors, exit 2, no file left)."""
from __future__ import annotations

import ctypes
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from quantpress import assets
import llamacpp_tools
import make
import synth
from quantpress.calibration import data
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.convert.imatrix_file import Imatrix, imatrix_bytes, read_imatrix, write_imatrix
from quantpress.errors import InputError
from quantpress.targets.imatrix import imatrix_from_rows
from refs import tensors_of

N_CTX, N_CHUNKS = 256, 4


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    """Plain text of the first calibration articles (≈6k tokens; llama-imatrix reads it)."""
    p = tmp_path_factory.mktemp("imatrix_text") / "calib.txt"
    p.write_text("\n\n".join(a.strip() for a in data.calibration_articles(assets.standard_cal_data())[:12]),
                 encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def f16_gguf() -> Path:
    return llamacpp_tools.smollm2_gguf("f16")


@pytest.fixture(scope="module")
def both(tmp_path_factory, smollm2_dir, f16_gguf, calib_text):
    """(ours, llama-imatrix's) on the same tokens: llama-imatrix -c 256 --chunks 4 over the
    text; ours over the same 4 consecutive 256-token windows of llama.cpp's tokenization of
    it (llama.cpp's "smollm" pre-tokenizer differs from HF's on "\n\n" before digits)."""
    import llama_cpp

    d = tmp_path_factory.mktemp("imatrix_cmp")
    ref = d / "llamacpp.imatrix.gguf"
    subprocess.run([str(llamacpp_tools.tool("llama-imatrix")), "-m", str(f16_gguf), "-f", str(calib_text),
                    "-o", str(ref), "-c", str(N_CTX), "-b", str(N_CTX), "--chunks", str(N_CHUNKS),
                    "--no-ppl", "-t", "2"], check=True, capture_output=True)
    vocab = llama_cpp.Llama(str(f16_gguf), vocab_only=True, verbose=False)
    ids = vocab.tokenize(calib_text.read_text(encoding="utf-8").encode(), add_bos=False, special=False)
    del vocab
    rows = torch.tensor(ids[: N_CTX * N_CHUNKS]).view(N_CHUNKS, N_CTX)  # SmolLM2: no BOS
    entries = imatrix_from_rows(make.source(smollm2_dir), rows, progress=False)
    from quantpress.convert.imatrix_file import from_stats
    ours = d / "ours.imatrix.gguf"
    write_imatrix(ours, from_stats(entries, [str(calib_text)], N_CHUNKS, N_CTX))
    return ours, ref


def test_file_layout_is_llamacpps(both, calib_text):
    """Same KVs (keys, types, order), tensors (names, shapes, types, order); and re-writing
    llama-imatrix's own file with our writer reproduces it byte for byte."""
    from gguf import GGUFReader

    ours, ref = both
    ro, rr = GGUFReader(str(ours)), GGUFReader(str(ref))
    assert [(k, f.types) for k, f in ro.fields.items()] == [(k, f.types) for k, f in rr.fields.items()]
    assert "general.architecture" not in rr.fields
    assert [(t.name, t.shape.tolist(), int(t.tensor_type)) for t in ro.tensors] == \
           [(t.name, t.shape.tolist(), int(t.tensor_type)) for t in rr.tensors]
    assert len(ro.tensors) == 2 * 7 * 30
    a, b = read_imatrix(ours), read_imatrix(ref)
    assert (a.chunk_count, a.chunk_size) == (b.chunk_count, b.chunk_size) == (N_CHUNKS, N_CTX)
    assert b.datasets == [str(calib_text)] == a.datasets
    assert imatrix_bytes(b) == ref.read_bytes()


def test_values_agree_with_llama_imatrix(both):
    a, b = read_imatrix(both[0]), read_imatrix(both[1])
    assert set(a.sums) == set(b.sums)
    corr, rel = {}, []
    for name in a.sums:
        assert a.counts[name].tolist() == b.counts[name].tolist() == [N_CHUNKS * N_CTX]
        x, y = a.sums[name].reshape(-1).astype(np.float64), b.sums[name].reshape(-1).astype(np.float64)
        corr[name] = float(np.corrcoef(x, y)[0, 1])
        assert np.allclose(x, y, rtol=1e-2, atol=1e-4 * y.max()), name
        rel.append(np.median(np.abs(x - y) / np.maximum(np.abs(y), 1e-12)))
    worst = min(corr, key=corr.get)
    # measured: worst correlation 0.9999998, worst median relative difference 6e-4 (float32
    # transformers against llama.cpp's F16 matmuls)
    assert corr[worst] >= 0.9999, (worst, corr[worst])
    assert max(rel) <= 2e-3, max(rel)


def _quantize(src: Path, out: Path, imatrix: dict[str, np.ndarray] | None) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    p.nthread = 2
    keep = []
    if imatrix is not None:
        arr = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, v) in enumerate(sorted(imatrix.items())):
            buf = np.ascontiguousarray(v, dtype=np.float32)
            keep += [name.encode(), buf]
            arr[i].name = keep[-2]
            arr[i].data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = buf.size
        arr[len(imatrix)].name = None
        p.imatrix = arr
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(p)) == 0


def test_llama_quantize_accepts_our_imatrix(both, f16_gguf, tmp_path):
    """llama-quantize --imatrix reads our file (its metadata keys land in the output) and the
    result equals llama_model_quantize given our file's importance (in_sum2 / counts), and
    differs from quantizing without an imatrix."""
    from refs import kvs_of

    ours = both[0]
    cli_out = tmp_path / "cli-Q4_K_M.gguf"
    r = subprocess.run([str(llamacpp_tools.tool("llama-quantize")), "--imatrix", str(ours), str(f16_gguf),
                        str(cli_out), "Q4_K_M", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    kv = kvs_of(cli_out)
    assert kv["quantize.imatrix.entries_count"][1] == 210
    assert kv["quantize.imatrix.chunks_count"][1] == N_CHUNKS
    assert kv["quantize.imatrix.file"][1] == str(ours)
    api_out = tmp_path / "api-Q4_K_M.gguf"
    _quantize(f16_gguf, api_out, read_imatrix(ours).importance())
    plain = tmp_path / "plain-Q4_K_M.gguf"
    _quantize(f16_gguf, plain, None)
    a, b, c = tensors_of(cli_out), tensors_of(api_out), tensors_of(plain)
    assert a == b
    assert a["blk.5.ffn_down.weight"][2] != c["blk.5.ffn_down.weight"][2]


def test_cli_imatrix_default_and_calib(smollm2_dir, calib_text, tmp_path, capsys):
    out = tmp_path / "im.gguf"
    args = ["imatrix", str(smollm2_dir), "-o", str(out), "--calib", str(calib_text), "--samples", "3",
            "--seqlen", "64", "--device", "cpu", "--quiet"]
    assert quantize_main(args + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["kind"] == "imatrix" and js["details"]["entries"] == 210 and js["details"]["tokens"] == 192
    assert js["roundtrip"].startswith("ok (210 entries") and js["files"] == {"im.gguf": out.stat().st_size}
    im = read_imatrix(out)
    assert im.datasets == [str(calib_text)] and (im.chunk_count, im.chunk_size) == (3, 64)
    assert all(c.tolist() == [192.0] for c in im.counts.values())
    first = out.read_bytes()
    assert quantize_main(args) == 2  # exists
    assert "already exists (use --force" in capsys.readouterr().err
    assert quantize_main(args + ["--force"]) == 0  # fixed seed: same rows, same file
    assert out.read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == ["im.gguf"]


def test_writer_roundtrip_and_importance(tmp_path):
    im = Imatrix(datasets=["a.txt", "b.txt"], chunk_count=7, chunk_size=512)
    im.add("blk.0.ffn_down.weight", torch.arange(1, 65, dtype=torch.float32), 10)
    im.add("blk.0.ffn_gate_exps.weight", np.ones((4, 32), np.float32), np.array([2, 0, 4, 8]))
    write_imatrix(tmp_path / "x.gguf", im)
    back = read_imatrix(tmp_path / "x.gguf")
    assert back.datasets == im.datasets and back.chunk_count == 7 and back.chunk_size == 512
    assert back.sums["blk.0.ffn_gate_exps.weight"].shape == (4, 32)
    imp = back.importance()
    assert np.allclose(imp["blk.0.ffn_down.weight"], np.arange(1, 65) / 10)
    assert np.allclose(imp["blk.0.ffn_gate_exps.weight"].reshape(4, 32)[:, 0], [0.5, 1.0, 0.25, 0.125])
    with pytest.raises(InputError, match="non-finite"):
        im.add("x", np.array([np.nan]), 1)
    bad = tmp_path / "noimeta.gguf"
    from gguf import GGUFWriter
    w = GGUFWriter(str(bad), "llama")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones(4, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(InputError, match=r"missing imatrix metadata \(imatrix.datasets"):
        read_imatrix(bad)


# --------------------------------------------------------------------------------------------
# Bad input

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("imatrix_tiny")
    good = synth.make_model(root / "good", "llama", smollm2_dir, num_hidden_layers=2)
    from safetensors.torch import load_file, save_file
    bad = synth.make_model(root / "inf", "llama", smollm2_dir, num_hidden_layers=2)
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.1.input_layernorm.weight"][5] = float("inf")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return good, bad


def _fails(args, capsys, match: str) -> None:
    assert quantize_main(args + ["--quiet", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err


def test_imatrix_bad_input(tiny, calib_text, tmp_path, capsys):
    good, bad = tiny
    out = tmp_path / "out" / "im.gguf"
    out.parent.mkdir()
    base = ["imatrix", str(good), "-o", str(out), "--samples", "2", "--seqlen", "32"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _fails(base + ["--calib", str(empty)], capsys, "empty.txt: calibration file is empty")
    j = tmp_path / "c.jsonl"
    j.write_text('{"content": "some text here"}\n')
    _fails(base + ["--calib", str(j)], capsys, "c.jsonl: no column 'text'; available columns: content")
    _fails(base + ["--calib", str(j), "--calib-field", "content"], capsys,
           "tokens, 64 needed (2 samples x 32 tokens)")
    pq = tmp_path / "garbage.parquet"
    pq.write_bytes(b"not parquet at all" * 10)
    _fails(base + ["--calib", str(pq)], capsys, "garbage.parquet: cannot read as parquet")
    _fails(base + ["--calib", str(tmp_path / "nope.txt")], capsys, "nope.txt: calibration file not found")
    _fails(["imatrix", str(bad), "-o", str(out), "--samples", "2", "--seqlen", "32", "--calib", str(calib_text)],
           capsys, "non-finite activations (NaN/Inf) at the input of model.layers.1.self_attn")
    _fails(["imatrix", str(tmp_path / "nomodel"), "-o", str(out), "--calib", str(calib_text)], capsys,
           "nomodel: no such file or directory")
    assert list(out.parent.iterdir()) == []  # nothing half-written
    assert quantize_main(base + ["--calib", str(calib_text), "--quiet", "--device", "cpu"]) == 0
    assert read_imatrix(out).counts["blk.1.ffn_down.weight"].tolist() == [64.0]


def test_gguf_model_gives_the_same_imatrix(smollm2_dir, f16_gguf):
    """A GGUF input goes through the same engine after dequantization: on llama.cpp's own F16
    conversion (exact fp16 weights, Q/K un-permuted) the statistics equal the HF directory's."""
    rows = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(3))
    a = imatrix_from_rows(make.source(smollm2_dir), rows, progress=False)
    b = imatrix_from_rows(make.source(f16_gguf), rows, progress=False)
    assert a.keys() == b.keys() and len(a) == 210
    for name in a:
        assert a[name][1] == b[name][1] == 96
        torch.testing.assert_close(a[name][0], b[name][0], rtol=1e-6, atol=0)
