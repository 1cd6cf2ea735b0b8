"""EXL2 (exllamav2 0.3.2) outputs: ``quantize exl2 -o DIR --bpw B`` (a model directory,
:class:`EXL2Target`) and ``quantize exl2 --measure-only FILE`` (measurement.json alone,
:class:`~quantpress.targets.exl2_measuring.EXL2MeasurementTarget`), as exllamav2 0.3.2's
``convert.py`` makes them (``-om`` / ``-m`` / ``-b``). Their options are in
:mod:`.exl2_options`.

Stages of the directory:

1. **tokenize**: the :class:`~quantpress.targets.base.Source`'s calibration rows (default text:
   the calibration split of exllamav2's wiki.utf8), kept with the model's shapes and checks
   (:class:`~quantpress.targets.exl2_model.EXL2Model`). The same rows serve both passes
   (exllamav2 draws 16 measurement rows and 115 quantization rows from its built-in mix).
2. **measurement** (:class:`quantpress.calibration.exl2_measure.Measurer`): every attention /
   MLP option scored on reference hidden states (exllamav2 ``conversion/measure.py``), unless
   :attr:`EXL2Options.measurement` names a measurement.json to reuse (validated against the
   model: layer count, every option's total_bits against this model's shapes).
3. **allocation** (:func:`quantpress.targets.exl2_allocation.allocate_options`): one option per
   module under the budget ``int(decoder numel × bpw)`` bits (exact knapsack,
   :func:`quantpress.calibration.exl2_alloc.allocate`, instead of exllamav2
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
6. **verify** (:func:`quantpress.targets.exl2_verify.verify_exl2_dir`): every linear re-read
   from the final files, checked against the kernel's constraints and reconstructed by
   :func:`quantpress.quantize.exl2.reconstruct`; its SHA-256 must equal the quantizer's
   fake-quantized float16 weight's. The summary: :func:`quantpress.targets.exl2_summary.dir_summary`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

from quantpress.calibration import engine
from quantpress.calibration import exl2_measure as cm
from quantpress.calibration import exl2_measurement as mfile
from quantpress.convert import exl2_dir
from quantpress.memory import available_memory, trim_heap
from quantpress.targets import hfdir
from quantpress.targets.base import Run, Summary, Target, WriterShare, reference_pass
from quantpress.targets.exl2_allocation import allocate_options, check_target, cost_slots
# the measurement's own target, registered with the directory target that needs its output
from quantpress.targets.exl2_measuring import EXL2MeasurementTarget  # noqa: F401
from quantpress.targets.exl2_model import EXL2Model, layer_seconds
from quantpress.targets.exl2_options import KIND, EXL2MeasurementOptions, EXL2Options, exl2_steps, head_qparams
from quantpress.targets.exl2_summary import dir_summary
from quantpress.targets.exl2_verify import verify_exl2_dir
from quantpress.targets.registry import Estimate, Needs, Verb


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


class EXL2Target(Target, kind=KIND, options=EXL2Options, output_is_dir=True):
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
        self.m = m = EXL2Model(self.source)
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


    def _measure(self, run: Run) -> None:
        # this target's own measurement pass when none is reused and no shared pass fed it
        if self.meas is not None:
            return
        m = self.m
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

    def _allocate(self, run: Run) -> None:
        o = self.options
        self._measure(run)
        with run.stage("allocation"):
            self.chosen = allocate_options(self.meas, self.m, o.objective, float(o.bpw), self.budget,
                                           run.progress)
        if self.chosen.forward_seconds is not None:
            self.detail["allocation_forward"] = self.chosen.forward_seconds
        # the measurement written with the model carries the content shares the allocation used
        self.meas = self.chosen.measurement
        self.strategy = self.chosen.strategy

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
        return dir_summary(self.options, self.m, self.chosen, self.head, self.detail,
                           self.measurement_layers, out, roundtrip, self.tensor_bytes)
