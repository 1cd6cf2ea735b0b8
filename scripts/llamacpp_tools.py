#!/usr/bin/env python3
"""llama.cpp itself, the reference of the tests and benchmarks (never part of quantpress), built
once and cached under quantpress's cache root.

- ``llamacpp_src()``: llama.cpp's source tree as vendored in the ``llama-cpp-python==0.3.36``
  sdist (for the reference ``convert_hf_to_gguf.py``; never committed).
- ``tools()``: ``llama-quantize``, ``llama-perplexity`` and ``llama-imatrix`` compiled from the
  pinned source (``llamacpp_src()``, llama.cpp 0c1e57098 as vendored in llama-cpp-python
  0.3.36), Release, without CURL, tests, examples or the server, with llama.cpp's shared
  libraries (``libllama``, ``libggml*``) beside them in ``<cache>/ref/llama_cpp-0.3.36-<flags>/bin``.
  Built the first time (``scripts/setup.sh --test`` builds it; its time in docs/benchmarks.md,
  "Figures behind the code", scripts/setup.sh), then cached. The imatrix *file* is read by ``llama-quantize`` (``common_imatrix_load``) and
  written by ``llama-imatrix``, which the Python bindings do not expose.
- ``install_libs()``: those shared libraries copied into the installed ``llama_cpp`` package's
  ``lib/``, where llama-cpp-python's own build would put them (llama-cpp-python's
  CMakeLists.txt ``llama_cpp_python_install_target``): setup.sh installs the bindings with
  ``CMAKE_ARGS=-DLLAMA_BUILD=OFF`` (Python only), so that llama.cpp is compiled once for both
  the bindings and the tools rather than twice (the bindings' own build compiles most of the
  same ggml and libllama the tools need; figures in docs/benchmarks.md).
- ``smollm2_gguf("f16"|"q8_0")``: SmolLM2-135M-Instruct converted by llama.cpp's own
  ``convert_hf_to_gguf.py --outtype f16`` (and ``llama_model_quantize`` to Q8_0), cached
  under ``<cache>/ref/smollm2-gguf/``: reference inputs for tests and benchmarks.
- ``cached_files()`` / ``cached_value()``: llama.cpp's outputs (``convert_hf``'s conversions,
  the tests' llama-quantize, llama-imatrix and llama-perplexity runs) kept under
  ``<cache>/ref/outputs/`` by a key over the input files' bytes, the exact arguments and
  :func:`tool_key`, so that a run on a machine with a filled cache does not repeat them and a
  fresh machine runs each once (``QUANTPRESS_REF_CACHE=0`` runs them again, storing nothing).

Usage: ``python scripts/llamacpp_tools.py [--install-libs]`` builds (once) and prints the bin
directory; ``--install-libs`` also copies the libraries into the ``llama_cpp`` package.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable
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
#: on x86, llama.cpp's GGML_NATIVE build (-march=native) compiles ggml-cpu's AMX kernels
#: (ggml/src/ggml-cpu/amx/mmq.cpp, under ``__AMX_INT8__``) wherever the CPU reports AMX, and
#: ggml then takes them for quantized matrices (its AMX extra buffer type). A virtual machine
#: may report AMX without enabling its tile state: the first ``tilezero`` / ``ldtilecfg`` then
#: traps (SIGILL in llama-perplexity, SIGSEGV in a process that loaded the bindings' libggml-cpu,
#: which killed a test worker). The ISA flags given before -march=native keep AMX out of the
#: build, every other instruction set of the CPU in (an explicit -mno-* wins over what
#: -march implies: ``echo | gcc -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -march=native -dM -E -``
#: defines no ``__AMX_*__`` with gcc 12 on an AMX Xeon; :func:`amx_excluded`). None of the
#: reference bytes depends on it: llama-quantize's quantization is ggml-base's
#: (ggml/src/ggml-quants.c), built without ISA flags.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def amx_excluded() -> bool:
    """Whether the build passes :data:`NO_AMX` (on x86)."""
    return platform.machine().lower() in ("x86_64", "amd64")


if amx_excluded():
    CMAKE_FLAGS += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


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
    """Where the tools are built (in the cache), one directory per :data:`CMAKE_FLAGS` (a
    change of flags builds anew)."""
    flags = hashlib.sha256(json.dumps(CMAKE_FLAGS).encode()).hexdigest()[:8]
    return assets.cache_root() / "ref" / f"llama_cpp-{LLAMA_CPP_PYTHON}-{flags}"


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


def convert_hf(model_dir: Path, out: Path, outtype: str = "f16", extra: tuple[str, ...] = (),
               cache: bool = True) -> Path:
    """``convert_hf_to_gguf.py MODEL_DIR --outtype OUTTYPE --outfile OUT [EXTRA...]``
    (offline, the pinned source of :func:`llamacpp_src`; ``extra`` e.g. ``("--split-max-tensors",
    "20")``, which writes ``OUT``'s stem ``-00001-of-0000N.gguf`` and on instead); returns
    ``out``. Raises RuntimeError with the end of the converter's stderr when it fails.

    ``cache``: the files are kept by :func:`cached_files` under a key over every file of
    ``model_dir``, its name (the converter names the model after the directory when the
    config does not), ``outtype``, ``extra`` and :func:`tool_key` ``"convert"``;
    the directory's full path is left out (the converter writes only its name), so the
    same model built in another temporary directory of the same name hits."""
    model_dir = Path(model_dir)
    if cache:
        return cached_files("convert", ["convert", model_dir.name, outtype, *extra],
                            [model_dir], out,
                            lambda o: convert_hf(model_dir, o, outtype, extra, cache=False))
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


# --------------------------------------------------------------------------- reference cache

_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, or of a directory's files (relative path and digest of
    each, sorted); remembered per (path, size, mtime) within the process, as the same inputs
    (SmolLM2's 270 MB F16 GGUF) are keyed by many calls. FileNotFoundError if absent."""
    p = Path(path)
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(f for f in p.rglob("*") if f.is_file()):
            h.update(f"{f.relative_to(p)}\0{file_digest(f)}\n".encode())
        return h.hexdigest()
    st = p.stat()
    k = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    if k not in _DIGESTS:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _DIGESTS[k] = h.hexdigest()
    return _DIGESTS[k]


def tool_key(kind: str) -> str:
    """What a reference output depends on besides its inputs and arguments: the pinned
    llama-cpp-python version and, by ``kind``, ``"convert"``: the versions of the Python
    packages ``convert_hf_to_gguf.py`` runs with (torch, transformers, numpy, safetensors,
    tokenizers: the script loads the tokenizer and casts with them); ``"tools"``: the digest
    of the built binaries and libraries of :func:`tools` (the tool build: a rebuild with other
    flags or another compiler is another key); ``"bindings"``: the digest of the libraries the
    installed ``llama_cpp`` package loads (:func:`bindings_lib_dir`). ValueError otherwise."""
    parts = [f"llama-cpp-python {LLAMA_CPP_PYTHON}", kind]
    if kind == "convert":
        from importlib.metadata import PackageNotFoundError, version

        for pkg in ("torch", "transformers", "numpy", "safetensors", "tokenizers", "sentencepiece"):
            try:
                parts.append(f"{pkg} {version(pkg)}")
            except PackageNotFoundError:
                parts.append(f"{pkg} -")
    elif kind == "tools":
        d = tools()
        parts += [f"{f.name} {file_digest(f)}" for f in sorted(d.iterdir()) if f.is_file()]
    elif kind == "bindings":
        d = bindings_lib_dir()
        parts += [f"{f.name} {file_digest(f)}" for f in sorted(d.glob("lib*.so*")) if f.is_file()]
    else:
        raise ValueError(f"tool kind {kind!r}: convert, tools or bindings")
    return "\n".join(parts)


def _enabled() -> bool:
    return os.environ.get("QUANTPRESS_REF_CACHE", "1") != "0"


def _entry(kind: str, parts: Iterable[str], inputs: Iterable[Path]) -> Path:
    """``<cache>/ref/outputs/<kind>/<key>``: the key is 24 hex digits of a SHA-256 over
    :func:`tool_key` of ``kind``, the arguments ``parts`` and the digest of each input."""
    h = hashlib.sha256(tool_key(kind).encode())
    h.update(json.dumps([str(p) for p in parts]).encode())
    for p in inputs:
        h.update(file_digest(Path(p)).encode())
    return assets.cache_root() / "ref" / "outputs" / kind / h.hexdigest()[:24]


def _fill(entry: Path, produce: Callable[[Path], None]) -> None:
    """Under the entry's lock: ``produce(staging directory)``, then the directory renamed to
    ``entry`` (a reader sees a whole entry or none; a crash leaves only a ``.tmp-*``
    directory, which nothing reads)."""
    def fill() -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        try:
            produce(staging)
            os.rename(staging, entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    assets.fill_once(f"ref-{entry.parent.name}-{entry.name}", entry.is_dir, fill)


def cached_files(kind: str, parts: Iterable[str], inputs: Iterable[Path], out: Path,
                 produce: Callable[[Path], object]) -> Path:
    """``out`` (and any file ``produce`` writes beside it whose name starts with ``out``'s
    stem, e.g. a split's ``-00001-of-00003`` parts) made by ``produce(path)``, which writes the
    reference output at ``path`` (``ref`` + ``out``'s suffix, in a fresh directory); kept in
    the cache (:func:`_entry` of ``kind``, ``parts``, ``inputs``: ``parts`` must hold every
    argument that reaches the bytes, paths included where the tool records them in its
    output; the output's own name is not part of the key, as none of the tools records it)
    and copied to ``out``'s directory under ``out``'s stem. Returns ``out``. Whatever
    ``produce`` raises propagates and nothing is stored."""
    out = Path(out)
    parts, inputs = list(parts), list(inputs)
    if not _enabled():
        produce(out)
        return out
    entry = _entry(kind, [*parts, out.suffix], inputs)
    def make(d: Path) -> None:
        produce(d / f"ref{out.suffix}")
        if not any(d.iterdir()):
            raise RuntimeError(f"{kind} reference {parts}: nothing was written")

    _fill(entry, make)
    out.parent.mkdir(parents=True, exist_ok=True)
    for f in sorted(entry.iterdir()):
        shutil.copyfile(f, out.parent / (out.stem + f.name[len("ref"):]))
    return out


def cached_value(kind: str, parts: Iterable[str], inputs: Iterable[Path], compute: Callable[[], object]):
    """``compute()``'s JSON-serialisable result (figures or facts read from a reference run:
    llama-perplexity's perplexities, the tensor types of a llama-quantize output), kept in the
    cache as :func:`cached_files` keeps files (``value.json`` in the entry)."""
    parts, inputs = list(parts), list(inputs)
    if not _enabled():
        return compute()
    entry = _entry(kind, parts, inputs)

    def produce(d: Path) -> None:
        (d / "value.json").write_text(json.dumps(compute()))

    _fill(entry, produce)
    return json.loads((entry / "value.json").read_text())


def stable_copy(path: Path) -> Path:
    """A copy of the file ``path`` at ``<cache>/ref/inputs/<key>/<name>`` (the key over its name
    and bytes), a path that is the same wherever and whenever the same file is copied: for
    inputs whose *path* a reference tool records in its output (llama-quantize's
    ``quantize.imatrix.file``, llama-imatrix's dataset name), so that the output, and its
    cache key, do not change with a test's temporary directory. Returns ``path`` itself when
    the cache is off."""
    path = Path(path)
    if not _enabled():
        return path
    key = hashlib.sha256(f"{path.name}\0{file_digest(path)}".encode()).hexdigest()[:24]
    entry = assets.cache_root() / "ref" / "inputs" / key
    _fill(entry, lambda d: shutil.copyfile(path, d / path.name))
    return entry / path.name


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["--install-libs"]):
        sys.exit("usage: llamacpp_tools.py [--install-libs]")
    if sys.argv[1:]:
        install_libs()
    print(tools())
