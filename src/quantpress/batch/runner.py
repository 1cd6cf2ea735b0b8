"""``quantize batch``: every output of every model of a job file, sharing what they can.

Per model, its stages (:func:`model_stages`), with one :class:`~quantpress.targets.base.Source`
(config, tokenizer and calibration rows read once) per process:

1. **GGUF policies**, all written from one read of each tensor;
2. **calibrated pass**: :func:`quantpress.targets.base.produce_many` over the importance
   matrix, the AWQ targets and the EXL2 measurement (``measurement.json``): one streamed pass
   over the reference hidden states feeds the imatrix statistics, every AWQ search and the
   EXL2 measurement;
3. **GPTQ targets** (each its own quantized pass), the **imatrix-weighted GGUF policies**
   once the imatrix exists, and the **EXL2 targets**, each with ``--measurement`` set to that
   measurement.json (its own quantized pass), so each is byte-identical to ``quantize exl2
   --measurement`` and to a fresh ``quantize exl2``;
4. **evaluation** (``eval = true``): one :func:`quantpress.targets.eval.evaluate` of the source
   against every model output;

``manifest.json`` and ``README.md`` (the model card) rewritten after every output by the
process that owns the model (:class:`ModelRun`). :func:`run_model` runs the stages one after
the other in this process; ``--ray`` runs each as a Ray task once what it waits for is
finished (:mod:`quantpress.batch.ray_exec`).

Re-running the same command resumes: outputs whose manifest entry is ``ok`` with the same
options and unchanged checksums are kept (reported as kept), the others are made; a pass
that was killed goes on from the last finished layer (``.work/``, see :func:`run_model`). An output
path that exists but was not made by this batch is refused unless ``--force``. A model whose
output fails keeps what finished, marks the failure in its manifest and the batch goes on.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from quantpress.batch import manifest as mf
from quantpress.batch.jobfile import OutputJob
from quantpress.errors import InputError, RoundTripError
from quantpress.devices import pick_device
from quantpress.targets.base import Outcome, Source, options_json, produce_many
# the plan of a run (defined in .stages; importable from here as before)
from quantpress.batch.stages import (CALIBRATED, CALIBRATION_PASS, EVAL, ModelPlan, Stage,  # noqa: F401
                                     lane_budget, memory_peak, model_key, model_stages, on_side_lane,
                                     plan_model, plan_text, plan_words, stage_memory, two_lanes)

@dataclass
class Row:
    """One line of the closing table."""

    model: str
    kind: str
    target: str
    path: str
    status: str          # made, kept, failed
    seconds: float = 0.0
    bytes: int = 0
    bpw: float | None = None
    error: str = ""
    code: int = 0        # exit code class of a failure (1, 2, 3)
    resumed_at: int = 0  # first layer run by this process when a pass resumed saved work


def _code(e: Exception) -> int:
    return 2 if isinstance(e, InputError) else 3 if isinstance(e, RoundTripError) else 1


def _first_line(e: Exception) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


class _Manifest:
    """The manifest of one model as it is being made: entries by path, written after every
    change. ``device`` / ``dtype`` of the calibration: the earlier manifest's of the same job
    until :meth:`computed_on` reports where this run computes."""

    def __init__(self, plan: ModelPlan):
        job = plan.job
        self.plan = plan
        prev = {e["path"]: e for e in (plan.previous or {}).get("outputs", [])}
        self.entries = {o.path: prev[o.path] for o in plan.keep}
        c = job.calib
        self.doc = {"model": job.name, "source": str(job.source), "outputs": [],
                    "calibration": {"text": c.calib, "calib_field": c.calib_field,
                                    "samples": c.samples, "seqlen": c.seqlen, "seed": c.seed,
                                    "device": None, "dtype": None},
                    "versions": mf.versions(), "job": model_key(job)}
        if plan.previous and plan.previous.get("job") == model_key(job):
            for k in ("eval_base", "eval_options"):
                if k in plan.previous:
                    self.doc[k] = plan.previous[k]
            cal = plan.previous.get("calibration", {})
            self.computed_on(cal.get("device"), cal.get("dtype"))

    def computed_on(self, device: str | None, dtype: str | None) -> None:
        """Record the compute device and dtype."""
        self.doc["calibration"].update(device=device, dtype=dtype)

    def record(self, o: OutputJob, oc: Outcome) -> Row:
        p = self.plan.dir / o.path
        base = {"kind": o.kind, "target": o.target, "path": o.path, "is_dir": p.is_dir(),
                "options": options_json(o.options)}
        if oc.ok:
            s = oc.summary
            self.entries[o.path] = {**base, "files": mf.file_digests(p), "bytes": s.bytes,
                                    "bpw": None if s.bpw is None else round(s.bpw, 4),
                                    "roundtrip": "ok", "seconds": round(s.seconds, 2), "eval": None}
            if s.details.get("resumed_at_layer"):
                self.entries[o.path]["resumed_at_layer"] = s.details["resumed_at_layer"]
            row = Row(self.plan.job.name, o.kind, o.target, o.path, "made", s.seconds, s.bytes, s.bpw,
                      resumed_at=int(s.details.get("resumed_at_layer", 0)))
        else:
            self.entries[o.path] = {**base, "files": {}, "bytes": 0, "bpw": None, "roundtrip": "failed",
                                    "error": _first_line(oc.error), "seconds": 0.0, "eval": None}
            row = Row(self.plan.job.name, o.kind, o.target, o.path, "failed",
                      error=_first_line(oc.error), code=_code(oc.error))
        self.write()
        return row

    def write(self) -> None:
        order = [o.path for o in self.plan.job.outputs]
        self.doc["outputs"] = [self.entries[p] for p in order if p in self.entries]
        mf.write_json_atomic(self.plan.dir / mf.MANIFEST, self.doc)
        (self.plan.dir / mf.CARD).write_text(mf.model_card(self.doc), encoding="utf-8")


WORK = ".work"


def _stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr)


class ModelRun:
    """What the process that owns a model's manifest knows while its stages run, locally
    (:func:`run_model`) or as Ray tasks (:func:`quantpress.batch.ray_exec.run_batch_ray`): the
    rows, the manifest (written here only, after every recorded output) and which stages are
    started and finished. Creating it makes the output directory and reports the kept
    outputs. ``eval_each`` / ``together``: as :func:`model_stages` (Ray scores each
    stage's outputs; a local run makes its EXL2 targets in one stage)."""

    def __init__(self, plan: ModelPlan, on_row: Callable[[Row], None] | None = None,
                 eval_each: bool = False, together: bool = False):
        self.plan = plan
        self.rows: list[Row] = []
        self.on_row = on_row
        self.stages = model_stages(plan, eval_each, together)
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self._recorded: set[str] = set()
        plan.dir.mkdir(parents=True, exist_ok=True)
        job = plan.job
        prev = {e["path"]: e for e in (plan.previous or {}).get("outputs", [])}
        for o in plan.keep:
            e = prev[o.path]
            self.emit(Row(job.name, o.kind, o.target, o.path, "kept", e.get("seconds", 0.0),
                          e.get("bytes", 0), e.get("bpw")))
        self.man = _Manifest(plan)

    def emit(self, r: Row) -> None:
        self.rows.append(r)
        if self.on_row is not None:
            self.on_row(r)

    def ready(self) -> list[Stage]:
        """The stages not started whose ``after`` are all finished."""
        names = {s.name for s in self.stages}
        return [s for s in self.stages if s.name not in self.started
                and all(a in self.finished or a not in names for a in s.after)]

    def next_stage(self, admit: Callable[[Stage], bool] = lambda s: True) -> tuple[Stage, list, list[str]] | None:
        """The first ready stage that ``admit`` accepts, started: (stage, its (output,
        options) pairs from :meth:`start`, the paths an evaluation stage scores from
        :meth:`eval_todo`); None when no such stage is left. A stage with nothing to do (no
        output left to make, nothing left to score) is finished here instead, and the search
        goes on (finishing it may make others ready)."""
        while True:
            stage = next((s for s in self.ready() if admit(s)), None)
            if stage is None:
                return None
            inputs = self.start(stage)
            paths = self.eval_todo(stage) if stage.is_eval else []
            if paths or (inputs and not stage.is_eval):
                return stage, inputs, paths
            self.finish(stage)

    def start(self, stage: Stage) -> list[tuple[OutputJob, Any]]:
        """Mark ``stage`` started and return its (output, options) pairs, with the option of
        ``needs`` set to the finished earlier output. When that output failed, its outputs
        are recorded failed, the stage finished, and [] returned."""
        self.started.add(stage.name)
        if stage.needs is None:
            return [(o, o.options) for o in stage.outputs]
        path, what, key = stage.needs
        entry = self.man.entries.get(path)
        if entry is None or entry.get("roundtrip") != "ok":
            err = InputError(f"{self.plan.dir / path}: {what} failed ({(entry or {}).get('error', 'not made')})")
            for o in stage.outputs:
                self.record(Outcome(o.options, self.plan.dir / o.path, error=err))
            self.finished.add(stage.name)
            return []
        return [(o, replace(o.options, **{key: str(self.plan.dir / path)})) for o in stage.outputs]

    def record(self, oc: Outcome, device: str | None = None, dtype: str | None = None) -> None:
        """Record one output's outcome (its manifest entry and row)."""
        if device is not None:  # None: the task could not open the model
            self.man.computed_on(device, dtype)
        o = next(o for o in self.plan.job.outputs if self.plan.dir / o.path == Path(oc.out))
        self._recorded.add(o.path)
        self.emit(self.man.record(o, oc))

    def finish(self, stage: Stage, error: Exception | None = None) -> None:
        """Mark ``stage`` finished; with ``error`` (its process died), the outputs it did not
        report are recorded failed."""
        if error is not None:
            if stage.is_eval:
                self.emit(Row(self.plan.job.name, "eval", "", "", "failed", error=_first_line(error),
                              code=_code(error)))
            for o in stage.outputs:
                if o.path not in self._recorded:
                    self.record(Outcome(o.options, self.plan.dir / o.path, error=error))
        self.finished.add(stage.name)

    def fail_all(self, error: Exception) -> None:
        """The model cannot be opened: every output not made yet fails with ``error``."""
        for s in self.stages:
            self.started.add(s.name)
            self.finish(s, None if s.is_eval else error)

    def eval_todo(self, stage: Stage) -> list[str]:
        """Paths of the finished model outputs (of ``stage.evaluates`` when it names them)
        that have no evaluation yet (all of them when the evaluation options changed since the
        manifest was written)."""
        job = self.plan.job
        if self.man.doc.get("eval_options") != options_json(job.eval):
            for e in self.man.entries.values():
                e["eval"] = None
            self.man.doc.pop("eval_options", None)
        return [e["path"] for e in (self.man.entries.get(o.path) for o in job.outputs
                                    if o.maker.is_model
                                    and (stage.evaluates is None or o.path in stage.evaluates))
                if e is not None and e.get("roundtrip") == "ok" and e.get("eval") is None]

    def record_eval(self, paths: list[str], rep) -> None:
        """Record :func:`~quantpress.targets.eval.evaluate`'s report of ``paths``."""
        b = rep.models[0]
        self.man.doc["eval_base"] = {"ppl": b.ppl["ppl"], "text": rep.text, "n_ctx": rep.n_ctx,
                                     "n_chunks": rep.n_chunks}
        self.man.doc["eval_options"] = options_json(self.plan.job.eval)
        for path, m in zip(paths, rep.models[1:]):
            self.man.entries[path]["eval"] = {"ppl": m.ppl["ppl"], "kld": m.kl["kld_mean"],
                                              "kld_p99": m.kl["kld_p99"], "same_top": m.kl["same_top"]}
        self.man.write()

    def close(self) -> list[Row]:
        """Write the manifest a last time, remove an empty ``.work/``; the rows."""
        self.man.write()
        work = self.plan.dir / WORK
        if work.is_dir() and not any(work.iterdir()):
            work.rmdir()
        return self.rows


def open_source(plan: ModelPlan, progress: bool = False) -> Source:
    """The model's :class:`Source`, its device and dtype resolved (so that a model that cannot
    be opened fails here)."""
    job = plan.job
    source = Source(job.source, job.compute, job.calib, progress=progress)
    source.device, source.dtype
    return source


def run_stage(plan: ModelPlan, inputs: list[tuple[OutputJob, Any]], source: Source,
              on_done: Callable[[Outcome], None], progress: bool = False,
              log: Callable[[str], None] = _stderr) -> None:
    """Make one stage's outputs (``inputs`` from :meth:`ModelRun.start`) with one
    :func:`~quantpress.targets.base.produce_many` into the model's directory, its resumable
    work in ``.work/`` (keyed by :func:`model_key`); ``on_done`` gets each :class:`Outcome`
    as it finishes. Runs in whichever process computes (this one, or a Ray worker)."""
    plan.dir.mkdir(parents=True, exist_ok=True)
    produce_many([(opt, plan.dir / o.path) for o, opt in inputs], source, force=True,
                 progress=progress, on_done=on_done, work=plan.dir / WORK,
                 work_key=model_key(plan.job), log=log)


def run_eval(plan: ModelPlan, paths: list[str], progress: bool = False):
    """:func:`~quantpress.targets.eval.evaluate` of the source against the outputs ``paths``
    (relative to the model's directory): the EvalReport."""
    from quantpress.targets.eval import evaluate

    job = plan.job
    return evaluate(job.source, [plan.dir / p for p in paths], job.eval, job.compute, progress=progress)


def run_model(plan: ModelPlan, progress: bool = True,
              on_row: Callable[[Row], None] | None = None,
              log: Callable[[str], None] = _stderr, side=None) -> list[Row]:
    """Make the outputs of one planned model (:func:`model_stages`, one :class:`Source` for
    all). Returns one :class:`Row` per output (kept, made or failed); never raises for a failing
    output.

    Without ``side``, or when the model has no stage for one of the two lanes, the stages run
    one after the other in this thread and one :class:`~quantpress.targets.eval.Evaluation`
    scores every output at the end. ``side``: a :class:`quantpress.batch.lanes.SideLane`
    (:func:`run_plans` gives one when :func:`two_lanes`): the GGUF policies and the scoring of
    each stage's outputs (``eval_each``, :func:`on_side_lane`) run in that lane's process while
    this process makes the calibrated pass, the GPTQ and the EXL2 targets, each lane one stage
    at a time, a stage as soon as what it waits for is finished; a stage starts beside the
    other lane's only while the two stages' estimated working memory (:func:`stage_memory`)
    stays within half the memory available when the model started (``MemAvailable``). A
    scoring that starts when this lane has nothing left to do scores two outputs at once
    (``Evaluation.report(side_by_side=2)``) when twice its working memory fits that budget.
    Only this process records outcomes and writes the manifest.

    Work in progress lives in ``OUT_ROOT/<name>/.work/`` (temporary outputs and the
    checkpoints of the layer-streamed passes): a run killed inside a pass resumes at the layer
    it reached (the row's ``resumed_at``); ``log`` gets the messages about saved work (resumed,
    or discarded because the job or the code changed)."""
    try:
        source = open_source(plan, progress)
    except Exception as e:  # the model cannot even be opened: every output fails
        run = ModelRun(plan, on_row, together=True)
        run.fail_all(e)
        return run.rows
    if side is not None:
        sides = {on_side_lane(s) for s in model_stages(plan, eval_each=True, together=True) if not s.is_eval}
        if plan.job.eval is not None:
            sides.add(True)
        side = side if sides == {True, False} else None
    run = ModelRun(plan, on_row, eval_each=side is not None, together=True)
    run.man.computed_on(str(source.device), str(source.dtype).replace("torch.", ""))
    run.man.write()

    if side is not None:
        try:
            _two_lanes(run, source, side, progress, log)
        finally:
            side.forget(plan)
        return run.close()

    scorer = None
    try:
        while (started := run.next_stage()) is not None:
            stage, inputs, paths = started
            error = None
            try:
                if stage.is_eval:
                    if scorer is None:
                        from quantpress.targets.eval import Evaluation

                        job = plan.job
                        scorer = Evaluation(job.source, job.eval, job.compute, progress)
                    run.record_eval(paths, scorer.report([plan.dir / p for p in paths]))
                else:
                    run_stage(plan, inputs, source, run.record, progress, log)
            except Exception as e:  # noqa: BLE001 - recorded as the stage's failure
                error = e
            run.finish(stage, error)
    finally:
        if scorer is not None:
            scorer.close()
    return run.close()


def _two_lanes(run: ModelRun, source: Source, side, progress: bool, log: Callable[[str], None]) -> None:
    """:func:`run_model`'s stages in two lanes: this process's lane in a thread (one torch
    intra-op thread, no autograd), the side lane's in its process; the events of both come
    back through one queue to this thread, which records them and starts what is ready."""
    import queue
    import threading

    import torch

    plan = run.plan
    memory = stage_memory(plan)
    budget = lane_budget()
    events: queue.Queue = queue.Queue()
    running: dict[bool, tuple[Stage, list[str], int]] = {}   # by lane: on the side lane or not

    def admit(stage: Stage) -> bool:
        return on_side_lane(stage) not in running and (
            not running or sum(m for *_, m in running.values()) + memory(stage) <= budget)

    def take(stage: Stage, paths: list[str], event: tuple) -> bool:
        """Record one event of ``stage``; True when the stage is done."""
        what, value = event
        if what == "outcome":
            run.record(value)
        elif what == "eval":
            run.record_eval(paths, value)
        elif what == "log":
            log(value)
        else:
            run.finish(stage, value)
        return what == "done"

    def here(stage: Stage, inputs: list) -> None:
        put = lambda ev: events.put((False, ev))  # noqa: E731
        try:
            torch.set_num_threads(1)
            with torch.no_grad():
                run_stage(plan, inputs, source, lambda oc: put(("outcome", oc)), progress,
                          lambda m: put(("log", m)))
        except BaseException as e:  # noqa: BLE001 - the stage failed
            put(("done", e))
            return
        put(("done", None))

    while True:
        while (started := run.next_stage(admit)) is not None:
            stage, inputs, paths = started
            lane = on_side_lane(stage)
            running[lane] = (stage, paths, memory(stage))
            if lane:
                if stage.is_eval:
                    # the last scoring, with nothing left for this lane: its core scores too
                    alone = False not in running and all(
                        s.name in run.finished for s in run.stages if not on_side_lane(s))
                    both = 2 if alone and 2 * memory(stage) <= budget else 1
                    side.start("eval", plan, (paths, both), lambda ev: events.put((True, ev)))
                else:
                    side.start("stage", plan, inputs, lambda ev: events.put((True, ev)))
            else:
                threading.Thread(target=here, args=(stage, inputs), name=f"quantpress-{stage.name}",
                                 daemon=True).start()
        if not running:
            return
        lane, ev = events.get()
        stage, paths, _ = running[lane]
        if take(stage, paths, ev):
            del running[lane]


def closing_table(rows: list[Row]) -> str:
    """The table printed when the batch ends: one line per output."""
    head = f"{'model':<20} {'output':<36} {'status':<7} {'size':>11} {'bpw':>7} {'time':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r.bytes / 2 ** 20:,.1f} MiB" if r.bytes else ""
        bpw = f"{r.bpw:.3f}" if r.bpw else ""
        t = f"{r.seconds:.1f} s" if r.seconds else ""
        lines.append(f"{r.model[:20]:<20} {r.path[:36]:<36} {r.status:<7} {size:>11} {bpw:>7} {t:>8}"
                     + (f"  {r.error}" if r.error else "")
                     + (f"  (resumed at layer {r.resumed_at})" if r.resumed_at else ""))
    made = sum(r.status == "made" for r in rows)
    kept = sum(r.status == "kept" for r in rows)
    failed = sum(r.status == "failed" for r in rows)
    lines.append(f"{made} made, {kept} kept from an earlier run, {failed} failed")
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    """0 when nothing failed; else 3 if a round trip failed, 2 for bad input, 1 otherwise."""
    codes = {r.code for r in rows if r.status == "failed"}
    if not codes:
        return 0
    return 3 if 3 in codes else 2 if 2 in codes else 1


def run_plans(plans: list[ModelPlan], progress: bool = True,
              on_row: Callable[[Row], None] | None = None, side_lane: Callable[[], Any] | None = None) -> list[Row]:
    """Make the planned models one after the other in this process (:func:`run_model`).
    ``side_lane``: what makes the side lane of the models that may use two lanes
    (:func:`two_lanes`), :class:`quantpress.batch.lanes.SideLane` as ``quantize batch``
    passes it (the lanes module calls this one's functions in its process, so this module
    does not import it); None: every stage in this process."""
    rows: list[Row] = []
    side = None
    if side_lane is not None and any(two_lanes(pick_device(p.job.compute.device)) for p in plans):
        side = side_lane()
    try:
        for p in plans:
            use = side if two_lanes(pick_device(p.job.compute.device)) else None
            rows += run_model(p, progress, on_row, side=use)
    finally:
        if side is not None:
            side.close()
    return rows


