"""Each ggml codec against llama.cpp's on the same values: nanoseconds per weight of
``quantize.ggml.quantize`` and of llama.cpp's ``ggml_quantize_chunk`` (the library the codec
tests compare bytes with, ``tests/ggml_ref.py``: llama-cpp-python 0.3.36's libggml-base), with
and without an importance vector, on one thread, the glibc heap bounded as the targets bound
it, best of ``--rounds`` runs of each, alternating; the ratio, and whether the bytes are equal.

The values: ``--rows`` x 4,096 Gaussian weights (sigma 0.02, seed 0), the importance vector
uniform^2 x 10 (seed 0). End to end figures (reading, writing, the round trip, the processes)
are ``scripts/bench_gguf.py``'s; this isolates the codecs.

    .venv/bin/python scripts/bench_codecs.py [--types Q4_K,Q6_K] [--rows 256] [--rounds 3]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from bench_common import use_tests

use_tests()                         # tests/ggml_ref.py: llama.cpp's codecs
import ggml_ref  # noqa: E402
from quantpress.quantize import ggml  # noqa: E402
from quantpress.memory import bound_heap  # noqa: E402

TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated ggml type names")
    ap.add_argument("--rows", type=int, default=256, help="rows of 4,096 weights (default 256: 1M)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, alternating (the best counts)")
    args = ap.parse_args()
    if not ggml_ref.available():
        print("llama.cpp's libggml-base is not installed (bash scripts/setup.sh --test)", file=sys.stderr)
        return 2
    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 4096, generator=g) * 0.02
    imatrix = torch.rand(4096, generator=g) ** 2 * 10
    n = x.numel()
    print(f"{n:,} weights, one thread; ns per weight, best of {args.rounds}")
    for name in args.types.split(","):
        for imat in (None, imatrix):
            ours, theirs = [], []
            for _ in range(args.rounds):
                t = time.perf_counter()
                a = ggml.quantize(x, name, imat).numpy()
                ours.append(time.perf_counter() - t)
                timing: dict = {}
                b = ggml_ref.ref_quantize(x.numpy(), name, timing, None if imat is None else imat.numpy())
                theirs.append(timing["seconds"])
            o, r = min(ours) * 1e9 / n, min(theirs) * 1e9 / n
            print(f"{name:7s} {'imatrix' if imat is not None else '       '}  quantpress {o:6.1f}  "
                  f"llama.cpp {r:6.1f}  ratio {o / r:5.2f}  same bytes: {np.array_equal(a, b)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
