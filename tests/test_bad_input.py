"""Bad input: one-line message naming the file or tensor, non-zero exit, no output file."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from quantpress.cli.convert_main import main as convert_main

EXIT_BAD_INPUT = 2


def run(capsys, *args):
    code = convert_main(["hf-to-gguf", *map(str, args), "--quiet"])
    err = capsys.readouterr().err.strip()
    return code, err


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def model(tmp_path, tiny_llama_dir):
    return copy_model(tiny_llama_dir, tmp_path / "model")


def no_output(tmp_path, out):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")], "temporary file left"


def test_missing_config(tmp_path, capsys, model):
    (model / "config.json").unlink()
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "config.json" in err and "missing" in err and len(err.splitlines()) == 1
    no_output(tmp_path, out)


def test_invalid_config(tmp_path, capsys, model):
    (model / "config.json").write_text("{not json")
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "config.json" in err and "invalid JSON" in err
    no_output(tmp_path, out)


def test_missing_tokenizer(tmp_path, capsys, model):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (model / f).unlink()
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "tokenizer" in err and str(model) in err
    no_output(tmp_path, out)


def test_unsupported_architecture(tmp_path, capsys, model):
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "GPTNeoXForCausalLM" in err
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in err
    no_output(tmp_path, out)


def test_truncated_safetensors(tmp_path, capsys, model):
    f = model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "model.safetensors" in err
    no_output(tmp_path, out)


def test_corrupt_safetensors_header(tmp_path, capsys, model):
    f = model / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\x00garbage\x00\xff\xfe\x01"
    f.write_bytes(bytes(data))
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "model.safetensors" in err
    no_output(tmp_path, out)


def test_tensor_in_index_but_absent(tmp_path, capsys, model):
    tensors = load_file(model / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, model / "model-00001-of-00002.safetensors",
              metadata={"format": "pt"})
    missing = names[-1]
    save_file({n: tensors[n] for n in names[half:-1]}, model / "model-00002-of-00002.safetensors",
              metadata={"format": "pt"})
    (model / "model.safetensors").unlink()
    weight_map = {n: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
                  for i, n in enumerate(names)}
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and missing in err and "model-00002-of-00002.safetensors" in err
    no_output(tmp_path, out)


def test_nan_in_weight_names_tensor(tmp_path, capsys, model):
    tensors = load_file(model / "model.safetensors")
    victim = "model.layers.1.mlp.up_proj.weight"
    tensors[victim][5, 7] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "--policy", "Q4_K_M", "-o", out)
    assert code == EXIT_BAD_INPUT and "blk.1.ffn_up.weight" in err and "NaN" in err
    no_output(tmp_path, out)


def test_inf_in_weight_names_tensor(tmp_path, capsys, model):
    tensors = load_file(model / "model.safetensors")
    victim = "model.norm.weight"
    tensors[victim][0] = float("inf")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "o.gguf"
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and "output_norm.weight" in err and "Inf" in err
    no_output(tmp_path, out)


def test_existing_output_needs_force(tmp_path, capsys, model):
    out = tmp_path / "o.gguf"
    out.write_bytes(b"precious")
    code, err = run(capsys, model, "-o", out)
    assert code == EXIT_BAD_INPUT and str(out) in err and "--force" in err
    assert out.read_bytes() == b"precious"
    code, err = run(capsys, model, "-o", out, "--force")
    assert code == 0 and out.read_bytes()[:4] == b"GGUF"


def test_output_dir_not_writable(tmp_path, capsys, model, monkeypatch):
    d = tmp_path / "ro"
    d.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **k: False if str(p) == str(d) else real_access(p, m, **k))
    code, err = run(capsys, model, "-o", d / "o.gguf")
    assert code == EXIT_BAD_INPUT and str(d) in err and "not writable" in err
    assert list(d.iterdir()) == []


def test_output_dir_missing(tmp_path, capsys, model):
    code, err = run(capsys, model, "-o", tmp_path / "nope" / "o.gguf")
    assert code == EXIT_BAD_INPUT and "nope" in err and "does not exist" in err


def test_roundtrip_mismatch_fails_command_and_leaves_nothing(tmp_path, capsys, model, monkeypatch):
    from quantpress.convert import gguf_file, gguf_roundtrip

    real = gguf_file.ggml.dequantize

    def broken(raw, name):
        out = real(raw, name)
        if name == "Q4_K":
            out = out.clone()
            out.view(-1)[0] += 1.0
        return out

    monkeypatch.setattr(gguf_file.ggml, "dequantize", broken)
    monkeypatch.setattr(gguf_roundtrip, "USE_PROCESSES", False)   # the broken codec is this process's
    out = tmp_path / "o.gguf"
    code = convert_main(["hf-to-gguf", str(model), "--policy", "Q4_K_M", "-o", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and "round-trip" in err and "differ" in err
    no_output(tmp_path, out)


@pytest.mark.parametrize("key, table, bad", [
    ("awq", "{ group_size = 64, groups = 2 }", "groups"),
    ("gptq", "{ bits = 4, desc_act = true }", "desc_act"),
    ("fp8", "{ schema = 'static' }", "schema"),
    ("exl2", "{ bpw = 4.0, measurement = 'm.json' }", "measurement"),   # per model: exl2_measurement
    ("gguf", "{ policy = 'Q8_0', imatrix_file = 'x' }", "imatrix_file"),
])
def test_job_file_unknown_key_lists_the_declared_keys(tmp_path, tiny_llama_dir, capsys, key, table, bad):
    """An unknown key of a job-file table names the section, the key and every key the kind's
    options declare (from the declaration, not a list kept in batch/); exit 2, nothing written."""
    from quantpress.cli.quantize_main import main as quantize_main
    from quantpress.targets.options import job_keys
    from quantpress.targets.registry import registered

    cls = next(c for c in registered() if c.job_key == key)
    job = tmp_path / "j.toml"
    job.write_text(f'[[model]]\nsource = "{tiny_llama_dir}"\nname = "m"\n{key} = [{table}]\n')
    out = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(out), "--dry-run"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {job}: model[0] (m): {key}[0]: unknown key {bad!r}; known keys: "
                   f"{', '.join(job_keys(cls.options_type))}"), err
    assert bad not in job_keys(cls.options_type) and not out.exists()


@pytest.mark.parametrize("table, message", [
    ("awq = [{ group_size = '64' }]", "awq[0]: group_size = '64': expected an integer"),
    ("gptq = [{ damp = 'little' }]", "gptq[0]: damp = 'little': expected a number"),
    ("exl2 = [{ bpw = true }]", "exl2[0]: bpw = True: expected a number"),
    ("gguf = [{ policy = 'Q8_0', tensor_type = 'attn_v=q8_0' }]",
     "gguf[0]: tensor_type = 'attn_v=q8_0': expected a list of strings"),
    ("imatrix = 'yes'", "imatrix = 'yes': expected true or false"),
])
def test_job_file_type_error_names_key_and_type(tmp_path, tiny_llama_dir, capsys, table, message):
    from quantpress.cli.quantize_main import main as quantize_main

    job = tmp_path / "j.toml"
    job.write_text(f'[[model]]\nsource = "{tiny_llama_dir}"\nname = "m"\n{table}\n')
    out = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(out)]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err == f"error: {job}: model[0] (m): {message}", err
    assert not out.exists()
