"""The small measurements that code comments and the README cite, each printed beside the
constant or choice it supports (CPU, this machine):

- the GGUF round trip's SNR floor (``convert.gguf_file.MIN_SNR_DB``): SNR of every ggml type on
  Gaussian, Student-t (2 degrees of freedom) and outlier-column tensors, against the SNR of the
  wrong data the floor is there to catch (another tensor's data, zeros);
- the codecs' CPU slice size (``quantize.ggml.common.CPU_SLICE_ELEMENTS``): Q4_K of 6.3 M
  weights on two threads with slices of 2^18, 2^19 and 2^21 elements;
- the codecs' parallel threshold (``CPU_PARALLEL_ELEMENTS``): Q5_0 of a 576 x 576 tensor on
  the calling thread alone and shared over two threads;
- GPTQ's inverse-Hessian factor (``quantize.gptq_linear.hessian_inverse_factor``,
  ``quantize.gptq.hessian_inverse_factor``): ``cholesky_inverse`` against solving against the
  identity, one thread;
- gguf-py's reader over a plain ndarray view (``convert.gguf_file.GGUFFileReader``) against
  gguf-py's own, parsing a SmolLM2 GGUF (its 49,152-token vocabulary).

    .venv/bin/python scripts/micro_figures.py [--gguf FILE]
"""
from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def best_ms(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    e = x - y
    return 10 * math.log10(float((x * x).sum()) / float((e * e).sum()))


def snr_floor() -> None:
    from quantpress.convert.gguf_file import MIN_SNR_DB
    from quantpress.quantize import ggml

    g = torch.Generator().manual_seed(0)
    dists = {"gaussian": torch.randn(256, 1024, generator=g),
             "student-t": torch.distributions.StudentT(2.0).sample((256, 1024)),
             "outlier columns": torch.randn(256, 1024, generator=g) * torch.rand(1024, generator=g) ** 4}
    print(f"SNR (dB) of each ggml type; the round trip's floor MIN_SNR_DB = {MIN_SNR_DB:g}")
    print(f"  {'type':<8}" + "".join(f"{d:>17}" for d in dists))
    lowest = math.inf
    for name in ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
                 "Q6_K", "Q8_0"):
        row = []
        for x in dists.values():
            s = snr_db(x, ggml.dequantize(ggml.quantize(x, name), name).reshape(x.shape))
            lowest = min(lowest, s)
            row.append(s)
        print(f"  {name:<8}" + "".join(f"{s:17.1f}" for s in row))
    x = dists["gaussian"]
    other = torch.randn(x.shape, generator=g)
    print(f"  lowest {lowest:.1f} dB; wrong data: another tensor's {snr_db(x, other):.1f} dB, "
          f"zeros {snr_db(x, torch.zeros_like(x)):.1f} dB")


def codec_threads() -> None:
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common

    torch.set_num_threads(2)
    x = torch.randn(4096, 1536)
    saved = common.CPU_SLICE_ELEMENTS
    try:
        for bits in (18, 19, 21):
            common.CPU_SLICE_ELEMENTS = 1 << bits
            print(f"Q4_K of 4096 x 1536 on 2 threads, slices of 2^{bits}: "
                  f"{best_ms(lambda: ggml.quantize(x, 'Q4_K'), 3):.0f} ms")
    finally:
        common.CPU_SLICE_ELEMENTS = saved
    small = torch.randn(576, 576)
    saved = common.CPU_PARALLEL_ELEMENTS
    try:
        common.CPU_PARALLEL_ELEMENTS = 0
        two = best_ms(lambda: ggml.quantize(small, "Q5_0"), 20)
        torch.set_num_threads(1)
        one = best_ms(lambda: ggml.quantize(small, "Q5_0"), 20)
    finally:
        common.CPU_PARALLEL_ELEMENTS = saved
        torch.set_num_threads(2)
    print(f"Q5_0 of 576 x 576: {one:.1f} ms on the calling thread alone, {two:.1f} ms on two threads "
          f"(CPU_PARALLEL_ELEMENTS = 2^{int(math.log2(saved))})")


def hessian_factor() -> None:
    torch.set_num_threads(1)
    for k in (576, 1536, 3072):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(4096, k, generator=g)
        h = x.T @ x / 4096
        torch.diagonal(h).add_(0.01 * float(torch.diagonal(h).mean()))
        chol = torch.linalg.cholesky(h)
        eye = torch.eye(k)
        solve = best_ms(lambda: torch.cholesky_solve(eye, chol), 3)
        inverse = best_ms(lambda: torch.cholesky_inverse(chol), 3)
        print(f"inverse of a {k}² Cholesky factor, one thread: cholesky_inverse {inverse:.1f} ms, "
              f"cholesky_solve against the identity {solve:.1f} ms")
    torch.set_num_threads(2)


def reader_parse(gguf: Path | None) -> None:
    from gguf import GGUFReader

    from quantpress.convert.gguf_file import GGUFFileReader

    with tempfile.TemporaryDirectory() as d:
        if gguf is None:
            model = Path.home() / ".cache/quantpress/models/SmolLM2-135M-Instruct"
            gguf = Path(d) / "smollm2-Q8_0.gguf"
            subprocess.run([str(Path(sys.executable).parent / "convert"), "hf-to-gguf", str(model),
                            "--policy", "Q8_0", "-o", str(gguf), "--quiet"], check=True,
                           stdout=subprocess.DEVNULL)
        plain = best_ms(lambda: GGUFReader(str(gguf)), 3)
        ours = best_ms(lambda: GGUFFileReader(str(gguf)), 3)
    print(f"parsing {gguf.name}: gguf-py's GGUFReader {plain / 1e3:.2f} s, GGUFFileReader "
          f"{ours / 1e3:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="a GGUF with a large vocabulary (default: SmolLM2 "
                    "Q8_0 made by convert hf-to-gguf)")
    args = ap.parse_args()
    snr_floor()
    codec_threads()
    hessian_factor()
    reader_parse(args.gguf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
