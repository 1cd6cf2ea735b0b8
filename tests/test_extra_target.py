"""An output kind from outside the package (tests/int8_target.py) gets everything the built-in
kinds get from their declarations alone: ``quantize int8 --help`` with its declared options, a
working verified command (also in a fresh CLI process), a job-file key with its options
checked, batch planning (``--dry-run``), a manifest entry and resume, with no line of
``cli/`` or ``batch/`` naming it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import int8_target
from int8_target import Int8Options, Int8Target
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.targets.base import TARGETS

TESTS = Path(__file__).resolve().parent
# importing the module registered the target for the whole test process: only the tests
# below that ask for it (the fixture) see it, so that the other modules (the generated
# docs/commands.md among them) see the package's own targets only
TARGETS.pop(Int8Options, None)


@pytest.fixture
def int8(monkeypatch):
    monkeypatch.setitem(TARGETS, Int8Options, Int8Target)


def _job(path: Path, src: Path, tables: str) -> Path:
    path.write_text(f'[defaults]\ndevice = "cpu"\n\n[[model]]\nsource = "{src}"\nname = "m"\nint8 = {tables}\n')
    return path


def test_help_lists_the_declared_options(int8, capsys):
    with pytest.raises(SystemExit) as e:
        quantize_main(["int8", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--min-size MIN_SIZE" in out and "(default 1024)" in out and "--skip NAME" in out
    # not calibrated, no compute dtype: neither is offered
    assert "--samples" not in out and "--dtype" not in out and "--batch-tokens" in out


def test_command_writes_a_verified_output(int8, tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "o"
    assert quantize_main(["int8", str(tiny_llama_dir), "-o", str(out), "--min-size", "64",
                          "--skip", "embed", "--json", "--quiet"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["kind"] == "int8" and s["target"] == "int8-m64" and s["roundtrip"].startswith("ok (")
    with safe_open(str(out / int8_target.WEIGHTS), "pt") as r:
        keys = set(r.keys())
        emb = next(k for k in keys if "embed" in k)
        assert r.get_tensor(emb).dtype != torch.int8        # --skip embed kept it
        q = next(k for k in keys if k.endswith("q_proj.weight"))
        assert r.get_tensor(q).dtype == torch.int8 and q + ".scale" in keys
    # a bad value of a declared option is bad input naming the flag; nothing is written
    assert quantize_main(["int8", str(tiny_llama_dir), "-o", str(tmp_path / "p"), "--min-size", "0"]) == 2
    assert "error: --min-size 0: expected a positive integer" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_verifier_fails_a_wrong_output(int8, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """The round trip checks the written file: codes one step off fail it (exit 3, nothing left)."""
    good = int8_target.quantize_rows

    def off_by_one(w):
        q, s = good(w)
        return (q.to(torch.int16) + 1).clamp(-127, 127).to(torch.int8), s

    monkeypatch.setattr(int8_target, "quantize_rows", off_by_one)
    assert quantize_main(["int8", str(tiny_llama_dir), "-o", str(tmp_path / "o"), "--quiet"]) == 3
    assert "off by more than half a step" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_cli_process_with_the_module_imported(tiny_llama_dir, tmp_path):
    """The target registered in another process the way a user would: import its module, then
    call the entry point (an installed package would declare an entry point in the
    ``quantpress.targets`` group instead)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import int8_target; "
            "from quantpress.cli.quantize_main import main; sys.exit(main(sys.argv[2:]))")
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, "-c", code, str(TESTS), "int8", str(tiny_llama_dir), "-o",
                        str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "int8       int8-m1024" in r.stdout and "round trip ok (" in r.stdout
    assert (out / int8_target.WEIGHTS).is_file()


def test_job_file_key_planning_manifest_and_resume(int8, tiny_llama_dir, tmp_path, capsys):
    job = _job(tmp_path / "j.toml", tiny_llama_dir, "[{ min_size = 64 }, { skip = ['mlp'] }]")
    root = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(root), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "stages: 2 int8 pass(es)" in plan
    assert "make  m-int8-m64" in plan and "make  m-int8-m1024" in plan
    assert "int8 pass" in plan and not root.exists()

    assert quantize_main(["batch", str(job), "-o", str(root), "--quiet", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["path"], r["status"]) for r in rows] == [
        ("int8", "m-int8-m64", "made"), ("int8", "m-int8-m1024", "made")]
    man = json.loads((root / "m" / "manifest.json").read_text())
    e = {o["path"]: o for o in man["outputs"]}
    assert e["m-int8-m64"]["roundtrip"] == "ok" and e["m-int8-m64"]["options"] == {"min_size": 64, "skip": []}
    assert e["m-int8-m1024"]["options"] == {"min_size": 1024, "skip": ["mlp"]}
    assert "tests/int8_target.py" in (root / "m" / "README.md").read_text()   # its runtimes
    # a re-run keeps both; a damaged one is made again
    assert quantize_main(["batch", str(job), "-o", str(root), "--quiet", "--json"]) == 0
    assert {r["status"] for r in json.loads(capsys.readouterr().out)} == {"kept"}
    with open(root / "m" / "m-int8-m64" / int8_target.WEIGHTS, "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\0\0\0\0")
    assert quantize_main(["batch", str(job), "-o", str(root), "--quiet", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["path"]: r["status"] for r in rows} == {"m-int8-m64": "made", "m-int8-m1024": "kept"}


def test_output_names_from_the_declared_templates(int8):
    """A batch names each output from its kind's declared templates (``job_target_format``,
    ``job_marks``, ``job_path_format``): the defaults for the int8 kind, declared data for the
    built-in ones."""
    from quantpress.targets.awq import AWQOptions
    from quantpress.targets.fp8 import FP8Options
    from quantpress.targets.gptq import GPTQOptions
    from quantpress.targets.imatrix import ImatrixOptions
    from quantpress.targets.target import target_for

    cases = [(Int8Options(min_size=64), "int8-m64", "m-int8-m64"),
             (ImatrixOptions(), "imatrix", "m.imatrix.gguf"),
             (AWQOptions(), "w4g128", "m-AWQ-w4g128"),
             (AWQOptions(group_size=64, rtn=True), "w4g64-rtn", "m-AWQ-w4g64-rtn"),
             (GPTQOptions(group_size=-1, act_order=True, sym=False, rtn=True), "w4gc-act-asym-rtn",
              "m-GPTQ-w4gc-act-asym-rtn"),
             (FP8Options(), "dynamic", "m-FP8-dynamic"),
             (FP8Options(scheme="static", lm_head=True), "static", "m-FP8-static-head")]
    for o, target, path in cases:
        cls = target_for(o)
        assert (cls.job_target(o), cls.job_path("m", o)) == (target, path), o


@pytest.mark.parametrize("tables, message", [
    ("[{ min = 64 }]", r"model\[0\] \(m\): int8\[0\]: unknown key 'min'; known keys: min_size, skip$"),
    ("[{ min_size = 'big' }]", r"int8\[0\]: min_size = 'big': expected an integer$"),
    ("[{ skip = [1] }]", r"int8\[0\]: skip = \[1\]: expected a list of strings$"),
    ("[{ min_size = 0 }]", r"int8\[0\]: --min-size 0: expected a positive integer$"),
    ("'all'", r"int8 = 'all': expected a list of tables$"),
])
def test_job_file_values_checked_from_the_declaration(int8, tiny_llama_dir, tmp_path, capsys, tables, message):
    import re

    job = _job(tmp_path / "j.toml", tiny_llama_dir, tables)
    assert quantize_main(["batch", str(job), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()
