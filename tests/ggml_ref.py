"""ctypes harness over llama.cpp's own ggml (``libggml-base.so`` in the installed ``llama_cpp``
package, llama-cpp-python 0.3.36 = llama.cpp 0c1e57098, built from its vendored source by
``scripts/llamacpp_tools.py`` as the package's own build configures it): reference bytes for
the codec tests.

* :func:`ref_quantize` calls ``ggml_quantize_chunk(type, src, dst, 0, nrows, n_per_row,
  imatrix)`` (imatrix NULL: the ``quantize_row_<type>_ref`` path of the legacy and K types;
  float32 [n_per_row]: the importance-weighted ``quantize_row_<type>_impl`` path).
* :func:`ref_dequantize` calls ``ggml_get_type_traits(type)->to_float``
  (``dequantize_row_<type>``).
* :func:`available` tells whether the library can be loaded (the test stack installs it).
"""
from __future__ import annotations

import ctypes
import os
import time
from functools import lru_cache

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import llamacpp_tools


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def lib_dir() -> str:
    """Directory of the shared libraries inside the installed ``llama_cpp`` package
    (:func:`llamacpp_tools.bindings_lib_dir`)."""
    return str(llamacpp_tools.bindings_lib_dir())


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(os.path.join(lib_dir(), "libggml-base.so"))
    lib.ggml_init.argtypes = [_InitParams]
    lib.ggml_init.restype = ctypes.c_void_p
    lib.ggml_free.argtypes = [ctypes.c_void_p]
    lib.ggml_free.restype = None
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    # ggml_init sets up ggml's global state (fp16 tables in table-based builds); once is enough
    ctx = lib.ggml_init(_InitParams(1 << 16, None, True))
    if not ctx:
        raise RuntimeError("ggml_init failed")
    lib.ggml_free(ctx)
    return lib


def available() -> bool:
    """True when llama.cpp's libggml-base can be loaded."""
    try:
        _lib()
        return True
    except (ImportError, OSError):
        return False


def _type(type_name: str) -> tuple[int, int, int]:
    t = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[t]
    return int(t), block, size


def ref_quantize(x: np.ndarray, type_name: str, timing: dict | None = None,
                 imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp ``ggml_quantize_chunk``, with ``imatrix`` (float32 [n]) or without (None).

    ``x``: float32 [rows, n] (n a multiple of the block size). Returns uint8
    [rows, n // block * type_size]. If ``timing`` is a dict, the seconds spent in the C call
    are stored under ``"seconds"``.
    """
    tid, block, size = _type(type_name)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    assert n % block == 0, (n, block)
    out = np.zeros((rows, n // block * size), dtype=np.uint8)
    lib = _lib()
    qw = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        assert imatrix.shape == (n,), (imatrix.shape, n)
        qw = imatrix.ctypes.data
    t0 = time.perf_counter()
    written = lib.ggml_quantize_chunk(tid, x.ctypes.data, out.ctypes.data, 0, rows, n, qw)
    if timing is not None:
        timing["seconds"] = time.perf_counter() - t0
    assert written == out.nbytes, (written, out.nbytes)
    return out


def ref_dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """llama.cpp ``ggml_get_type_traits(type)->to_float`` (``dequantize_row_<type>``).

    ``raw``: uint8 [rows, row_bytes]; returns float32 [rows, row_bytes // type_size * block].
    """
    tid, block, size = _type(type_name)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows, nbytes = raw.shape
    assert nbytes % size == 0
    n = nbytes // size * block
    out = np.zeros((rows, n), dtype=np.float32)
    traits = _lib().ggml_get_type_traits(tid).contents
    assert traits.type_size == size and traits.blck_size == block
    fn = _TO_FLOAT(traits.to_float)
    fn(raw.ctypes.data, out.ctypes.data, rows * n)
    return out


def fuzz_rows(seed: int, count: int) -> np.ndarray:
    """``count`` rows of 256 mixing distributions, sparsity, grids and magnitudes from 1e-40 to 1e37."""
    r = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        kind = r.integers(0, 8)
        scale = 10.0 ** r.uniform(-40, 37)
        if kind == 0:
            v = r.normal(0, 1, 256)
        elif kind == 1:
            v = r.standard_t(2, 256)
        elif kind == 2:
            v = r.integers(-4, 5, 256).astype(float)
        elif kind == 3:
            v = np.abs(r.normal(0, 1, 256)) * r.choice([-1, 1])
        elif kind == 4:
            v = np.where(r.random(256) < r.random(), r.normal(0, 1, 256), 0.0)
        elif kind == 5:
            v = r.normal(0, 1, 256) * 10.0 ** r.uniform(-6, 6, 256)
        elif kind == 6:
            v = np.repeat(r.normal(0, 1, 16), 16) + r.normal(0, 1e-3, 256) * (r.random() < 0.5)
        else:
            v = r.uniform(-1, 1, 256).round(r.integers(0, 4))
        rows.append(np.clip(v * scale, -3e38, 3e38))
    return np.stack(rows).astype(np.float32)
