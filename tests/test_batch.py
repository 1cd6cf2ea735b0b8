"""``quantize batch`` on tiny random models: the outputs equal the single verbs' byte for byte,
the manifest and model card describe them, a re-run keeps what is finished, bad job files are
refused before any work, and a failing output does not stop the batch."""
from __future__ import annotations

import json
import re
from pathlib import Path

import batches
import pytest
import synth
import make
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.targets import FP8Options, GPTQOptions, produce

CALIB = dict(samples=4, seqlen=64)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny models' many small ops run faster and the same every time."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A second model: llama with other weights, 1 layer, tied embeddings."""
    return synth.make_model(tmp_path_factory.mktemp("batch_second"), "llama", smollm2_dir, seed=1,
                            num_hidden_layers=1, tie_word_embeddings=True)


def _job(path: Path, llama: Path, qwen2: Path | None = None) -> Path:
    text = f"""
[defaults]
device = "cpu"
calib = {{ samples = {CALIB['samples']}, seqlen = {CALIB['seqlen']} }}

[[model]]
source = "{llama}"
name = "tiny"
gguf = ["Q4_K_M", "Q8_0"]
imatrix = true
awq = [{{ group_size = 64 }}]
exl2 = [{{ bpw = 4.0 }}, {{ bpw = 5.0, head_bits = 8 }}]
eval = {{ ctx = 64, chunks = 2 }}
"""
    if qwen2 is not None:
        text += f"""
[[model]]
source = "{qwen2}"
gguf = ["Q8_0", {{ policy = "Q4_0", imatrix = true }}]
awq = [{{ group_size = 64 }}]
gptq = [{{ group_size = 64, act_order = true }}]
fp8 = [{{ scheme = "static" }}]
"""
    path.write_text(text)
    return path


_digests = make.digests


#: (what, thread name, start, end) of the EXL2 passes and the shared pass's consumers of the
#: ``batch`` fixture's run
SPANS: list = []


@pytest.fixture(scope="module")
def batch(tmp_path_factory, tiny_llama_dir, second_dir):
    """The job of :func:`_job` run by ``quantize batch`` with one intra-op thread (as the
    single verbs it is compared with), the EXL2 passes and the shared pass's consumers timed
    into :data:`SPANS`."""
    import threading
    import time

    import torch
    from quantpress.calibration import engine
    from quantpress.targets.exl2 import EXL2Target

    root = tmp_path_factory.mktemp("batch")
    job = _job(root / "jobs.toml", tiny_llama_dir, second_dir)
    out = root / "out"
    write, call = EXL2Target.write, engine.FanOut._call

    def timed(what, f, *a):
        t0 = time.perf_counter()
        try:
            return f(*a)
        finally:
            SPANS.append((what, threading.current_thread().name, t0, time.perf_counter()))

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    EXL2Target.write = lambda self, tmp, run: timed(f"exl2 {self.options.bpw}", write, self, tmp, run)
    engine.FanOut._call = staticmethod(lambda c, i, *a: timed(f"{type(c).__name__} {i}", call, c, i, *a))
    try:
        code = quantize_main(["batch", str(job), "-o", str(out), "--quiet", "--json"])
    finally:
        EXL2Target.write, engine.FanOut._call = write, staticmethod(call)
        torch.set_num_threads(n)
    return job, out, code


def test_passes_run_side_by_side(batch):
    """With one intra-op thread and two cores, the shared pass's consumers of a layer (the AWQ
    search, the measurement) and the two EXL2 passes each ran in their own threads at the
    same time; on one core, in the main thread."""
    import os

    assert batch[2] == 0
    apart = len(os.sched_getaffinity(0)) > 1
    exl2 = sorted(s for s in SPANS if s[0].startswith("exl2"))
    assert [s[0] for s in exl2] == ["exl2 4.0", "exl2 5.0"]
    layer0 = [s for s in SPANS if s[0] in ("WriterShare 0", "Measurer 0")]
    assert len(layer0) == 4      # tiny's AWQ and measurement, the second model's AWQ and FP8
    for spans in (exl2, layer0[:2]):
        (_, ta, a0, a1), (_, tb, b0, b1) = spans
        if apart:
            assert ta != tb and "MainThread" not in (ta, tb)
            assert max(a0, b0) < min(a1, b1)            # they overlapped
        else:
            assert ta == tb == "MainThread"


def test_outputs_equal_the_single_verbs(batch, tiny_llama_dir, second_dir, tmp_path, capsys):
    job, out, code = batch
    assert code == 0
    d = out / "tiny"
    expected = ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny.imatrix.gguf", "tiny-AWQ-w4g64",
                "measurement.json", "tiny-EXL2-4.0bpw", "tiny-EXL2-5.0bpw"]
    assert sorted(p.name for p in d.iterdir()) == sorted(expected + ["manifest.json", "README.md"])
    src = make.source(tiny_llama_dir, **CALIB)
    single = tmp_path / "single"
    single.mkdir()
    make.gguf(src, single / "tiny-Q4_K_M.gguf", "Q4_K_M")
    make.gguf(src, single / "tiny-Q8_0.gguf", "Q8_0")
    make.imatrix(src, single / "tiny.imatrix.gguf")
    make.awq(src, single / "tiny-AWQ-w4g64", group_size=64)
    make.exl2(src, single / "tiny-EXL2-4.0bpw", bpw=4.0)   # measured by itself
    make.exl2(src, single / "tiny-EXL2-5.0bpw", bpw=5.0, head_bits=8,
              measurement=str(single / "tiny-EXL2-4.0bpw" / "measurement.json"))
    for name in expected:
        if name == "measurement.json":
            continue
        assert _digests(d / name) == _digests(single / name), name
    assert (d / "measurement.json").read_bytes() == (single / "tiny-EXL2-4.0bpw" / "measurement.json").read_bytes()
    q = out / second_dir.name
    src2 = make.source(second_dir, **CALIB)
    make.awq(src2, single / "q-awq", group_size=64)
    assert _digests(q / f"{second_dir.name}-AWQ-w4g64") == _digests(single / "q-awq")
    # GPTQ (its own quantized stream) and FP8 static (input scales from the shared pass)
    produce(GPTQOptions(group_size=64, act_order=True), src2, single / "q-gptq", progress=False)
    produce(FP8Options(scheme="static"), src2, single / "q-fp8", progress=False)
    assert _digests(q / f"{second_dir.name}-GPTQ-w4g64-act") == _digests(single / "q-gptq")
    assert _digests(q / f"{second_dir.name}-FP8-static") == _digests(single / "q-fp8")
    # gguf table with imatrix = true: the model's imatrix is made (no imatrix key needed) and
    # the output is quantize gguf --imatrix of it, unlike the unweighted Q4_0
    n2 = second_dir.name
    make.imatrix(src2, single / "q.imatrix.gguf")
    im = q / f"{n2}.imatrix.gguf"
    assert im.read_bytes() == (single / "q.imatrix.gguf").read_bytes()
    # (the same --imatrix path: llama-quantize records it in quantize.imatrix.file)
    make.gguf(src2, single / "q-Q4_0-im.gguf", "Q4_0", imatrix=im)
    make.gguf(src2, single / "q-Q4_0.gguf", "Q4_0")
    got = (q / f"{n2}-Q4_0.gguf").read_bytes()
    assert got == (single / "q-Q4_0-im.gguf").read_bytes() and got != (single / "q-Q4_0.gguf").read_bytes()


def test_manifest_and_model_card(batch):
    _, out, _ = batch
    d = out / "tiny"
    m = json.loads((d / "manifest.json").read_text())
    assert m["model"] == "tiny" and m["calibration"]["samples"] == 4 and m["versions"]["quantpress"]
    assert [(o["kind"], o["target"]) for o in m["outputs"]] == [
        ("gguf", "Q4_K_M"), ("gguf", "Q8_0"), ("imatrix", "imatrix"), ("awq", "w4g64"),
        ("measurement", "exl2"), ("exl2", "4.0"), ("exl2", "5.0")]
    for o in m["outputs"]:
        assert o["roundtrip"] == "ok" and o["files"] == _digests(d / o["path"])
        p = d / o["path"]
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        assert o["bytes"] == sum(f.stat().st_size for f in files)
        if o["kind"] in ("gguf", "awq", "exl2"):
            assert o["eval"]["ppl"] > 1 and o["eval"]["kld"] > 0, o
        else:
            assert o["eval"] is None
    bpw = {o["target"]: o["bpw"] for o in m["outputs"] if o["kind"] == "exl2"}
    assert bpw["4.0"] < bpw["5.0"]
    kld = {o["target"]: o["eval"]["kld"] for o in m["outputs"] if o["eval"]}
    assert kld["Q8_0"] < kld["Q4_K_M"]
    card = (d / "README.md").read_text()
    for o in m["outputs"]:
        assert f"`{o['path']}" in card
    assert card.count("| ok |") == len(m["outputs"])


def test_rerun_keeps_finished_outputs(batch, capsys):
    job, out, _ = batch
    d = out / "tiny"
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["status"] for r in rows} == {"kept"} and len(rows) == 13
    after = {p.name: p.stat().st_mtime_ns for p in d.iterdir() if p.name not in ("manifest.json", "README.md")}
    assert all(after[k] == before[k] for k in after)
    # a damaged output is made again, the rest kept
    awq = d / "tiny-AWQ-w4g64"
    good = _digests(awq)
    with open(sorted(awq.glob("*.safetensors"))[0], "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\0" * 8)
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in rows if r["status"] == "made"] == ["tiny-AWQ-w4g64"]
    assert _digests(awq) == good


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, tiny_llama_dir, capsys):
    job = _job(tmp_path / "j.toml", tiny_llama_dir)
    assert quantize_main(["batch", str(job), "-o", str(tmp_path / "out"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "one calibration pass (4 x 64 tokens) feeding imatrix, awq, measurement" in text
    assert "make  tiny-EXL2-5.0bpw" in text and "estimated disk" in text
    m = re.search(r"working memory ~[\d,]+ MiB at its largest \((.+?)\), above", text)
    stages = {"gguf", "calibration pass", "EXL2 passes", "EXL2 head", "evaluation",   # in order
              "calibrated", "exl2 4.0+5.0", "eval gguf", "eval calibrated", "eval exl2 4.0+5.0",
              "eval exl2 4.0+5.0 x2"}                   # (the last scoring, two at once)
    assert m and set(m[1].split(" beside ")) <= stages, text
    assert not (tmp_path / "out").exists()


def test_dry_run_estimate_adds_what_runs_side_by_side(tmp_path, tiny_llama_dir, monkeypatch):
    # every stage of the job has a working-memory figure; the passes that run side by side
    # (one core each) count once per pass, the consumers of the shared pass all together
    from quantpress.batch.jobfile import estimate, read_jobs
    from quantpress.calibration import engine

    job = read_jobs(_job(tmp_path / "j.toml", tiny_llama_dir), tmp_path / "out")[0]
    monkeypatch.setattr(engine, "side_by_side_threads", lambda device, n: 1)
    alone = estimate(job)
    monkeypatch.setattr(engine, "side_by_side_threads", lambda device, n: n)
    together = estimate(job)
    assert set(alone["stages"]) == {"gguf", "calibration pass", "EXL2 passes", "EXL2 head", "evaluation"}
    for e in (alone, together):
        assert e["peak_memory"] == max(e["stages"].values()) == e["stages"][e["peak_stage"]]
    assert together["stages"]["EXL2 passes"] == 2 * alone["stages"]["EXL2 passes"]
    assert together["stages"]["EXL2 head"] == 2 * alone["stages"]["EXL2 head"]
    assert together["stages"]["calibration pass"] > alone["stages"]["calibration pass"]
    assert together["stages"]["gguf"] == alone["stages"]["gguf"]
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    head = 4 * cfg["vocab_size"] * cfg["hidden_size"]          # float32, before GPTQ's own
    assert head < alone["stages"]["EXL2 head"] < 5 * head


BAD = [
    ("not toml", "[[model]\nsource = 1", "not valid TOML: .*line 1"),
    ("unknown top key", "[[model]]\nsource = '{src}'\ngguf=['Q8_0']\n[other]\n", "unknown top-level key 'other'"),
    ("unknown model key", "[[model]]\nsource = '{src}'\nggfu = ['Q8_0']", r"model\[0\]: unknown key 'ggfu'; known keys: source, name, revision, gguf"),
    ("missing source", "[[model]]\ngguf = ['Q8_0']", r"model\[0\]: missing key 'source'"),
    ("source not a model", "[[model]]\nsource = '{tmp}'\ngguf = ['Q8_0']", "not a Hugging Face model directory"),
    ("bad policy", "[[model]]\nsource = '{src}'\nname = 'm'\ngguf = ['Q9_K']", r"model\[0\] \(m\): gguf\[0\]: --policy Q9_K: unknown"),
    ("wrong type", "[[model]]\nsource = '{src}'\nname = 'm'\ngguf = 'Q8_0'", "gguf = 'Q8_0': expected a list of policy names or tables"),
    ("gguf imatrix file", "[[model]]\nsource = '{src}'\nname = 'm'\ngguf = [{{ policy = 'Q4_0', imatrix = 'no.gguf' }}]", r"gguf\[0\]: imatrix = 'no.gguf': expected true \(this model's imatrix\) or the path"),
    ("gguf table key", "[[model]]\nsource = '{src}'\nname = 'm'\ngguf = [{{ policy = 'Q4_0', pure = 1 }}]", r"gguf\[0\]: pure = 1: expected true/false"),
    ("gguf filter alone", "[[model]]\nsource = '{src}'\nname = 'm'\ngguf = [{{ policy = 'Q4_0', include_weights = ['attn'] }}]", r"gguf\[0\]: --include-weights/--exclude-weights need --imatrix"),
    ("bad awq option", "[[model]]\nsource = '{src}'\nname = 'm'\nawq = [{{ group_size = 0 }}]", r"awq\[0\]: --group-size 0: must be a positive"),
    ("unknown awq key", "[[model]]\nsource = '{src}'\nname = 'm'\nawq = [{{ groups = 64 }}]", r"awq\[0\]: unknown key 'groups'; known keys: bits, group_size"),
    ("awq type", "[[model]]\nsource = '{src}'\nname = 'm'\nawq = [{{ clip = 'yes' }}]", r"awq\[0\]: clip = 'yes': expected true/false"),
    ("bad bpw", "[[model]]\nsource = '{src}'\nname = 'm'\nexl2 = [{{ bpw = -1 }}]", r"exl2\[0\]: --bpw -1: expected a positive"),
    ("missing bpw", "[[model]]\nsource = '{src}'\nname = 'm'\nexl2 = [{{ head_bits = 8 }}]", r"exl2\[0\]: missing key 'bpw'"),
    ("bad head bits", "[[model]]\nsource = '{src}'\nname = 'm'\nexl2 = [{{ bpw = 4.0, head_bits = 7 }}]", "--head-bits 7: choose one of"),
    ("same output twice", "[[model]]\nsource = '{src}'\nname = 'm'\nexl2 = [{{ bpw = 4.0 }}, {{ bpw = 4.0, head_bits = 8 }}]", "two entries write the same output m/m-EXL2-4.0bpw"),
    ("same name twice", "[[model]]\nsource = '{src}'\ngguf=['Q8_0']\n[[model]]\nsource = '{src}'\ngguf=['Q4_0']", r"model\[0\] and model\[1\] both write"),
    ("bad device", "[defaults]\ndevice = 'bogus'\n[[model]]\nsource = '{src}'\nname = 'm'\ngguf=['Q8_0']", "bogus"),
    ("calib type", "[defaults]\ncalib = {{ samples = 'many' }}\n[[model]]\nsource = '{src}'\nname = 'm'\nimatrix = true", r"calib: samples = 'many': expected an integer"),
    ("bad gptq option", "[[model]]\nsource = '{src}'\nname = 'm'\ngptq = [{{ bits = 3 }}]", r"gptq\[0\]: --bits 3"),
    ("bad fp8 scheme", "[[model]]\nsource = '{src}'\nname = 'm'\nfp8 = [{{ scheme = 'int8' }}]", r"fp8\[0\]: --scheme 'int8'"),
    ("fp8 ignore type", "[[model]]\nsource = '{src}'\nname = 'm'\nfp8 = [{{ ignore = 'lm_head' }}]", r"fp8\[0\]: ignore = 'lm_head': expected a list of strings"),
    ("no outputs", "[[model]]\nsource = '{src}'\nname = 'm'", "no outputs"),
    ("source in defaults", "[defaults]\nsource = '{src}'\n[[model]]\nsource = '{src}'\ngguf=['Q8_0']", r"\[defaults\]: key 'source' not allowed"),
]


@pytest.mark.parametrize("case,text,message", BAD, ids=[b[0] for b in BAD])
def test_bad_job_files_are_refused_before_any_work(case, text, message, tmp_path, tiny_llama_dir, capsys):
    import re

    job = tmp_path / "jobs.toml"
    job.write_text(text.format(src=tiny_llama_dir, tmp=tmp_path))
    out = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert str(job) in err[0] or "bogus" in err[0]
    assert not out.exists()


def test_out_root_on_a_file_and_foreign_outputs(tmp_path, tiny_llama_dir, capsys):
    job = _job(tmp_path / "j.toml", tiny_llama_dir)
    f = tmp_path / "file"
    f.write_text("x")
    assert quantize_main(["batch", str(job), "-o", str(f), "--quiet"]) == 2
    assert "OUT_ROOT is a file" in capsys.readouterr().err
    out = tmp_path / "out"
    (out / "tiny").mkdir(parents=True)
    (out / "tiny" / "tiny-Q8_0.gguf").write_text("mine")
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet"]) == 2
    assert "tiny-Q8_0.gguf: already exists and was not made by this batch" in capsys.readouterr().err
    assert (out / "tiny" / "tiny-Q8_0.gguf").read_text() == "mine"
    assert sorted(p.name for p in (out / "tiny").iterdir()) == ["tiny-Q8_0.gguf"]


def _two_models(path: Path, first: Path, second: Path, second_outputs: str) -> Path:
    """A job of two models on 2 × 32 calibration tokens: ``a`` (GGUF Q8_0 and AWQ g64) and
    ``b`` with ``second_outputs`` (TOML lines)."""
    path.write_text(f"""
[defaults]
device = "cpu"
calib = {{ samples = 2, seqlen = 32 }}
[[model]]
source = "{first}"
name = "a"
gguf = ["Q8_0"]
awq = [{{ group_size = 64 }}]
[[model]]
source = "{second}"
name = "b"
{second_outputs}
""")
    return path


def test_a_failing_output_does_not_stop_the_batch(tmp_path, tiny_llama_dir, second_dir, monkeypatch, capsys):
    """A broken AWQ round trip fails the AWQ outputs (exit 3, marked failed in the manifest, no
    directory left); the GGUF outputs of both models are made."""
    from quantpress.errors import RoundTripError
    from quantpress.targets import awq as tawq

    def broken(*a, **k):
        raise RoundTripError("round trip failed: injected")

    monkeypatch.setattr(tawq, "verify_awq_dir", broken)
    job = _two_models(tmp_path / "j.toml", tiny_llama_dir, second_dir, 'gguf = ["Q8_0"]')
    out = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet"]) == 3
    table = capsys.readouterr().out
    assert "2 made, 0 kept from an earlier run, 1 failed" in table
    m = json.loads((out / "a" / "manifest.json").read_text())
    st = {o["path"]: (o["roundtrip"], o.get("error", "")) for o in m["outputs"]}
    assert st == {"a-Q8_0.gguf": ("ok", ""), "a-AWQ-w4g64": ("failed", "round trip failed: injected")}
    assert not (out / "a" / "a-AWQ-w4g64").exists()
    assert (out / "b" / "b-Q8_0.gguf").is_file()
    assert "**failed**" in (out / "a" / "README.md").read_text()


def test_weighted_gguf_fails_with_its_imatrix(tmp_path, tiny_llama_dir, second_dir, monkeypatch, capsys):
    """A GGUF table with imatrix = true waits for the model's imatrix: when that fails its
    round trip, the GGUF output fails too, naming the imatrix, and nothing of either is left;
    the unweighted GGUF of the same model is made."""
    from quantpress.errors import RoundTripError
    from quantpress.targets import imatrix as timatrix

    def broken(*a, **k):
        raise RoundTripError("round trip failed: injected")

    monkeypatch.setattr(timatrix, "verify_imatrix", broken)
    job = _two_models(tmp_path / "j.toml", tiny_llama_dir, second_dir,
                      'gguf = ["Q8_0", { policy = "Q4_0", imatrix = true }]')
    out = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet"]) == 3
    m = json.loads((out / "b" / "manifest.json").read_text())
    st = {o["path"]: (o["roundtrip"], o.get("error", "")) for o in m["outputs"]}
    assert st["b-Q8_0.gguf"] == ("ok", "")
    assert st["b.imatrix.gguf"] == ("failed", "round trip failed: injected")
    assert st["b-Q4_0.gguf"][0] == "failed" and st["b-Q4_0.gguf"][1].startswith(
        f"{out / 'b' / 'b.imatrix.gguf'}: the imatrix failed (round trip failed: injected)")
    assert not (out / "b" / "b-Q4_0.gguf").exists() and not (out / "b" / "b.imatrix.gguf").exists()


def _manifest_without_times(p: Path) -> dict:
    m = json.loads(p.read_text())
    for o in m["outputs"]:
        o.pop("seconds")
    return m


def test_ray_gives_the_outputs_and_manifests_of_the_local_run(batch, tmp_path_factory, capsys):
    """``--ray`` on a local Ray instance, the job of the ``batch`` fixture (two models, every
    kind of stage: GGUF, the calibrated pass, GPTQ, imatrix-weighted GGUF, EXL2 after the
    measurement, eval), each stage a Ray task: the same files and the same manifests (but for
    the seconds) as the run in this process. (The imatrix-weighted GGUF records its imatrix's
    path, quantize.imatrix.file: the two roots have paths of one length, that path is
    swapped before comparing.)"""
    job, local, _ = batch
    viaray = tmp_path_factory.mktemp("batch") / "out"
    assert len(str(viaray)) == len(str(local))
    swapped = 0
    assert quantize_main(["batch", str(job), "-o", str(viaray), "--quiet", "--ray"]) == 0
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in viaray.iterdir()) and len(names) == 2
    for name in names:
        files = sorted(p.name for p in (local / name).iterdir())
        assert files == sorted(p.name for p in (viaray / name).iterdir())
        m = json.loads((local / name / "manifest.json").read_text())
        weighted = {o["path"] for o in m["outputs"] if o["kind"] == "gguf" and o["options"].get("imatrix")}
        for f in files:
            if f == "manifest.json":
                a, b = _manifest_without_times(local / name / f), _manifest_without_times(viaray / name / f)
                for o in a["outputs"] + b["outputs"]:
                    if o["path"] in weighted:   # their digests: compared below
                        o.pop("files")
                assert a == b
            elif f in weighted:
                im = f"{name}.imatrix.gguf"
                got = (viaray / name / f).read_bytes().replace(str(viaray / name / im).encode(),
                                                               str(local / name / im).encode())
                assert got == (local / name / f).read_bytes(), f
                swapped += 1
            elif f != "README.md":
                assert _digests(local / name / f) == _digests(viaray / name / f), f
    assert swapped == 1
    # run again: every output kept, no task run, the manifests as they were (calibration included)
    before = {n: json.loads((viaray / n / "manifest.json").read_text()) for n in names}
    capsys.readouterr()
    assert quantize_main(["batch", str(job), "-o", str(viaray), "--quiet", "--ray", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 13 and {r["status"] for r in rows} == {"kept"}
    assert {n: json.loads((viaray / n / "manifest.json").read_text()) for n in names} == before


def test_stages_and_what_they_wait_for(tmp_path, tiny_llama_dir, second_dir):
    """The stage graph Ray runs (stages.model_stages): the GGUF policies and the calibrated
    pass wait for nothing, the imatrix-weighted GGUF and every EXL2 target for the calibrated
    pass, taking its imatrix / measurement, and the evaluation for all of them."""
    from quantpress.batch import jobfile, stages

    job = _job(tmp_path / "jobs.toml", tiny_llama_dir, second_dir)
    plans = [stages.plan_model(j, tmp_path / "fresh") for j in jobfile.read_jobs(job, tmp_path / "fresh")]
    got = [[(s.name, [o.path for o in s.outputs], s.after, s.needs and s.needs[2])
            for s in stages.model_stages(p)] for p in plans]
    q = plans[1].job.name
    assert got == [
        [("gguf", ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"], (), None),
         ("calibrated", ["tiny.imatrix.gguf", "tiny-AWQ-w4g64", "measurement.json"], (), None),
         ("exl2 4.0", ["tiny-EXL2-4.0bpw"], ("calibrated",), "measurement"),
         ("exl2 5.0", ["tiny-EXL2-5.0bpw"], ("calibrated",), "measurement"),
         ("eval", [], ("gguf", "calibrated", "exl2 4.0", "exl2 5.0"), None)],
        [("gguf", [f"{q}-Q8_0.gguf"], (), None),
         ("calibrated", [f"{q}.imatrix.gguf", f"{q}-AWQ-w4g64", f"{q}-FP8-static"], (), None),
         ("gptq w4g64-act", [f"{q}-GPTQ-w4g64-act"], (), None),
         ("gguf+imatrix", [f"{q}-Q4_0.gguf"], ("calibrated",), "imatrix")]]
    # Ray's graph also scores each stage's model outputs once that stage is finished
    each = [(s.name, s.after, s.evaluates) for s in stages.model_stages(plans[0], eval_each=True)
            if s.is_eval]
    assert each == [
        ("eval gguf", ("gguf",), ("tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf")),
        ("eval calibrated", ("calibrated",), ("tiny-AWQ-w4g64",)),
        ("eval exl2 4.0", ("exl2 4.0",), ("tiny-EXL2-4.0bpw",)),
        ("eval exl2 5.0", ("exl2 5.0",), ("tiny-EXL2-5.0bpw",)),
        ("eval", ("gguf", "calibrated", "exl2 4.0", "exl2 5.0", "eval gguf", "eval calibrated",
                  "eval exl2 4.0", "eval exl2 5.0"), None)]
    # a local run makes the EXL2 targets in one stage (their passes side by side)
    local = [(s.name, [o.path for o in s.outputs], s.after, s.needs and s.needs[2])
             for s in stages.model_stages(plans[0], together=True)]
    assert local == [*got[0][:2], ("exl2 4.0+5.0", ["tiny-EXL2-4.0bpw", "tiny-EXL2-5.0bpw"], ("calibrated",),
                                   "measurement"),
                     ("eval", [], ("gguf", "calibrated", "exl2 4.0+5.0"), None)]


def test_ray_missing_says_how_to_install(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    import builtins

    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    job = _job(tmp_path / "j.toml", tiny_llama_dir)
    out = tmp_path / "out"
    assert quantize_main(["batch", str(job), "-o", str(out), "--quiet", "--ray"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'quantpress[ray]'" in err and not out.exists()


# resume: the 3-layer model of conftest.py's three_layer_dir, jobs and killed runs from batches.py

def test_killed_batch_resumes_at_the_layer_it_reached(tmp_path, three_layer_dir):
    """SIGKILL after layer 1 of the shared reference pass, then after layer 0 of the EXL2
    quantization pass: each re-run goes on from the saved layer (it says so, and the manifest
    records it), keeps the outputs already finished, and the outputs equal those of a run
    never interrupted, byte for byte."""
    job = batches.one_model_job(tmp_path / "j.toml", three_layer_dir,
                         'imatrix = true\nawq = [{ group_size = 64 }]\nexl2 = [{ bpw = 4.0 }]')
    whole = tmp_path / "whole"
    assert quantize_main(["batch", str(job), "-o", str(whole), "--quiet"]) == 0
    out = tmp_path / "out"

    def run(kill: str | None):
        return batches.batch_process(job, out, kill)

    p = run("reference:1")
    assert p.returncode == -9, p.stderr[-2000:]
    ckpt = out / "m" / ".work" / "reference.ckpt"
    assert json.loads((ckpt / "done.json").read_text()) == {"layer": 1}
    assert not (out / "m" / "m-AWQ-w4g64").exists()

    p = run("m-EXL2-4.0bpw:0")
    assert p.returncode == -9, p.stderr[-2000:]
    assert "reference: resuming at layer 2 (layers 0-1 kept" in p.stderr
    m = json.loads((out / "m" / "manifest.json").read_text())
    done = {o["path"]: o.get("resumed_at_layer") for o in m["outputs"] if o["roundtrip"] == "ok"}
    assert done == {"m.imatrix.gguf": 2, "m-AWQ-w4g64": 2, "measurement.json": 2}
    assert not ckpt.exists()

    p = run(None)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "m-EXL2-4.0bpw: resuming at layer 1 (layers 0-0 kept" in p.stderr
    rows = {r["path"]: (r["status"], r["resumed_at"]) for r in json.loads(p.stdout)}
    assert rows == {"m.imatrix.gguf": ("kept", 0), "m-AWQ-w4g64": ("kept", 0),
                    "measurement.json": ("kept", 0), "m-EXL2-4.0bpw": ("made", 1)}
    assert not (out / "m" / ".work").exists()
    for name in ("m.imatrix.gguf", "m-AWQ-w4g64", "measurement.json", "m-EXL2-4.0bpw"):
        assert _digests(out / "m" / name) == _digests(whole / "m" / name), name


def test_killed_gptq_pass_resumes_at_the_layer_it_reached(tmp_path, three_layer_dir):
    """SIGKILL after the last layer of a GPTQ pass (the checkpoint is kept until the output is
    verified and installed): the re-run restores the three layers, runs none, and the output
    equals the single verb's byte for byte; the work directory is gone after it."""
    job = batches.one_model_job(tmp_path / "j.toml", three_layer_dir, "gptq = [{ group_size = 64 }]")
    out = tmp_path / "out"
    p = batches.batch_process(job, out, "m-GPTQ-w4g64:2")
    assert p.returncode == -9, p.stderr[-2000:]
    assert json.loads((out / "m" / ".work" / "m-GPTQ-w4g64.ckpt" / "done.json").read_text()) == {"layer": 2}
    p = batches.batch_process(job, out)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "m-GPTQ-w4g64: resuming at layer 3 (layers 0-2 kept" in p.stderr
    assert [(r["status"], r["resumed_at"]) for r in json.loads(p.stdout)] == [("made", 3)]
    assert not (out / "m" / ".work").exists()
    produce(GPTQOptions(group_size=64), make.source(three_layer_dir, samples=2, seqlen=32),
            tmp_path / "single", progress=False)
    assert _digests(out / "m" / "m-GPTQ-w4g64") == _digests(tmp_path / "single")


def test_saved_work_of_another_job_is_discarded(tmp_path, three_layer_dir):
    """A pass killed under one job, re-run after the job changed: the saved layers are not
    used (message), and the output equals a fresh run's."""
    def job(samples: int) -> Path:
        return batches.one_model_job(tmp_path / f"j{samples}.toml", three_layer_dir, "imatrix = true", samples)

    out, fresh = tmp_path / "out", tmp_path / "fresh"
    p = batches.batch_process(job(2), out, "reference:0")
    assert p.returncode == -9, p.stderr[-2000:]
    p = batches.batch_process(job(3), out)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "saved work under" in p.stderr and "another job or code version; discarded" in p.stderr
    assert quantize_main(["batch", str(job(3)), "-o", str(fresh), "--quiet"]) == 0
    assert _digests(out / "m" / "m.imatrix.gguf") == _digests(fresh / "m" / "m.imatrix.gguf")


def test_a_side_lane_that_dies_fails_its_stage_only(tmp_path, tiny_llama_dir, monkeypatch):
    """When the side lane's process dies during a request (its handle reports the exit code),
    the outputs of that stage, the GGUF policy here, are recorded failed with that message,
    nothing of them is left, and the stage of this process (AWQ) is made: exit 1."""
    from quantpress.batch import lanes, runner

    class DeadSide:
        requests: list = []

        def start(self, kind, plan, payload, put):
            DeadSide.requests.append(kind)
            put(("done", RuntimeError("the side process (stage) exited with code -9")))

        def forget(self, plan):
            pass

        def close(self):
            pass
    monkeypatch.setattr(lanes, "SideLane", DeadSide)
    monkeypatch.setattr(runner, "two_lanes", lambda device: True)
    job = batches.one_model_job(tmp_path / "j.toml", tiny_llama_dir, 'gguf = ["Q8_0"]\nawq = [{ group_size = 64 }]')
    out = tmp_path / "out"
    code = quantize_main(["batch", str(job), "-o", str(out), "--quiet"])
    m = json.loads((out / "m" / "manifest.json").read_text())
    st = {o["path"]: (o["roundtrip"], o.get("error", "")) for o in m["outputs"]}
    assert DeadSide.requests == ["stage"]
    assert st == {"m-Q8_0.gguf": ("failed", "the side process (stage) exited with code -9"),
                  "m-AWQ-w4g64": ("ok", "")}
    assert code == 1 and not (out / "m" / "m-Q8_0.gguf").exists() and (out / "m" / "m-AWQ-w4g64").is_dir()


class _ExitOnUnpickle:
    """A request the side process cannot survive: unpickling it ends the process (code 7)."""

    def __reduce__(self):
        import os

        return (os._exit, (7,))


def test_side_lane_reports_its_process_death_and_starts_anew():
    """The side lane's handle: a request during which the child process dies ends with
    ("done", RuntimeError) naming the exit code, and the next request starts a new process."""
    import queue

    from quantpress.batch.lanes import SideLane

    lane = SideLane()
    pids = []
    try:
        for _ in range(2):
            events: queue.Queue = queue.Queue()
            lane.start("stage", _ExitOnUnpickle(), None, events.put)
            pids.append(lane.pid)
            what, err = events.get(timeout=300)
            assert what == "done" and isinstance(err, RuntimeError) and "exited with code 7" in str(err)
    finally:
        lane.close()
    assert pids[0] != pids[1]


#: ``python -c`` program: ``quantize batch JOB -o OUT`` with the GGUF policy on the side lane,
#: the process SIGKILLed when it records that output (``record``: before its manifest entry
#: is written) or installs it (``install``: after the entry, before the rename into place)
_KILLED_AT = """
import os, signal, sys
from quantpress.batch import model_run, runner
from quantpress.cli.quantize_main import main

point, job, out = sys.argv[1:]
runner.two_lanes = lambda device: True

def kill_at(real, out_of):
    def f(*a, **k):
        if str(out_of(*a)).endswith(".gguf"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)
    return f

if point == "record":
    model_run.ModelRun.record = kill_at(model_run.ModelRun.record, lambda self, oc, *a: oc.out)
else:
    model_run.install = kill_at(model_run.install, lambda tmp, out: out)
sys.exit(main(["batch", job, "-o", out, "--quiet"]))
"""


@pytest.mark.parametrize("point", ["record", "install"])
def test_side_lane_output_killed_around_its_record_is_resumed(tmp_path, tiny_llama_dir, point, capsys):
    """The GGUF policy made on the side lane, the batch killed as the main process records
    it: before its manifest entry is written the output is not in place (only verified under
    ``.work/``), so the re-run makes it without ``--force``; after the entry, before the
    rename, the re-run installs the verified output and keeps it. Either way the re-run
    ends with the output in place and intact and no ``.work/`` left."""
    import os
    import subprocess
    import sys

    from quantpress.batch import manifest as mf

    job = batches.one_model_job(tmp_path / "j.toml", tiny_llama_dir, 'gguf = ["Q8_0"]\nawq = [{ group_size = 64 }]')
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", _KILLED_AT, point, str(job), str(out)], capture_output=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, text=True, timeout=600)
    assert p.returncode == -9, p.stderr[-2000:]
    gguf = out / "m" / "m-Q8_0.gguf"
    entries = {e["path"]: e for e in json.loads((out / "m" / "manifest.json").read_text())["outputs"]}
    assert not gguf.exists()
    assert (point == "install") == (entries.get(gguf.name, {}).get("roundtrip") == "ok")

    capsys.readouterr()
    code = quantize_main(["batch", str(job), "-o", str(out), "--quiet", "--json"])
    rows = {r["path"]: r["status"] for r in json.loads(capsys.readouterr().out)}
    assert code == 0 and rows[gguf.name] == ("made" if point == "record" else "kept"), rows
    m = json.loads((out / "m" / "manifest.json").read_text())
    entry = next(e for e in m["outputs"] if e["path"] == gguf.name)
    assert entry["roundtrip"] == "ok" and mf.intact(out / "m", entry)
    assert not (out / "m" / ".work").exists()
