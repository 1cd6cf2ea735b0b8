"""The Triton kernels of the K-quant searches (``quantize/ggml/triton_searches.py``, taken on
CUDA devices) run here in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``; Triton is
installed beside the environment by ``scripts/setup.sh --test``, not into it): every codec
that uses them gives llama.cpp's bytes, with and without an importance matrix, on the edge
rows, fuzz rows and special rows of the codec tests, and the searches equal the torch ones
bit for bit. That the compiled kernels give the same bits on a GPU is checked by
``scripts/gpu_checks.py --checks ggml`` (the README's "On a GPU")."""
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
    assert "_qx_kernel failed (RuntimeError: no such instruction)" in fb["warnings"][0]
    assert len(res) == 9 * 2 + 9
    differ = [k for k, v in res.items() if not v["same"]]
    assert not differ, differ
    # every case went through the kernels, except the legacy types' unweighted paths (they
    # round directly, with no search)
    direct = {"Q4_0/none", "Q4_1/none", "Q5_0/none", "Q5_1/none"}
    assert [k for k, v in res.items() if v["launches"] == 0] == sorted(direct, key=list(res).index)


def test_torch_path_off_cuda():
    """Outside the interpreter a CPU tensor never takes the kernels, whatever is installed."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    assert not triton_searches.available(torch.zeros(4, 4))
