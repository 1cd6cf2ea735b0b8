"""Run llama.cpp itself as the reference: its converter (convert_hf_to_gguf.py from the
pinned source) and its quantizer (llama_model_quantize from llama-cpp-python 0.3.36)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader


def ref_convert(llamacpp_src: Path, model_dir: Path, out: Path, outtype: str = "f16") -> Path:
    """``convert_hf_to_gguf.py MODEL --outtype OUTTYPE --outfile OUT`` (offline)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")  # the script puts its own gguf-py first
    subprocess.run([sys.executable, str(Path(llamacpp_src) / "convert_hf_to_gguf.py"), str(model_dir),
                    "--outtype", outtype, "--outfile", str(out)], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def ref_quantize(src: Path, out: Path, policy: str, nthread: int = 2) -> Path:
    """``llama_model_quantize(src, out, ftype=LLAMA_FTYPE_MOSTLY_<policy>)``."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    name = "LLAMA_FTYPE_ALL_F32" if policy == "F32" else f"LLAMA_FTYPE_MOSTLY_{policy}"
    params.ftype = getattr(llama_cpp, name)
    params.nthread = nthread
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize({policy}) returned {rc}"
    return out


def tensors_of(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (ggml type name, ne shape, raw bytes) of every tensor in a GGUF file."""
    r = GGUFReader(str(path))
    return {t.name: (GGMLQuantizationType(t.tensor_type).name, tuple(int(d) for d in t.shape),
                     np.asarray(t.data).tobytes()) for t in r.tensors}


def kvs_of(path: Path) -> dict[str, tuple[list[int], object]]:
    """key -> (value type list, decoded value) of every KV in a GGUF file."""
    r = GGUFReader(str(path))
    return {k: (list(f.types), f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
