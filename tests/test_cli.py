"""The command line: exit codes for every class of failure (bad input 2, failed round trip 3,
anything else 1 with one line and a traceback only with --debug), the device check, and
``python -m quantpress`` with the verbs of ``convert`` and ``quantize``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quantpress.cli.convert_main import main as convert_main
from quantpress.cli.quantize_main import main as quantize_main


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def _nothing_left(d):
    assert list(d.iterdir()) == [], list(d.iterdir())


@pytest.mark.parametrize("verb", ["hf-to-gguf", "imatrix", "awq", "exl2", "eval"])
def test_bogus_device_is_bad_input(tiny_llama_dir, tmp_path, capsys, verb):
    out = tmp_path / "out"
    out.mkdir()
    args = {"hf-to-gguf": (convert_main, ["hf-to-gguf", str(tiny_llama_dir), "-o", str(out / "o.gguf")]),
            "imatrix": (quantize_main, ["imatrix", str(tiny_llama_dir), "-o", str(out / "i.gguf")]),
            "awq": (quantize_main, ["awq", str(tiny_llama_dir), "-o", str(out / "a")]),
            "exl2": (quantize_main, ["exl2", str(tiny_llama_dir), "-o", str(out / "x"), "--bpw", "4"]),
            "eval": (quantize_main, ["eval", str(tiny_llama_dir)])}
    main, argv = args[verb]
    assert main(argv + ["--device", "bogus", "--quiet"]) == 2
    err = _err(capsys)
    assert err == ["error: --device bogus: expected auto, cpu, cuda or cuda:N"], err
    _nothing_left(out)


def test_cuda_without_a_gpu_is_bad_input(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:1"):
        assert convert_main(["hf-to-gguf", str(tiny_llama_dir), "-o", str(tmp_path / "o.gguf"),
                             "--device", dev, "--quiet"]) == 2
        err = _err(capsys)
        assert len(err) == 1 and err[0].startswith(f"error: --device {dev}: CUDA is not available"), err
    _nothing_left(tmp_path)


def test_internal_error_is_exit_1_with_one_line(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """An error that is neither bad input nor a failed round trip (here a RuntimeError from
    inside the quantizer, as a torch shape error would be) exits 1 with one line naming it;
    --debug adds the traceback. Nothing is left behind."""
    from quantpress.convert import gguf_file

    def broken(*a, **k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (injected)")

    monkeypatch.setattr(gguf_file, "encode_many", broken)
    argv = ["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q8_0", "-o", str(tmp_path / "o.gguf"), "--quiet"]
    assert convert_main(argv) == 1
    err = _err(capsys)
    assert len(err) == 1 and err[0].startswith("error: internal error (RuntimeError: mat1 and mat2"), err
    assert "--debug" in err[0]
    assert convert_main(argv + ["--debug"]) == 1
    err = _err(capsys)
    assert err[0] == "Traceback (most recent call last):" and err[-1].startswith("error: internal error")
    assert any("broken" in line for line in err)
    _nothing_left(tmp_path)


def test_cuda_out_of_memory_says_what_to_do(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from quantpress.calibration import engine

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(engine, "run", oom)
    assert quantize_main(["imatrix", str(tiny_llama_dir), "-o", str(tmp_path / "i.gguf"), "--samples",
                          "2", "--seqlen", "32", "--device", "cpu", "--quiet"]) == 1
    err = _err(capsys)
    assert len(err) == 1 and err[0].startswith("error: CUDA out of memory"), err
    assert "--batch-tokens" in err[0] and "--device cpu" in err[0]
    _nothing_left(tmp_path)


def test_failed_imatrix_round_trip_is_exit_3(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """The imatrix file is re-read and compared bit for bit: a reader that sees one value
    differently fails the command with exit 3 and leaves nothing."""
    from quantpress.convert import imatrix_file
    from quantpress.targets import imatrix as target

    real = imatrix_file.read_imatrix

    def altered(path):
        im = real(path)
        name = sorted(im.sums)[3]
        im.sums[name] = im.sums[name].copy()
        im.sums[name].reshape(-1)[7] *= 1.0000001
        return im

    monkeypatch.setattr(target, "read_imatrix", altered)
    assert quantize_main(["imatrix", str(tiny_llama_dir), "-o", str(tmp_path / "i.gguf"), "--samples",
                          "2", "--seqlen", "32", "--device", "cpu", "--quiet"]) == 3
    err = _err(capsys)
    assert len(err) == 1 and err[0].startswith("error: round trip failed: 'blk.") and "in_sum2" in err[0], err
    _nothing_left(tmp_path)


def test_failed_measurement_round_trip_is_exit_3(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from quantpress.calibration import exl2_measurement as mfile

    real = mfile.write_measurement

    def lossy(path, measurement, last, **kw):
        key = next(iter(measurement))
        measurement = dict(measurement)
        measurement[key] = [dict(o, accuracy=round(o["accuracy"], 3)) for o in measurement[key]]
        return real(path, measurement, last, **kw)

    monkeypatch.setattr(mfile, "write_measurement", lossy)
    assert quantize_main(["exl2", str(tiny_llama_dir), "--measure-only", str(tmp_path / "m.json"),
                          "--samples", "2", "--seqlen", "32", "--device", "cpu", "--quiet"]) == 3
    err = _err(capsys)
    assert len(err) == 1 and "differs from the measurement made" in err[0], err
    _nothing_left(tmp_path)


def test_python_m_quantpress_has_every_verb(tiny_llama_dir, tmp_path):
    """``python -m quantpress VERB`` and ``python -m quantpress convert|quantize VERB`` run the
    same verbs as the console scripts, with their exit codes."""
    out = tmp_path / "m.gguf"
    run = [sys.executable, "-m", "quantpress"]
    p = subprocess.run(run + ["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q8_0", "-o", str(out),
                              "--quiet", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    s = json.loads(p.stdout)
    assert s["kind"] == "gguf" and s["target"] == "Q8_0" and s["files"] == {"m.gguf": out.stat().st_size}
    p = subprocess.run(run + ["convert", "inspect", str(out), "--json"], capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["tensors"]
    p = subprocess.run(run + ["quantize", "gguf", str(out), "--policy", "Q4_K_M", "-o",
                              str(tmp_path / "q.gguf"), "--quiet"], capture_output=True, text=True)
    assert p.returncode == 2 and "is already quantized (Q8_0)" in p.stderr
    p = subprocess.run(run + ["--help"], capture_output=True, text=True)
    for verb in ("hf-to-gguf", "inspect", "gguf", "imatrix", "awq", "exl2", "eval"):
        assert verb in p.stdout
    p = subprocess.run(run + ["--version"], capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.startswith("quantpress ")


def test_calibrated_verb_prints_one_estimate_line(tiny_llama_dir, tmp_path, capsys):
    """After the first layer a calibrated pass prints its estimate (rows x tokens x layers at
    the first layer's rate) once; --quiet prints none."""
    import json as _json

    layers = _json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    base = ["imatrix", str(tiny_llama_dir), "--samples", "3", "--seqlen", "32", "--device", "cpu"]
    assert quantize_main(base + ["-o", str(tmp_path / "a.gguf")]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("estimate: ")]
    assert len(lines) == 1 and lines[0].startswith(f"estimate: 3 rows x 32 tokens x {layers} layers: "
                                                   "the first took "), lines
    assert quantize_main(base + ["-o", str(tmp_path / "b.gguf"), "--quiet"]) == 0
    assert "estimate:" not in capsys.readouterr().err


def test_commands_doc_is_current():
    """docs/commands.md is what ``python -m quantpress.cli.docs`` prints from the registry:
    regenerate it when a verb, an option or a job-file key changes."""
    from pathlib import Path

    from quantpress.cli import docs

    committed = (Path(__file__).resolve().parents[1] / "docs" / "commands.md").read_text(encoding="utf-8")
    assert committed == docs.render(), "docs/commands.md is stale: python -m quantpress.cli.docs > docs/commands.md"


def test_cli_and_batch_name_no_output_kind():
    """cli/ and batch/ take every output kind from the target registry: none of the kinds'
    names appears in them as a string literal (the grep of issue 56)."""
    import ast
    from pathlib import Path

    import quantpress
    from quantpress.targets.registry import registered

    kinds = {c.kind for c in registered()} | {c.job_key for c in registered() if c.job_key}
    pkg = Path(quantpress.__file__).resolve().parent
    found = []
    for f in sorted([*(pkg / "cli").rglob("*.py"), *(pkg / "batch").rglob("*.py")]):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in kinds:
                found.append(f"{f.name}:{node.lineno} {node.value!r}")
    assert not found, found
