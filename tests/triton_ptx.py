"""Run by tests/test_triton_searches.py with Triton importable (no GPU needed): compiles each
kernel of ``quantize/ggml/triton_kernels.py`` for an sm_90 GPU with quantpress's compile
options (``triton_searches.COMPILE_OPTIONS``) and prints, as one JSON object, the float32
instructions of its PTX per kernel, whether ``.ftz`` (flush to zero) appears, and the fused
multiply-adds of qkx2_kernel compiled with contraction allowed (the control)."""
from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from quantpress.quantize.ggml import triton_kernels as tk
from quantpress.quantize.ggml.triton_searches import BLOCK, COMPILE_OPTIONS

F, I, C = "*fp32", "i32", "constexpr"
# one variant of each kernel: Q4_K's qkx2 with an explicit min, Q6_K's weighted qx, Q4_K's
# qp of the scales, Q3_K's q3, a sum over 32 positions
P4 = ("x_ptr", "w_ptr", "nums_ptr", "scale_ptr")
CASES = {
    "qkx2_kernel": (dict({k: F for k in P4}, xmin_ptr=F, min_ptr=F, l_ptr=F, S=I, N=C, NMAX=C, NSTEP=C,
                         USE_MAD=C, HAS_XMIN=C, BLOCK=C),
                    {"N": 32, "NMAX": 15, "NSTEP": 20, "USE_MAD": False, "HAS_XMIN": True}),
    "qx_kernel": (dict({k: F for k in P4}, l_ptr=F, S=I, eps="fp32", N=C, NMAX=C, WEIGHTED=C, BLOCK=C),
                  {"N": 16, "NMAX": 32, "WEIGHTED": True}),
    "qp_kernel": (dict({k: F for k in P4}, l_ptr="*i32", S=I, eps="fp32", N=C, NMAX=C, BLOCK=C),
                  {"N": 8, "NMAX": 63}),
    "q3_kernel": (dict(x_ptr=F, scale_ptr=F, l_ptr=F, S=I, eps="fp32", N=C, NMAX=C, BLOCK=C),
                  {"N": 16, "NMAX": 4}),
    "seq_sum_kernel": (dict(p_ptr=F, out_ptr=F, S=I, N=C, FROM_FIRST=C, BLOCK=C),
                       {"N": 32, "FROM_FIRST": False}),
}

def ptx(name: str, options: dict) -> str:
    sig, constexprs = CASES[name]
    src = ASTSource(getattr(tk, name), signature=sig, constexprs=dict(constexprs, BLOCK=BLOCK))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def main() -> None:
    out = {}
    for name in CASES:
        text = ptx(name, COMPILE_OPTIONS)
        out[name] = {"f32": sorted(set(re.findall(r"\b[a-z]+(?:\.[a-z0-9]+)*\.f32\b", text))),
                     "ftz": ".ftz" in text}
    out["control_fma"] = len(re.findall(r"\bfma\.rn\.f32\b", ptx("qkx2_kernel", {"enable_fp_fusion": True})))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
