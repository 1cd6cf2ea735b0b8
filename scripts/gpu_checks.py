"""GPU check suite: the same work on device A (the CPU) and device B (CUDA), side by side.

    python scripts/gpu_checks.py [--out gpu_report.json] [--device-b cuda] [--model DIR] ...

``scripts/gpu_suite.sh`` is the one-command wrapper (installation included). Four checks, each
recorded in the JSON report under ``checks`` with ``identical`` (bit-for-bit the same on both
devices), ``pass`` (within the tolerances below) and the figures that decide them:

- ``ggml``: every registered ggml type (:func:`quantpress.quantize.ggml.names`) quantizes the
  same seeded float32 tensors on A and B; the bytes and the dequantized values must be
  identical (the project's rule: bit-exact on every device). Times per type and shape.
- ``awq`` / ``exl2``: :func:`quantpress.targets.produce` with ``AWQOptions(group_size=64)`` and
  ``EXL2Options(bpw=4.0)`` on A and on B, from the same model and calibration rows. Per
  quantized linear: max |difference| of the dequantized weights, the quantization step that
  bounds it, the fraction of identical packed words; for EXL2 also the option chosen for every
  layer and each output's relative error against the source weights (what its tolerance
  compares, see :data:`EXL2_REL_ERR`).
- ``stages``: the seconds of every stage (``Summary.stages``) of those runs, A and B side by
  side.
- ``batch``: ``python -m quantpress quantize batch`` on the job of ``tests/test_batch.py``
  (GGUF Q4_K_M and Q8_0, imatrix, AWQ g64, EXL2 4.0 and 5.0 with head_bits 8, eval), once with
  device A and once with device B: exit codes, rows, wall times, which outputs are
  byte-identical, the outputs that are not compared by kind (an imatrix by its importances,
  :data:`IMATRIX_REL`; EXL2 and AWQ directories as the checks above), and each output's KL
  divergence on both devices.

A tolerance miss is recorded, not fatal. Exit codes: 0 the report is written (whatever the
checks found), 1 a check or the script crashed (the report still holds what was done and the
error), 2 device B is CUDA and CUDA is not available (one line on stderr).

The model: ``--model DIR`` (any HF directory quantpress reads), else a random 2-layer llama
built like ``tests/synth.py`` with the SmolLM2 tokenizer (``--tokenizer DIR``, else the one in
quantpress's cache, else fetched by :func:`quantpress.assets.smollm2_dir`, which needs the
network). The calibration and evaluation text: ``--calib FILE``, else the default text of
every quantpress command, exllamav2's ``standard_cal_data`` (its wiki.utf8 split), from
quantpress's cache or fetched into it (:func:`quantpress.targets.source.default_cal_dir`; fill
the cache beforehand with ``python -m quantpress.assets cal-data`` on an offline machine).
Without either the script fails (exit 1) with an error saying so.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# digests and sync are part of this module's interface (tests and callers use gpu_checks.X)
from bench_common import digests, parse_sizes, sync, tiny_llama  # noqa: F401

# ---- tolerances (what "pass" means per check) -----------------------------------------------

#: ggml types: the quantized bytes and the dequantized float32 values on A and B must be
#: bit-identical (the project's rule for every device)
GGML_TOLERANCE = "bytes and dequantized values identical"
#: AWQ: each dequantized weight may differ between A and B by at most one quantization step,
#: i.e. the larger of the two float16 scales of its group (a rounding decision that flipped)
AWQ_MAX_STEPS = 1.0
#: EXL2: the same option for every layer (attention and MLP) on A and B, and per linear the
#: relative reconstruction errors ||W_q - W||_F / ||W||_F of A and B (W the source weight) within
#: this fraction of each other. Not "each weight within one step", as for AWQ: GPTQ's rounding
#: decisions are discontinuous in the Hessian, and float32 sums in another order (cuBLAS against
#: the CPU) flip some of them; the error feedback carries each flip to the columns after it.
#: On an H100 (README.md calibration text, 4 x 64 tokens): the same allocation, weights up to
#: 1.35 steps apart, 1-26% of layer 1's packed words identical, the relative errors within
#: 0.70% of each other. ``--device-b cpu --hessian-noise 1e-6`` (every Hessian of device B times
#: 1 + 1e-6 N) gives the same picture on the CPU: 1.51 steps, 0.01-12%, 0.70% (at 1e-5 the
#: allocation changes).
EXL2_REL_ERR = 0.01
#: batch: an imatrix whose files differ between the devices must have the same tensors and
#: token counts, and every importance (in_sum2 / count, what llama-quantize hands its
#: quantizers) within this relative difference of the other device's. float32 sums in another
#: order move them by 3.2e-7 at most on SmolLM2 (``quantize imatrix --samples 4 --seqlen 64``
#: with ``--batch-tokens 64`` against 4096, then ``--compare-imatrix A B``: every tensor
#: differs; OMP_NUM_THREADS 1 against 2 changes nothing); the margin is for CUDA's matmul and
#: attention kernels, which round otherwise again (to be confirmed by the next device run,
#: which records the figure).
IMATRIX_REL = 1e-4
#: batch: both runs exit 0 with every output made; outputs that differ between the devices are
#: compared by kind (byte identity is recorded, not required)
BATCH_TOLERANCE = ("exit code 0 and every row made on both devices; where the files differ, an "
                   f"imatrix's importances within {IMATRIX_REL:g} (relative) with the same counts, "
                   "an EXL2 directory as the exl2 check, an AWQ directory as the awq check "
                   "(GGUF files and measurement.json: recorded)")

#: default shapes of the ggml tensors: rows x columns (columns a multiple of 256)
DEFAULT_SHAPES = "64x256,32x4096,1024x4096"
#: argument names under which a ggml quantizer would take an importance matrix
IMATRIX_PARAMS = ("imatrix", "quant_weights", "importance")


class CheckError(Exception):
    """A check could not be carried out (recorded with its message in the report)."""


# ---- small helpers ----------------------------------------------------------------------------

def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"64x256,32x4096"`` -> [(64, 256), (32, 4096)] (rows, columns;
    :func:`bench_common.parse_sizes`)."""
    return parse_sizes(text)


def sample_tensor(rows: int, cols: int, seed: int):
    """Seeded float32 tensor [rows, cols] on the CPU: N(0, 1) values, with row 0 all zeros and
    row 1 scaled by 1000 (when there are such rows) so that the edge paths of the quantizers
    (zero blocks, large magnitudes) run too."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float32)
    if rows > 2:
        x[0] = 0.0
        x[1] *= 1000.0
    return x


def imatrix_param(quantize_fn) -> str | None:
    """The name under which ``quantize_fn`` (``ggml.quantize``) accepts an importance matrix,
    or None when its signature has none of :data:`IMATRIX_PARAMS`."""
    params = inspect.signature(quantize_fn).parameters
    return next((p for p in IMATRIX_PARAMS if p in params), None)


# ---- 1. ggml types ----------------------------------------------------------------------------

def time_quantize(x, name: str, device, repeat: int, **kw):
    """Quantize float32 ``x`` [rows, cols] (CPU) to ggml type ``name`` on ``device``: one
    untimed warm-up, then ``repeat`` timed runs. Returns (uint8 bytes [rows, row_bytes] on the
    CPU, dequantized float32 [rows, cols] on the CPU computed on ``device``, best time in
    seconds of one quantize call)."""
    from quantpress.quantize import ggml

    xd = x.to(device)
    kwd = {k: v.to(device) for k, v in kw.items()}
    raw = ggml.quantize(xd, name, **kwd)
    sync(device)
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        ggml.quantize(xd, name, **kwd)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    deq = ggml.dequantize(raw, name)
    return raw.cpu(), deq.cpu(), best


def check_ggml(types: list[str] | None, shapes: list[tuple[int, int]], dev_a: str, dev_b: str,
               repeat: int = 3, seed: int = 0) -> dict:
    """Check 1: each ggml type on the same tensors on ``dev_a`` and ``dev_b``.

    ``types``: names to check (None: every registered type; names not registered are listed
    under ``unknown_types``). ``shapes``: (rows, cols) of the float32 test tensors
    (:func:`sample_tensor`, seeded ``seed + index``). With an importance matrix too when
    ``ggml.quantize`` takes one (:func:`imatrix_param`; a seeded positive float32 [cols]).
    Returns {"identical", "pass", "tolerance", "imatrix", "types": {name: {"identical",
    "shapes": {"RxC": {"bytes_identical", "dequant_identical", "a_s", "b_s"}}}},
    "unknown_types"}; times in seconds per quantize call (best of ``repeat``)."""
    import torch
    from quantpress.quantize import ggml

    known = ggml.names()
    wanted = known if types is None else [t for t in types if t in known]
    unknown = [] if types is None else [t for t in types if t not in known]
    param = imatrix_param(ggml.quantize)
    tensors = {(r, c): sample_tensor(r, c, seed + i) for i, (r, c) in enumerate(shapes)}
    out = {}
    for name in wanted:
        row_block = ggml.get(name).block_size
        per_shape = {}
        for (r, c), x in tensors.items():
            if c % row_block:
                continue
            variants = [("", {})]
            if param is not None:
                g = torch.Generator().manual_seed(seed + 1000 + c)
                variants.append(("+imatrix", {param: torch.rand(c, generator=g) + 0.01}))
            for suffix, kw in variants:
                key = f"{r}x{c}{suffix}"
                try:
                    qa, da, ta = time_quantize(x, name, dev_a, repeat, **kw)
                    qb, db, tb = time_quantize(x, name, dev_b, repeat, **kw)
                except TypeError as e:  # this type's quantizer does not take the importance matrix
                    if not kw:
                        raise
                    per_shape[key] = {"skipped": f"{type(e).__name__}: {e}"}
                    continue
                same_q = qa.shape == qb.shape and bool(torch.equal(qa, qb))
                same_d = da.shape == db.shape and bool(torch.equal(da.view(torch.int32), db.view(torch.int32)))
                entry = {"bytes_identical": same_q, "dequant_identical": same_d,
                         "a_s": round(ta, 6), "b_s": round(tb, 6)}
                if not same_q:
                    entry["differing_bytes"] = int((qa != qb).sum()) if qa.shape == qb.shape else None
                per_shape[key] = entry
        ident = all(v.get("bytes_identical", True) and v.get("dequant_identical", True)
                    for v in per_shape.values())
        out[name] = {"identical": ident, "shapes": per_shape}
    ident = all(v["identical"] for v in out.values()) and bool(out)
    return {"identical": ident, "pass": ident, "tolerance": GGML_TOLERANCE,
            "imatrix": (f"with an importance matrix through ggml.quantize(..., {param}=...)" if param
                        else "not checked: no registered quantizer takes an importance matrix "
                             "(ggml.quantize(x, name) has no such argument)"),
            "types": out, "unknown_types": unknown}


# ---- 2. AWQ and EXL2 passes -------------------------------------------------------------------

def make_source(model: Path, device: str, samples: int, seqlen: int, calib: str | None,
                cal_dir: Path | None):
    """A :class:`quantpress.targets.Source` over ``model`` computing on ``device`` with
    ``samples`` calibration rows of ``seqlen`` tokens from ``calib`` (None: the default text
    from ``cal_dir``), progress bars off."""
    from quantpress.targets import CalibOptions, ComputeOptions, Source

    return Source(model, ComputeOptions(device=device), CalibOptions(calib=calib, samples=samples, seqlen=seqlen),
                  progress=False, cal_dir=cal_dir)


def run_pass(options, model: Path, device: str, out: Path, samples: int, seqlen: int,
             calib: str | None, cal_dir: Path | None):
    """Make one verified output (``produce(options, ...)``) of ``model`` on ``device`` at
    ``out`` (replaced if present). Returns (its :class:`Summary`, wall seconds)."""
    from quantpress.targets import produce

    src = make_source(model, device, samples, seqlen, calib, cal_dir)
    t0 = time.perf_counter()
    summary = produce(options, src, out, force=True, progress=False)
    return summary, time.perf_counter() - t0


def compare_awq(dir_a: Path, dir_b: Path) -> dict:
    """Compare two AWQ GEMM directories linear by linear.

    Per quantized linear: ``max_abs_diff`` of the float16 dequantized weights [out, in]
    (:meth:`AWQWeights.dequantized`), ``max_step`` (largest float16 group scale of either),
    ``qweight_identical`` (fraction of identical int32 words of ``qweight``), and ``pass``:
    every weight within :data:`AWQ_MAX_STEPS` times the larger scale of its own group.
    Returns {"identical" (every file byte-identical), "pass", "tolerance", "files_identical",
    "linears": {...}}."""
    import torch
    from quantpress.convert.awq_dir import AWQWeights

    wa, wb = AWQWeights(dir_a), AWQWeights(dir_b)
    if wa.quantized != wb.quantized:
        raise CheckError(f"the AWQ outputs quantize different linears: {wa.quantized} vs {wb.quantized}")
    g = wa.group_size
    linears = {}
    for m in wa.quantized:
        da = wa.dequantized(m).float()
        db = wb.dequantized(m).float()
        sa = wa.raw.get(m + ".scales").float()
        sb = wb.raw.get(m + ".scales").float()
        step = torch.maximum(sa, sb).abs().repeat_interleave(g, dim=0).T  # [out, in]
        diff = (da - db).abs()
        qa, qb = wa.raw.get(m + ".qweight"), wb.raw.get(m + ".qweight")
        linears[m] = {"max_abs_diff": float(diff.max()), "max_step": float(step.max()),
                      "qweight_identical": float((qa == qb).float().mean()),
                      "pass": bool((diff <= AWQ_MAX_STEPS * step).all())}
    files_a, files_b = digests(dir_a), digests(dir_b)
    same = {f: files_a.get(f) == files_b.get(f) for f in sorted(set(files_a) | set(files_b))}
    ident = all(same.values())
    return {"identical": ident, "pass": all(v["pass"] for v in linears.values()),
            "tolerance": f"|W_a - W_b| <= {AWQ_MAX_STEPS:g} x max(scale_a, scale_b) of the group, per weight",
            "files_identical": same, "linears": linears}


def exl2_allocation(summary) -> list[dict]:
    """The option chosen per layer in an EXL2 :class:`Summary` (``details["layers"]``):
    [{"layer", "attn", "mlp", "attn_setting", "mlp_setting"}] without the content shares."""
    keep = ("layer", "attn", "mlp", "attn_setting", "mlp_setting")
    return [{k: row[k] for k in keep if k in row} for row in summary.details.get("layers", [])]


def source_weights(model: Path, names: list[str]) -> dict:
    """The float32 ``<name>.weight`` tensors [out, in] of an HF model directory
    (:class:`quantpress.convert.hf.HFModel`), for the linears ``names``; a tied ``lm_head``
    is the token embedding. CheckError naming the first one missing."""
    from quantpress.convert.hf import HFModel

    hf = HFModel(model)
    have = set(hf.names)
    out = {}
    for n in names:
        key = f"{n}.weight"
        if key not in have and n == "lm_head":
            key = "model.embed_tokens.weight"
        if key not in have:
            raise CheckError(f"{model}: no tensor '{n}.weight' in its safetensors files")
        out[n] = hf.tensor(key).float()
    return out


def compare_exl2(dir_a: Path, dir_b: Path, alloc_a: list[dict], alloc_b: list[dict], model: Path) -> dict:
    """Compare two EXL2 directories of ``model`` linear by linear and their per-layer allocations.

    Per quantized linear: ``rel_err_a`` / ``rel_err_b``, the relative reconstruction error
    ||W_q - W||_F / ||W||_F of each output's float16 reconstructed weight [out, in]
    (:meth:`EXL2Weights.dequantized`) against the source weight W of ``model``; ``pass`` when
    they are within :data:`EXL2_REL_ERR` of each other (relative to the smaller); and, as
    figures, ``max_abs_diff`` between the two reconstructions (null when the shapes differ),
    ``max_step`` (largest ``q_scale_max`` of either, which bounds every group's scale) and
    ``q_weight_identical`` (fraction of identical packed int32 words; 0 when the layouts differ).
    Returns {"identical" (every file byte-identical and the same allocation), "pass" (same
    allocation and every linear passes), "allocation_identical", "layers_a", "layers_b",
    "tolerance", "files_identical", "linears"}. CheckError when the outputs quantize different
    linears or ``model`` lacks one of their weights."""
    from quantpress.convert.exl2_dir import EXL2Weights

    wa, wb = EXL2Weights(dir_a), EXL2Weights(dir_b)
    if wa.quantized != wb.quantized:
        raise CheckError(f"the EXL2 outputs quantize different linears: {wa.quantized} vs {wb.quantized}")
    source = source_weights(model, list(wa.quantized))
    linears = {}
    for m in wa.quantized:
        da = wa.dequantized(m).float()
        db = wb.dequantized(m).float()
        w = source[m]
        ea = float((da - w).norm() / w.norm()) if da.shape == w.shape else float("inf")
        eb = float((db - w).norm() / w.norm()) if db.shape == w.shape else float("inf")
        ta, tb = wa.q_tensors(m), wb.q_tensors(m)
        step = max(float(ta["q_scale_max"].float().abs().max()), float(tb["q_scale_max"].float().abs().max()))
        diff = float((da - db).abs().max()) if da.shape == db.shape else None
        qa, qb = ta["q_weight"], tb["q_weight"]
        words = float((qa == qb).float().mean()) if qa.shape == qb.shape else 0.0
        ok = math.isfinite(ea) and math.isfinite(eb) and abs(ea - eb) <= EXL2_REL_ERR * min(ea, eb)
        linears[m] = {"rel_err_a": ea, "rel_err_b": eb, "max_abs_diff": diff, "max_step": step,
                      "q_weight_identical": words, "pass": ok}
    files_a, files_b = digests(dir_a), digests(dir_b)
    same = {f: files_a.get(f) == files_b.get(f) for f in sorted(set(files_a) | set(files_b))}
    same_alloc = alloc_a == alloc_b
    return {"identical": all(same.values()) and same_alloc,
            "pass": same_alloc and all(v["pass"] for v in linears.values()),
            "allocation_identical": same_alloc, "layers_a": alloc_a, "layers_b": alloc_b,
            "tolerance": (f"the same option per layer, and per linear relative errors ||W_q - W|| / ||W|| "
                          f"of A and B within {EXL2_REL_ERR:.0%} of each other"),
            "files_identical": same, "linears": linears}


def compare_stages(sa, sb, seconds_a: float, seconds_b: float) -> dict:
    """The stages of two runs of one output side by side: {"identical" (the same stages in the
    same order), "stages": {name: {"a": s, "b": s}}, "seconds": {"a", "b"} (wall seconds of
    the whole produce call)}; absent stages are null."""
    names = list(sa.stages) + [n for n in sb.stages if n not in sa.stages]
    return {"identical": list(sa.stages) == list(sb.stages),
            "stages": {n: {"a": _r(sa.stages.get(n)), "b": _r(sb.stages.get(n))} for n in names},
            "seconds": {"a": _r(seconds_a), "b": _r(seconds_b)}}


def _r(v):
    return None if v is None else round(float(v), 4)


# ---- 3. the batch -----------------------------------------------------------------------------

def write_job(path: Path, model: Path, device: str, samples: int, seqlen: int, calib: str | None,
              eval_ctx: int, eval_chunks: int) -> Path:
    """The job file of ``tests/test_batch.py`` (model "tiny": GGUF Q4_K_M and Q8_0, imatrix,
    AWQ g64, EXL2 4.0 and 5.0 with head_bits 8, eval) for ``model`` on ``device``, with
    ``samples`` x ``seqlen`` calibration tokens of ``calib`` (None: the default text, which
    then also serves the evaluation) and evaluation ``eval_ctx`` tokens x ``eval_chunks``."""
    calib_tbl = f"samples = {samples}, seqlen = {seqlen}"
    eval_tbl = f"ctx = {eval_ctx}, chunks = {eval_chunks}"
    if calib is not None:
        calib_tbl += f", calib = {json.dumps(str(calib))}"
        eval_tbl += f", text = {json.dumps(str(calib))}"
    path.write_text(f"""[defaults]
device = {json.dumps(device)}
calib = {{ {calib_tbl} }}

[[model]]
source = {json.dumps(str(model))}
name = "tiny"
gguf = ["Q4_K_M", "Q8_0"]
imatrix = true
awq = [{{ group_size = 64 }}]
exl2 = [{{ bpw = 4.0 }}, {{ bpw = 5.0, head_bits = 8 }}]
eval = {{ {eval_tbl} }}
""")
    return path


def run_batch(job: Path, out: Path, timeout_s: float) -> dict:
    """``python -m quantpress quantize batch JOB -o OUT --quiet --json`` in a subprocess.
    Returns {"exit_code", "seconds" (wall), "rows" (the JSON rows printed), "stderr_tail"} and,
    when the manifest exists, "manifest" (output path -> {"roundtrip", "files" sha256,
    "eval"})."""
    cmd = [sys.executable, "-m", "quantpress", "quantize", "batch", str(job), "-o", str(out),
           "--quiet", "--json"]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        code, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = "timeout", "", f"timed out after {timeout_s} s: {e}"
    seconds = time.perf_counter() - t0
    try:
        rows = json.loads(stdout) if stdout.strip() else []
    except json.JSONDecodeError:
        rows = [{"unparsed_stdout": stdout[-2000:]}]
    res = {"exit_code": code, "seconds": round(seconds, 3), "rows": rows,
           "stderr_tail": stderr[-2000:]}
    manifest = out / "tiny" / "manifest.json"
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        res["manifest"] = {o["path"]: {"roundtrip": o.get("roundtrip"), "files": o.get("files", {}),
                                       "eval": o.get("eval")} for o in m.get("outputs", [])}
    return res


def compare_imatrix(file_a: Path, file_b: Path) -> dict:
    """Two GGUF imatrix files of the same model: {"identical" (byte-identical), "pass" (the
    same tensors, counts equal, every importance within :data:`IMATRIX_REL` of the other's,
    relative to the larger), "tensors", "counts_equal", "max_rel_diff" (over every value of
    every tensor), "worst" (its tensor), "tolerance"}. Importances are
    :meth:`Imatrix.importance`'s in_sum2 / count."""
    import numpy as np
    from quantpress.convert.imatrix_file import read_imatrix

    ia, ib = read_imatrix(file_a), read_imatrix(file_b)
    names_equal = sorted(ia.sums) == sorted(ib.sums)
    counts_equal = names_equal and all(np.array_equal(ia.counts[n], ib.counts[n]) for n in ia.counts)
    worst, worst_name = 0.0, None
    if names_equal:
        pa, pb = ia.importance(), ib.importance()
        for n in sorted(pa):
            if pa[n].shape != pb[n].shape:
                worst, worst_name = math.inf, n
                break
            big = np.maximum(np.abs(pa[n]), np.abs(pb[n]))
            rel = np.abs(pa[n] - pb[n]) / np.where(big > 0, big, 1)
            m = float(rel.max()) if rel.size else 0.0
            if not m <= worst:                              # (NaN counts as the worst)
                worst, worst_name = m, n
    same = file_a.read_bytes() == file_b.read_bytes()
    return {"identical": same, "pass": names_equal and counts_equal and worst <= IMATRIX_REL,
            "tensors": len(ia.sums), "names_equal": names_equal, "counts_equal": counts_equal,
            "max_rel_diff": worst, "worst": worst_name,
            "tolerance": f"same tensors and counts, importances within {IMATRIX_REL:g} (relative)"}


def exl2_dir_allocation(path: Path) -> list[dict]:
    """What an EXL2 directory chose per quantized linear: [{"linear", "q_groups" (exllamav2's
    (bits, first row) pairs of its groups)}], in the directory's order; for
    :func:`compare_exl2` where no :class:`Summary` is at hand (the batch's outputs)."""
    from quantpress.convert.exl2_dir import EXL2Weights

    w = EXL2Weights(path)
    try:
        return [{"linear": m, "q_groups": w.q_tensors(m)["q_groups"].tolist()} for m in w.quantized]
    finally:
        w.close()


def compare_outputs(path: str, dir_a: Path, dir_b: Path, model: Path) -> dict | None:
    """One batch output that differs between the devices (``path`` under ``dir_a`` and
    ``dir_b``), compared by its kind: an imatrix (:func:`compare_imatrix`), an EXL2 directory
    (:func:`compare_exl2`, the allocation read from the directories), an AWQ directory
    (:func:`compare_awq`); None for the others (GGUF files, quantized with each device's
    imatrix; measurement.json)."""
    from quantpress.convert.awq_dir import is_awq_dir
    from quantpress.convert.exl2_dir import is_exl2_dir

    fa, fb = dir_a / path, dir_b / path
    if path.endswith(".imatrix.gguf"):
        return compare_imatrix(fa, fb)
    if fa.is_dir() and is_exl2_dir(fa):
        return compare_exl2(fa, fb, exl2_dir_allocation(fa), exl2_dir_allocation(fb), model)
    if fa.is_dir() and is_awq_dir(fa):
        return compare_awq(fa, fb)
    return None


def compare_batches(a: dict, b: dict, dir_a: Path | None = None, dir_b: Path | None = None,
                    model: Path | None = None) -> dict:
    """Check 3 from two :func:`run_batch` results: {"identical" (every output's files have
    the same SHA-256 on both), "pass" (:data:`BATCH_TOLERANCE`), "outputs_identical":
    {path: bool}, "compared": {path: the comparison of :func:`compare_outputs`} for the
    outputs made on both whose files differ (with ``dir_a``/``dir_b``, the model's output
    folders, and ``model``, its source directory), "eval": {path: {"kld_a", "kld_b",
    "rel_diff"}} for the outputs both evaluated, "a", "b"} (the manifests' checksums are
    dropped from "a" and "b")."""
    ma, mb = a.get("manifest", {}), b.get("manifest", {})
    paths = sorted(set(ma) | set(mb))
    same = {p: p in ma and p in mb and ma[p]["files"] == mb[p]["files"] and bool(ma[p]["files"])
            for p in paths}

    def ok(r: dict) -> bool:
        return r["exit_code"] == 0 and bool(r["rows"]) and all(row.get("status") == "made" for row in r["rows"])

    def slim(r: dict) -> dict:
        d = {k: v for k, v in r.items() if k != "manifest"}
        d["eval"] = {p: v["eval"] for p, v in r.get("manifest", {}).items()}
        return d

    compared = {}
    if dir_a is not None and dir_b is not None:
        for p in paths:
            if not same[p] and p in ma and p in mb and ma[p]["files"] and mb[p]["files"]:
                c = compare_outputs(p, dir_a, dir_b, model)
                if c is not None:
                    compared[p] = c
    evals = {}
    for p in paths:
        ea, eb = (m.get(p, {}).get("eval") or {} for m in (ma, mb))
        if isinstance(ea.get("kld"), (int, float)) and isinstance(eb.get("kld"), (int, float)):
            ka, kb = float(ea["kld"]), float(eb["kld"])
            big = max(abs(ka), abs(kb))
            evals[p] = {"kld_a": ka, "kld_b": kb, "rel_diff": abs(ka - kb) / big if big > 0 else 0.0}
    return {"identical": bool(paths) and all(same.values()),
            "pass": ok(a) and ok(b) and all(c["pass"] for c in compared.values()),
            "tolerance": BATCH_TOLERANCE, "outputs_identical": same, "compared": compared,
            "eval": evals, "a": slim(a), "b": slim(b)}


# ---- inputs -----------------------------------------------------------------------------------

def calibration_text(calib: str | None) -> tuple[str | None, Path | None]:
    """The calibration and evaluation text of the model checks, ``(calib, cal_dir)``: the file
    ``--calib`` names (resolved), or None and the directory of exllamav2's ``standard_cal_data``,
    the default text of every quantpress command (:func:`quantpress.targets.source.default_cal_dir`:
    the cache's copy, else fetched into the cache). CheckError when the file is missing or the
    default text can be neither found nor fetched."""
    from quantpress.errors import InputError
    from quantpress.targets.source import default_cal_dir

    if calib is not None:
        if not Path(calib).is_file():
            raise CheckError(f"--calib {calib}: no such file")
        return str(Path(calib).resolve()), None
    try:
        return None, default_cal_dir()
    except InputError as e:
        raise CheckError(f"no calibration text: {e} (python -m quantpress.assets cal-data fills "
                         f"the cache where the network is reachable)") from None


def find_tokenizer(given: str | None) -> Path:
    """A directory holding the SmolLM2 tokenizer files: ``given``, else quantpress's cached
    SmolLM2 directory, else :func:`quantpress.assets.smollm2_dir` (downloads: needs the
    network). CheckError when ``given`` has no tokenizer.json."""
    from quantpress import assets

    if given is not None:
        if not (Path(given) / "tokenizer.json").is_file():
            raise CheckError(f"--tokenizer {given}: no tokenizer.json there")
        return Path(given)
    cached = assets.cache_root() / "models" / "SmolLM2-135M-Instruct"
    if (cached / "tokenizer.json").is_file():
        return cached
    return assets.smollm2_dir()


def build_tiny_model(out: Path, tokenizer_dir: Path, layers: int = 2) -> Path:
    """A random llama with ``layers`` decoder layers (hidden 256, GQA, untied, float16) saved
    at ``out`` with the tokenizer of ``tokenizer_dir``: ``tests/synth.py``'s ``make_model``
    (:func:`bench_common.tiny_llama`)."""
    return tiny_llama(out, tokenizer_dir, layers)


@contextlib.contextmanager
def hessian_noise(eps: float):
    """While active (``eps`` > 0): every Hessian H [K, K] that the EXL2 measurement and
    quantization factor (``quantize.gptq.hessian_factor``, as ``calibration.exl2_measure``
    imports it) is replaced by H * (1 + eps * N) elementwise, N a symmetric standard normal
    matrix seeded by K, computed in float64 and rounded to float32. A stand-in, on the CPU, for
    the Hessians another device sums in another order. ``eps`` = 0: no change."""
    if eps <= 0:
        yield
        return
    import torch
    import quantpress.calibration.exl2_measure as measure
    import quantpress.quantize.gptq as gptq

    real = gptq.hessian_factor

    def noisy(hessian, K, *a, **kw):
        if hessian is not None:
            gen = torch.Generator().manual_seed(K)
            n = torch.randn(tuple(hessian.shape), generator=gen, dtype=torch.float64)
            n = ((n + n.T) / 2).to(hessian.device)
            hessian = (hessian.double() * (1 + eps * n)).float()
        return real(hessian, K, *a, **kw)

    gptq.hessian_factor = measure.hessian_factor = noisy
    try:
        yield
    finally:
        gptq.hessian_factor = measure.hessian_factor = real


# ---- driver -----------------------------------------------------------------------------------

CHECKS = ("ggml", "awq", "exl2", "batch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(description="quantpress on the CPU (device A) against device B "
                                            "(CUDA by default): bit-exactness, tolerances, timings")
    p.add_argument("--out", default="gpu_report.json", help="JSON report (default gpu_report.json)")
    p.add_argument("--device-b", default="cuda", help="device B: cuda (default), cuda:N, or cpu for a "
                                                      "CPU-only smoke test of the script")
    p.add_argument("--model", help="HF model directory (default: a random 2-layer llama)")
    p.add_argument("--tokenizer", help="tokenizer directory for the random llama (default: the "
                                       "cached SmolLM2 one)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the random llama (2)")
    p.add_argument("--calib", help="calibration and evaluation text file (default: exllamav2's "
                                   "wiki.utf8 split, from quantpress's cache or fetched into it)")
    p.add_argument("--samples", type=int, default=4, help="calibration rows (4)")
    p.add_argument("--seqlen", type=int, default=64, help="tokens per calibration row (64)")
    p.add_argument("--eval-ctx", type=int, default=64, help="batch eval: tokens per chunk (64)")
    p.add_argument("--eval-chunks", type=int, default=2, help="batch eval: chunks (2)")
    p.add_argument("--types", help="comma-separated ggml types (default: every registered type)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"ggml tensors, RxC,... ({DEFAULT_SHAPES})")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per ggml type and shape (best kept)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"subset of {','.join(CHECKS)} "
                                                              "(stages come with awq/exl2)")
    p.add_argument("--batch-timeout", type=float, default=600, help="seconds per batch run (600)")
    p.add_argument("--work", help="keep the outputs in this directory (default: a temporary one)")
    p.add_argument("--hessian-noise", type=float, default=0.0, metavar="EPS",
                   help="device B's EXL2 pass: every Hessian times 1 + EPS x N (N symmetric, standard "
                        "normal), to see what float32 sums in another order do to the exl2 check")
    p.add_argument("--compare-imatrix", nargs=2, type=Path, metavar=("A", "B"),
                   help="only compare two imatrix files as the batch check does (JSON on stdout)")
    return p.parse_args(argv)


def device_name(dev_b: str) -> str:
    """What device B is: the CUDA device's name, else the CPU's description."""
    import torch

    if dev_b.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(dev_b))
    return f"cpu ({platform.processor() or platform.machine()})"


class Report:
    """The JSON report, rewritten after every check so that a killed run leaves what it did."""

    def __init__(self, path: Path, head: dict):
        self.path = Path(path)
        self.data = {**head, "checks": {}, "seconds": 0.0}
        self.t0 = time.perf_counter()
        self.crashed = False

    def record(self, name: str, fn) -> object:
        """Run check ``fn()`` and store its dict under ``checks[name]``; an exception is stored
        as {"identical": false, "pass": false, "error", "traceback"} and marks the run crashed.
        Returns the result (None after an exception)."""
        t0 = time.perf_counter()
        try:
            res = fn()
        except Exception as e:  # recorded; the other checks still run
            self.crashed = True
            res = None
            self.data["checks"][name] = {"identical": False, "pass": False,
                                         "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc()[-4000:]}
        else:
            self.data["checks"][name] = res
        self.data["checks"][name]["check_seconds"] = round(time.perf_counter() - t0, 3)
        self.write()
        return res

    def write(self) -> None:
        """Write the report (indented JSON) with the seconds elapsed so far."""
        self.data["seconds"] = round(time.perf_counter() - self.t0, 3)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def run_checks(args: argparse.Namespace, work: Path, report: Report) -> None:
    """Every requested check into ``report``, outputs under ``work``."""
    from quantpress.targets import AWQOptions, EXL2Options

    dev_a, dev_b = "cpu", args.device_b
    wanted = {c.strip() for c in args.checks.split(",") if c.strip()}
    unknown = wanted - set(CHECKS)
    if unknown:
        raise CheckError(f"--checks: unknown {sorted(unknown)}; choose from {', '.join(CHECKS)}")

    if "ggml" in wanted:
        types = None if not args.types else [t.strip() for t in args.types.split(",") if t.strip()]
        report.record("ggml", lambda: check_ggml(types, parse_shapes(args.shapes), dev_a, dev_b,
                                                 args.repeat))
    if not wanted & {"awq", "exl2", "batch"}:
        return

    # inputs of the model checks
    if args.model:
        model = Path(args.model).resolve()
        report.data["model"] = str(model)
    else:
        tok = find_tokenizer(args.tokenizer)
        model = build_tiny_model(work / "tiny-llama", tok, args.layers)
        report.data["model"] = f"random llama, {args.layers} layers, tokenizer of {tok}"
    calib, cal_dir = calibration_text(args.calib)
    report.data["calibration"] = {"text": calib or f"{cal_dir}/wiki.utf8 (default split)",
                                  "samples": args.samples, "seqlen": args.seqlen}
    report.write()

    def pair(kind: str, options):
        runs = {}
        for side, dev in (("a", dev_a), ("b", dev_b)):
            with hessian_noise(args.hessian_noise if side == "b" else 0.0):
                runs[side] = run_pass(options, model, dev, work / f"{kind}-{side}", args.samples,
                                      args.seqlen, calib, cal_dir)
        return runs

    runs = {}
    if "awq" in wanted:
        def awq():
            runs["awq"] = pair("awq", AWQOptions(group_size=64))
            return compare_awq(work / "awq-a", work / "awq-b")
        report.record("awq", awq)
    if "exl2" in wanted:
        def exl2():
            runs["exl2"] = pair("exl2", EXL2Options(bpw=4.0))
            (sa, _), (sb, _) = runs["exl2"]["a"], runs["exl2"]["b"]
            return compare_exl2(work / "exl2-a", work / "exl2-b", exl2_allocation(sa), exl2_allocation(sb),
                                model)
        report.record("exl2", exl2)
    if runs:
        def stages():
            res = {kind: compare_stages(r["a"][0], r["b"][0], r["a"][1], r["b"][1]) for kind, r in runs.items()}
            return {"identical": all(v["identical"] for v in res.values()),
                    "pass": all(v["identical"] for v in res.values()),
                    "tolerance": "the same stages in the same order (seconds recorded)", **res}
        report.record("stages", stages)
    if "batch" in wanted:
        def batch():
            res = {}
            for side, dev in (("a", dev_a), ("b", dev_b)):
                job = write_job(work / f"jobs-{side}.toml", model, dev, args.samples, args.seqlen,
                                calib, args.eval_ctx, args.eval_chunks)
                out = work / f"batch-{side}"
                shutil.rmtree(out, ignore_errors=True)
                res[side] = run_batch(job, out, args.batch_timeout)
            return compare_batches(res["a"], res["b"], work / "batch-a" / "tiny", work / "batch-b" / "tiny",
                                   model)
        report.record("batch", batch)


def main(argv: list[str] | None = None) -> int:
    """Entry point: 0 report written, 1 a crash (recorded in the report when it got that far),
    2 device B is CUDA and CUDA is not available."""
    args = parse_args(argv)
    if args.compare_imatrix:
        print(json.dumps(compare_imatrix(*args.compare_imatrix), indent=1))
        return 0
    import torch

    if args.device_b.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: CUDA is not available (torch {torch.__version__} sees no GPU); "
              f"use --device-b cpu for a CPU-only smoke test", file=sys.stderr)
        return 2
    head = {"device": device_name(args.device_b), "torch": torch.__version__,
            "cuda": torch.version.cuda, "devices": {"a": "cpu", "b": args.device_b},
            "python": platform.python_version(), "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]}
    report = Report(Path(args.out), head)
    tmp = None
    try:
        if args.work:
            work = Path(args.work)
            work.mkdir(parents=True, exist_ok=True)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="quantpress-gpu-")
            work = Path(tmp.name)
        run_checks(args, work, report)
    except Exception as e:
        report.crashed = True
        report.data["error"] = f"{type(e).__name__}: {e}"
        report.data["traceback"] = traceback.format_exc()[-4000:]
    finally:
        report.write()
        if tmp is not None:
            tmp.cleanup()
    checks = report.data["checks"]
    summary = ", ".join(f"{k} {'identical' if v.get('identical') else ('pass' if v.get('pass') else 'FAIL')}"
                        for k, v in checks.items())
    print(f"{report.path}: {summary or 'no checks'} ({report.data['seconds']:.1f} s)")
    if report.crashed:
        print(f"error: {report.data.get('error') or 'a check crashed (see its error in the report)'}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
