"""llama.cpp, the reference, is one build: the shared libraries the bindings load (``llama_cpp``'s
``lib/``: ``llama_model_quantize`` in tests/refs.py, ``ggml_quantize_chunk`` in tests/ggml_ref.py)
are byte for byte those built beside ``llama-quantize``, ``llama-imatrix`` and
``llama-perplexity`` from llama-cpp-python 0.3.36's vendored source (scripts/llamacpp_tools.py;
``scripts/setup.sh --test`` installs the bindings without a build of their own and copies the
libraries in), so the tests that call the bindings and those that run the tools compare against
the same compiled code."""
from __future__ import annotations

import filecmp
import importlib
import shutil
import subprocess
from pathlib import Path

import llamacpp_tools
import pytest


def test_bindings_load_the_tools_build():
    bindir = llamacpp_tools.tools()
    lib = llamacpp_tools.bindings_lib_dir()
    for name in llamacpp_tools.LIBS:
        built, installed = (bindir / name).resolve(), (lib / name).resolve()
        assert built.name == installed.name, name           # the same version behind the link
        assert filecmp.cmp(built, installed, shallow=False), name

    importlib.import_module("llama_cpp")     # loads libllama, as every test calling the bindings does
    maps = Path("/proc/self/maps").read_text().split()
    loaded = {Path(f).resolve() for f in maps if "/libllama.so" in f}
    assert loaded == {(lib / "libllama.so").resolve()}, loaded


def test_the_cpu_backend_has_no_amx_code():
    """On x86 the build keeps AMX out (scripts/llamacpp_tools.py, ``NO_AMX``): a virtual machine
    that reports AMX without enabling its tile state traps at the first tile instruction, which
    killed llama-perplexity and the test worker that had loaded the bindings. No tile
    instruction is in the CPU backend's library."""
    if not llamacpp_tools.amx_excluded():
        pytest.skip("AMX is x86's")
    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils, beside the compiler that built llama.cpp) is needed"
    lib = (llamacpp_tools.tools() / "libggml-cpu.so").resolve()
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib)], check=True, capture_output=True,
                          text=True).stdout
    assert "vfmadd" in text or "vaddps" in text, "no vector code at all: not the native build"
    tiles = [line for line in text.splitlines() if any(op in line for op in ("tilezero", "ldtilecfg", "tdpb"))]
    assert not tiles, tiles[:3]
