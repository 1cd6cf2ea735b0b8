"""Run under Triton's interpreter (``TRITON_INTERPRET=1``, Triton importable) by
tests/test_triton_searches.py: the ggml codecs whose searches have Triton kernels
(``quantize/ggml/triton_searches.py``), with those kernels on CPU tensors, against llama.cpp's
``ggml_quantize_chunk`` and against the torch searches (``QUANTPRESS_TRITON=0``). Prints one
JSON object: per case whether the bytes (or the search's outputs) are the same bits and how
many kernel launches it made."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))   # (ggml_ref's llamacpp_tools)
import ggml_ref  # noqa: E402
import quantpress.quantize.ggml as qg  # noqa: E402
from quantpress.quantize.ggml import common, kquants, triton_searches as ts  # noqa: E402
from quantpress.quantize.ggml import triton_kernels as tk  # noqa: E402
from test_ggml_codecs import edge_rows  # noqa: E402
from test_ggml_imatrix import _imatrix, _special_rows  # noqa: E402

launches = {"qkx2": 0, "qx": 0, "qp": 0, "q3": 0, "seq_sum": 0}


def _counted(name):
    fn = getattr(ts, name)

    def run(*args, **kwargs):
        launches[name] += 1
        return fn(*args, **kwargs)
    return run


def _bits(a: torch.Tensor) -> np.ndarray:
    return a.contiguous().view(torch.int32).numpy()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1" and ts.available(torch.zeros(1))
    for name in launches:
        setattr(ts, name, _counted(name))
    # rows of 1024: four super-blocks, each under another kind of importance vector (an
    # interpreted kernel costs per launch, not per row)
    x = np.concatenate([edge_rows(), ggml_ref.fuzz_rows(11, 24), _special_rows(1024).reshape(-1, 256)])
    x = x[: len(x) // 4 * 4].reshape(-1, 1024)
    ims = {"none": None,
           "imatrix": np.concatenate([_imatrix("lognormal", 256), _imatrix("zeros", 512)[:256],
                                      _imatrix("huge", 256, 1), _imatrix("ones", 256)])}
    out: dict[str, dict] = {}
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        for im_name, im in ims.items():
            before = dict(launches)
            ref = ggml_ref.ref_quantize(x, name, imatrix=im)
            ours = qg.quantize(torch.from_numpy(x), name, None if im is None else torch.from_numpy(im)).numpy()
            out[f"{name}/{im_name}"] = {"same": bool(np.array_equal(ref, ours)),
                                        "launches": sum(launches.values()) - sum(before.values())}
    # the searches themselves against the torch versions, on inputs the codecs never pass
    # (non-finite values, an explicit minimum with signed zeros), positions first
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(32, 300, generator=g) * torch.rand(1, 300, generator=g) * 3
    xs[:, 0], xs[:, 1], xs[:, 2] = 0.0, 1.5, -0.0
    w = xs.abs() + 0.1
    xmin = torch.where(xs.amin(0) > 0, 0.0, xs.amin(0))
    xmin[1] = -0.0
    xn = xs[:16].clone()
    xn[3, 7], xn[:, 9], xn[2, 11] = float("nan"), float("inf"), float("-inf")
    sz = torch.where(torch.rand(5, 64, generator=g) < 0.5, -0.0, 0.0)
    sz[:, 1:8] = xs[:5, :7] * 1e30                  # overflowing sums and signed zeros
    sz[:, 8] = -0.0                                 # (C's sum from +0 is +0 there)
    cases = {
        "seq_sum empty": lambda: (common.seq_sum0(torch.zeros(4, 0)),),
        "qkx2": lambda: kquants.make_qkx2_quants(xs, w, 15, -1.0, 0.1, 20, False),
        "qkx2 mad": lambda: kquants.make_qkx2_quants(xs[:16], xs[:16].abs(), 3, -0.5, 0.1, 15, True),
        "qkx2 xmin": lambda: kquants.make_qkx2_quants(xs, w, 31, -0.9, 0.05, 36, False, xmin=xmin),
        "qx": lambda: kquants.make_qx_quants(xs[:16], 32),
        "qx weighted non-finite": lambda: kquants.make_qx_quants(xn, 32, w[:16]),
        "seq_sum": lambda: (common.seq_sum0(sz), common.seq_sum0(sz, from_first=True),
                            common.seq_sum0(torch.stack([xs, w]).transpose(0, 1).contiguous())),
        "q3": lambda: kquants.make_q3_quants(xs[:16], 4),
        "qp": lambda: kquants.make_qp_quants(xs[:8].abs(), w[:8], 63),
        "qp signed non-finite": lambda: kquants.make_qp_quants(xn, w[:16], 15),
    }
    for case, fn in cases.items():
        before = dict(launches)
        got = fn()
        n = sum(launches.values()) - sum(before.values())
        # the torch searches with C's integer rounding (their float shortcut on the CPU may
        # give -0.0 for a level 0, which changes no byte)
        os.environ["QUANTPRESS_TRITON"] = "0"
        kquants.FAST_ROUNDING_ON_CPU = False
        try:
            want = fn()
        finally:
            del os.environ["QUANTPRESS_TRITON"]
            kquants.FAST_ROUNDING_ON_CPU = True
        out[f"search {case}"] = {"same": all(np.array_equal(_bits(a), _bits(b)) for a, b in zip(got, want)),
                                 "launches": n}
    # a kernel that cannot be compiled: one warning, the kernels off, the torch path's bytes
    class Broken:
        def __getitem__(self, grid):
            raise RuntimeError("no such instruction")
    kept = tk.qx_kernel
    tk.qx_kernel = Broken()
    xq = x[:8]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = qg.quantize(torch.from_numpy(xq), "Q6_K").numpy()
        again = qg.quantize(torch.from_numpy(xq), "Q6_K").numpy()
    tk.qx_kernel = kept
    out["fallback"] = {"same": bool(np.array_equal(ours, ggml_ref.ref_quantize(xq, "Q6_K"))
                                    and np.array_equal(again, ours)),
                       "warnings": [str(w.message) for w in caught],
                       "off": not ts.available(torch.from_numpy(xq)), "launches": 0}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
