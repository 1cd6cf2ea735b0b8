"""``scripts/gpu_checks.py`` smoke-tested on the CPU: with ``--device-b cpu`` it compares the CPU
with itself, so every check must come out identical; its comparisons report a difference when
there is one; and asking for CUDA where there is none exits 2 with one line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_checks.py"
TYPES = ["F16", "Q4_0", "Q8_0", "Q2_K", "Q4_K", "Q6_K"]
FAST = ["--samples", "2", "--seqlen", "32", "--eval-ctx", "32", "--eval-chunks", "1",
        "--types", ",".join(TYPES + ["IQ2_XXS"]), "--shapes", "64x256,8x4096", "--repeat", "1"]


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, smollm2_dir):
    """One CPU-vs-CPU run of the whole script on the random 2-layer llama; its outputs kept."""
    d = tmp_path_factory.mktemp("gpu_checks")
    out, work = d / "report.json", d / "work"
    p = subprocess.run([sys.executable, str(SCRIPT), "--device-b", "cpu", "--out", str(out),
                        "--work", str(work), "--tokenizer", str(smollm2_dir), *FAST],
                       env=_env(), capture_output=True, text=True, timeout=900)
    return p, out, work


def test_cpu_against_cpu_is_identical_everywhere(smoke):
    p, out, _ = smoke
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["devices"] == {"a": "cpu", "b": "cpu"} and r["torch"] and r["seconds"] > 0
    assert {"device", "cuda", "checks"} <= set(r)
    # no --calib: the default text of every command, exllamav2's wiki.utf8 split
    assert r["calibration"]["text"].endswith("standard_cal_data/wiki.utf8 (default split)"), r["calibration"]
    checks = r["checks"]
    assert set(checks) == {"ggml", "awq", "exl2", "stages", "batch"}
    for name, c in checks.items():
        assert "error" not in c, (name, c.get("traceback"))
        assert c["identical"] is True and c["pass"] is True, name

    g = checks["ggml"]
    assert sorted(g["types"]) == sorted(TYPES) and g["unknown_types"] == ["IQ2_XXS"]
    for t, v in g["types"].items():
        assert set(v["shapes"]) >= {"64x256", "8x4096"}, t
        for s in v["shapes"].values():
            assert s["bytes_identical"] and s["dequant_identical"] and s["a_s"] >= 0 and s["b_s"] >= 0

    awq, exl2 = checks["awq"], checks["exl2"]
    assert len(awq["linears"]) == 14    # 2 layers x 7 linears (lm_head stays FP16 in AWQ)
    for v in awq["linears"].values():
        assert v["max_abs_diff"] == 0.0 and v["qweight_identical"] == 1.0 and v["max_step"] > 0
    assert "lm_head" in exl2["linears"] and len(exl2["linears"]) == 15
    assert exl2["allocation_identical"] and len(exl2["layers_a"]) == 2
    for v in exl2["linears"].values():
        assert v["max_abs_diff"] == 0.0 and v["q_weight_identical"] == 1.0 and v["max_step"] > 0
        assert 0 < v["rel_err_a"] == v["rel_err_b"] < 0.5
    assert all(awq["files_identical"].values()) and all(exl2["files_identical"].values())

    st = checks["stages"]
    for kind in ("awq", "exl2"):
        assert st[kind]["stages"] and all(v["a"] is not None and v["b"] is not None
                                          for v in st[kind]["stages"].values())
    assert "measurement" in st["exl2"]["stages"]

    b = checks["batch"]
    paths = {"tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny.imatrix.gguf", "tiny-AWQ-w4g64",
             "measurement.json", "tiny-EXL2-4.0bpw", "tiny-EXL2-5.0bpw"}
    assert set(b["outputs_identical"]) == paths and all(b["outputs_identical"].values())
    for side in ("a", "b"):
        assert b[side]["exit_code"] == 0 and b[side]["seconds"] > 0
        assert {row["path"] for row in b[side]["rows"]} == paths
        assert b[side]["eval"]["tiny-Q8_0.gguf"]["kld"] >= 0
    assert b["compared"] == {}                  # (nothing differs)
    assert b["eval"]["tiny-Q8_0.gguf"]["rel_diff"] == 0.0 and b["eval"]["tiny-Q8_0.gguf"]["kld_a"] >= 0


def test_the_comparisons_see_differences(smoke, tmp_path, monkeypatch, capsys):
    """The same comparison functions on outputs made to differ: not identical, and the
    tolerances fail where the difference exceeds them."""
    import gpu_checks
    from safetensors.torch import load_file, save_file

    p, _, work = smoke
    assert p.returncode == 0, p.stderr[-3000:]
    # AWQ: one qweight word of one linear changed (its nibbles all flipped)
    other = tmp_path / "awq-b"
    shutil.copytree(work / "awq-b", other)
    f = sorted(other.glob("*.safetensors"))[0]
    tensors = load_file(f)
    name = "model.layers.0.mlp.down_proj.qweight"
    tensors[name][0, 0] = ~tensors[name][0, 0]
    save_file(tensors, f, metadata={"format": "pt"})
    c = gpu_checks.compare_awq(work / "awq-a", other)
    assert c["identical"] is False and c["pass"] is False
    bad = c["linears"]["model.layers.0.mlp.down_proj"]
    assert bad["qweight_identical"] < 1.0 and bad["max_abs_diff"] > bad["max_step"] > 0
    assert c["linears"]["model.layers.1.mlp.down_proj"]["max_abs_diff"] == 0.0

    # EXL2: another allocation for one layer
    model = work / "tiny-llama"
    alloc = [{"layer": 0, "attn": 1, "mlp": 2}, {"layer": 1, "attn": 1, "mlp": 2}]
    moved = [dict(alloc[0]), dict(alloc[1], mlp=3)]
    c = gpu_checks.compare_exl2(work / "exl2-a", work / "exl2-b", alloc, moved, model)
    assert c["allocation_identical"] is False and c["identical"] is False and c["pass"] is False
    # EXL2: one linear's reconstruction 5% larger (its q_scale_max scaled): its relative error
    # moves by more than EXL2_REL_ERR, the others stay equal
    other = tmp_path / "exl2-b"
    shutil.copytree(work / "exl2-b", other)
    f = other / "output.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mlp.down_proj.q_scale_max"] *= 1.05
    save_file(tensors, f, metadata={"format": "pt"})
    c = gpu_checks.compare_exl2(work / "exl2-a", other, alloc, alloc, model)
    assert c["allocation_identical"] is True and c["identical"] is False and c["pass"] is False
    bad = c["linears"]["model.layers.0.mlp.down_proj"]
    assert bad["pass"] is False and bad["rel_err_b"] > bad["rel_err_a"] * (1 + gpu_checks.EXL2_REL_ERR)
    assert all(v["pass"] and v["rel_err_a"] == v["rel_err_b"] for m, v in c["linears"].items()
               if m != "model.layers.0.mlp.down_proj")

    # batch: one output with another checksum, one run failed
    ok = {"exit_code": 0, "seconds": 1.0, "rows": [{"path": "x.gguf", "status": "made"}],
          "manifest": {"x.gguf": {"files": {"x.gguf": "00"}, "eval": None, "roundtrip": "ok"}}}
    changed = json.loads(json.dumps(ok))
    changed["manifest"]["x.gguf"]["files"]["x.gguf"] = "11"
    c = gpu_checks.compare_batches(ok, changed)
    assert c["identical"] is False and c["pass"] is True
    failed = dict(ok, exit_code=3, rows=[{"path": "x.gguf", "status": "failed"}])
    assert gpu_checks.compare_batches(ok, failed)["pass"] is False

    # batch outputs that differ, compared by kind: the imatrix with one importance moved by
    # 3x IMATRIX_REL fails, by a third of it passes; an EXL2 output with one linear 5% larger fails
    from quantpress.convert.imatrix_file import read_imatrix, write_imatrix

    src_a = work / "batch-a" / "tiny"
    im_path, exl2_path = "tiny.imatrix.gguf", "tiny-EXL2-4.0bpw"
    rows = [{"path": im_path, "status": "made"}, {"path": exl2_path, "status": "made"}]

    def run(digest: str, kld: float) -> dict:
        return {"exit_code": 0, "seconds": 1.0, "rows": rows,
                "manifest": {p: {"files": {p: digest}, "eval": {"kld": kld}, "roundtrip": "ok"}
                             for p in (im_path, exl2_path)}}
    for factor, passes in ((1 + 3 * gpu_checks.IMATRIX_REL, False), (1 + gpu_checks.IMATRIX_REL / 3, True)):
        side_b = tmp_path / f"batch-b-{passes}"
        side_b.mkdir()
        shutil.copytree(src_a / exl2_path, side_b / exl2_path)
        im = read_imatrix(src_a / im_path)
        name = sorted(im.sums)[3]
        im.sums[name][0, 5] *= factor
        write_imatrix(side_b / im_path, im)
        if not passes:
            f = side_b / exl2_path / "output.safetensors"
            tensors = load_file(f)
            tensors["model.layers.1.self_attn.o_proj.q_scale_max"] *= 1.05
            save_file(tensors, f, metadata={"format": "pt"})
        c = gpu_checks.compare_batches(run("00", 0.010), run("11", 0.012), src_a, side_b, model)
        assert c["identical"] is False and c["pass"] is passes
        ci = c["compared"][im_path]
        assert ci["identical"] is False and ci["pass"] is passes and ci["worst"] == name and ci["counts_equal"]
        assert abs(ci["max_rel_diff"] - (factor - 1) / factor) < 1e-6
        ce = c["compared"][exl2_path]
        assert ce["allocation_identical"] and ce["pass"] is passes and ce["identical"] is passes
        if not passes:
            assert ce["linears"]["model.layers.1.self_attn.o_proj"]["pass"] is False
        assert c["eval"][im_path] == {"kld_a": 0.010, "kld_b": 0.012, "rel_diff": pytest.approx(1 / 6)}
        # the same comparison from the command line
        assert gpu_checks.main(["--compare-imatrix", str(src_a / im_path), str(side_b / im_path)]) == 0
        assert json.loads(capsys.readouterr().out) == ci

    # ggml: device B's bytes differ in one bit (device "cpu-b" = the CPU, one byte flipped)
    real = gpu_checks.time_quantize

    def flipped_on_b(x, name, device, repeat, **kw):
        raw, deq, t = real(x, name, "cpu", repeat, **kw)
        if device == "cpu-b":
            raw = raw.clone()
            raw[0, 0] ^= 1
        return raw, deq, t

    monkeypatch.setattr(gpu_checks, "time_quantize", flipped_on_b)
    c = gpu_checks.check_ggml(["Q8_0", "Q4_K"], [(4, 256)], "cpu", "cpu-b", repeat=1)
    assert c["identical"] is False and c["pass"] is False
    for t in ("Q8_0", "Q4_K"):
        s = c["types"][t]["shapes"]["4x256"]
        assert s["bytes_identical"] is False and s["differing_bytes"] == 1 and s["dequant_identical"]


def test_source_weights_of_a_tied_head_are_the_embedding(tmp_path, smollm2_dir):
    """The exl2 check's reference weights: a tied lm_head is read as the token embedding; a
    linear the model lacks is named in a CheckError."""
    import gpu_checks
    import synth
    import torch
    from quantpress.convert.hf import HFModel

    model = synth.make_model(tmp_path / "tied", "llama", smollm2_dir, num_hidden_layers=1,
                             tie_word_embeddings=True)
    hf = HFModel(model)
    assert "lm_head.weight" not in hf.names
    w = gpu_checks.source_weights(model, ["lm_head", "model.layers.0.mlp.down_proj"])
    assert torch.equal(w["lm_head"], hf.tensor("model.embed_tokens.weight").float())
    assert torch.equal(w["model.layers.0.mlp.down_proj"],
                       hf.tensor("model.layers.0.mlp.down_proj.weight").float())
    with pytest.raises(gpu_checks.CheckError, match="model.layers.0.mlp.gate"):
        gpu_checks.source_weights(model, ["model.layers.0.mlp.gate"])


def test_hessian_noise_perturbs_every_factorization_while_active():
    """--hessian-noise's stand-in for another device: the Hessians that both import sites of
    hessian_factor see are perturbed while the context is active, and only then."""
    import gpu_checks
    import torch
    import quantpress.calibration.exl2_measure as measure
    import quantpress.quantize.gptq as gptq

    real = gptq.hessian_factor
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    H = x.T @ x / 256
    plain = real(H, 64).upper
    with gpu_checks.hessian_noise(1e-3):
        assert measure.hessian_factor is gptq.hessian_factor is not real
        noisy = gptq.hessian_factor(H, 64).upper
        again = measure.hessian_factor(H, 64).upper
    assert measure.hessian_factor is gptq.hessian_factor is real
    assert torch.equal(noisy, again) and not torch.equal(noisy, plain)
    with gpu_checks.hessian_noise(0.0):
        assert gptq.hessian_factor is real and torch.equal(real(H, 64).upper, plain)


def test_calibration_text_is_the_default_data_or_a_clear_error(tmp_path, monkeypatch):
    """No --calib: exllamav2's standard_cal_data, as every command reads it; when that can be
    neither found nor fetched, an error naming --calib (never a file of the repository)."""
    import gpu_checks
    from quantpress import assets

    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert gpu_checks.calibration_text(str(text)) == (str(text.resolve()), None)
    with pytest.raises(gpu_checks.CheckError, match=r"^--calib .*nope\.txt: no such file$"):
        gpu_checks.calibration_text(str(tmp_path / "nope.txt"))
    assert gpu_checks.calibration_text(None) == (None, assets.standard_cal_data())

    def offline():
        raise OSError("no network")
    monkeypatch.setattr(assets, "standard_cal_data", offline)
    with pytest.raises(gpu_checks.CheckError) as e:
        gpu_checks.calibration_text(None)
    msg = str(e.value)
    assert msg.startswith("no calibration text: cannot fetch exllamav2's calibration data") and "--calib FILE" in msg
    assert "\n" not in msg and "README" not in msg


def test_no_cuda_exits_2_with_one_line(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)],
                       env=_env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA is not available" in lines[0] and p.stdout == ""
    assert not out.exists()
