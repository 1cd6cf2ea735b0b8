"""The small measurements that code comments and the README cite, each printed beside the
constant or choice it supports (CPU, this machine):

- the GGUF round trip's SNR floor (``convert.gguf_checks.MIN_SNR_DB``): SNR of every ggml type on
  Gaussian, Student-t (2 degrees of freedom) and outlier-column tensors, against the SNR of the
  wrong data the floor is there to catch (another tensor's data, zeros);
- the codecs' CPU slice size (``quantize.ggml.common.CPU_SLICE_ELEMENTS``): Q4_K of 6.3 M
  weights on one thread with slices of 2^15 to 2^21 elements (what a slice costs beyond its
  work: Python's dispatch of its ops, under the GIL; and how many torch ops a slice issues)
  and on two threads with slices of 2^18,
  2^19 and 2^21 elements;
- the codecs' parallel threshold (``CPU_PARALLEL_ELEMENTS``): Q5_0 of a 576 x 576 tensor on
  the calling thread alone and shared over two threads;
- GPTQ's inverse-Hessian factor (``quantize.gptq_linear.hessian_inverse_factor``,
  ``quantize.gptq.hessian_inverse_factor``): ``cholesky_inverse`` against solving against the
  identity, one thread;
- gguf-py's reader over a plain ndarray view (``convert.gguf_reading.GGUFFileReader``) against
  gguf-py's own, and the round trip's checkers' reader (``GGUFTensorsReader``, arrays' extents
  only), parsing a SmolLM2 GGUF (its 49,152-token vocabulary; alone with ``--parse``);
- the AWQ scale search's slices (``calibration.awq.SEARCH_SLICE_TOKENS``): float32 matmul
  throughput of SmolLM2's shapes by tokens per slice, and whether SmolLM2's attention and MLP
  give, row by row, the same bits over slices as over one batch (what keeps pruning exact);
- the AWQ search's Gram form (``quantize.awq.linear_output_loss``) on the first ``--awq-layers``
  layers of SmolLM2 at 16 x 256 tokens: its largest relative error against the loss computed in
  float64, and the smallest relative gap between the best and second-best loss of a down_proj
  grid (the form must stay far below it); and the search's seconds per layer with slices of
  512 and 1,024 tokens and unsliced.

With ``--slices 18,19`` only ``convert hf-to-gguf`` end to end (the 554M random llama, or
``--slice-model``) with the codecs' slices of 2^18 and 2^19 elements, alternating, three runs
each (the figures of ``CPU_SLICE_ELEMENTS``'s comment).

With ``--threads 1,2,4,8`` only the codecs' thread cap (``quantize.ggml.common.CPU_CODEC_THREADS``):
Q4_K of 16384 x 4096 weights (67 M) on each thread count, one run each (run it on a many-core
machine: the figures in the constant's comment come from a 16-core Xeon).

With ``--lanes 1,2`` only the codec processes (``quantize.ggml.processes``): Q4_K of 65536 x 256
(16.8 M weights) on the calling thread alone, then on n lanes as threads of the codec pool and
as codec processes: wall and CPU seconds.

With ``--dequantize`` only the dequantizers (``quantize.ggml.dequantize``, which the round trip's
checks run): milliseconds for 1,024 x 4,096 values of Q4_K, Q6_K, Q5_0, Q8_0, F16 and F32 on
one thread, the glibc heap bounded as the targets bound it (best of five); then Q4_K's nibble
unpacking on uint8 against through int32, the round trip's bit comparison of one piece
(``convert.gguf_checks.CHECK_PIECE_ELEMENTS`` values) by ``np.array_equal`` and
``torch.equal`` against counting the differences, and gguf-py's dequantization (the round
trip's reference) of about 4M values: ``gguf.quants.dequantize`` of the whole chunk (rows
merged into rows of 16,384 values) against each type's ``dequantize_blocks`` on the check's
pieces (``convert.gguf_reading.gguf_py_decoder``).

With ``--weighted`` only the importance-weighted codecs (Q5_0, Q4_K, IQ4_XS with an imatrix:
nanoseconds per weight, one thread, heap bounded) and ``quantize.ggml.common.sqrtf`` /
``sqrtf_checked`` (their weights' exact square roots on the CPU / other devices: nanoseconds
per element).

With ``--q3-slices`` only Q3_K's CPU slice size (``quantize.ggml.kquants.Q3_K_SLICE_FACTOR``):
Q3_K of 2M values, with and without an importance vector, in slices of 2, 1 and 4 times the
other codecs' 2^18 elements (one thread, alternating, four runs each; the same bytes).

With ``--select`` only the K-quant searches' update of their accepted fits
(``quantize.ggml.kquants._RowSelect``, through the int32 bits) against ``torch.where``: microseconds
per update of a [5, 8192] state, then Q4_K and Q6_K of 2M values with each (one thread,
alternating, four runs each; the same bytes).

With ``--seq-sum`` only the codecs' sequential float32 sums (``quantize.ggml.common.seq_sum0``):
numpy's axis-0 reduce against a loop of torch adds on the K-quant searches' shapes
(microseconds per sum), then Q4_K, Q6_K and Q5_0 with an imatrix of 2M values with each
(one thread, alternating, four runs each; the same bytes).

With ``--numpy-searches`` only the searches written for NumPy and torch alike
(``quantize.ggml.kquants.make_qp_quants``, the weighted K-quants' scale and min search,
``make_q3_quants``' coordinate descent, ``make_qkx2_quants``' and ``make_qx_quants``' acceptance
tests) with NumPy's operations (the CPU's) against torch's (other devices'): microseconds of one product,
comparison, masked write, select (``where``) and ``any()`` on [8192] rows, milliseconds per make_qp_quants call on [8, 2048],
the sub-blocks each of Q3_K's descent passes works on, then Q2_K, Q4_K and Q5_K with an imatrix and Q3_K, Q4_K and Q6_K without, 2M values
each (one thread, alternating, four runs each; the same bytes), and Q3_K with the descent's
test on the gathered sub-blocks whose level changes against on whole rows.

With ``--first-extremes`` only the legacy types' search for each block's extremes
(``quantize.ggml.common.first_absmax`` along the last axis, ``legacy._first_min_max``) from
plain amax/amin against torch's argmax/argmin on [8192, 32] (microseconds, best of five
rounds of 50, one thread, heap bounded), and ``first_absmax`` along the first axis of [16, 16384]
(the K-quants' sub-blocks) against the weighted-position search, then Q4_0, Q4_1, Q5_0, Q5_1,
Q6_K and Q3_K of 2M values.

With ``--levels`` only the K-quants' requantization to level bytes (``kquants._requant_bytes``,
block order) against positions first with a transpose back, float32 to uint8 through int32
against directly, sub-blocks' extremes along rows of 16 against along the first axis, a
broadcast masked_fill_ of a slice's levels, then Q4_K and Q6_K of 2M values.

With ``--round-trip [MODEL]`` only the GGUF round trip's check (``convert.gguf_roundtrip.verify_gguf``)
of MODEL's Q4_K_M (default SmolLM2) on one thread, in pieces of ``CHECK_PIECE_ELEMENTS``
against whole chunks, two runs each.

With ``--check-costs`` only what one round-trip check costs per value, by part, on one thread:
both halves in the checker (gguf-py's and our dequantization, the bit comparison, the error
sums) against gguf-py's half with the checksums of each row (the writer computing our half).

With ``--compiled`` only the K-quant search's compiled steps
(``quantize.ggml.compiled_searches``): a fresh process's time to compile them with an empty
kernel cache and to load them from the cache, then Q2_K, Q4_K and Q5_K of 2M weights with and
without an importance vector (Q4_1 and Q5_1 with one), eager against compiled steps (one
thread, alternating, three runs each, the same bytes): milliseconds.

With ``--kernel-cache`` (on an AVX-512 machine) only why compiled_searches keys its kernel
directory by the instruction set: in a fresh directory, a process at the native capability
compiles the Q4_K search, then processes at ``ATEN_CPU_CAPABILITY=avx2`` run it from one
shared directory (as Inductor's own cache would hand it over) and from their keyed one
(:func:`compiled_searches.kernel_cache_dir`); each prints how many of 256 Q4_K blocks differ
from the eager search's (llama.cpp's) bytes and whether a compile failure was warned.

With ``--exit`` only the console commands' ending (``cli.common.exit_with``): SmolLM2's
``convert hf-to-gguf`` to Q4_K_M ended by it and by a plain ``sys.exit``, three runs each,
alternating (wall seconds of the process).

With ``--codec-profile [DEVICE]`` (default cuda) only where Q4_K's, Q6_K's and Q3_K's time goes on that
device: wall, device busy time, kernels and copies launched, values read back by the host.

With ``--cuda`` (a CUDA machine) only the GPU figure: ``quantize.ggml.ACCEL_CHUNK_ELEMENTS``,
Q4_K and Q6_K of 8,192 x 8,192 weights (67 M) with and without an imatrix by chunk size
(2^24, 2^25, 2^26 elements): milliseconds and the GPU memory the call adds.

    .venv/bin/python scripts/micro_figures.py [--gguf FILE] [--awq-layers 3] [--cuda]
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench_common import alternate, best_ms, model_dir, truncated_model


def snr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    e = x - y
    return 10 * math.log10(float((x * x).sum()) / float((e * e).sum()))


def snr_floor() -> None:
    from quantpress.convert.gguf_checks import MIN_SNR_DB
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


def codec_profile(device: str) -> None:
    """Where a ggml codec's time goes on ``device`` (CUDA: is it the kernels, or their
    launches and the host's waits?): Q4_K with and without an importance vector, Q6_K and Q3_K
    of 8,192 x 8,192 weights (67 M) through ``quantize.ggml.quantize``: the wall milliseconds of
    the call (best of three, synchronized), then under ``torch.profiler`` the device's busy
    milliseconds (the sum of its kernels' and copies' own times), how many kernels and copies
    it ran, and how many times the host read a value back (``aten::_local_scalar_dense``:
    ``bool()``/``item()``; ``aten::nonzero``), each a wait for the device to drain."""
    from torch.profiler import ProfilerActivity, profile
    import quantpress.quantize.ggml as qg

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8192, 8192, device=dev, generator=g)
    w = torch.rand(8192, device=dev, generator=g) + 0.1

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for t, im in (("Q4_K", None), ("Q4_K", w), ("Q6_K", None), ("Q3_K", None)):
        qg.quantize(x[:512], t, imatrix=im)           # warm-up
        sync()
        ms = best_ms(lambda: (qg.quantize(x, t, imatrix=im), sync()), n=3)
        with profile(activities=acts) as prof:
            qg.quantize(x, t, imatrix=im)
            sync()
        busy_us, launched, reads = 0.0, 0, 0
        for e in prof.key_averages():
            on_device = getattr(e, "self_device_time_total", None)
            if on_device is None:
                on_device = getattr(e, "self_cuda_time_total", 0)
            if str(e.device_type).endswith("CUDA"):
                busy_us += on_device
                launched += e.count
            if e.key in ("aten::_local_scalar_dense", "aten::nonzero"):
                reads += e.count
        print(f"{t} {'imatrix' if im is not None else 'plain  '} on {device}: {ms:7.1f} ms; device busy "
              f"{busy_us / 1e3:7.1f} ms in {launched} kernels and copies; {reads} reads back")


def torch_ops(fn) -> int:
    """The number of aten ops ``fn()`` dispatches (a TorchDispatchMode counting them)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


def codec_threads() -> None:
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common

    x = torch.randn(4096, 1536)
    saved = common.CPU_SLICE_ELEMENTS
    try:
        # one thread: the cost of a slice beyond its work (its op dispatches, which hold the
        # GIL), from the time's growth as the slices shrink
        torch.set_num_threads(1)
        t = {}
        for bits in (15, 17, 19, 21):
            common.CPU_SLICE_ELEMENTS = 1 << bits
            t[bits] = best_ms(lambda: ggml.quantize(x, 'Q4_K'), 3)
            print(f"Q4_K of 4096 x 1536 on 1 thread, slices of 2^{bits} ({x.numel() >> bits}): {t[bits]:.0f} ms")
        per = (t[15] - t[17]) / ((x.numel() >> 15) - (x.numel() >> 17))
        print(f"  {per:.2f} ms per slice beyond its work: {per * (x.numel() >> 19) / t[19]:.0%} of the time "
              f"at 2^19, done under the GIL; one slice issues {torch_ops(lambda: ggml.quantize(x[:128], 'Q4_K'))} "
              f"torch ops (kernels, on a GPU)")
        torch.set_num_threads(2)
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


def codec_thread_sweep(counts: list[int]) -> None:
    """Q4_K of 16384 x 4096 (67M weights) with the codec pool dealing its slices to each of
    ``counts`` threads (torch's thread count; CPU_CODEC_THREADS lifted), one run each."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common

    x = torch.randn(16384, 4096)
    ggml.quantize(x[:256], "Q4_K")
    saved, before = common.CPU_CODEC_THREADS, torch.get_num_threads()
    try:
        common.CPU_CODEC_THREADS = max(counts)
        for n in counts:
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            ggml.quantize(x, "Q4_K")
            print(f"Q4_K of 16384 x 4096 on {n} threads: {time.perf_counter() - t0:.2f} s", flush=True)
    finally:
        common.CPU_CODEC_THREADS = saved
        torch.set_num_threads(before)


def _cpu_seconds(pids: list[int]) -> float:
    # user + system seconds of this process and of the live processes ``pids`` (from /proc)
    import resource
    r = resource.getrusage(resource.RUSAGE_SELF)
    total = r.ru_utime + r.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def codec_lanes(counts: list[int]) -> None:
    """Q4_K of 65536 x 256 (16.8 M weights) on ``counts`` lanes: the calling thread and n - 1
    threads of the codec pool, then the calling thread and n - 1 codec processes
    (``quantize.ggml.processes``); wall and CPU seconds (the processes' included), best of 3,
    with glibc's heap as a GGUF target sets it (``memory.bound_heap``)."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common, processes
    from quantpress.memory import bound_heap

    bound_heap()
    x = torch.randn(65536, 256, generator=torch.Generator().manual_seed(0))
    saved, before = common.CPU_CODEC_THREADS, torch.get_num_threads()
    try:
        common.CPU_CODEC_THREADS = max(counts)
        for n in counts:
            torch.set_num_threads(n)
            for how in ("threads", "processes"):
                if how == "processes":
                    processes.start_codec_processes(n - 1)
                pids = processes.codec_process_ids()
                ggml.quantize(x[:8192], "Q4_K")
                best = None
                for _ in range(3):
                    c0, t0 = _cpu_seconds(pids), time.perf_counter()
                    ggml.quantize(x, "Q4_K")
                    run = (time.perf_counter() - t0, _cpu_seconds(pids) - c0)
                    best = run if best is None or run[0] < best[0] else best
                processes.close_codec_processes()
                print(f"Q4_K of 65536 x 256 on {n} lane(s), {how:9s}: {best[0]:.2f} s wall, "
                      f"{best[1]:.2f} s CPU", flush=True)
                if n == 1:
                    break
    finally:
        common.CPU_CODEC_THREADS = saved
        torch.set_num_threads(before)


def slice_sizes(exponents: list[int], model: Path, rounds: int = 3) -> None:
    """``convert hf-to-gguf MODEL --policy Q4_K_M`` end to end (a fresh process each, the
    console command as users run it) with the codecs' CPU slices of 2^e elements
    (``quantize.ggml.common.CPU_SLICE_ELEMENTS``) for each e of ``exponents``, ``rounds``
    times alternating; prints each run's wall seconds and whether the files are identical."""
    import filecmp

    code = ("import sys; from quantpress.quantize.ggml import common; "
            "common.CPU_SLICE_ELEMENTS = 1 << int(sys.argv[1]); "
            "from quantpress.cli.convert_main import console; sys.argv = ['convert'] + sys.argv[2:]; console()")
    with tempfile.TemporaryDirectory() as d:
        def convert(e: int):
            return lambda: subprocess.run([sys.executable, "-c", code, str(e), "hf-to-gguf", str(model), "--policy",
                                           "Q4_K_M", "-o", str(Path(d) / f"s{e}.gguf"), "--quiet", "--force"],
                                          check=True, stdout=subprocess.DEVNULL)
        times = alternate({e: convert(e) for e in exponents}, rounds,
                          after=lambda e, s: print(f"{model.name} Q4_K_M, slices of 2^{e}: {s:.2f} s", flush=True))
        first = Path(d) / f"s{exponents[0]}.gguf"
        same = all(filecmp.cmp(first, Path(d) / f"s{e}.gguf", shallow=False) for e in exponents)
    for e in exponents:
        print(f"slices of 2^{e}: {min(times[e]):.2f}-{max(times[e]):.2f} s over {rounds} runs")
    print(f"identical files: {same}")


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

    from quantpress.convert.gguf_reading import GGUFFileReader, GGUFTensorsReader

    with tempfile.TemporaryDirectory() as d:
        if gguf is None:
            model = Path.home() / ".cache/quantpress/models/SmolLM2-135M-Instruct"
            gguf = Path(d) / "smollm2-Q8_0.gguf"
            subprocess.run([str(Path(sys.executable).parent / "convert"), "hf-to-gguf", str(model),
                            "--policy", "Q8_0", "-o", str(gguf), "--quiet"], check=True,
                           stdout=subprocess.DEVNULL)
        plain = best_ms(lambda: GGUFReader(str(gguf)), 3)
        ours = best_ms(lambda: GGUFFileReader(str(gguf)), 3)
        checks = best_ms(lambda: GGUFTensorsReader(str(gguf)), 3)
    print(f"parsing {gguf.name}: gguf-py's GGUFReader {plain / 1e3:.2f} s, GGUFFileReader "
          f"{ours / 1e3:.2f} s, GGUFTensorsReader {checks / 1e3:.3f} s")


def awq_search(layers: int) -> None:

    from quantpress import assets
    from quantpress.calibration import awq as cawq
    from quantpress.calibration import engine
    from quantpress.quantize import awq as qawq
    from quantpress.targets import AWQOptions, CalibOptions, ComputeOptions, Source, produce

    for k, n in ((576, 1536), (1536, 576), (576, 576)):
        w = torch.randn(n, k) * 0.05
        rates = []
        for m in (256, 512, 1024, 4096):
            x = torch.randn(m, k)
            rates.append(f"{m}: {2 * m * k * n / best_ms(lambda: x @ w.T, 10) / 1e6:.0f}")
        print(f"float32 matmul [tokens, {k}] x [{k}, {n}], GFLOP/s by tokens: " + ", ".join(rates))
    sm = engine.StreamingModel(assets.smollm2_dir(), dtype=torch.float32)
    layer = sm.load_layer(0)
    x = torch.randn(16, 256, sm.hidden_size)
    kw = sm.layer_kwargs(0, 16, 256)
    with torch.no_grad():
        for name, mod, kwargs in (("self_attn", layer.self_attn, True), ("mlp", layer.mlp, False)):
            whole = mod(x, **(kw if kwargs else {}))
            whole = whole[0] if isinstance(whole, tuple) else whole
            same = []
            for rows in (1, 2, 4):
                parts = []
                for a in range(0, 16, rows):
                    y = mod(x[a:a + rows], **(sm.layer_kwargs(0, rows, 256) if kwargs else {}))
                    parts.append(y[0] if isinstance(y, tuple) else y)
                same.append(f"{rows} row(s) {'equal' if torch.equal(torch.cat(parts), whole) else 'DIFFER'}")
            print(f"SmolLM2 layer 0 {name} over slices against one batch of 16 x 256: " + ", ".join(same))

    seen, errors, gaps, cur = {}, [], [], []
    gram_of = qawq.input_gram
    loss_of = qawq.linear_output_loss

    def gram(x, *a, **k):
        seen["x"] = x.reshape(-1, x.shape[-1])
        return gram_of(x, *a, **k)

    def loss(d, g, tokens):
        v = loss_of(d, g, tokens)
        exact = float((seen["x"].double() @ d.double().T).pow(2).sum()) / (tokens * d.shape[0])
        errors.append(abs(v / exact - 1))
        cur.append(v)
        return v

    search = cawq.LayerQuantizer.search_scale

    def per_group(self, g, *a):
        cur.clear()
        s = search(self, g, *a)
        if len(cur) == qawq.N_GRID:
            ordered = sorted(cur)
            gaps.append(ordered[1] / ordered[0] - 1)
        return s

    qawq.input_gram, qawq.linear_output_loss = gram, loss
    cawq.LayerQuantizer.search_scale = per_group
    try:
        with tempfile.TemporaryDirectory() as d:
            model = truncated_model(assets.smollm2_dir(), layers, d)
            src = Source(str(model), ComputeOptions(device="cpu"), CalibOptions(samples=16, seqlen=256),
                         progress=False)
            produce(AWQOptions(group_size=64, clip=False), src, Path(d) / "out", progress=False)
    finally:
        qawq.input_gram, qawq.linear_output_loss = gram_of, loss_of
        cawq.LayerQuantizer.search_scale = search
    slice_tokens = cawq.SEARCH_SLICE_TOKENS
    times = []
    try:
        for tokens in (512, 1024, 1 << 30):
            cawq.SEARCH_SLICE_TOKENS = tokens
            with tempfile.TemporaryDirectory() as d:
                model = truncated_model(assets.smollm2_dir(), layers, d)
                src = Source(str(model), ComputeOptions(device="cpu"),
                             CalibOptions(samples=16, seqlen=256), progress=False)
                summary = produce(AWQOptions(group_size=64, clip=False), src, Path(d) / "out",
                                  progress=False)
            times.append(f"{'unsliced' if tokens > 4096 else tokens}: "
                         f"{summary.stages['search'] / layers:.2f}")
    finally:
        cawq.SEARCH_SLICE_TOKENS = slice_tokens
    print(f"AWQ search seconds per layer by slice tokens, SmolLM2 first {layers} layers, 16 x 256 "
          f"tokens, no clip: " + ", ".join(times))
    print(f"AWQ Gram form, SmolLM2 first {layers} layers, 16 x 256 tokens: {len(errors)} candidates, "
          f"largest relative error against float64 {max(errors):.1e}; smallest gap between a "
          f"down_proj grid's best and second-best loss {min(gaps):.1e} (relative)")


def ggml_cuda_chunks() -> None:
    """Q4_K / Q6_K of 67 M weights on CUDA by ``ACCEL_CHUNK_ELEMENTS``: ms and GPU memory added."""
    import quantpress.quantize.ggml as qg

    x = torch.randn(8192, 8192, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    w = torch.rand(8192, device="cuda") + 0.1
    kept = qg.ACCEL_CHUNK_ELEMENTS
    try:
        for t in ("Q4_K", "Q6_K"):
            for ch in (1 << 24, 1 << 25, 1 << 26):
                qg.ACCEL_CHUNK_ELEMENTS = ch
                for im in (None, w):
                    qg.quantize(x[:512], t, imatrix=im)           # warm-up
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    t0 = time.perf_counter()
                    qg.quantize(x, t, imatrix=im)
                    torch.cuda.synchronize()
                    ms = (time.perf_counter() - t0) * 1e3
                    add = (torch.cuda.max_memory_allocated() - base) / 2**20
                    print(f"{t} chunks of 2^{ch.bit_length() - 1} elements, "
                          f"{'imatrix' if im is not None else 'plain'}: {ms:.1f} ms, +{add:.0f} MiB of GPU memory")
    finally:
        qg.ACCEL_CHUNK_ELEMENTS = kept


def dequantizers() -> None:
    """``quantize.ggml.dequantize`` of 1,024 x 4,096 values per type, one thread: best of five;
    then gguf-py's dequantization of about 4M values, over the whole chunk and per piece
    (``convert.gguf_reading.gguf_py_decoder``)."""
    from quantpress.quantize import ggml
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    x = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0))
    raws = {name: ggml.quantize(x, name) for name in ["Q4_K", "Q6_K", "Q5_0", "Q8_0", "F16", "F32"]}
    for name, raw in raws.items():
        print(f"dequantize {name:5s} of 1024 x 4096: {best_ms(lambda: ggml.dequantize(raw, name)):6.2f} ms")
    # the choices inside: Q4_K's nibbles split on uint8 then converted once, against through
    # int32; the round trip's bit comparison by np.array_equal and torch.equal, against
    # counting the differences
    qs = raws["Q4_K"].reshape(-1, 144)[:, 16:144].reshape(-1, 4, 1, 32)

    def on_uint8():
        return torch.cat([qs & 0xF, qs >> 4], dim=2).to(torch.float32)

    def on_int32():
        q = qs.to(torch.int32)
        return torch.cat([q & 0xF, q >> 4], dim=2).to(torch.float32)
    assert torch.equal(on_uint8(), on_int32())
    print(f"Q4_K nibbles of 1024 x 4096: on uint8 {best_ms(on_uint8):6.2f} ms, through int32 {best_ms(on_int32):6.2f} ms")
    # (on one of the check's pieces, which it compares while they are in the cache)
    from quantpress.convert.gguf_checks import CHECK_PIECE_ELEMENTS
    a = ggml.dequantize(raws["Q4_K"], "Q4_K").reshape(-1)[:CHECK_PIECE_ELEMENTS].view(torch.int32)
    b = a.clone()
    an, bn = a.numpy(), b.numpy()
    print(f"bit comparison of {a.numel()} values: torch.equal {best_ms(lambda: torch.equal(a, b), n=50) * 1e3:6.1f} us, "
          f"np.array_equal {best_ms(lambda: np.array_equal(an, bn), n=50) * 1e3:6.1f} us, "
          f"(a != b).sum() {best_ms(lambda: int((a != b).sum()), n=50) * 1e3:6.1f} us")
    # gguf-py's dequantization (the round trip's reference) of 4M values: gguf.quants.dequantize
    # of the whole chunk (rows merged to 16,384 values, as the check gave it before), against
    # the type's dequantize_blocks on each of the check's pieces (gguf_reading.gguf_py_decoder)
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from quantpress.convert.gguf_reading import gguf_py_decoder
    for name, width in [("Q5_0", 576), ("Q8_0", 576), ("Q4_K", 1536), ("Q6_K", 1536)]:
        n = (1 << 22) // width
        rows = ggml.quantize(x.reshape(-1)[:n * width].reshape(n, width), name).numpy()
        m = max(1, (1 << 14) // width)
        merged = rows[:rows.shape[0] // m * m].reshape(-1, m * rows.shape[1])
        qt = GGMLQuantizationType[name]
        decode, per = gguf_py_decoder(name), max(1, CHECK_PIECE_ELEMENTS // width)

        def by_piece():
            for r in range(0, rows.shape[0], per):
                decode(rows[r:r + per])
        print(f"gguf-py dequantize {name:4s} of {rows.shape[0]} x {width}: gguf.quants.dequantize, rows merged by {m}, "
              f"{best_ms(lambda: gguf_quants.dequantize(merged, qt)) * rows.shape[0] / (merged.shape[0] * m):6.2f} ms; "
              f"dequantize_blocks per piece of {per} rows {best_ms(by_piece):6.2f} ms")


def weighted_codecs() -> None:
    """The importance-weighted codecs per weight (Q5_0, Q4_K, IQ4_XS of 341 x 1,536 with an
    imatrix, best of eight) and ``sqrtf`` (NumPy's float32 root) and ``sqrtf_checked`` (torch's
    float64 root, checked) per element (512K values), how often torch's float32 root differs,
    and ``all_finite`` against ``isfinite().all()``; one thread, the heap bounded as the
    targets bound it."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml.common import all_finite, sqrtf, sqrtf_checked
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(341, 1536, generator=g) * 0.02
    qw = torch.rand(1536, generator=g) + 0.1
    for name in ["Q5_0", "Q4_K", "IQ4_XS"]:
        ms = best_ms(lambda: ggml.quantize(x, name, qw), n=8)
        print(f"{name:6s} with an imatrix, 341 x 1536: {ms * 1e6 / x.numel():6.1f} ns/weight")
    v = torch.rand(1 << 19, generator=g) * 1e-3
    for f in (sqrtf, sqrtf_checked):
        print(f"{f.__name__} of {v.numel()} values: {best_ms(lambda: f(v), n=20) * 1e6 / v.numel():6.2f} ns/element")
    wrong = float((torch.sqrt(v) != sqrtf(v)).float().mean())
    print(f"torch.sqrt (float32) differs from the correctly rounded root in {wrong:.1%} of them")
    print(f"all_finite of {v.numel()} values: {best_ms(lambda: all_finite(v), n=20):6.3f} ms, "
          f"torch.isfinite(v).all() {best_ms(lambda: bool(torch.isfinite(v).all()), n=20):6.3f} ms")


def compiled_steps() -> None:
    """``compiled_searches``: compile time with an empty Inductor cache and load time from it
    (fresh processes), then ns per weight of the search types, eager against compiled."""
    code = ("import time, torch; t = time.perf_counter(); "
            "from quantpress.quantize.ggml import compiled_searches as cs; cs.enable(); "
            "ok = cs.warm_up(); print(ok, time.perf_counter() - t)")
    with tempfile.TemporaryDirectory() as d:
        for what in ("compile (empty cache)", "load (cache filled)"):
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=d, OMP_NUM_THREADS="1"))
            ok, sec = r.stdout.split()
            print(f"compiled steps, {what}: {float(sec):5.1f} s in a fresh process (usable: {ok})")
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import compiled_searches as cs
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 2048, generator=g) * 0.02           # 2M values
    qw = torch.rand(2048, generator=g) + 0.1
    codecs = [(f"{name}{' imatrix' if w is not None else ''}", lambda name=name, w=w: ggml.quantize(x, name, w))
              for name, weights in [("Q2_K", (None, qw)), ("Q4_K", (None, qw)), ("Q5_K", (None, qw)),
                                    ("Q4_1", (qw,)), ("Q5_1", (qw,))] for w in weights]
    codec_ab({"eager": False, "compiled": True}, cs.enable, codecs, "eager", 8, rounds=3)


_KERNEL_CACHE_CHILD = """
import sys, warnings, numpy as np, torch
from quantpress.quantize import ggml
from quantpress.quantize.ggml import compiled_searches as cs
if sys.argv[1] == "shared":
    cs.machine_key = lambda: "shared"
x = torch.from_numpy(np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    cs.enable()
    a = ggml.quantize(x, "Q4_K")
cs.enable(False)
b = ggml.quantize(x, "Q4_K")
print((a != b).reshape(256, -1).any(1).sum().item(), any("search failed" in str(m.message) for m in w))
"""


def kernel_cache() -> None:
    """Q4_K of 256 blocks with the compiled steps at ``avx2`` after a native (AVX-512) compile:
    from one shared kernel directory and from the keyed ones, blocks differing from eager."""
    import torch

    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        print("needs an AVX-512 machine (the native kernels must be other than avx2's)")
        return
    with tempfile.TemporaryDirectory() as d:
        env = {k: v for k, v in os.environ.items() if k not in ("QUANTPRESS_INDUCTOR_DIR", "ATEN_CPU_CAPABILITY")}
        env.update(TORCHINDUCTOR_CACHE_DIR=d, OMP_NUM_THREADS="1")
        for layout in ("shared", "keyed"):
            for cap in (None, "avx2"):
                e = dict(env, **({"ATEN_CPU_CAPABILITY": cap} if cap else {}))
                r = subprocess.run([sys.executable, "-c", _KERNEL_CACHE_CHILD, layout], capture_output=True,
                                   text=True, check=True, env=e)
                bad, warned = r.stdout.split()
                print(f"{layout:6s} directory, {cap or 'native'} process: {bad} of 256 Q4_K blocks differ "
                      f"from the eager search's, compile failure warned: {warned}")


def state_select() -> None:
    """``kquants._RowSelect`` against ``torch.where(take, new, state, out=state)``: one update
    of a [5, 8192] float32 state (best of 2,000), then Q4_K and Q6_K of 8,192 x 256 values with
    the searches using each (one thread, alternating, four runs each, the bytes compared)."""
    from quantpress.quantize.ggml import kquants

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    state, new = torch.randn(5, 8192, generator=g), torch.randn(5, 8192, generator=g)
    take = torch.rand(8192, generator=g) < 0.3

    class WhereSelect:
        def __init__(self, st: torch.Tensor, nw: torch.Tensor):
            self.st, self.nw = st, nw

        def __call__(self, tk: torch.Tensor) -> None:
            torch.where(tk, self.nw, self.st, out=self.st)

    real = kquants._RowSelect
    ways = {"int32 bits (_RowSelect)": real, "torch.where": WhereSelect}
    for way, cls in ways.items():
        sel = cls(state, new)
        us = best_ms(lambda: [sel(take) for _ in range(2000)], n=3) * 1e3 / 2000
        print(f"update of a [5, 8192] state, {way:24s} {us:6.1f} us")
    x = torch.randn(8192, 256, generator=g) * 0.02

    def use(cls) -> None:
        kquants._RowSelect = cls
    codec_ab(ways, use, (("Q4_K", lambda: kquants.quantize_q4_k(x)), ("Q6_K", lambda: kquants.quantize_q6_k(x))),
             "torch.where", 24)


def numpy_searches() -> None:
    """The searches written for NumPy and torch alike (``kquants.make_qp_quants``, the
    weighted scale and min search of Q2_K, Q4_K, Q5_K, ``make_q3_quants``' descent and
    ``make_qkx2_quants``' and ``make_qx_quants``' acceptance tests) with NumPy's operations
    against torch's: one make_qp_quants call on [8, 2048] (a Q4_K codec slice's scales and
    mins, best of 20), then Q2_K, Q4_K and Q5_K of 512 x 4,096 values with an importance
    vector and Q3_K, Q4_K and Q6_K without (one thread, alternating, four runs each, the bytes compared)."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common, kquants

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(8, 2048, generator=g) * 0.01
    w = torch.rand(8, 2048, generator=g) * 50
    ways = {"NumPy": True, "torch": False}

    def use(flag: bool) -> None:
        kquants.NUMPY_SEARCHES_ON_CPU = flag
    # one operation on a search step's [8192] rows: a product, a comparison, a masked write, a
    # select, any()
    a, b = torch.rand(8192, generator=g), torch.rand(8192, generator=g)
    o, m = torch.empty(8192), torch.empty(8192, dtype=torch.bool)
    an, bn, on, mn = a.numpy(), b.numpy(), o.numpy(), m.numpy()
    ops = {"product": (lambda: torch.mul(a, b, out=o), lambda: np.multiply(an, bn, out=on)),
           "comparison": (lambda: torch.gt(a, 0, out=m), lambda: np.greater(an, 0, out=mn)),
           "masked write": (lambda: o.masked_fill_(m, 0.0), lambda: np.copyto(on, 0.0, where=mn)),
           "select": (lambda: torch.where(m, a, b), lambda: np.where(mn, an, bn)),
           "any()": (lambda: bool(m.any()), lambda: bool(mn.any()))}
    for name, (tf, nf) in ops.items():
        t_us, n_us = (best_ms(lambda f=f: [f() for _ in range(2000)], n=3) / 2 for f in (tf, nf))
        print(f"one {name:12s} on [8192]: torch {t_us:5.2f} us, NumPy {n_us:5.2f} us")
    # NumPy's Python wrappers against what kquants._NumpyOps calls instead, on [512] (the size
    # of the Q3_K descent's later passes)
    li = (np.random.default_rng(0).random(512) * 10 - 5).astype(np.int32)
    lm = li > 0
    ops_ = kquants._NumpyOps
    for name, wrapper, ours in (("clip", lambda: np.clip(li, -4, 3), lambda: ops_.clip(li, -4, 3)),
                                ("flatnonzero", lambda: np.flatnonzero(lm), lambda: ops_.flatnonzero(lm))):
        assert np.array_equal(wrapper(), ours())
        w_us, o_us = (best_ms(lambda f=f: [f() for _ in range(2000)], n=3) / 2 for f in (wrapper, ours))
        print(f"np.{name:11s} on [512]: {w_us:5.2f} us, _NumpyOps.{name} {o_us:5.2f} us")
    for way, flag, gathered in (("NumPy", True, True), ("NumPy, whole rows", True, False),
                                ("torch", False, False)):
        use(flag)
        kquants._NumpyOps.GATHERS = gathered
        with common.quiet_floats():         # (as the codecs' slices run)
            ms = best_ms(lambda: [kquants.make_qp_quants(x, w, 63) for _ in range(20)], n=3) / 20
        print(f"make_qp_quants of [8, 2048], {way:17s} {ms:6.2f} ms")
    kquants._NumpyOps.GATHERS = True
    use(True)
    # how many of a Q3_K slice's sub-blocks each descent pass works on (Gaussian values)
    sizes: list[int] = []

    class Counting(kquants._NumpyOps):
        @staticmethod
        def false_like(a):                  # (once per pass, on the pass's sums)
            sizes.append(int(a.shape[0]))
            return np.zeros_like(a, dtype=bool)
    real, kquants._NumpyOps = kquants._NumpyOps, Counting
    try:
        with common.quiet_floats():
            kquants.quantize_q3_k.__wrapped__(torch.randn(1024, 256, generator=g) * 0.02)
    finally:
        kquants._NumpyOps = real
    print("Q3_K descent passes on 2^18 values work on", ", ".join(map(str, sizes)), "sub-blocks")
    v = torch.randn(512, 4096, generator=g) * 0.02
    imatrix = torch.rand(4096, generator=g) ** 2 * 10
    codecs = tuple((t, lambda t=t: ggml.quantize(v, t, imatrix)) for t in ("Q2_K", "Q4_K", "Q5_K"))
    codecs += tuple((t + " -", lambda t=t: ggml.quantize(v, t)) for t in ("Q3_K", "Q4_K", "Q6_K"))
    codec_ab(ways, use, codecs, "torch", 6)
    # Q3_K's descent and make_qp_quants' (Q4_K with an imatrix) with C's test on the
    # gathered groups whose level changes, later passes on the groups that changed, against
    # the test on whole rows (NumPy's select, as torch's path does)

    def gathers(flag: bool) -> None:
        kquants._NumpyOps.GATHERS = flag
    codec_ab({"NumPy, test gathered": True, "NumPy, whole rows": False}, gathers,
             (("Q3_K -", lambda: ggml.quantize(v, "Q3_K")),
              ("Q4_K", lambda: ggml.quantize(v, "Q4_K", imatrix))),
             "NumPy, whole rows", 20)


def first_extremes() -> None:
    """The codecs' extremes on the CPU: ``common.first_absmax(x, 1)`` and
    ``legacy._first_min_max`` (amax/amin, argmax only for rows where those cannot tell the
    element) against the argmax/argmin they replaced (``common._first_absmax_by_argmax``, the
    path off the CPU), on Gaussian [8192, 32] (a legacy codec slice) with ties and zeros of
    both signs mixed in, and ``first_absmax(xs, 0)`` on [16, 16384] (a Q6_K slice, positions
    first) against the same function's weighted-position search: microseconds per call, best
    of five rounds of 50, one thread, heap bounded, the results compared bit for bit; then
    Q4_0, Q4_1, Q5_0, Q5_1, Q6_K and Q3_K of 2M values (one thread, best of four)."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common, legacy
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8192, 32, generator=g) * 0.02
    x[::7, 3], x[::7, 5], x[::11], x[::13, 0] = 0.5, -0.5, 0.0, -0.0

    def min_max_by_argmin(x):
        return x.gather(1, x.argmin(1, keepdim=True)), x.gather(1, x.argmax(1, keepdim=True))

    xs = torch.randn(16, 16384, generator=g) * 0.02     # a Q6_K slice's sub-blocks, positions first
    xs[3, ::7], xs[5, ::7], xs[:, ::11], xs[0, ::13] = 0.5, -0.5, 0.0, -0.0
    for what, shape, new, old in (
            ("first_absmax", "[8192, 32]", lambda: common.first_absmax(x, 1),
             lambda: common._first_absmax_by_argmax(x, 1)),
            ("_first_min_max", "[8192, 32]", lambda: legacy._first_min_max(x), lambda: min_max_by_argmin(x)),
            ("first_absmax", "[16, 16384] dim 0", lambda: common.first_absmax(xs, 0),
             lambda: common._first_absmax_by_argmax(xs, 0))):
        same = all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(new(), old()))
        t_new, t_old = (best_ms(lambda f=f: [f() for _ in range(50)]) / 50 * 1e3 for f in (new, old))
        print(f"{what:15s} of {shape}: amax/amin {t_new:6.1f} us, argmax {t_old:6.1f} us (same bits: {same})")
    v = torch.randn(512, 4096, generator=g) * 0.02
    for t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q3_K"):
        print(f"{t} of 2M values: {best_ms(lambda t=t: ggml.quantize(v, t), n=4):6.1f} ms")


def levels_bytes() -> None:
    """The K-quants' requantization to level bytes on the CPU, a Q4_K slice (8,192 sub-blocks
    of 32): ``kquants._requant_bytes`` (block order, bytes through int32) against the same
    float ops and range check positions first followed by the transpose back to block order
    and a direct float32 -> uint8 conversion (its form before), and that conversion alone
    against through int32 on [16, 16384]; Q3_K's hmask of a 2^19-value slice
    (``kquants._q3_hmask``, uint8 shifts and ORs, against a comparison and int32 sums); the
    extremes of a Q6_K slice's 16,384 sub-blocks of 16 along rows (block order) and along the
    first axis (positions first), which
    ``_requant_bytes``' range check takes; a masked_fill_ of [32, 8192] with an [8192] mask
    (the searches' final fill of degenerate sub-blocks): microseconds, best of five rounds of
    50, one thread, heap bounded; then Q4_K and Q6_K of 2M values."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import kquants
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    nb, S = 1024, 8192
    x = torch.randn(nb, 256, generator=g) * 0.02
    dj = torch.rand(1, S, generator=g) * 0.002 + 0.001
    mj = torch.rand(1, S, generator=g) * 0.01
    L = torch.zeros(32, S)

    xs = x.reshape(-1, 32).t().contiguous()     # as the search has it

    def positions_first():
        e = torch.stack([xs.amin(0), xs.amax(0)])
        e += mj
        assert bool(e.div_(dj).abs_().amax() <= kquants.NI_SAFE)
        t = xs + mj
        t.div_(dj).round_().clamp_(0, 15)
        return t.t().contiguous().reshape(nb, 256).to(torch.uint8)

    Lf = torch.randint(0, 64, (16, 16384), generator=g).to(torch.float32)
    # Q3_K's hmask of a 2^19-value slice's levels 0..7 (kquants._q3_hmask: a uint8 shift and
    # ORs) against its form before (a uint8 comparison, int32 shifts summed over j)
    nb3 = 2048
    L3 = torch.randint(0, 8, (nb3, 256), generator=g, dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.int32).reshape(1, 8, 1)

    def hmask_sum():
        hb = (L3 > 3).to(torch.int32).reshape(nb3, 8, 32)
        return (hb << shifts).sum(1, dtype=torch.int32).to(torch.uint8)
    for what, new, old in (
            ("requantization to bytes", lambda: kquants._requant_bytes(x, xs, mj, dj, 0, 15, L), positions_first),
            ("float32 -> uint8", lambda: Lf.to(torch.int32).to(torch.uint8), lambda: Lf.to(torch.uint8)),
            ("Q3_K hmask, 2^19 values", lambda: kquants._q3_hmask(L3), hmask_sum)):
        same = torch.equal(new(), old())
        t_new, t_old = (best_ms(lambda f=f: [f() for _ in range(50)]) / 50 * 1e3 for f in (new, old))
        print(f"{what:24s}: now {t_new:6.1f} us, before {t_old:6.1f} us (same: {same})")
    x16 = torch.randn(16384, 16, generator=g) * 0.02
    x16t = x16.t().contiguous()
    rows = best_ms(lambda: [(x16.amin(1), x16.amax(1)) for _ in range(50)]) / 50 * 1e3
    cols = best_ms(lambda: [(x16t.amin(0), x16t.amax(0)) for _ in range(50)]) / 50 * 1e3
    print(f"amin and amax of 16,384 sub-blocks of 16: along rows {rows:6.1f} us, "
          f"along the first axis {cols:6.1f} us")
    L32, mask = torch.zeros(32, S), torch.zeros(S, dtype=torch.bool)
    fill = best_ms(lambda: [L32.masked_fill_(mask, 0.0) for _ in range(50)]) / 50 * 1e3
    print(f"masked_fill_ of [32, 8192] with an [8192] mask: {fill:6.1f} us")
    v = torch.randn(512, 4096, generator=g) * 0.02
    for t in ("Q4_K", "Q6_K", "Q3_K"):
        print(f"{t} of 2M values: {best_ms(lambda t=t: ggml.quantize(v, t), n=4):6.1f} ms")


def codec_ab(ways: dict, use, codecs, reference: str, width: int, rounds: int = 4) -> None:
    """Time each of ``codecs`` ((name, function returning the bytes tensor)) under each of
    ``ways`` (label -> the value ``use`` installs), alternating, ``rounds`` runs each; print
    each's times and whether its bytes equal those under the ``reference`` way. The first
    way's value is installed again at the end."""
    out: dict[tuple[str, str], bytes] = {}

    def run(way: str, name: str, fn):
        def call():
            out[way, name] = fn().numpy().tobytes()
        return call
    try:
        took = alternate({(way, name): run(way, name, fn) for way in ways for name, fn in codecs}, rounds,
                         before=lambda key: use(ways[key[0]]))
    finally:
        use(next(iter(ways.values())))
    for (way, name), ts in took.items():
        same = out[way, name] == out[reference, name]
        print(f"{name:12s} of 2M values, {way:{width}s} {min(ts) * 1e3:6.1f}-{max(ts) * 1e3:6.1f} ms "
              f"(same bytes: {same})")


def q3_slices() -> None:
    """Q3_K's CPU slice size (``quantize.ggml.kquants.Q3_K_SLICE_FACTOR``): Q3_K of 512 x 4,096
    values (2M) without and with an importance vector, in slices of 2, 1 and 4 times
    ``common.CPU_SLICE_ELEMENTS`` (2^18) elements, through ``common.map_block_slices`` as the
    codec runs (one thread, heap bounded, alternating, four runs each, the bytes compared)."""
    from quantpress.quantize.ggml import common, kquants
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(512, 4096, generator=g) * 0.02
    qw = (torch.rand(4096, generator=g) ** 2 * 10).expand(512, 4096).reshape(-1, 256)
    factor = [kquants.Q3_K_SLICE_FACTOR]

    def use(f: int) -> None:
        factor[0] = f
    codecs = (("Q3_K", lambda: common.map_block_slices(kquants.quantize_q3_k.__wrapped__, v.reshape(-1, 256),
                                                        search=True, slice_factor=factor[0])),
              ("Q3_K imatrix", lambda: common.map_block_slices(kquants.quantize_q3_k_weighted.__wrapped__,
                                                               v.reshape(-1, 256), qw, search=True,
                                                               slice_factor=factor[0])))
    codec_ab({"slices of 2 x 2^18": 2, "slices of 2^18": 1, "slices of 4 x 2^18": 4}, use, codecs,
             "slices of 2^18", 18)


def seq_sums() -> None:
    """``common.seq_sum0`` (C's sequential float32 sums) through numpy's axis-0 reduce against
    the loop of torch adds it replaced, one thread: the sums of the K-quant searches' shapes
    alone (best of 200), then Q4_K and Q6_K of 8,192 x 256 values and Q5_0 with an imatrix
    (alternating, four runs each, the bytes compared)."""
    from quantpress.quantize import ggml
    from quantpress.quantize.ggml import common

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)

    def adds(p: torch.Tensor, out: torch.Tensor) -> None:
        rows = p.unbind(0)
        torch.add(rows[0], 0.0, out=out)
        for r in rows[1:]:
            out.add_(r)

    for shape, what in (((32, 3, 8192), "Q4_K's products"), ((32, 8192), "Q4_K's error"),
                        ((16, 2, 16384), "Q6_K's products")):
        p = torch.randn(shape, generator=g)
        out = torch.empty(shape[1:])
        loop = best_ms(lambda: adds(p, out), n=200) * 1e3
        red = best_ms(lambda: common.seq_sum0(p, out), n=200) * 1e3
        print(f"sum of {str(list(shape)):16s} ({what:16s}): torch adds {loop:6.1f} us, numpy reduce {red:6.1f} us")
    x = torch.randn(8192, 256, generator=g) * 0.02
    qw = torch.rand(256, generator=g) + 0.1
    ways = {"numpy reduce": common.SEQ_SUM_NUMPY_MIN, "torch adds": 1 << 62}

    def use(least: int) -> None:
        common.SEQ_SUM_NUMPY_MIN = least
    codec_ab(ways, use, (("Q4_K", lambda: ggml.quantize(x, "Q4_K")), ("Q6_K", lambda: ggml.quantize(x, "Q6_K")),
                         ("Q5_0 imatrix", lambda: ggml.quantize(x, "Q5_0", qw))), "torch adds", 12)


def round_trip(model: Path) -> None:
    """``verify_gguf`` of ``model``'s Q4_K_M (made by ``convert hf-to-gguf``) on one thread:
    as it is (gguf-py's values and ours in pieces of ``CHECK_PIECE_ELEMENTS``) and with
    pieces of whole chunks (``VERIFY_CHUNK_ELEMENTS``); two runs each, alternating (the
    sources read once before, so all find them in the page cache)."""
    from quantpress.convert import gguf_checks, gguf_roundtrip
    from quantpress.memory import bound_heap
    from quantpress.targets.gguf import plan_from_hf

    bound_heap()
    torch.set_num_threads(1)
    piece = gguf_checks.CHECK_PIECE_ELEMENTS
    ways = {f"as it is (pieces of {piece})": piece,
            "pieces of whole chunks": gguf_checks.VERIFY_CHUNK_ELEMENTS}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "q4_k_m.gguf"
        subprocess.run([str(Path(sys.executable).parent / "convert"), "hf-to-gguf", str(model),
                        "--policy", "Q4_K_M", "-o", str(out), "--quiet"], check=True,
                       stdout=subprocess.DEVNULL)
        plan = plan_from_hf(model, "Q4_K_M")
        for st in plan.tensors:
            st.load()

        def check():
            rep = gguf_roundtrip.verify_gguf(out, plan.tensors, plan.types, torch.device("cpu"))
            assert rep.ok, rep.mismatches[:3]

        def use(way: str):
            gguf_roundtrip.CHECK_PIECE_ELEMENTS = ways[way]
        times = alternate({way: check for way in ways}, 2, before=use)
        gguf_roundtrip.CHECK_PIECE_ELEMENTS = piece
    print(f"verify_gguf of {model.name}'s Q4_K_M, one thread:")
    for way, ts in times.items():
        print(f"  {way:<60s} {min(ts):.2f}-{max(ts):.2f} s")


def check_costs() -> None:
    """What one round-trip check costs per value, by part, on one thread (4096 x 1536
    Gaussian float16 weights; pieces of ``CHECK_PIECE_ELEMENTS``, three passes): gguf-py's
    dequantization, ours, the bit comparison, the source widened to float32, the error, its
    two dot products and its extremes (the checker's work when it computes both halves), and
    the checksums of each row of gguf-py's values (``gguf_checks.row_checksums_np``: the
    checker's work besides gguf-py's when the writer computes our half,
    ``gguf_checks.writer_figures``). Nanoseconds per value, for Q4_K, Q6_K, Q5_0, Q8_0."""
    from quantpress.convert import gguf_checks as rt
    from quantpress.convert import gguf_reading
    from quantpress.quantize import ggml
    from quantpress.memory import bound_heap

    bound_heap()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows, cols = 4096, 1536
    src = (torch.randn(rows, cols, generator=g) * 0.02).half()
    piece = max(1, rt.CHECK_PIECE_ELEMENTS // cols)
    for tname in ("Q4_K", "Q6_K", "Q5_0", "Q8_0"):
        raw = ggml.quantize(src.float(), tname).numpy().reshape(rows, -1)
        theirs = gguf_reading.gguf_py_decoder(tname)
        spent = dict.fromkeys(("gguf-py", "ours", "bits", "widen", "error", "dots", "extremes", "checksums"), 0.0)
        for _ in range(3):
            for p0 in range(0, rows, piece):
                p1 = min(rows, p0 + piece)
                t = time.perf_counter()
                ref = theirs(raw[p0:p1])
                spent["gguf-py"] += (t1 := time.perf_counter()) - t
                ours = ggml.dequantize(torch.from_numpy(raw[p0:p1].copy()), tname).reshape(-1)
                spent["ours"] += (t2 := time.perf_counter()) - t1
                np.array_equal(ref.view(np.int32), ours.numpy().view(np.int32))
                spent["bits"] += (t3 := time.perf_counter()) - t2
                x = src[p0:p1].to(torch.float32).reshape(-1)
                spent["widen"] += (t4 := time.perf_counter()) - t3
                e = torch.sub(ours, x, out=ours)
                spent["error"] += (t5 := time.perf_counter()) - t4
                torch.dot(e, e).double(), torch.dot(x, x).double()
                spent["dots"] += (t6 := time.perf_counter()) - t5
                torch.aminmax(e)
                spent["extremes"] += (t7 := time.perf_counter()) - t6
                rt.row_checksums_np(ref.reshape(p1 - p0, cols))
                spent["checksums"] += time.perf_counter() - t7
        ns = {k: v / (3 * rows * cols) * 1e9 for k, v in spent.items()}
        both = sum(v for k, v in ns.items() if k != "checksums")
        print(f"{tname}: ns per value " + ", ".join(f"{k} {v:.2f}" for k, v in ns.items())
              + f"; the check with both halves {both:.2f}, gguf-py's half and the checksums "
              f"{ns['gguf-py'] + ns['checksums']:.2f}")


def exit_freeze() -> None:
    """``convert hf-to-gguf`` of SmolLM2 to Q4_K_M, three times each way, alternating: as the
    console command ends it (``cli.common.exit_with``: the run's objects frozen out of the
    garbage collector before ``sys.exit``) and with a plain ``sys.exit`` of the same
    ``main``: wall seconds of the process, from its start to its exit."""
    model = model_dir(None)
    with tempfile.TemporaryDirectory() as d:
        argv = ["hf-to-gguf", str(model), "--policy", "Q4_K_M", "-o", str(Path(d) / "x.gguf"),
                "--force", "--quiet"]
        ways = {"exit_with (gc.freeze)": "from quantpress.cli import common, convert_main; "
                                         f"common.exit_with(convert_main.main({argv!r}))",
                "plain sys.exit": "import sys; from quantpress.cli import convert_main; "
                                  f"sys.exit(convert_main.main({argv!r}))"}
        took = alternate({label: (lambda code=code: subprocess.run([sys.executable, "-c", code], check=True,
                                                                   stdout=subprocess.DEVNULL))
                          for label, code in ways.items()}, 3)
    for label, ts in took.items():
        print(f"convert hf-to-gguf SmolLM2 Q4_K_M, {label:22s} {min(ts):5.2f}-{max(ts):5.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="a GGUF with a large vocabulary (default: SmolLM2 "
                    "Q8_0 made by convert hf-to-gguf)")
    ap.add_argument("--awq-layers", type=int, default=3, help="SmolLM2 layers for the AWQ Gram "
                    "form's figures (30: all)")
    ap.add_argument("--cuda", action="store_true", help="only the GPU figure (ggml chunk size on CUDA)")
    ap.add_argument("--codec-profile", metavar="DEVICE", nargs="?", const="cuda",
                    help="only where Q4_K's and Q6_K's time goes on DEVICE (default cuda): wall, device "
                         "busy time, kernels launched, values read back")
    ap.add_argument("--threads", help="only the codec thread sweep, on these thread counts (e.g. 1,2,4,8)")
    ap.add_argument("--lanes", help="only the codec lanes (threads against processes), on these "
                    "lane counts (e.g. 1,2)")
    ap.add_argument("--slices", metavar="E,E", help="only hf-to-gguf end to end with codec slices of 2^E "
                    "elements for each E (e.g. 18,19), alternating, three runs each")
    ap.add_argument("--slice-model", type=Path,
                    default=Path.home() / ".cache/quantpress/models/synth-llama-554M",
                    help="--slices: the model (default: the 554M random llama)")
    ap.add_argument("--dequantize", action="store_true", help="only the dequantizers' times")
    ap.add_argument("--parse", action="store_true", help="only the GGUF readers' parse of --gguf "
                    "(default: SmolLM2's Q8_0)")
    ap.add_argument("--weighted", action="store_true",
                    help="only the importance-weighted codecs' times and sqrtf's")
    ap.add_argument("--select", action="store_true",
                    help="only the K-quant searches' state update: int32 bits against torch.where")
    ap.add_argument("--numpy-searches", action="store_true",
                    help="only the searches written for NumPy and torch alike (make_qp_quants, "
                         "make_q3_quants' descent, make_qkx2_quants' acceptance test): "
                         "NumPy's operations against torch's")
    ap.add_argument("--q3-slices", action="store_true",
                    help="only Q3_K's CPU slice size: 2, 1 and 4 times the other codecs'")
    ap.add_argument("--seq-sum", action="store_true",
                    help="only the codecs' sequential sums: numpy's reduce against torch adds")
    ap.add_argument("--first-extremes", action="store_true",
                    help="only the codecs' block and sub-block extremes: amax/amin against argmax/argmin")
    ap.add_argument("--levels", action="store_true",
                    help="only the K-quants' requantization to level bytes: block order against "
                         "positions first, through int32 against directly")
    ap.add_argument("--round-trip", type=Path, nargs="?", metavar="MODEL",
                    const=Path.home() / ".cache/quantpress/models/SmolLM2-135M-Instruct",
                    help="only the GGUF round trip's check of MODEL's Q4_K_M (default SmolLM2) "
                         "with gguf-py given merged rows against rows as they are, our side in "
                         "pieces against whole chunks")
    ap.add_argument("--compiled", action="store_true",
                    help="only the K-quant search's compiled steps: compile and load time, eager "
                         "against compiled per type")
    ap.add_argument("--kernel-cache", action="store_true",
                    help="only the compiled steps at avx2 after a native AVX-512 compile, from one "
                         "shared kernel directory and from keyed ones")
    ap.add_argument("--exit", action="store_true",
                    help="only the console commands' exit (gc.freeze) against a plain sys.exit")
    ap.add_argument("--check-costs", action="store_true",
                    help="only what a round-trip check costs per value, by part, with both halves "
                         "in the checker and with the writer's checksums")
    args = ap.parse_args()
    if args.cuda:
        ggml_cuda_chunks()
        return 0
    if args.codec_profile:
        codec_profile(args.codec_profile)
        return 0
    if args.threads:
        codec_thread_sweep([int(n) for n in args.threads.split(",")])
        return 0
    if args.lanes:
        codec_lanes([int(n) for n in args.lanes.split(",")])
        return 0
    if args.slices:
        slice_sizes([int(e) for e in args.slices.split(",")], args.slice_model)
        return 0
    if args.dequantize:
        dequantizers()
        return 0
    if args.weighted:
        weighted_codecs()
        return 0
    if args.compiled:
        compiled_steps()
        return 0
    if args.kernel_cache:
        kernel_cache()
        return 0
    if args.exit:
        exit_freeze()
        return 0
    if args.check_costs:
        check_costs()
        return 0
    if args.select:
        state_select()
        return 0
    if args.q3_slices:
        q3_slices()
        return 0
    if args.seq_sum:
        seq_sums()
        return 0
    if args.numpy_searches:
        numpy_searches()
        return 0
    if args.first_extremes:
        first_extremes()
        return 0
    if args.levels:
        levels_bytes()
        return 0
    if args.round_trip:
        round_trip(args.round_trip)
        return 0
    if args.parse:
        reader_parse(args.gguf)
        return 0
    snr_floor()
    codec_threads()
    hessian_factor()
    reader_parse(args.gguf)
    awq_search(args.awq_layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
