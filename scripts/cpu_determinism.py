"""Which operations on the output byte paths give one result on every CPU (issue 56 item 9).

For each elementwise or reducing operation that the bytes of an output depend on, as the
codecs use it, this runs the operation in one child process per ``ATEN_CPU_CAPABILITY`` that
this processor supports (``default``, ``avx2``, ``avx512``: a capability is kept when
``torch.backends.cpu.get_cpu_capability()`` reports it in the child) on the same seeded
inputs, and prints, per operation:

* the share of results that differ between capabilities (against the first one);
* the share that differ from a correctly rounded reference (the exact result rounded once,
  computed in float64 or with NumPy's IEEE operations), where the operation has one; for a
  reduction, from the float64 sum rounded to float32 (any fixed order differs from that by
  rounding; the column says how far from exact, the capability column whether the order
  moves).

Then one EXL2 quantization (``quantize.gptq.gptq_quantize`` of a 256 x 512 layer with a
Hessian, packed) per capability, with quantpress's defined operations and, for comparison,
with torch's own ``sqrt``, ``sum`` and ``addr_`` put back: the digest of the packed
tensors per capability.

Run: ``PYTHONPATH=src OMP_NUM_THREADS=1 .venv/bin/python scripts/cpu_determinism.py``
(a few seconds a capability). The operations and where they are used:

============================  =================================================================
sqrt f32                      quantize/gptq.py scale search |e|^3.5 = e³·√e, find_params √(base/smax)
sqrt f64                      quantize/ggml/common.py sqrtf_checked (checked candidate; CUDA path)
defined_sqrt                  quantize/exact_ops.py (what gptq.py takes its roots from)
pow(x, 3)                     gptq.py scale search e³ (torch computes x·x·x)
div tensor/tensor             gptq.py x/(cand·p), W[c]/s; awq.py g/scales; fp8.py w/scale
div by a Python float         gptq.py base/((2^b−1)/2), r/U[c,c]: torch multiplies by 1/b
sum f32 [m, rows, N] -> [m]   gptq.py scale search E(p) (torch.sum over dims 1, 2)
tree_sum_                     exact_ops.py (one fixed pairwise order)
mean of a diagonal            gptq.py damping: mean(diag H)
addr_ (rank-1 update)         gptq.py W[c+1:be] −= U[c]ᵀ·err before exact_ops.sub_outer_; gptq_linear.py
addmm_ [R, 32] x [32, C]      gptq.py W[be:] −= U[a:be, be:]ᵀ·err (after a block; BLAS)
cholesky_ex / solve           gptq.py hessian_inverse_factor (LAPACK)
pow f16 (fractional)          quantize/awq.py grid_scales x_mean^r / w_mean^(1−r)
sqrt f16 0-d                  awq.py s / sqrt(max(s)·min(s))
mean(0) f16, sum(0) f32       awq.py weight_mean (mean over output rows), input_mean (Σ|x| over tokens)
vector_norm f32 dim=1         calibration/exl2_measure.py relative output error (measurement)
exp f32                       model forward (softmax, SiLU) of every calibrated format
============================  =================================================================
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

CAPABILITIES = ("default", "avx2", "avx512")

_CHILD = r"""
import hashlib, json, sys
import numpy as np
import torch
torch.set_num_threads(1)
out_dir, mode = sys.argv[1], sys.argv[2]
res = {"capability": torch.backends.cpu.get_cpu_capability()}
rng = np.random.default_rng(0)

# inputs from NumPy (torch's own generators and exp2 may give other bits at another capability)
def randn(*shape, dtype=np.float32):
    return torch.from_numpy(rng.standard_normal(shape).astype(dtype))

def rand(*shape, dtype=np.float32):
    return torch.from_numpy(rng.random(shape).astype(dtype))

def save(name, t):
    np.save(f"{out_dir}/{name}.npy", t.detach().contiguous().numpy())

if mode == "ops":
    from quantpress.quantize import exact_ops
    # positive float32 over many binades, as the scale search's |err| and find_params' ratios
    x = torch.from_numpy(np.exp2(rng.uniform(-30, 10, 1 << 20)).astype(np.float32))
    save("x", x)
    save("sqrt_f32", torch.sqrt(x))
    save("sqrt_f64", torch.sqrt(x.double()))
    save("defined_sqrt", exact_ops.defined_sqrt(x))
    save("pow3", torch.pow(x, 3))
    y = randn(1 << 20)
    save("y", y)
    save("div_tt", torch.div(y, x))
    save("div_scalar", y / 7.5)
    e = randn(8, 64, 1024).abs_()
    save("e", e)
    save("sum_f32", torch.sum(e, dim=(1, 2)))
    save("tree_sum", exact_ops.tree_sum(e))
    h = randn(1536).abs_()
    save("h", h)
    save("diag_mean", torch.diagonal(torch.diag(h)).mean().reshape(1))
    w = randn(31, 4096)
    u, r = randn(31), randn(4096)
    save("addr_in", torch.cat([w.reshape(-1), u, r]))
    save("addr", w.clone().addr_(u, r, alpha=-1.0))
    a, b, c = randn(32, 1024), randn(32, 4096), randn(1024, 4096)
    save("addmm_in", torch.cat([a.reshape(-1), b.reshape(-1), c.reshape(-1)]))
    save("addmm", c.clone().addmm_(a.T, b, alpha=-1.0))
    m = randn(256, 256, dtype=np.float64)
    hm = torch.from_numpy((m.numpy() @ m.numpy().T / 256 + np.eye(256)).astype(np.float32))
    chol, _ = torch.linalg.cholesky_ex(hm)
    save("cholesky", torch.cholesky_solve(torch.eye(256), chol))
    xm = (rand(1 << 16) * 4 + 1e-3).half()
    save("xm", xm)
    save("pow_f16", torch.cat([xm.pow(k / 20) for k in (1, 7, 13, 19)]))
    s = (rand(1 << 12) * 8 + 1e-2).half()
    save("s16", s)
    save("sqrt_f16", torch.stack([(s[i:i + 16].max() * s[i:i + 16].min()).sqrt() for i in range(0, s.numel(), 16)]))
    v = randn(4096, 576)
    save("v", v)
    save("vector_norm", torch.linalg.vector_norm(v, dim=1))
    wm = (randn(4096, 2048) * 0.05).half()
    save("wm", wm)
    save("mean0_f16", wm.abs().mean(0))
    save("sum0_f32", wm.abs().sum(0, dtype=torch.float32))
    ex = randn(1 << 20) * 10
    save("ex", ex)
    save("exp_f32", torch.exp(ex))
else:
    from quantpress.quantize import gptq, exact_ops
    from quantpress.quantize.exl2 import QParams
    if mode == "exl2-torch":
        # put torch's own sqrt, sum and addr_ back
        exact_ops.defined_sqrt_ = lambda t: t.sqrt_()
        exact_ops.defined_sqrt = torch.sqrt
        exact_ops.tree_sum_ = lambda t: t.sum(1)
        exact_ops.sub_outer_ = lambda w, u, r, scratch: w.addr_(u, r, alpha=-1.0)
    w = (randn(256, 512) * 0.02).half()
    z = randn(2048, 512) @ randn(512, 512) * 0.05
    hess = z.T @ z / 2048
    packed = gptq.gptq_quantize(w, hess, QParams(64, [4, 3], [0.5, 0.5])).pack()
    dig = hashlib.sha256()
    for k in sorted(packed):
        dig.update(k.encode()); dig.update(packed[k].contiguous().view(torch.uint8).numpy().tobytes())
    res["digest"] = dig.hexdigest()
print(json.dumps(res))
"""


_PROBE = ("import torch; x = torch.rand(4096); float((x.sqrt() * x.exp()).sum()); "
          "print(torch.backends.cpu.get_cpu_capability())")


def _child(cap: str, out_dir: str, mode: str) -> dict:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", _CHILD, out_dir, mode], capture_output=True, text=True,
                       env=env, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


#: the processor flags each capability's kernels need (Linux /proc/cpuinfo names)
_FLAGS = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}


def cpu_flags() -> set[str] | None:
    """The processor's feature flags from /proc/cpuinfo (None where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def supported() -> list[str]:
    """The capabilities this processor runs: its flags hold what the kernels need, and a
    child at that capability reports it and runs a few kernels."""
    flags = cpu_flags()
    caps = []
    with tempfile.TemporaryDirectory() as d:
        for cap in CAPABILITIES:
            if flags is not None and not _FLAGS[cap] <= flags:
                continue
            env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
            # torch reports a capability the processor lacks as set (and then dies of SIGILL in
            # its first vector kernel): run a few kernels too
            r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, cwd=d)
            if r.returncode == 0 and r.stdout.strip().lower() == cap:
                caps.append(cap)
    return caps


def _references(d: str):
    """Correctly rounded (or float64-then-rounded) references, computed with NumPy."""
    import numpy as np

    ld = lambda n: np.load(f"{d}/{n}.npy")       # noqa: E731
    x, y, e = ld("x"), ld("y"), ld("e")
    ref = {
        "sqrt_f32": np.sqrt(x.astype(np.float64)).astype(np.float32),
        "defined_sqrt": np.sqrt(x.astype(np.float64)).astype(np.float32),
        "sqrt_f64": None,     # no exact float64 root at hand in NumPy beyond its own (the same)
        "pow3": (x * x) * x,  # torch's definition: two float32 products
        "div_tt": np.divide(y, x),
        "div_scalar": y / np.float32(7.5),
        "sum_f32": e.astype(np.float64).sum(axis=(1, 2)).astype(np.float32),
        "tree_sum": e.astype(np.float64).sum(axis=(1, 2)).astype(np.float32),
        "diag_mean": np.array([ld("h").astype(np.float64).mean()], dtype=np.float32),
    }
    ref["sqrt_f64"] = np.sqrt(x.astype(np.float64))
    ai = ld("addr_in")
    w, u, r = ai[:31 * 4096].reshape(31, 4096), ai[31 * 4096:31 * 4096 + 31], ai[31 * 4096 + 31:]
    ref["addr"] = w - np.multiply.outer(u, r)          # two roundings, no fused multiply-add
    mi = ld("addmm_in")
    a = mi[:32 * 1024].reshape(32, 1024).astype(np.float64)
    b = mi[32 * 1024:32 * 1024 + 32 * 4096].reshape(32, 4096).astype(np.float64)
    c = mi[32 * 1024 + 32 * 4096:].reshape(1024, 4096).astype(np.float64)
    ref["addmm"] = (c - a.T @ b).astype(np.float32)
    xm = ld("xm").astype(np.float64)
    ref["pow_f16"] = np.concatenate([xm ** (k / 20) for k in (1, 7, 13, 19)]).astype(np.float16)
    s = ld("s16").astype(np.float64).reshape(-1, 16)
    ref["sqrt_f16"] = np.sqrt((s.max(1) * s.min(1)).astype(np.float16).astype(np.float64)).astype(np.float16)
    ref["vector_norm"] = np.sqrt((ld("v").astype(np.float64) ** 2).sum(1)).astype(np.float32)
    wm = np.abs(ld("wm").astype(np.float64))
    ref["mean0_f16"] = wm.mean(0).astype(np.float16)
    ref["sum0_f32"] = wm.sum(0).astype(np.float32)
    ref["exp_f32"] = np.exp(ld("ex").astype(np.float64)).astype(np.float32)
    return ref


def main() -> int:
    import numpy as np

    caps = supported()
    print(f"capabilities this CPU runs: {', '.join(caps)}")
    dirs = {}
    root = tempfile.mkdtemp(prefix="cpu_det_")
    for cap in caps:
        dirs[cap] = os.path.join(root, cap)
        os.makedirs(dirs[cap])
        _child(cap, dirs[cap], "ops")
    refs = _references(dirs[caps[0]])
    names = [n for n in refs] + ["cholesky"]
    print(f"{'operation':14s} " + " ".join(f"{'≠' + caps[0] + ' @' + c:>16s}" for c in caps[1:])
          + " " + " ".join(f"{'≠ref @' + c:>14s}" for c in caps))
    for n in names:
        vals = {c: np.load(f"{dirs[c]}/{n}.npy") for c in caps}
        base = vals[caps[0]]
        cross = [float(np.mean(vals[c].view(np.uint8) != base.view(np.uint8))) if vals[c].dtype == base.dtype else 1.0
                 for c in caps[1:]]
        cross = [float(np.mean((vals[c] != base) & ~(np.isnan(vals[c]) & np.isnan(base)))) for c in caps[1:]]
        ref = refs.get(n)
        vs = [float(np.mean(vals[c] != ref)) if ref is not None else float("nan") for c in caps]
        print(f"{n:14s} " + " ".join(f"{v:16.4%}" for v in cross) + " " + " ".join(f"{v:14.4%}" for v in vs))
    print()
    for mode in ("exl2", "exl2-torch"):
        digs = {c: _child(c, root, mode)["digest"] for c in caps}
        same = len(set(digs.values())) == 1
        label = "exact_ops" if mode == "exl2" else "torch's sqrt, sum, addr_"
        print(f"EXL2 256x512, {label:22s}: " + ", ".join(f"{c} {d[:12]}" for c, d in digs.items())
              + ("  (identical)" if same else "  (DIFFER)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
