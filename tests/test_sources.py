"""Model sources (``quantpress.convert.sources``): a MODEL argument or a job file's ``source``
may be a Hugging Face repo id, read from a hub cache laid out by huggingface_hub (here written
into a temporary directory, :mod:`hub_cache`), offline: HF_HUB_OFFLINE is set for every test,
and nothing here touches the network."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hub_cache
import synth
from quantpress.cli.convert_main import main as convert_main
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.convert import sources
from quantpress.errors import InputError

REPO = "quantpress-test/tiny-llama"
SRC = Path(__file__).resolve().parents[1] / "src"
#: the GGUF keys gguf-py's metadata heuristics derive from the model directory's name
DIR_NAME_KEYS = ("general.name", "general.basename", "general.finetune", "general.size_label")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny random llamas (2 layers, hidden 256, 384-token tokenizer), seeds 0 and 1."""
    root = tmp_path_factory.mktemp("tiny")
    a = synth.make_small_vocab_llama(root / "tiny-llama", num_hidden_layers=2)
    b = synth.make_small_vocab_llama(root / "tiny-llama-b", num_hidden_layers=2, seed=1)
    return a, b


@pytest.fixture(scope="module")
def cache(models, tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """A hub cache with REPO at two commits: ``main`` → the seed-0 model, tag ``v1`` → the
    seed-1 model; returns the cache and the snapshot directory of each ref."""
    cache = tmp_path_factory.mktemp("hub")
    snaps = {"main": hub_cache.add_snapshot(cache, REPO, models[0], refs=("main",)),
             "v1": hub_cache.add_snapshot(cache, REPO, models[1], refs=("v1",))}
    layout = hub_cache.check_layout(cache, REPO)
    assert layout == {snaps["main"].name: {"main"}, snaps["v1"].name: {"v1"}}
    return cache, snaps


@pytest.fixture
def hub(cache, monkeypatch):
    """The cache as the process's hub cache, offline (the variables for child processes, and
    huggingface_hub's constants, read once at its import, for this one)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache[0]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _err(capsys) -> list[str]:
    return capsys.readouterr().err.strip().splitlines()


def test_repo_id_converts_as_its_directory(models, hub, tmp_path):
    """``convert hf-to-gguf ORG/NAME`` in a fresh process, with HF_HUB_CACHE pointing at the
    cache, writes what the snapshot directory given as a path does, except ``general.name``:
    the repo id, as llama.cpp's ``convert_hf_to_gguf.py --remote ORG/NAME`` sets it; the other
    naming keys come from the directory's name (the snapshot's commit hash) in both, as
    gguf-py's heuristics derive them. Against the original directory every tensor and every
    other key is equal."""
    from gguf import GGUFReader

    cache, snaps = hub
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "quantpress.cli.convert_main", "hf-to-gguf", REPO,
                        "--policy", "F16", "-o", str(tmp_path / "repo.gguf"), "--quiet"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert str(snaps["main"]) in p.stdout, p.stdout      # the summary names the snapshot
    for name, src in (("snap.gguf", snaps["main"]), ("dir.gguf", models[0])):
        assert convert_main(["hf-to-gguf", str(src), "--policy", "F16", "-o", str(tmp_path / name),
                             "--quiet"]) == 0
    a, s, b = (GGUFReader(tmp_path / n) for n in ("repo.gguf", "snap.gguf", "dir.gguf"))
    def named(r):
        return {k: f.contents() for k, f in r.fields.items() if k in DIR_NAME_KEYS}

    snap = snaps["main"].name
    assert named(a) == {"general.name": REPO, "general.finetune": snap, "general.size_label": "1.8M"}
    assert named(s) == {**named(a), "general.name": snap}

    def kept(r):
        return [(k, f.contents()) for k, f in r.fields.items()
                if k not in DIR_NAME_KEYS and not k.startswith("GGUF.")]

    def tensors(r):
        return [(t.name, t.tensor_type, t.data.tobytes()) for t in r.tensors]

    assert kept(a) == kept(s) == kept(b) and "general.finetune" not in b.fields
    assert tensors(a) == tensors(s) == tensors(b)


def test_revision_picks_the_snapshot(models, hub, monkeypatch):
    """A branch, a tag and a commit hash each resolve to their snapshot; a local path is
    used as it is, even when it could be read as a repo id."""
    cache, snaps = hub
    assert sources.resolve_model(REPO).path == snaps["main"]
    assert sources.resolve_model(REPO, "main").path == snaps["main"]
    v1 = sources.resolve_model(REPO, "v1")
    assert (v1.path, v1.repo_id, v1.revision, v1.name) == (snaps["v1"], REPO, "v1", "tiny-llama")
    assert sources.resolve_model(REPO, snaps["v1"].name).path == snaps["v1"]

    local = sources.resolve_model(models[0])
    assert (local.path, local.repo_id, local.name) == (models[0], None, "tiny-llama")
    # relative paths: to ``base`` (a job file's directory), else to the working directory,
    # where an existing ``dir/name`` is that directory, not a repo id
    assert sources.resolve_model("tiny-llama-b", base=models[1].parent).path == models[1].resolve()
    monkeypatch.chdir(models[0].parent.parent)
    spelled = f"{models[0].parent.name}/{models[0].name}"
    assert sources.is_repo_id(spelled)
    assert sources.resolve_model(spelled) == sources.ModelSource(Path(spelled))


@pytest.mark.parametrize("argv, repo, rev", [
    (["hf-to-gguf", "quantpress-test/absent"], "quantpress-test/absent", "main"),
    (["hf-to-gguf", REPO, "--revision", "v9"], REPO, "v9"),
    (["hf-to-gguf", REPO, "--revision", "0" * 40], REPO, "0" * 40),
])
def test_missing_repo_or_revision_is_exit_2(hub, tmp_path, capsys, argv, repo, rev):
    """A repo id or revision the cache lacks: exit 2, one line naming the id, the revision
    and the cache directory searched; nothing written, no download tried."""
    cache, _ = hub
    out = tmp_path / "out"
    out.mkdir()
    assert convert_main(argv + ["-o", str(out / "o.gguf"), "--quiet"]) == 2
    err = _err(capsys)
    assert err == [f"error: {repo} (revision {rev}): not in the Hugging Face cache {cache}; "
                   f"not a local path either (pass --allow-download to fetch it)"], err
    assert list(out.iterdir()) == []


def test_other_verbs_and_eval_read_repo_ids(hub, capsys):
    """Every model verb takes the repo id (the same message for a missing one), ``quantize
    eval`` too; ``--revision`` with a local path, or on a verb whose input is a GGUF file, is
    refused."""
    for argv in (["imatrix", "quantpress-test/absent", "-o", "x.gguf"],
                 ["awq", "quantpress-test/absent", "-o", "x"],
                 ["gptq", "quantpress-test/absent", "-o", "x"],
                 ["fp8", "quantpress-test/absent", "-o", "x"],
                 ["exl2", "quantpress-test/absent", "-o", "x", "--bpw", "4"],
                 ["eval", "quantpress-test/absent"]):
        assert quantize_main(argv + ["--quiet"]) == 2, argv
        err = _err(capsys)
        assert len(err) == 1, err
        assert "quantpress-test/absent (revision main): not in the Hugging Face cache" in err[0], err
    with pytest.raises(InputError, match="a local path; --revision v1 applies to repo ids only"):
        sources.resolve_model(hub[1]["main"], "v1")
    with pytest.raises(SystemExit):
        quantize_main(["gguf", "in.gguf", "-o", "x.gguf", "--revision", "v1"])


def test_allow_download_stays_offline_under_hf_hub_offline(hub):
    """``--allow-download`` with HF_HUB_OFFLINE set: refused with the reason, before any
    request."""
    with pytest.raises(InputError, match=r"quantpress-test/absent \(revision main\): not in the "
                                         r"Hugging Face cache .*; HF_HUB_OFFLINE is set"):
        sources.resolve_model("quantpress-test/absent", allow_download=True)


def test_job_file_source_may_be_a_repo_id(hub, tmp_path):
    """A job file's ``source`` may be a repo id with ``revision``: the job reads the snapshot
    and is named after the repo; a missing one names the entry, the id, the revision and the
    cache."""
    from quantpress.batch.jobfile import read_jobs

    cache, snaps = hub
    job = tmp_path / "jobs.toml"
    job.write_text(f'[[model]]\nsource = "{REPO}"\ngguf = ["Q8_0"]\n\n'
                   f'[[model]]\nsource = "{REPO}"\nrevision = "v1"\nname = "b"\ngguf = ["Q8_0"]\n')
    jobs = read_jobs(job, tmp_path / "out")
    assert [(j.source, j.name) for j in jobs] == [(snaps["main"], "tiny-llama"), (snaps["v1"], "b")]
    assert [(j.repo_id, j.revision) for j in jobs] == [(REPO, None), (REPO, "v1")]
    # the manifest's card names what was made from by repo id and revision, not the snapshot path
    from quantpress.batch.manifest import model_card
    from quantpress.batch.model_run import ModelRun
    from quantpress.batch.stages import plan_model

    for j, rev in zip(jobs, ("main", "v1")):
        doc = ModelRun(plan_model(j, tmp_path / "out")).man.doc
        assert (doc["source"], doc["repo_id"], doc["revision"]) == (str(j.source), REPO, j.revision)
        assert f"from `{REPO}@{rev}`;" in model_card({**doc, "outputs": []})

    job.write_text(f'[[model]]\nsource = "{REPO}"\nrevision = "v9"\ngguf = ["Q8_0"]\n')
    with pytest.raises(InputError) as e:
        read_jobs(job, tmp_path / "out")
    assert str(e.value) == (f"{job}: model[0]: source {REPO} (revision v9): not in the Hugging Face "
                            f"cache {cache}; not a local path either (pass --allow-download "
                            f"to fetch it)")
    job.write_text(f'[defaults]\nrevision = "v1"\n\n[[model]]\nsource = "{REPO}"\ngguf = ["Q8_0"]\n')
    with pytest.raises(InputError, match=r"\[defaults\]: key 'revision' not allowed"):
        read_jobs(job, tmp_path / "out")
