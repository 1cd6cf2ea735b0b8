#!/usr/bin/env python3
"""llama.cpp itself, the reference of the tests and benchmarks (never part of quantpress), built
once and cached under quantpress's cache root.

- ``llamacpp_src()``: llama.cpp's source tree as vendored in the ``llama-cpp-python==0.3.36``
  sdist (for the reference ``convert_hf_to_gguf.py``; never committed).
- ``tools()``: ``llama-quantize``, ``llama-perplexity`` and ``llama-imatrix`` compiled from the
  pinned source (``llamacpp_src()``, llama.cpp 0c1e57098 as vendored in llama-cpp-python
  0.3.36), Release, without CURL, tests, examples or the server, with llama.cpp's shared
  libraries (``libllama``, ``libggml*``) beside them in ``<cache>/ref/llama_cpp-0.3.36/bin``.
  About 4 minutes on 2 cores the first time (``scripts/setup.sh --test`` builds it), then
  cached. The imatrix *file* is read by ``llama-quantize`` (``common_imatrix_load``) and
  written by ``llama-imatrix``, which the Python bindings do not expose.
- ``install_libs()``: those shared libraries copied into the installed ``llama_cpp`` package's
  ``lib/``, where llama-cpp-python's own build would put them (llama-cpp-python's
  CMakeLists.txt ``llama_cpp_python_install_target``): setup.sh installs the bindings with
  ``CMAKE_ARGS=-DLLAMA_BUILD=OFF`` (Python only, 5 s), so that llama.cpp is compiled once for
  both the bindings and the tools rather than twice (the bindings' own build took 222 s on
  2 cores, most of it the same ggml and libllama the tools need).
- ``smollm2_gguf("f16"|"q8_0")``: SmolLM2-135M-Instruct converted by llama.cpp's own
  ``convert_hf_to_gguf.py --outtype f16`` (and ``llama_model_quantize`` to Q8_0), cached
  under ``<cache>/ref/smollm2-gguf/``: reference inputs for tests and benchmarks.

Usage: ``python scripts/llamacpp_tools.py [--install-libs]`` builds (once) and prints the bin
directory; ``--install-libs`` also copies the libraries into the ``llama_cpp`` package.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from quantpress import assets

LLAMA_CPP_PYTHON = "0.3.36"

TARGETS = ("llama-quantize", "llama-perplexity", "llama-imatrix")
#: what the bindings load (llama_cpp/llama_cpp.py: libllama; tests/ggml_ref.py: libggml-base),
#: the unversioned names (symlinks to the versioned files, copied along)
LIBS = ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so")
#: as llama-cpp-python 0.3.36's build configures llama.cpp (shared, Release, no CURL; GGML_NATIVE
#: left at its default), plus the tools; every binary finds the libraries beside it ($ORIGIN)
CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_TOOLS=ON", "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
               "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]


def llamacpp_src() -> Path:
    """llama.cpp source tree vendored in llama-cpp-python's sdist (for convert_hf_to_gguf.py),
    downloaded with pip and unpacked into the cache once."""
    out = assets.cache_root() / "ref" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"

    def unpack() -> None:
        sdist = assets.pip_download(f"llama-cpp-python=={LLAMA_CPP_PYTHON}", assets.cache_root() / "dl", sdist=True)
        with tarfile.open(sdist) as t:
            t.extractall(assets.cache_root() / "ref", filter="data")

    assets.fill_once("llama_cpp_src", (out / "convert_hf_to_gguf.py").exists, unpack)
    return out


def build_dir() -> Path:
    """Where the tools are built (in the cache)."""
    return assets.cache_root() / "ref" / f"llama_cpp-{LLAMA_CPP_PYTHON}"


def tools() -> Path:
    """Directory holding the built ``llama-quantize``, ``llama-perplexity`` and
    ``llama-imatrix`` and the shared libraries :data:`LIBS` (built on first use; raises
    CalledProcessError if cmake fails, its output in ``build.log`` there)."""
    b = build_dir()
    bindir = b / "bin"
    assets.fill_once("llama_cpp_tools", lambda: all((bindir / t).is_file() for t in TARGETS + LIBS),
                     lambda: _build(b))
    return bindir


def bindings_lib_dir() -> Path:
    """``lib/`` of the installed ``llama_cpp`` package, found without importing it (its import
    loads libllama, which may not be there yet); ModuleNotFoundError if it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llama_cpp is not installed (bash scripts/setup.sh --test installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


def install_libs() -> Path:
    """Copy the built shared libraries :data:`LIBS` (with their versioned names, links kept as
    links) from :func:`tools`' directory into :func:`bindings_lib_dir`, each written beside
    its place and renamed over it; returns that directory."""
    src = tools()
    dest = bindings_lib_dir()
    dest.mkdir(parents=True, exist_ok=True)
    for f in sorted(f for f in src.glob("lib*.so*") if f.name.split(".so")[0] + ".so" in LIBS):
        tmp = dest / f".{f.name}.tmp"
        tmp.unlink(missing_ok=True)
        shutil.copy2(f, tmp, follow_symlinks=False)
        tmp.replace(dest / f.name)
    return dest


def _build(b: Path) -> None:
    """cmake configure and build of TARGETS in ``b`` (log in ``b/build.log``)."""
    src = llamacpp_src()
    b.mkdir(parents=True, exist_ok=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = [f for f in CMAKE_FLAGS if f not in ("-G", "Ninja")]
    with open(b / "build.log", "w") as log:
        subprocess.run(["cmake", "-S", str(src), "-B", str(b), *gen, *flags], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
        subprocess.run(["cmake", "--build", str(b), "-j", str(os.cpu_count() or 2), "--target", *TARGETS, "llama"],
                       check=True, stdout=log, stderr=subprocess.STDOUT)


def tool(name: str) -> Path:
    """Path of one tool (``llama-imatrix`` …), building them if needed."""
    return tools() / name


def smollm2_gguf(outtype: str = "f16") -> Path:
    """SmolLM2-135M-Instruct as a GGUF made by llama.cpp itself: ``f16`` from
    ``convert_hf_to_gguf.py --outtype f16``; ``q8_0`` from that file by
    ``llama_model_quantize(ftype=MOSTLY_Q8_0)``. Cached."""
    if outtype not in ("f16", "q8_0"):
        raise ValueError(f"outtype {outtype!r}: f16 or q8_0")
    out_dir = assets.cache_root() / "ref" / "smollm2-gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / "SmolLM2-135M-Instruct-F16.gguf"
    assets.fill_once("smollm2-gguf-f16", f16.is_file, lambda: _convert_f16(f16))
    if outtype == "f16":
        return f16
    q8 = out_dir / "SmolLM2-135M-Instruct-Q8_0.gguf"
    assets.fill_once("smollm2-gguf-q8_0", q8.is_file, lambda: _quantize_q8_0(f16, q8))
    return q8


def convert_hf(model_dir: Path, out: Path, outtype: str = "f16", extra: tuple[str, ...] = ()) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outtype OUTTYPE --outfile OUT [EXTRA...]``
    (offline, the pinned source of :func:`llamacpp_src`; ``extra`` e.g. ``("--split-max-tensors",
    "20")``, which writes ``OUT``'s stem ``-00001-of-0000N.gguf`` and on instead); returns
    ``out``. Raises RuntimeError with the end of the converter's stderr when it fails."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")     # (the script puts its own gguf-py first)
    res = subprocess.run([sys.executable, str(llamacpp_src() / "convert_hf_to_gguf.py"), str(model_dir),
                          "--outtype", outtype, "--outfile", str(out), *extra],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {model_dir} --outtype {outtype} failed "
                           f"(exit {res.returncode}):\n{res.stderr[-4000:]}")
    return out


def _convert_f16(f16: Path) -> None:
    """``convert_hf_to_gguf.py --outtype f16`` of SmolLM2 into ``f16`` (staged, renamed)."""
    with tempfile.TemporaryDirectory(dir=f16.parent) as tmp:
        t = Path(tmp, f16.name)
        convert_hf(assets.smollm2_dir(), t)
        t.rename(f16)


def _quantize_q8_0(f16: Path, q8: Path) -> None:
    """``llama_model_quantize(ftype=MOSTLY_Q8_0)`` of ``f16`` into ``q8`` (staged, renamed)."""
    import ctypes

    import llama_cpp

    with tempfile.TemporaryDirectory(dir=q8.parent) as tmp:
        t = Path(tmp, q8.name)
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        p.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(t).encode(), ctypes.byref(p))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize(Q8_0) returned {rc}")
        t.rename(q8)


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--install-libs"]):
        sys.exit("usage: llamacpp_tools.py [--install-libs]")
    if sys.argv[1:]:
        install_libs()
    print(tools())
