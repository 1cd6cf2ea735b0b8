"""The Triton kernels of the K-quant searches (``quantize/ggml/triton_searches.py``, taken on
CUDA devices) run here in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``; Triton is
installed beside the environment by ``scripts/setup.sh --test``, not into it): every codec
that uses them gives llama.cpp's bytes, with and without an importance matrix, on the edge
rows, fuzz rows and special rows of the codec tests, and the searches equal the torch ones
bit for bit; compiled for an H100 (no GPU needed), their float32 instructions are C's. That
the compiled kernels give the same bits on a GPU is checked by ``scripts/gpu_checks.py
--checks ggml`` (the README's "On a GPU")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from quantpress.quantize.ggml import triton_searches

REPO = Path(__file__).resolve().parent.parent
TRITON_DIR = REPO / ".venv" / "triton-interp"


def test_triton_searches_match_llamacpp():
    assert (TRITON_DIR / "triton").is_dir(), f"{TRITON_DIR}: missing (scripts/setup.sh --test installs it)"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(REPO / "src"), str(REPO / "tests")]))
    env.pop("QUANTPRESS_TRITON", None)
    r = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests" / "triton_interp.py")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # a kernel that fails to compile: one warning naming it, the kernels off for the process,
    # the torch path's bytes (llama.cpp's)
    fb = res.pop("fallback")
    assert fb["same"] and fb["off"], fb
    assert len(fb["warnings"]) == 1
    assert "Triton kernel qx_kernel failed (RuntimeError: no such instruction)" in fb["warnings"][0]
    assert len(res) == 9 * 2 + 10
    differ = [k for k, v in res.items() if not v["same"]]
    assert not differ, differ
    # every case went through the kernels, except the legacy types' unweighted paths (they
    # round directly, with no search)
    direct = {"Q4_0/none", "Q4_1/none", "Q5_0/none", "Q5_1/none"}
    assert [k for k, v in res.items() if v["launches"] == 0] == sorted(direct, key=list(res).index)


#: the float32 instructions the kernels may use: IEEE operations rounded to nearest (one
#: rounding each, as C's), comparisons, selects, int -> float conversions
ALLOWED_F32 = {"abs.f32", "add.rn.f32", "sub.rn.f32", "mul.rn.f32", "div.rn.f32", "cvt.rn.f32",
               "max.f32", "min.f32", "selp.f32"}


def test_kernels_compile_to_exact_float_instructions():
    """Compiled for an H100 (sm_90, by Triton's own ptxas; no GPU needed) with quantpress's
    options, no kernel has a fused multiply-add, an approximate division, reciprocal or
    square root, or flush-to-zero: only the instructions of C's float32 arithmetic. The
    control: the same kernel compiled with contraction allowed has fused multiply-adds."""
    assert (TRITON_DIR / "triton").is_dir(), f"{TRITON_DIR}: missing (scripts/setup.sh --test installs it)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRITON_DIR), str(REPO / "src")]))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-W", "ignore", str(REPO / "tests" / "triton_ptx.py")],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res.pop("control_fma") > 0
    assert sorted(res) == ["q3_kernel", "qkx2_kernel", "qp_kernel", "qx_kernel", "seq_sum_kernel"]
    for name, k in res.items():
        other = [op for op in k["f32"] if op not in ALLOWED_F32 and not op.startswith("setp.")]
        assert not other and not k["ftz"], (name, other, k["ftz"])
        assert "div.rn.f32" in k["f32"] or name == "seq_sum_kernel", (name, k["f32"])


def test_kernels_taken_only_where_they_apply(monkeypatch):
    """With Triton importable, a CPU tensor takes the kernels only under the interpreter;
    QUANTPRESS_TRITON=0, 2^31 elements or more (int32 indexing) and an earlier failure turn
    them off."""
    monkeypatch.setattr(triton_searches, "HAVE_TRITON", True)
    monkeypatch.setattr(triton_searches, "_failure", None)
    monkeypatch.delenv("QUANTPRESS_TRITON", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(4, 4)
    assert not triton_searches.available(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_searches.available(x)
    assert not triton_searches.available(torch.empty(1 << 31, device="meta"))
    monkeypatch.setenv("QUANTPRESS_TRITON", "0")
    assert not triton_searches.available(x)
    monkeypatch.delenv("QUANTPRESS_TRITON")
    monkeypatch.setattr(triton_searches, "_failure", "RuntimeError: earlier")
    assert not triton_searches.available(x)
