"""EXL2 (exllamav2 0.3.2) outputs: ``quantize exl2 -o DIR --bpw B`` (a model directory) and
``quantize exl2 --measure-only FILE`` (measurement.json alone), as exllamav2 0.3.2's
``convert.py`` makes them (``-om`` / ``-m`` / ``-b``).

Stages of the directory:

1. **tokenize**: the :class:`~quantpress.targets.base.Source`'s calibration rows (default text:
   the calibration split of exllamav2's wiki.utf8). The same rows serve both passes (exllamav2
   draws 16 measurement rows and 115 quantization rows from its built-in mix).
2. **measurement** (:class:`quantpress.calibration.exl2_measure.Measurer`): every attention /
   MLP option scored on reference hidden states (exllamav2 ``conversion/measure.py``), unless
   :attr:`EXL2Options.measurement` names a measurement.json to reuse (validated against the
   model: layer count, every option's total_bits against this model's shapes).
3. **allocation** (:func:`quantpress.calibration.exl2_alloc.allocate`): one option per module
   under the budget ``int(decoder numel × bpw)`` bits (exact knapsack instead of exllamav2
   ``conversion/optimize.py``'s annealing). The default objective ``"content"`` minimizes
   Σ (err / ρ)², ρ the share of each module output's norm carried by ordinary (non-sink) tokens
   (:func:`quantpress.calibration.exl2_measure.content_share`): ρ comes from the measurement
   pass or, with a reused measurement, from one unquantized forward pass
   (:class:`quantpress.calibration.exl2_measure.ContentProbe`); measurement.json keeps
   exllamav2's schema, so a file written by exllamav2 works too.
4. **quantization** (:class:`quantpress.calibration.exl2_measure.Quantizer`): sequential GPTQ
   with error propagation (exllamav2 ``conversion/quantize.py``); **head**: lm_head at
   ``head_bits``, from the quantized model's last hidden states.
5. **write** (:func:`quantpress.convert.exl2_dir.dir_writer`): part files per layer, then
   ``output.safetensors`` / shards, the copied files, config.json, and measurement.json when it
   was measured (published EXL2 models carry it).
6. **verify**: every linear re-read from the final files, checked against the kernel's
   constraints and reconstructed by :func:`quantpress.quantize.exl2.reconstruct`; its SHA-256
   must equal the quantizer's fake-quantized float16 weight's.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpress.calibration import engine
from quantpress.calibration import exl2_alloc as alloc
from quantpress.calibration import exl2_measure as cm
from quantpress.calibration import exl2_measurement as mfile
from quantpress.convert import exl2_dir
from quantpress.errors import InputError, RoundTripError
from quantpress.quantize import exl2 as qexl2
from quantpress.memory import available_memory, bound_heap, trim_heap
from quantpress.targets import hfdir
from quantpress.targets.base import Run, Source, Summary, Target, WriterShare, reference_pass
from quantpress.targets.options import option
from quantpress.targets.registry import Estimate, Needs, Step, Verb

HEAD_BITS = (2, 3, 4, 5, 6, 8)
#: the achieved decoder bpw lies in [target − BPW_WINDOW, target] (dearer options are taken
#: when the optimum of the objective spends less)
BPW_WINDOW = 0.05
#: what each objective minimizes, in words (summary text)
OBJECTIVE_TEXT = {"content": "sum of squared module errors relative to the non-sink tokens' norm",
                  "sum": "sum of module errors", "max": "maximum module error"}
#: output rows reconstructed at a time by the round trip (a multiple of 32)
VERIFY_ROWS = 4096


@dataclass(frozen=True)
class EXL2Options:
    """``bpw``: target bits per weight of the decoder layers (exllamav2 ``-b``); ``head_bits``:
    lm_head bits (2, 3, 4, 5, 6 or 8; ``-hb``); ``measurement``: reuse this measurement.json
    (``-m``; None: measure); ``objective``: what the allocation minimizes (``content``,
    ``sum`` or ``max``, :data:`quantpress.calibration.exl2_alloc.OBJECTIVE_MODES`);
    ``max_shard_size``: MB per output file (``-ss``; 0 = one file)."""

    bpw: float = option(flag="--bpw", help="target bits per weight of the decoder layers "
                                           "(exllamav2 -b; required unless --measure-only)")
    head_bits: int = option(6, flag="--head-bits", help="lm_head bits: 2, 3, 4, 5, 6 or 8 (default {default})")
    # job files share one measurement per model (exl2_measurement), not one per table
    measurement: str | None = option(None, flag="--measurement", job=False,
                                     help="reuse this measurement.json (skips the measurement pass)")
    objective: str = option(alloc.DEFAULT_OBJECTIVE, flag="--objective", choices=tuple(alloc.OBJECTIVE_MODES),
                            help="bit allocation: minimize the sum of squared module errors relative "
                                 "to the norm of the non-sink tokens (content, default), the sum of "
                                 "exllamav2's module errors (sum) or their maximum (max, exllamav2's intent)")
    max_shard_size: float = option(exl2_dir.DEFAULT_SHARD_MB, flag="--max-shard-size",
                                   help="MB per output file (exllamav2 -ss; default {default}, 0 = one file)")

    def validate(self) -> None:
        """InputError naming the option: bpw not a positive number, head bits not in
        {2,3,4,5,6,8}, an unknown objective, a negative shard size."""
        if isinstance(self.bpw, bool) or not isinstance(self.bpw, (int, float)) \
                or not math.isfinite(self.bpw) or self.bpw <= 0:
            raise InputError(f"--bpw {self.bpw!r}: expected a positive number of bits per weight")
        head_qparams(self.head_bits)
        if self.objective not in alloc.OBJECTIVE_MODES:
            raise InputError(f"--objective {self.objective!r}: choose one of "
                             f"{', '.join(alloc.OBJECTIVE_MODES)}")
        exl2_dir.shard_bytes(self.max_shard_size)

    @property
    def label(self) -> str:
        """The target bpw as given ("4.0", "4.25")."""
        return f"{float(self.bpw)}"


@dataclass(frozen=True)
class EXL2MeasurementOptions:
    """``quantize exl2 --measure-only FILE``: the measurement pass alone, written as
    measurement.json (exllamav2 ``-om``). No options of its own: calibration and compute are
    the source's."""

    def validate(self) -> None:
        """Nothing to check."""


def head_qparams(head_bits) -> qexl2.QParams:
    """The head's setting for ``head_bits`` (:func:`quantpress.quantize.exl2.head_options`).
    InputError unless it is one of :data:`HEAD_BITS`."""
    try:
        hb = int(head_bits)
        if hb != head_bits or hb not in HEAD_BITS:
            raise ValueError
        return qexl2.head_options(hb)
    except (ValueError, TypeError):
        raise InputError(f"--head-bits {head_bits}: choose one of "
                         f"{', '.join(map(str, HEAD_BITS))}") from None


# --------------------------------------------------------------------------------------------
# Model shapes and input checks

def linear_shapes(sm: engine.StreamingModel) -> dict[str, tuple[int, int, bool]]:
    """``{linear name: (in_features, out_features, has_bias)}`` of the decoder layers (read from
    the meta skeleton, no weights). InputError when a layer lacks a linear or the layers differ
    (EXL2 needs the llama-like q/k/v/o + gate/up/down layout)."""
    shapes = None
    for i in range(sm.num_layers):
        layer = sm.layer_skeleton(i)
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
    """Per slot (attn, mlp per layer), the costs of the candidate options for these shapes
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


# --------------------------------------------------------------------------------------------
# Passes

def content_shares(sm: engine.StreamingModel, rows: torch.Tensor, batch_size: int,
                   progress: bool = True) -> dict[str, float]:
    """Each decoder module output's content share ρ (measurement key → ρ, dimensionless;
    :func:`quantpress.calibration.exl2_measure.content_share`) from one unquantized forward
    pass over the calibration ``rows`` (int64 [rows, seqlen]): what the ``"content"`` objective
    needs when a measurement is reused."""
    p = cm.ContentProbe()
    engine.run(sm, rows, on_layer=p.on_layer, batch_size=batch_size, progress=progress)
    return p.results


class _EXL2Model:
    """What both EXL2 targets check and keep about the source: the streaming model, the
    linear shapes and the decoder numel (checked on the meta skeleton, nothing read), then
    (:meth:`calibrate`) the calibration rows."""

    def __init__(self, source: Source):
        bound_heap()
        source.require_hf("EXL2")
        self.source = source
        self.sm = source.streaming_model()
        self.L = self.sm.num_layers
        self.shapes = linear_shapes(self.sm)
        check_in_features(self.shapes, int(self.sm.head_skeleton().in_features), source.path)
        self.numel = alloc.decoder_numel(self.L, {n: s[:2] for n, s in self.shapes.items()})

    def calibrate(self, run: Run) -> None:
        """The calibration rows (stage "tokenize") and the rows per forward batch."""
        with run.stage("tokenize"):
            self.rows, self.text = self.source.calibration_rows()
        self.batch = self.source.batch_rows(self.rows.shape[1])

    def measurer(self) -> cm.Measurer:
        """A measurement pass consumer (:class:`quantpress.calibration.exl2_measure.Measurer`)
        for the reference hidden states of the calibration rows."""
        return cm.Measurer(int(self.rows.shape[0]), prefix=self.sm.layer_prefix)

    def measured(self, m: cm.Measurer) -> tuple[dict, int, dict]:
        """``(measurement dict, last_module_idx, content shares)`` of a finished measurement
        pass, as measurement.json holds them, validated against the model."""
        modules, last = cm.measurement_dict(m.results, self.sm.num_layers, self.sm.norm_name,
                                            self.sm.lm_head_name)
        mfile.validate_schema({"measurement": modules, "last_module_idx": last},
                              source="measurement pass", expect_layers=self.L,
                              cost=mfile.module_cost_fn(self.shapes))
        return modules, last, dict(m.content)


def _setting_text(option: dict, names) -> str:
    return ", ".join(f"{n.split('_')[0]} {qexl2.QParams.from_dict(option[n])}" for n in names)


def pass_memory(tokens: int, hidden_size: int, layer_weights: int, head_weights: int) -> tuple[int, int]:
    """Working memory (bytes, an estimate) of one quantization pass over a quantized stream
    (EXL2's; GPTQ's holds the same per layer) as (decoder layers, head): per layer two copies
    of the calibration hidden states, the largest module's output and the captured linear
    inputs (float32, as large as four copies: 6 × tokens × hidden_size × 4) and the layer's
    weights three times (float32, fake-quantized copies, GPTQ's float32 work: 12 bytes per
    weight); the head its weight in float32 plus GPTQ's ≈ 11 bytes per weight (15 bytes per
    weight; SmolLM2's 49,152 × 576 head 405 MiB; ``scripts/batch_memory.py`` measures 868–930
    MiB for two passes' heads side by side)."""
    return 24 * tokens * hidden_size + 12 * layer_weights, 15 * head_weights


# --------------------------------------------------------------------------------------------
# The round trip

def reconstructed_digest(name: str, t: dict, shape: tuple[int, int]) -> str:
    """:func:`quantpress.calibration.awq.tensor_digest` of the float16 weight [N, K] that
    :func:`quantpress.quantize.exl2.reconstruct` makes of the stored tensors ``t`` (by suffix:
    q_weight, q_scale, q_scale_max, q_groups, q_invperm), computed :data:`VERIFY_ROWS` output
    rows (stored columns) at a time, so the head of a large vocabulary is never reconstructed
    whole. Raises RoundTripError on a shape mismatch."""
    N, K = shape
    h = hashlib.sha256(f"{torch.float16}{(N, K)}".encode())
    for n0 in range(0, N, VERIFY_ROWS):
        n1 = min(N, n0 + VERIFY_ROWS)
        last = n1 == N
        qw = t["q_weight"][:, n0:] if last else t["q_weight"][:, n0:n1]
        qs = t["q_scale"][:, n0 // 8:] if last else t["q_scale"][:, n0 // 8:n1 // 8]
        deq = qexl2.reconstruct(qw, qs, t["q_scale_max"], t["q_groups"], t["q_invperm"], n1 - n0)
        if tuple(deq.shape) != (n1 - n0, K):
            raise RoundTripError(f"round trip: '{name}' rows {n0}..{n1 - 1} reconstruct to "
                                 f"{tuple(deq.shape)}, expected {(n1 - n0, K)}")
        h.update(deq.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def verify_exl2_dir(path: Path, records: list[cm.LinearRecord], expected: set[str]) -> str:
    """Round trip of a written EXL2 directory: the final files must hold exactly the
    ``expected`` tensor names; every linear of ``records`` is read back, checked with
    :func:`quantpress.quantize.exl2.check_kernel_constraints` and reconstructed by
    :func:`quantpress.quantize.exl2.reconstruct`; the SHA-256 of the float16 result must equal
    the quantizer's (``record.digest``), and a linear with a bias must have it. Raises
    RoundTripError naming the first tensor that differs."""
    w = exl2_dir.EXL2Weights(path, {r.name: r.shape[0] for r in records})
    stored = set(w.raw.keys())
    if stored != expected:
        extra, missing = sorted(stored - expected), sorted(expected - stored)
        raise RoundTripError(f"round trip: {path} holds tensors {extra[:3]} not written and "
                             f"lacks {missing[:3]}")
    for r in records:
        if not w.is_quantized(r.name + ".weight"):
            raise RoundTripError(f"round trip: '{r.name}' has no q_weight in {path}")
        t = w.q_tensors(r.name)
        try:
            qexl2.check_kernel_constraints(t["q_weight"], t["q_scale"], t["q_scale_max"],
                                           t["q_groups"], t["q_invperm"])
        except ValueError as e:
            raise RoundTripError(f"round trip: '{r.name}' violates the EXL2 kernel's "
                                 f"constraints: {e}") from None
        if t["q_invperm"].numel() != r.shape[1]:
            raise RoundTripError(f"round trip: '{r.name}.q_invperm' has {t['q_invperm'].numel()} "
                                 f"rows, expected in_features {r.shape[1]}")
        if r.has_bias != (f"{r.name}.bias" in w.raw):
            raise RoundTripError(f"round trip: '{r.name}.bias' "
                                 f"{'missing' if r.has_bias else 'unexpected'}")
        if reconstructed_digest(r.name, t, tuple(r.shape)) != r.digest:
            raise RoundTripError(f"round trip failed: '{r.name}' reconstructed from {path} "
                                 f"differs from the quantizer's fake-quantized weights")
    w.close()
    return (f"ok ({len(records)} linears bit-identical to the fake-quantized weights, kernel "
            f"constraints met)")


def verify_measurement(path: Path, text: str, num_layers: int, shapes: dict) -> str:
    """Round trip of a written measurement.json: it must validate against the model
    (:func:`quantpress.calibration.exl2_measurement.read_measurement`: layer count, every
    option's total_bits for these shapes) and hold exactly ``text``. RoundTripError otherwise."""
    try:
        mfile.read_measurement(path, expect_layers=num_layers, expect_shapes=shapes)
    except InputError as e:
        raise RoundTripError(f"round trip: {e}") from None
    if path.read_text(encoding="utf-8") != text:
        raise RoundTripError(f"round trip: {path} differs from the measurement made")
    return f"ok (re-read and validated: {num_layers} layers, every option's total_bits)"


def exl2_steps(args, options: EXL2Options) -> list[Step]:
    """The steps of ``quantize exl2``: with ``--measure-only FILE`` the measurement alone at
    FILE, else the EXL2 directory at ``-o``. InputError for --measure-only with
    --measurement, and for a missing -o or --bpw without --measure-only."""
    if args.measure_only is not None:
        if args.measurement is not None:
            raise InputError("--measure-only and --measurement exclude each other (one writes a "
                             "measurement, the other reuses one)")
        return [Step(EXL2MeasurementOptions(), args.measure_only)]
    if args.output is None:
        raise InputError("-o/--output is required (or --measure-only FILE)")
    if args.bpw is None:
        raise InputError("--bpw is required (or --measure-only FILE)")
    return [Step(options, args.output)]


# --------------------------------------------------------------------------------------------
# Targets

#: file name of the EXL2 measurement a batch shares between a model's EXL2 outputs
MEASUREMENT_FILE = "measurement.json"


class EXL2MeasurementTarget(Target, kind="measurement", options=EXL2MeasurementOptions):
    """measurement.json of the source (:class:`EXL2MeasurementOptions`)."""

    reference_stage = "measurement"
    measurer: cm.Measurer | None = None
    job_order = 60
    runtimes = "exllamav2 convert.py -m, quantize exl2 --measurement"
    stream = "reference"
    is_model = False

    @classmethod
    def job_target(cls, options: EXL2MeasurementOptions) -> str:
        return EXL2Target.kind

    @classmethod
    def job_path(cls, name: str, options: EXL2MeasurementOptions) -> str:
        return MEASUREMENT_FILE

    @classmethod
    def estimate(cls, info, options: list[EXL2MeasurementOptions]) -> Estimate:
        """The layer's four Hessians and, per module (two side by side), one candidate's
        forward and one batched GPTQ call (``calibration.exl2_measure.GPTQ_BATCH_BYTES``)."""
        h, f = info.hidden, info.ffn
        hess = 4 * (2 * h * h + (info.heads * info.head_dim) ** 2 + f * f)
        module = 4 * min(info.tokens, 4096) * (4 * f + 4 * h) + cm.GPTQ_BATCH_BYTES
        return Estimate([40_000 * info.layers for _ in options],
                        consumers=[info.layer + hess + 2 * module for _ in options])

    def prepare(self, run: Run) -> None:
        self.m = _EXL2Model(self.source)
        self.m.calibrate(run)

    def wants_reference(self) -> bool:
        """exllamav2 measures every module on the reference hidden states."""
        return True

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> cm.Measurer:
        """The measurer (the file is written at the end: nothing to resume in ``tmp``)."""
        self.measurer = self.m.measurer()
        return self.measurer

    def write(self, tmp: Path, run: Run) -> None:
        if self.measurer is None:
            self.reference_consumer(tmp, run)
            with run.stage("measurement"):
                reference_pass(self.source, [self.measurer], run.progress)
        self.timings = self.measurer.timings
        modules, last, shares = self.m.measured(self.measurer)
        self.text = mfile.measurement_text(modules, last, source="measurement pass", content_share=shares)
        mfile.write_measurement(tmp, modules, last, content_share=shares)

    def verify(self, tmp: Path, run: Run) -> str:
        return verify_measurement(tmp, self.text, self.m.L, self.m.shapes)

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        rows, seqlen = tuple(self.m.rows.shape)
        return Summary(self.kind, "exl2", out, str(self.source.path), roundtrip=roundtrip,
                       lines=[f"layers     {self.m.L} (attention and MLP options of each)",
                              f"calibration {rows} rows x {seqlen} tokens of {self.m.text}",
                              f"detail     GPTQ {self.timings.gptq:.1f} s (scale search "
                              f"{self.timings.search:.1f} s), forwards "
                              f"{self.timings.forward:.1f} s, Hessians {self.timings.hessian:.1f} s"],
                       details={"num_layers": self.m.L, "calibration": {"rows": rows, "seqlen": seqlen},
                                "detail": {"measurement_gptq": self.timings.gptq,
                                           "measurement_forward": self.timings.forward,
                                           "measurement_hessian": self.timings.hessian,
                                           "measurement_search": self.timings.search},
                                "measurement_layers": layer_seconds(self.measurer)})


def layer_seconds(measurer: cm.Measurer) -> list[dict]:
    """The measurement pass's wall seconds per decoder layer, in layer order:
    ``[{"gptq": s, "forward": s, "hessian": s, "search": s}, ...]`` (GPTQ of the candidate
    settings, module forwards, XᵀX accumulation, and the scale searches inside GPTQ;
    :class:`calibration.exl2_measure.Timings`)."""
    return [{k: round(v, 3) for k, v in vars(t).items()} for t in measurer.per_layer]


class EXL2Target(Target, kind="exl2", options=EXL2Options, output_is_dir=True):
    """An EXL2 directory at a target decoder bpw (:class:`EXL2Options`).

    Bad input (InputError, before anything is written): a bpw outside the reachable range
    (stated), a measurement of another model (layer count, shapes) or a truncated one,
    in_features > 65535 or not a multiple of 32, too little calibration text, non-HF input."""

    reference_stage = "measurement"
    resumable = True
    measurer: cm.Measurer | None = None
    resumed_at = 0
    verbs = (Verb("quantize", "exl2", "EXL2 (exllamav2 0.3.2) mixed-bit GPTQ quantization to a "
                                      "target bits per weight", out_required=False,
                  out_help="output directory (required unless --measure-only)",
                  extra=((("--measure-only",), {"metavar": "FILE", "help": "only measure; write "
                                                "measurement.json to FILE"}),),
                  steps=lambda args, options: exl2_steps(args, options)),)
    job_key = "exl2"
    job_order = 70
    runtimes = "ExLlamaV2, TabbyAPI"
    memory_stages = ("EXL2 passes", "EXL2 head")
    plan_words = "{n} EXL2 quantization pass(es)"
    needs = Needs(EXL2MeasurementOptions, "measurement", "the EXL2 measurement",
                  when=lambda o: o.measurement is None, reuse_key="exl2_measurement",
                  reuse_what="a measurement.json", together=True)

    @classmethod
    def job_target(cls, options: EXL2Options) -> str:
        return options.label

    @classmethod
    def job_path(cls, name: str, options: EXL2Options) -> str:
        return f"{name}-EXL2-{options.label}bpw"

    @classmethod
    def estimate(cls, info, options: list[EXL2Options]) -> Estimate:
        """:func:`pass_memory` per pass and per head, times the passes run side by side
        (:func:`quantpress.calibration.engine.side_by_side_threads`)."""
        n = engine.side_by_side_threads(info.device, len(options))
        layers, head = pass_memory(info.tokens, info.hidden, info.layer // 4, info.vocab * info.hidden)
        return Estimate([int(info.linear * o.bpw / 8 + 2 * (info.total - info.linear)) for o in options],
                        {"EXL2 passes": n * layers, "EXL2 head": n * head})

    def prepare(self, run: Run) -> None:
        o = self.options
        self.head_qp = head_qparams(o.head_bits)
        self.max_shard = exl2_dir.shard_bytes(o.max_shard_size)
        self.m = m = _EXL2Model(self.source)
        self.budget = check_target(float(o.bpw), cost_slots(m.shapes, m.L), m.numel)
        self.meas = None
        if o.measurement is not None:
            self.meas = mfile.read_measurement(o.measurement, expect_layers=m.L, expect_shapes=m.shapes)
        m.calibrate(run)
        self.detail: dict[str, float] = {}
        self.measurement_layers: list[dict] = []

    def wants_reference(self) -> bool:
        """Without :attr:`EXL2Options.measurement`, the measurement pass runs on the reference
        hidden states; not when a measurement is reused."""
        return self.meas is None

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> cm.Measurer:
        """The measurer (the measurement is made in memory: nothing to resume in ``tmp``)."""
        self.measurer = self.m.measurer()
        return self.measurer

    def _allocate(self, run: Run) -> None:
        o, m = self.options, self.m
        by_content, aggregate, power = alloc.OBJECTIVE_MODES[o.objective]
        if self.meas is None:
            if self.measurer is None:
                self.reference_consumer(Path(), run)
                with run.stage("measurement"):
                    reference_pass(self.source, [self.measurer], run.progress)
            t = self.measurer.timings
            modules, last, shares = m.measured(self.measurer)
            self.detail.update(measurement_gptq=t.gptq, measurement_forward=t.forward,
                               measurement_hessian=t.hessian)
            self.measurement_layers = layer_seconds(self.measurer)
            self.meas = mfile.Measurement(modules, last, m.L, shares)
        shares = self.meas.content_share
        with run.stage("allocation"):
            slots = self.meas.slots()
            self.content = []
            if by_content:
                if shares is None:  # a measurement written without them (exllamav2's)
                    t0 = time.perf_counter()
                    shares = content_shares(m.sm, m.rows, m.batch, run.progress)
                    self.detail["allocation_forward"] = time.perf_counter() - t0
                    self.meas = mfile.Measurement(self.meas.modules, self.meas.last_module_idx,
                                                  self.meas.num_layers, shares)
                rho = [shares[k] for k in self.meas.slot_keys()]
                self.content = [(rho[2 * i], rho[2 * i + 1]) for i in range(m.L)]
                slots = alloc.content_slots(slots, rho)
            a = alloc.allocate(slots, self.budget, numel=m.numel, objective=aggregate, power=power,
                               min_bits=alloc.budget_bits(float(o.bpw) - BPW_WINDOW, m.numel))
        self.allocation = a
        self.strategy = self.meas.strategy(a.choice)
        self.errs = [s[j][1] for s, j in zip(self.meas.slots(), a.choice)]
        self.objective_value = a.objective_value if aggregate == "sum" else a.err_max

    def pass_bytes(self) -> int:
        """Working memory of this target's quantization pass (bytes, an estimate): the larger
        of the two parts of :func:`pass_memory`."""
        m = self.m
        rows, seqlen = (int(v) for v in m.rows.shape)
        head = m.sm.head_skeleton()
        return max(pass_memory(rows * seqlen, m.sm.hidden_size, sum(inp * out for inp, out, _ in m.shapes.values()),
                               head.in_features * head.out_features))

    @classmethod
    def side_by_side(cls, targets: list["EXL2Target"]) -> int:
        """How many EXL2 quantization passes :meth:`write_together` runs at once: as many as
        :func:`quantpress.calibration.engine.side_by_side_threads` allows (CPU, one intra-op
        thread, a core each) and as fit in half the available memory (:meth:`pass_bytes`)."""
        n = engine.side_by_side_threads(targets[0].m.sm.device, len(targets))
        if n > 1:
            free = available_memory()
            need = max(t.pass_bytes() for t in targets)
            if free is not None:
                n = max(1, min(n, free // 2 // max(1, need)))
        return n

    @classmethod
    def write_together(cls, targets: list["EXL2Target"], tmps: list[Path],
                       runs: list[Run]) -> list[Exception | None] | None:
        """The EXL2 targets of one source, each with its own quantization pass timed in its
        own run: side by side in threads (:meth:`side_by_side`; each pass is what
        :meth:`write` alone does, on one intra-op thread, so the bytes do not change), else
        one after the other. Returns each target's error (None: written); one failing pass
        does not stop the others."""
        n = cls.side_by_side(targets) if len(targets) > 1 else 1
        if n <= 1:
            return super().write_together(targets, tmps, runs)
        errors = engine.run_side_by_side([functools.partial(t.write, tmp, r)
                                          for t, tmp, r in zip(targets, tmps, runs)], n)
        engine.raise_first([e for e in errors if not isinstance(e, Exception)])   # KeyboardInterrupt...
        return errors

    def write(self, tmp: Path, run: Run) -> None:
        o, m, sm = self.options, self.m, self.m.sm
        self._allocate(run)
        self.records: list[cm.LinearRecord] = []
        strategy = hashlib.sha256(json.dumps(self.strategy, sort_keys=True).encode()).hexdigest()
        ckpt = self.checkpoint({"strategy": strategy})
        first = ckpt.start()[0] if ckpt is not None else 0
        if not first and tmp.exists():  # an interrupted run's directory without a checkpoint
            shutil.rmtree(tmp)
        writer = exl2_dir.dir_writer(tmp, self.max_shard, resume=bool(first))
        with run.stage("quantization"):
            if not first:
                writer.add(hfdir.embedding_fp16(sm))

            def sink(index, tensors, recs):
                writer.add(tensors)
                self.records.extend(recs)

            q = cm.Quantizer(self.strategy, int(m.rows.shape[0]), sink, prefix=sm.layer_prefix)

            def on_layer(i, layer, inputs, outputs, ctx):
                y = q.on_layer(i, layer, inputs, outputs, ctx)
                trim_heap()
                return y

            hidden = engine.run(sm, m.rows, hooks_factory=q.hooks, on_layer=on_layer,
                                batch_size=m.batch, progress=run.progress, checkpoint=ckpt,
                                state=WriterShare(writer, self.records, sm.layer_prefix, q))
        self.resumed_at = first
        with run.stage("head"):
            tail = hfdir.norm_fp16(sm)
            self.head = q.quantize_head(sm, hidden, self.head_qp, m.batch, tail)
            self.records.append(self.head)
            del hidden
            writer.add(tail)
            sm.release()
        self.detail.update(quantization_gptq=q.timings.gptq, quantization_forward=q.timings.forward)
        with run.stage("write"):
            rows, seqlen = tuple(m.rows.shape)
            calib = self.source.calib.calib
            writer.finish(exl2_dir.exl2_config(self.source.config, o.bpw, int(o.head_bits), rows,
                                               seqlen, None if calib is None else str(calib)),
                          self.source.path)
            # kept with the model, as exllamav2 users publish it: the same file whether the
            # measurement was made here or reused
            mfile.write_measurement(tmp / "measurement.json", self.meas.modules,
                                    self.meas.last_module_idx, self.meas.content_share)
        self.expected = set(writer.sizes)
        self.tensor_bytes = writer.total_bytes
        # the checkpoint stays until the output is verified and installed (produce_many
        # removes it): a run killed during verification resumes without redoing the pass

    def verify(self, tmp: Path, run: Run) -> str:
        return verify_exl2_dir(tmp, self.records, self.expected)

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        o, m, a = self.options, self.m, self.allocation
        L = m.L
        choices = [(a.choice[2 * i], a.choice[2 * i + 1]) for i in range(L)]
        options = [tuple(_setting_text(self.strategy[mfile.layer_key(i, mode)], cm.MODULES[mode])
                         for mode in ("self_attn", "mlp")) for i in range(L)]
        rec = self.head
        head_rtn = rec.shape[0] * rec.shape[1] > cm.RTN_HEAD_NUMEL
        head = (f"{rec.name} {rec.qparams} ({'round-to-nearest' if head_rtn else 'GPTQ'}), "
                f"{rec.bits / (rec.shape[0] * rec.shape[1]):.3f} bpw")
        decoder_bpw = a.total_bits / max(1, m.numel)
        rows, seqlen = tuple(m.rows.shape)
        measurement = o.measurement if o.measurement is not None else "measured"
        lines = [f"decoder    {decoder_bpw:.4f} bpw ({a.total_bits} bits / {m.numel} weights) "
                 f"for a target of {o.bpw}; head {o.head_bits} bits: {head}",
                 f"allocation objective '{o.objective}' ({OBJECTIVE_TEXT[o.objective]}) = "
                 f"{self.objective_value:.5f}; module errors: sum {sum(self.errs):.5f}, "
                 f"max {max(self.errs):.5f}; measurement {measurement}",
                 f"calibration {rows} rows x {seqlen} tokens of {m.text}",
                 "options per layer (attn / mlp):"]
        lines += [f"    {i:3d}: attn {ai:2d} [{sa}]  mlp {mi:2d} [{sm_}]"
                  for i, ((ai, mi), (sa, sm_)) in enumerate(zip(choices, options))]
        if self.detail:
            lines.append("detail     " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                                   for k, v in self.detail.items()))
        layers = [{"layer": i, "attn": ai, "mlp": mi, "attn_setting": sa, "mlp_setting": sm_,
                   **({"share_attn": sc[0], "share_mlp": sc[1]} if sc else {})}
                  for i, ((ai, mi), (sa, sm_), sc) in enumerate(
                      zip(choices, options, self.content or [None] * L))]
        details = {"target_bpw": o.bpw, "head_bits": o.head_bits, "measurement": measurement,
                   "decoder_bpw": round(decoder_bpw, 4), "decoder_bits": a.total_bits,
                   "decoder_numel": m.numel, "objective": o.objective,
                   "objective_value": self.objective_value, "err_sum": sum(self.errs),
                   "err_max": max(self.errs), "head": head,
                   "calibration": {"rows": rows, "seqlen": seqlen}, "num_layers": L,
                   "detail": {k: round(v, 2) for k, v in self.detail.items()}, "layers": layers,
                   "measurement_layers": self.measurement_layers}
        return Summary(self.kind, o.label, out, str(self.source.path),
                       tensor_bytes=self.tensor_bytes, parameters=self.source.parameter_count(),
                       roundtrip=roundtrip, details=details, lines=lines)

