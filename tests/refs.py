"""Run llama.cpp itself as the reference: its quantizer (llama_model_quantize from
llama-cpp-python 0.3.36, and the ``llama-quantize`` / ``llama-imatrix`` tools built from the
same source) and readers of the files it writes. Its converter (convert_hf_to_gguf.py from
the pinned source) is ``scripts/llamacpp_tools.convert_hf``. Every reference output is kept in
the cache by a key over its inputs' bytes, its arguments and the tool build
(``llamacpp_tools.cached_files``): a second run does not repeat it."""
from __future__ import annotations

import ctypes
import math
import mmap
import struct
import subprocess
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

import llamacpp_tools


def ref_quantize(src: Path, out: Path, policy: str, nthread: int = 2) -> Path:
    """``llama_model_quantize(src, out, ftype=LLAMA_FTYPE_MOSTLY_<policy>)`` (default
    parameters, ``nthread`` threads), cached by ``src``'s bytes, the policy, ``nthread`` and the
    bindings' libraries; returns ``out``. AssertionError if llama.cpp returns non-zero."""
    return llamacpp_tools.cached_files("bindings", ["llama_model_quantize", policy, nthread],
                                       [src], out, lambda o: _quantize(src, o, policy, nthread))


def llama_quantize(src: Path, out: Path, policy: str, *flags: str, inputs: tuple[Path, ...] = ()) -> Path:
    """``llama-quantize [flags] SRC OUT POLICY 2`` (the CLI: it also records the imatrix keys),
    cached by the bytes of ``src`` and of ``inputs`` (files named in ``flags``, e.g. the
    ``--imatrix`` file), ``flags`` as given (llama-quantize records the imatrix *path*: pass
    one from ``llamacpp_tools.stable_copy`` for the cache to hit) and the tool build. Returns
    ``out``; AssertionError with the tool's output if it fails."""
    def run(o: Path) -> None:
        r = subprocess.run([str(llamacpp_tools.tool("llama-quantize")), *flags, str(src), str(o), policy, "2"],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]

    return llamacpp_tools.cached_files("tools", ["llama-quantize", *flags, policy, "2"],
                                       [src, *inputs], out, run)


def llama_imatrix(model: Path, text: Path, out: Path, *flags: str) -> Path:
    """``llama-imatrix -m MODEL -f TEXT -o OUT [flags]``, cached by the bytes of ``model`` and
    ``text``, ``text``'s path (written into the file as its dataset: pass one from
    ``llamacpp_tools.stable_copy``), ``flags`` and the tool build. Returns ``out``;
    CalledProcessError if the tool fails."""
    def run(o: Path) -> None:
        subprocess.run([str(llamacpp_tools.tool("llama-imatrix")), "-m", str(model), "-f", str(text),
                        "-o", str(o), *flags], check=True, capture_output=True)

    return llamacpp_tools.cached_files("tools", ["llama-imatrix", str(text), *flags],
                                       [model, text], out, run)


def _quantize(src: Path, out: Path, policy: str, nthread: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    name = "LLAMA_FTYPE_ALL_F32" if policy == "F32" else f"LLAMA_FTYPE_MOSTLY_{policy}"
    params.ftype = getattr(llama_cpp, name)
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({policy}) returned {rc}"


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}


def gguf_header(path: Path) -> tuple[dict, list[tuple[str, int, tuple[int, ...], int]]]:
    """Scalar/string KVs (arrays as None) and (name, ggml type id, numpy-order shape, absolute
    data offset) of every tensor, in file order, parsed directly from the GGUF v3 header (layout: llama.cpp 0c1e570
    ``ggml/src/gguf.cpp``). gguf.GGUFReader builds
    numpy views for each of the ~100k tokenizer strings (about 5 s per file); this skips
    arrays instead. ``test_header_parser_agrees_with_gguf_reader`` (test_gguf_policy.py) checks
    it against GGUFReader, and :func:`tensors_of` gives GGUFReader's bytes."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", m, 0)
        assert magic == 0x46554747 and version == 3, (magic, version)
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", m, pos)
            pos += 8 + n
            return bytes(m[pos - n:pos]).decode("utf-8")

        def skip_or_read(vtype: int):
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if etype == 8:
                    for _ in range(count):
                        (n,) = struct.unpack_from("<Q", m, pos)
                        pos += 8 + n
                elif etype == 9:
                    for _ in range(count):
                        skip_or_read(9)
                else:
                    pos += count * struct.calcsize(_SCALAR[etype])
                return None
            fmt = _SCALAR[vtype]
            (v,) = struct.unpack_from(fmt, m, pos)
            pos += struct.calcsize(fmt)
            return v

        kv = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", m, pos)
            pos += 4
            kv[key] = skip_or_read(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", m, pos)
            ne = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            ttype, offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            tensors.append((name, ttype, tuple(int(d) for d in reversed(ne)), offset))
        align = int(kv.get("general.alignment") or 32)
        start = pos + (-pos % align)
    return kv, [(n, t, shape, start + off) for n, t, shape, off in tensors]



def tensors_of(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (ggml type name, ne shape, raw bytes) of every tensor in a GGUF file, in file
    order (the header parsed by :func:`gguf_header`; sizes from gguf-py's GGML_QUANT_SIZES)."""
    _, tensors = gguf_header(path)
    out = {}
    with open(path, "rb") as f:
        for name, ttype, shape, offset in tensors:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            f.seek(offset)
            out[name] = (GGMLQuantizationType(ttype).name, tuple(reversed(shape)),
                         f.read(math.prod(shape) // block * size))
    return out


def kvs_of(path: Path) -> dict[str, tuple[list[int], object]]:
    """key -> (value type list, decoded value) of every KV in a GGUF file."""
    r = GGUFReader(str(path))
    return {k: (list(f.types), f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
