"""``quantize exl2``: an HF model directory → a verified EXL2 (exllamav2 0.3.2) directory.

Stages (specs/exl2.md §1; exllamav2 0.3.2 ``convert.py``):

1. **calibration**: token rows (:func:`cli.calib_pipeline.calibration_rows`; default text the
   calibration split of exllamav2's wiki.utf8). The same rows serve both passes (exllamav2
   draws 16 measurement rows and 115 quantization rows from its built-in mix).
2. **measurement** (:class:`calibration.exl2_measure.Measurer`): every attention / MLP option
   scored on reference hidden states → measurement.json (§2). ``--measure-only FILE`` writes it
   and stops; ``--measurement FILE`` reuses one (exllamav2's ``-om`` / ``-m``), validated
   against the model (layer count, every option's total_bits against this model's shapes).
3. **allocation** (:func:`calibration.exl2_alloc.allocate`): one option per module under the
   budget ``int(decoder numel × bpw)`` bits (§4; exact knapsack instead of annealing). The
   default objective ``"content"`` minimizes Σ (err / ρ)², ρ the share of each module
   output's norm carried by ordinary (non-sink) tokens
   (:func:`calibration.exl2_measure.content_share`): ρ comes from the measurement pass, or,
   with ``--measurement``, from one unquantized forward pass over the calibration rows
   (:class:`calibration.exl2_measure.ContentProbe`); measurement.json keeps exllamav2's
   schema, so a file written by exllamav2 works too.
4. **quantization** (:class:`calibration.exl2_measure.Quantizer`): sequential GPTQ with error
   propagation, then the head at ``--head-bits``.
5. **write** (:class:`convert.exl2_dir.EXL2DirWriter`): part files per layer in a temporary
   sibling directory, then ``output.safetensors`` / shards, the copied files, config.json.
6. **verify** (the round trip, part of the command): every linear re-read from the final
   files, checked against the kernel's constraints and reconstructed by
   :func:`quantize.exl2.reconstruct`; its SHA-256 must equal the quantizer's fake-quantized
   float16 weight's. Then the directory is renamed into place. A failure raises RuntimeError
   (exit 3) and leaves nothing.
"""
from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from calibration import engine
from calibration import exl2_alloc as alloc
from calibration import exl2_measure as cm
from calibration import exl2_measurement as mfile
from cli import calib_pipeline as cp
from cli.common import check_output, check_output_dir
from convert import awq_dir, exl2_dir
from convert.shards import float16_rows
from quantize import exl2 as qexl2
from quantize.errors import InputError

HEAD_BITS = (2, 3, 4, 5, 6, 8)
#: the achieved decoder bpw lies in [target − BPW_WINDOW, target] (dearer options are taken
#: when the optimum of the objective spends less)
BPW_WINDOW = 0.05
#: what each ``--objective`` minimizes, in words (summary text)
OBJECTIVE_TEXT = {"content": "sum of squared module errors relative to the non-sink tokens' norm",
                  "sum": "sum of module errors", "max": "maximum module error"}


@dataclass
class EXL2Summary:
    """What ``quantize exl2`` did.

    ``detail``: seconds in GPTQ and in forwards / Hessians within the measurement and
    quantization stages, and in the unquantized forward pass that the ``"content"`` objective
    runs within the allocation stage when a measurement is reused. ``decoder_bits`` / ``decoder_numel``: §3 cost of the chosen options (bits) and the
    decoder parameter count of the budget (out_features padded to 32); ``decoder_bpw`` their
    ratio (exllamav2's ``bits``). ``tensor_bytes`` / ``parameters``: bytes of every tensor
    written and parameters of the source checkpoint; ``file_bpw`` = 8·bytes / parameters
    (embeddings, norms and head included). ``choices``: per layer (attn option, mlp option)
    indices; ``options``: their settings in spec notation. ``stages``: seconds per stage.
    ``objective``: the allocation objective (:data:`calibration.exl2_alloc.OBJECTIVE_MODES`);
    ``err_sum`` / ``err_max``: Σ and max of the chosen options' measured err = 1 − accuracy;
    ``objective_value``: what the allocation minimized (Σ (err / ρ)² for ``"content"``);
    ``content``: per layer (ρ attn, ρ mlp) for ``"content"`` (else empty)."""

    out: Path | None
    target_bpw: float | None
    head_bits: int
    measurement: str
    rows: int
    seqlen: int
    num_layers: int
    decoder_numel: int = 0
    decoder_bits: int = 0
    tensor_bytes: int = 0
    parameters: int = 0
    choices: list = field(default_factory=list)
    options: list = field(default_factory=list)
    err_sum: float = 0.0
    err_max: float = 0.0
    head: str = ""
    seconds: float = 0.0
    stages: dict = field(default_factory=dict)
    roundtrip: str = ""
    measure_only: bool = False
    objective: str = alloc.DEFAULT_OBJECTIVE
    detail: dict = field(default_factory=dict)
    content: list = field(default_factory=list)
    objective_value: float = 0.0

    @property
    def decoder_bpw(self) -> float:
        """Achieved decoder bits per weight (the allocation's cost / decoder numel)."""
        return self.decoder_bits / max(1, self.decoder_numel)

    @property
    def file_bpw(self) -> float:
        """Bits per weight of the whole file (embeddings, norms, head included)."""
        return 8 * self.tensor_bytes / max(1, self.parameters)

    def to_json(self) -> dict:
        """The summary as a JSON-able dict."""
        d = {"output": str(self.out) if self.out else None, "measurement": self.measurement,
             "calibration": {"rows": self.rows, "seqlen": self.seqlen},
             "num_layers": self.num_layers, "seconds": round(self.seconds, 2),
             "stages": {k: round(v, 2) for k, v in self.stages.items()},
             "detail": {k: round(v, 2) for k, v in self.detail.items()}}
        if self.measure_only:
            d["measure_only"] = True
            return d
        d.update({"target_bpw": self.target_bpw, "head_bits": self.head_bits,
                  "decoder_bpw": round(self.decoder_bpw, 4), "decoder_bits": self.decoder_bits,
                  "decoder_numel": self.decoder_numel, "file_bpw": round(self.file_bpw, 4),
                  "tensor_bytes": self.tensor_bytes, "parameters": self.parameters,
                  "objective": self.objective, "objective_value": self.objective_value,
                  "err_sum": self.err_sum, "err_max": self.err_max, "head": self.head,
                  "layers": [{"layer": i, "attn": a, "mlp": m, "attn_setting": sa, "mlp_setting": sm,
                              **({"share_attn": sc[0], "share_mlp": sc[1]} if sc else {})}
                             for i, ((a, m), (sa, sm), sc) in enumerate(
                                 zip(self.choices, self.options,
                                     self.content or [None] * len(self.choices)))],
                  "roundtrip": self.roundtrip})
        return d

    def text(self) -> str:
        """Human-readable summary."""
        st = ", ".join(f"{k} {v:.1f} s" for k, v in self.stages.items())
        if self.measure_only:
            return "\n".join([f"wrote measurement {self.measurement} ({self.num_layers} layers)",
                              f"  calibration: {self.rows} rows x {self.seqlen} tokens",
                              f"  time {self.seconds:.1f} s ({st})"])
        lines = [f"wrote {self.out}",
                 f"  EXL2 {self.target_bpw} bpw target, head {self.head_bits} bits: decoder "
                 f"{self.decoder_bpw:.4f} bpw ({self.decoder_bits} bits / {self.decoder_numel} "
                 f"weights), whole file {self.file_bpw:.3f} bpw ({self.tensor_bytes / 2 ** 20:.1f} MiB)",
                 f"  measurement: {self.measurement}; allocation objective '{self.objective}' "
                 f"({OBJECTIVE_TEXT[self.objective]}) = {self.objective_value:.5f}; module errors: "
                 f"sum {self.err_sum:.5f}, max {self.err_max:.5f}",
                 f"  calibration: {self.rows} rows x {self.seqlen} tokens",
                 "  options per layer (attn / mlp):"]
        for i, ((a, m), (sa, sm)) in enumerate(zip(self.choices, self.options)):
            lines.append(f"    {i:3d}: attn {a:2d} [{sa}]  mlp {m:2d} [{sm}]")
        dt = ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in self.detail.items())
        lines += [f"  head: {self.head}",
                  f"  time {self.seconds:.1f} s ({st})" + (f"\n    of which {dt}" if dt else ""),
                  f"  round trip: {self.roundtrip}"]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Model shapes and input checks

def linear_shapes(sm: engine.StreamingModel) -> dict[str, tuple[int, int, bool]]:
    """``{linear name: (in_features, out_features, has_bias)}`` of the decoder layers (read from
    the meta skeleton, no weights). InputError when a layer lacks a linear or the layers differ
    (EXL2 needs the llama-like q/k/v/o + gate/up/down layout)."""
    shapes = None
    for i, layer in enumerate(sm._decoder.layers):
        s = {}
        for mode, names in cm.MODULES.items():
            for n in names:
                lin = cm.linear_of(layer, mode, n, i)
                s[n] = (int(lin.in_features), int(lin.out_features), lin.bias is not None)
        if shapes is None:
            shapes = s
        elif s != shapes:
            raise InputError(f"{sm.dir}: decoder layer {i} has linear shapes {s}, layer 0 has "
                             f"{shapes}; EXL2 measurement needs identical layers")
    if shapes is None:
        raise InputError(f"{sm.dir}: the model has no decoder layers")
    return shapes


def check_in_features(shapes: dict, head_in: int, model_dir: Path) -> None:
    """Every quantized linear's in_features must be a multiple of 32 (group and bit-segment
    boundaries) and at most 65535 (the loader's int16 permutation). InputError naming it."""
    for name, k in [(n, s[0]) for n, s in shapes.items()] + [("lm_head", head_in)]:
        if k > qexl2.MAX_IN_FEATURES:
            raise InputError(f"{model_dir}: {name} has in_features {k} > {qexl2.MAX_IN_FEATURES}; "
                             f"exllamav2's kernel cannot load it")
        if k % 32:
            raise InputError(f"{model_dir}: {name} has in_features {k}, not a multiple of 32; "
                             f"EXL2 groups need multiples of 32 input rows")


def cost_slots(shapes: dict, num_layers: int) -> list[list[tuple[int, float]]]:
    """Per slot (attn, mlp per layer), the §3 costs of the candidate options for these shapes
    (err 0): the reachable bpw range before anything is measured."""
    cost = mfile.module_cost_fn(shapes)
    a = [(cost({n: qp.as_dict() for n, qp in o.items()}, "attn"), 0.0) for o in qexl2.attn_options()]
    m = [(cost({n: qp.as_dict() for n, qp in o.items()}, "mlp"), 0.0) for o in qexl2.mlp_options()]
    return [a, m] * num_layers


def check_target(bpw: float, slots, numel: int) -> int:
    """The budget in bits for ``bpw``; InputError stating the reachable range when ``bpw`` is
    outside it (rounded inwards to 2 decimals, so every printed value is reachable)."""
    budget = alloc.budget_bits(bpw, numel)
    lo, hi = alloc.reachable_bits(slots)
    if not lo <= budget <= hi:
        rlo, rhi = math.ceil(lo / numel * 100) / 100, math.floor(hi / numel * 100) / 100
        raise InputError(f"--bpw {bpw}: outside the reachable range [{rlo:.2f}, {rhi:.2f}] bpw "
                         f"of this model's decoder layers (all cheapest / all most expensive options)")
    return budget


def _head_qparams(head_bits) -> qexl2.QParams:
    try:
        hb = int(head_bits)
        if hb != head_bits or hb not in HEAD_BITS:
            raise ValueError
        return qexl2.head_options(hb)
    except (ValueError, TypeError):
        raise InputError(f"--head-bits {head_bits}: choose one of "
                         f"{', '.join(map(str, HEAD_BITS))}") from None


# --------------------------------------------------------------------------------------------
# The pipeline

def quantize_exl2(model: str | Path, out: str | Path | None = None, bpw: float | None = None,
                  head_bits: int = 6, measurement: str | Path | None = None,
                  measure_only: str | Path | None = None, calib: str | Path | None = None,
                  calib_field: str = "text", samples: int = 128, seqlen: int = 512, seed: int = 0,
                  device: str = "auto", dtype: str | None = None,
                  batch_tokens: int = cp.DEFAULT_BATCH_TOKENS,
                  max_shard_size: float = exl2_dir.DEFAULT_SHARD_MB, force: bool = False,
                  progress: bool = True, cal_dir: str | Path | None = None,
                  objective: str = alloc.DEFAULT_OBJECTIVE) -> EXL2Summary:
    """Quantize the HF model directory ``model`` to EXL2 at ``bpw`` decoder bits per weight
    (head at ``head_bits``) into the directory ``out``; or, with ``measure_only``, only write
    the measurement there.

    ``measurement``: reuse this measurement.json (no measurement pass; without it, the
    measurement made is also written to ``out/measurement.json`` for later targets). Calibration:
    ``samples`` rows × ``seqlen`` tokens of ``calib`` (default: exllamav2's wiki.utf8 split),
    forwards in ``dtype`` (default float32) on ``device`` with ``batch_tokens`` tokens per
    batch. ``max_shard_size``: MB per output file (exllamav2 ``-ss``; 0 = one file).
    ``objective``: the allocation's: ``"content"`` (default; Σ (err / ρ)², ρ each module
    output's non-sink share, see :mod:`calibration.exl2_alloc`), ``"sum"`` (Σ err, as measured)
    or ``"max"`` (max err).
    An existing ``out`` (or measurement file) needs ``force``.

    Raises InputError for bad input, before anything is written: a bpw outside the reachable
    range (stated), head bits not in {2,3,4,5,6,8}, a measurement of another model (layer
    count, shapes) or a truncated one, in_features > 65535 or not a multiple of 32, too little
    calibration text, non-HF input. RuntimeError when the round trip fails (nothing is left).
    """
    t_start = time.perf_counter()
    cp.bound_heap()
    stages: dict[str, float] = {}
    src = Path(model)
    ld = cp.find_loader(src)
    if ld.kind != "hf":
        raise InputError(f"{src}: EXL2 needs a Hugging Face model directory (FP16/BF16/F32 "
                         f"safetensors), not a {ld.kind} input")
    if measure_only is not None and measurement is not None:
        raise InputError("--measure-only and --measurement exclude each other (one writes a "
                         "measurement, the other reuses one)")
    if measure_only is not None:
        mo_path = Path(measure_only)
        check_output(mo_path, force)
    else:
        if out is None:
            raise InputError("-o/--output is required (or --measure-only FILE)")
        if bpw is None:
            raise InputError("--bpw is required (or --measure-only FILE)")
        out = Path(out)
        check_output_dir(out, force)
    head_qp = _head_qparams(head_bits)
    max_shard = exl2_dir.shard_bytes(max_shard_size)
    cfg = ld.hf_config(src)
    if objective not in alloc.OBJECTIVE_MODES:
        raise InputError(f"objective {objective!r}: choose one of {', '.join(alloc.OBJECTIVE_MODES)}")

    dev = cp.pick_device(device)
    sm = ld.open(src, dev, cp.pick_dtype(dtype))
    L = sm.num_layers
    shapes = linear_shapes(sm)
    head_meta = sm._skel.get_output_embeddings()
    check_in_features(shapes, int(head_meta.in_features), src)
    numel = alloc.decoder_numel(L, {n: s[:2] for n, s in shapes.items()})
    budget = None
    if measure_only is None:
        try:
            bpw = float(bpw)
        except (TypeError, ValueError):
            raise InputError(f"--bpw {bpw!r}: expected a number") from None
        budget = check_target(bpw, cost_slots(shapes, L), numel)

    meas = None
    if measurement is not None:
        meas = mfile.read_measurement(measurement, expect_layers=L, expect_shapes=shapes)

    t0 = time.perf_counter()
    rows, source = cp.calibration_rows(src, calib, calib_field, samples, seqlen, seed, cal_dir, progress)
    bs = cp._rows_per_batch(batch_tokens, rows.shape[1])
    stages["calibration"] = time.perf_counter() - t0
    n_rows, n_len = int(rows.shape[0]), int(rows.shape[1])

    summary = EXL2Summary(out if measure_only is None else None, bpw, int(head_bits),
                          str(measurement) if measurement is not None else "measured", n_rows,
                          n_len, L, stages=stages)
    by_content, aggregate, power = alloc.OBJECTIVE_MODES[objective]
    shares: dict | None = None
    new_measurement = None
    if meas is None:
        t0 = time.perf_counter()
        modules, last_idx, mt, shares = measure(sm, rows, bs, progress)
        stages["measurement"] = time.perf_counter() - t0
        summary.detail.update(measurement_gptq=mt.gptq, measurement_forward=mt.forward)
        if measure_only is not None:
            mfile.write_measurement(mo_path, modules, last_idx)
            summary.measurement = str(mo_path)
            summary.measure_only = True
            summary.seconds = time.perf_counter() - t_start
            return summary
        mfile.validate_schema({"measurement": modules, "last_module_idx": last_idx},
                              source="measurement pass", expect_layers=L,
                              cost=mfile.module_cost_fn(shapes))
        meas = mfile.Measurement(modules, last_idx, L)
        new_measurement = (modules, last_idx)
    else:
        stages["measurement"] = 0.0

    t0 = time.perf_counter()
    slots = meas.slots()
    if by_content:
        if shares is None:
            t1 = time.perf_counter()
            shares = content_shares(sm, rows, bs, progress)
            summary.detail["allocation_forward"] = time.perf_counter() - t1
        rho = [shares[k] for k in meas.slot_keys()]
        summary.content = [(rho[2 * i], rho[2 * i + 1]) for i in range(L)]
        slots = alloc.content_slots(slots, rho)
    a = alloc.allocate(slots, budget, numel=numel, objective=aggregate, power=power,
                       min_bits=alloc.budget_bits(bpw - BPW_WINDOW, numel))
    strategy = meas.strategy(a.choice)
    stages["allocation"] = time.perf_counter() - t0
    errs = [s[j][1] for s, j in zip(meas.slots(), a.choice)]
    summary.decoder_bits, summary.decoder_numel = a.total_bits, numel
    summary.err_sum, summary.err_max, summary.objective = sum(errs), max(errs), objective
    summary.objective_value = a.objective_value if aggregate == "sum" else a.err_max
    summary.choices = [(a.choice[2 * i], a.choice[2 * i + 1]) for i in range(L)]
    summary.options = [tuple(_setting_text(strategy[mfile.layer_key(i, m)], cm.MODULES[m])
                             for m in ("self_attn", "mlp")) for i in range(L)]

    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    records: list[cm.LinearRecord] = []
    try:
        writer = exl2_dir.EXL2DirWriter(tmp, max_shard)
        t0 = time.perf_counter()
        emb = sm._embed_name + ".weight"
        writer.add({emb: float16_rows(sm.weights, emb)})

        def sink(index, tensors, recs):
            writer.add(tensors)
            records.extend(recs)

        q = cm.Quantizer(strategy, n_rows, sink, prefix=sm.layer_prefix)

        def on_layer(i, layer, inputs, outputs, ctx):
            y = q.on_layer(i, layer, inputs, outputs, ctx)
            cp.trim_heap()
            return y

        hidden = engine.run(sm, rows, hooks_factory=q.hooks, on_layer=on_layer, batch_size=bs,
                            progress=progress)
        tail: dict[str, torch.Tensor] = {}
        norm = sm._norm_name + ".weight"
        tail[norm] = cm._fp16_copy(sm.weights.get(norm, "cpu"), norm)
        head_rec = q.quantize_head(sm, hidden, head_qp, bs, tail)
        records.append(head_rec)
        del hidden
        writer.add(tail)
        sm.release()
        stages["quantization"] = time.perf_counter() - t0
        summary.detail.update(quantization_gptq=q.timings.gptq, quantization_forward=q.timings.forward)
        summary.head = (f"{head_rec.name} {head_rec.qparams} "
                        f"({'round-to-nearest' if _head_rtn(head_rec) else 'GPTQ'}), "
                        f"{head_rec.bits / (head_rec.shape[0] * head_rec.shape[1]):.3f} bpw")

        t0 = time.perf_counter()
        config = exl2_dir.exl2_config(cfg, bpw, int(head_bits), n_rows, n_len,
                                      None if calib is None else str(calib))
        writer.finish(config, src)
        if new_measurement is not None:  # kept with the model, as exllamav2 users publish it
            mfile.write_measurement(tmp / "measurement.json", *new_measurement)
        stages["write"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        summary.roundtrip = verify_exl2_dir(tmp, records, set(writer.sizes))
        stages["verify"] = time.perf_counter() - t0
        awq_dir.replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    summary.tensor_bytes = writer.total_bytes
    summary.parameters = sum(_numel_of(sm))
    summary.seconds = time.perf_counter() - t_start
    return summary


def _head_rtn(rec: cm.LinearRecord) -> bool:
    """Whether the head record was quantized by round-to-nearest (above 1e9 weights)."""
    return rec.shape[0] * rec.shape[1] > cm.RTN_HEAD_NUMEL


def _setting_text(option: dict, names) -> str:
    return ", ".join(f"{n.split('_')[0]} {qexl2.QParams.from_dict(option[n])}" for n in names)


def measure(sm: engine.StreamingModel, rows: torch.Tensor, batch_size: int,
            progress: bool = True) -> tuple[dict, int, cm.Timings, dict]:
    """The measurement pass over ``sm`` with calibration ``rows`` (int64 [rows, seqlen]):
    ``(measurement dict, last_module_idx)`` as measurement.json holds them, the seconds
    spent in GPTQ and in forwards, and each module output's content share ρ (measurement key
    → ρ, :func:`calibration.exl2_measure.content_share`)."""
    m = cm.Measurer(int(rows.shape[0]), prefix=sm.layer_prefix)

    def on_layer(i, layer, inputs, outputs, ctx):
        m.on_layer(i, layer, inputs, outputs, ctx)
        cp.trim_heap()

    engine.run(sm, rows, hooks_factory=m.hooks, on_layer=on_layer, batch_size=batch_size,
               progress=progress)
    meas, last = cm.measurement_dict(m.results, sm.num_layers, sm._norm_name, sm._lm_head_name)
    return meas, last, m.timings, m.content


def content_shares(sm: engine.StreamingModel, rows: torch.Tensor, batch_size: int,
                   progress: bool = True) -> dict[str, float]:
    """Each decoder module output's content share ρ (measurement key → ρ, dimensionless;
    :func:`calibration.exl2_measure.content_share`) from one unquantized forward pass over the
    calibration ``rows`` (int64 [rows, seqlen]): what the ``"content"`` objective needs when a
    measurement is reused."""
    p = cm.ContentProbe()
    engine.run(sm, rows, on_layer=p.on_layer, batch_size=batch_size, progress=progress)
    return p.results


def _numel_of(sm: engine.StreamingModel):
    """Parameter counts of the source checkpoint's tensors (without reading data)."""
    from safetensors import safe_open

    for f in sorted(set(sm.weights._files.values())):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                yield math.prod(h.get_slice(k).get_shape())


#: output rows reconstructed at a time by the round trip (a multiple of 32)
VERIFY_ROWS = 4096


def _reconstructed_digest(name: str, t: dict, shape: tuple[int, int]) -> str:
    """:func:`calibration.awq.tensor_digest` of the float16 weight [N, K] that
    :func:`quantize.exl2.reconstruct` makes of the stored tensors ``t``, computed
    :data:`VERIFY_ROWS` output rows (stored columns) at a time, so the head of a large
    vocabulary is never reconstructed whole. Raises RuntimeError on a shape mismatch."""
    import hashlib

    N, K = shape
    h = hashlib.sha256(f"{torch.float16}{(N, K)}".encode())
    for n0 in range(0, N, VERIFY_ROWS):
        n1 = min(N, n0 + VERIFY_ROWS)
        last = n1 == N
        qw = t["q_weight"][:, n0:] if last else t["q_weight"][:, n0:n1]
        qs = t["q_scale"][:, n0 // 8:] if last else t["q_scale"][:, n0 // 8:n1 // 8]
        deq = qexl2.reconstruct(qw, qs, t["q_scale_max"], t["q_groups"], t["q_invperm"], n1 - n0)
        if tuple(deq.shape) != (n1 - n0, K):
            raise RuntimeError(f"round trip: '{name}' rows {n0}..{n1 - 1} reconstruct to "
                               f"{tuple(deq.shape)}, expected {(n1 - n0, K)}")
        h.update(deq.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def verify_exl2_dir(path: Path, records: list[cm.LinearRecord], expected: set[str]) -> str:
    """Round trip of a written EXL2 directory: the final files must hold exactly the
    ``expected`` tensor names; every linear of ``records`` is read back, checked with
    :func:`quantize.exl2.check_kernel_constraints` and reconstructed by
    :func:`quantize.exl2.reconstruct`; the SHA-256 of the float16 result must equal the
    quantizer's (``record.digest``), and a linear with a bias must have it. Raises
    RuntimeError naming the first tensor that differs."""
    w = exl2_dir.EXL2Weights(path, {r.name: r.shape[0] for r in records})
    stored = set(w.raw.keys())
    if stored != expected:
        extra, missing = sorted(stored - expected), sorted(expected - stored)
        raise RuntimeError(f"round trip: {path} holds tensors {extra[:3]} not written and lacks "
                           f"{missing[:3]}")
    for r in records:
        if not w.is_quantized(r.name + ".weight"):
            raise RuntimeError(f"round trip: '{r.name}' has no q_weight in {path}")
        t = w.q_tensors(r.name)
        try:
            qexl2.check_kernel_constraints(t["q_weight"], t["q_scale"], t["q_scale_max"],
                                           t["q_groups"], t["q_invperm"])
        except ValueError as e:
            raise RuntimeError(f"round trip: '{r.name}' violates the EXL2 kernel's constraints: {e}") from None
        if t["q_invperm"].numel() != r.shape[1]:
            raise RuntimeError(f"round trip: '{r.name}.q_invperm' has {t['q_invperm'].numel()} rows, "
                               f"expected in_features {r.shape[1]}")
        if r.has_bias != (f"{r.name}.bias" in w.raw):
            raise RuntimeError(f"round trip: '{r.name}.bias' {'missing' if r.has_bias else 'unexpected'}")
        if _reconstructed_digest(r.name, t, tuple(r.shape)) != r.digest:
            raise RuntimeError(f"round trip failed: '{r.name}' reconstructed from {path} differs "
                               f"from the quantizer's fake-quantized weights")
    w.close()
    return f"ok ({len(records)} linears bit-identical to the fake-quantized weights, kernel constraints met)"
