"""``quantize batch``: every output of every model of a job file, sharing what they can.

Per model (:func:`run_model`), with one :class:`~quantpress.targets.base.Source` (config,
tokenizer and calibration rows read once):

1. **shared stage**: :func:`quantpress.targets.base.produce_many` over the GGUF policies (all
   written from one read of each tensor), the importance matrix, the AWQ targets and the EXL2
   measurement (``measurement.json``): one streamed pass over the reference hidden states
   feeds the imatrix statistics, every AWQ search and the EXL2 measurement;
2. **EXL2 targets**, each with ``--measurement`` set to that measurement.json (its own
   quantized pass), so each is byte-identical to ``quantize exl2 --measurement`` and to a
   fresh ``quantize exl2``;
3. **evaluation** (``eval = true``): one :func:`quantpress.targets.eval.evaluate` of the source
   against every model output;
4. ``manifest.json`` rewritten after every output, and ``README.md`` (the model card).

Re-running the same command resumes: outputs whose manifest entry is ``ok`` with the same
options and unchanged checksums are kept (reported as kept), the others are made; a pass
that was killed goes on from the last finished layer (``.work/``, see :func:`run_model`). An output
path that exists but was not made by this batch is refused unless ``--force``. A model whose
output fails keeps what finished, marks the failure in its manifest and the batch goes on.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from quantpress.batch import manifest as mf
from quantpress.batch.jobfile import MEASUREMENT_FILE, ModelJob, OutputJob
from quantpress.errors import InputError, RoundTripError
from quantpress.targets.base import Outcome, Source, options_json, produce_many

#: output kinds that are models (evaluated with ``eval = true``)
MODEL_KINDS = ("gguf", "awq", "gptq", "fp8", "exl2")


def model_key(job: ModelJob) -> dict:
    """What every output of a model depends on besides its own options: the source,
    compute and calibration options (JSON values)."""
    return {"source": str(job.source), "compute": options_json(job.compute), "calib": options_json(job.calib)}


@dataclass
class ModelPlan:
    """What a run of one model will do: ``keep`` (finished outputs of an earlier run, intact),
    ``make`` (in order) and the earlier manifest (None)."""

    job: ModelJob
    dir: Path
    keep: list[OutputJob]
    make: list[OutputJob]
    previous: dict | None


def plan_model(job: ModelJob, out_root: Path, force: bool = False) -> ModelPlan:
    """Which outputs of ``job`` are finished (kept) and which are to be made. InputError when an
    output path exists that no earlier run of this batch made (unless ``force``)."""
    mdir = Path(out_root) / job.name
    prev = mf.read_manifest(mdir) if mdir.is_dir() else None
    same_model = prev is not None and prev.get("job") == model_key(job)
    by_path = {e.get("path"): e for e in (prev or {}).get("outputs", [])}
    keep, make = [], []
    for o in job.outputs:
        e = by_path.get(o.path)
        if (same_model and e is not None and e.get("roundtrip") == "ok"
                and e.get("options") == options_json(o.options) and mf.intact(mdir, e)):
            keep.append(o)
            continue
        p = mdir / o.path
        if (p.exists() or p.is_symlink()) and e is None and not force:
            raise InputError(f"{p}: already exists and was not made by this batch "
                             f"(use --force to overwrite)")
        make.append(o)
    return ModelPlan(job, mdir, keep, make, prev)


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
    change."""

    def __init__(self, plan: ModelPlan, source: Source):
        job = plan.job
        self.plan = plan
        prev = {e["path"]: e for e in (plan.previous or {}).get("outputs", [])}
        self.entries = {o.path: prev[o.path] for o in plan.keep}
        c = job.calib
        self.doc = {"model": job.name, "source": str(job.source), "outputs": [],
                    "calibration": {"text": c.calib, "calib_field": c.calib_field,
                                    "samples": c.samples, "seqlen": c.seqlen, "seed": c.seed,
                                    "device": str(source.device),
                                    "dtype": str(source.dtype).replace("torch.", "")},
                    "versions": mf.versions(), "job": model_key(job)}
        if plan.previous and plan.previous.get("job") == model_key(job):
            for k in ("eval_base", "eval_options"):
                if k in plan.previous:
                    self.doc[k] = plan.previous[k]

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


def run_model(plan: ModelPlan, progress: bool = True,
              on_row: Callable[[Row], None] | None = None,
              log: Callable[[str], None] = _stderr) -> list[Row]:
    """Make the outputs of one planned model (see the module docstring). Returns one
    :class:`Row` per output (kept, made or failed); never raises for a failing output.

    Work in progress lives in ``OUT_ROOT/<name>/.work/`` (temporary outputs and the
    checkpoints of the layer-streamed passes): a run killed inside a pass resumes at the layer
    it reached (the row's ``resumed_at``); ``log`` gets the messages about saved work (resumed,
    or discarded because the job or the code changed)."""
    job = plan.job
    plan.dir.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []

    def emit(r: Row) -> None:
        rows.append(r)
        if on_row is not None:
            on_row(r)

    prev = {e["path"]: e for e in (plan.previous or {}).get("outputs", [])}
    for o in plan.keep:
        e = prev[o.path]
        emit(Row(job.name, o.kind, o.target, o.path, "kept", e.get("seconds", 0.0), e.get("bytes", 0),
                 e.get("bpw")))
    try:
        source = Source(job.source, job.compute, job.calib, progress=progress)
        man = _Manifest(plan, source)
    except Exception as e:  # the model cannot even be opened: every output fails
        for o in plan.make:
            emit(Row(job.name, o.kind, o.target, o.path, "failed", error=_first_line(e), code=_code(e)))
        return rows
    man.write()

    def produce_all(outs: list[OutputJob], options: list) -> None:
        by_path = {str(plan.dir / o.path): o for o in outs}

        def done(oc: Outcome) -> None:
            emit(man.record(by_path[str(oc.out)], oc))

        produce_many([(opt, plan.dir / o.path) for o, opt in zip(outs, options)], source,
                     force=True, progress=progress, on_done=done, work=plan.dir / WORK,
                     work_key=model_key(job), log=log)

    def after(outs: list[OutputJob], path: str, what: str, key: str) -> None:
        """Make ``outs`` with option ``key`` set to the finished output ``path`` (the
        imatrix, the EXL2 measurement), or fail them all when it failed."""
        entry = man.entries.get(path)
        if entry is None or entry.get("roundtrip") != "ok":
            err = InputError(f"{plan.dir / path}: {what} failed ({(entry or {}).get('error', 'not made')})")
            for o in outs:
                emit(man.record(o, Outcome(o.options, plan.dir / o.path, error=err)))
        else:
            produce_all(outs, [replace(o.options, **{key: str(plan.dir / path)}) for o in outs])

    first = [o for o in plan.make if o.kind != "exl2" and not o.after_imatrix]
    if first:
        produce_all(first, [o.options for o in first])
    weighted = [o for o in plan.make if o.after_imatrix]
    if weighted:
        after(weighted, next(o.path for o in job.outputs if o.kind == "imatrix"), "the imatrix", "imatrix")
    exl2 = [o for o in plan.make if o.kind == "exl2"]
    if exl2 and exl2[0].options.measurement is not None:  # exl2_measurement: reused as given
        produce_all(exl2, [o.options for o in exl2])
    elif exl2:
        after(exl2, MEASUREMENT_FILE, "the EXL2 measurement", "measurement")
    if job.eval is not None:
        _evaluate(plan, man, source, progress, emit)
    man.write()
    work = plan.dir / WORK
    if work.is_dir() and not any(work.iterdir()):
        work.rmdir()
    return rows


def _evaluate(plan: ModelPlan, man: _Manifest, source: Source, progress: bool,
              emit: Callable[[Row], None]) -> None:
    """PPL and KLD of every finished model output that has none yet (all of them when the
    evaluation options changed), against the source, in one :func:`evaluate` call."""
    from quantpress.targets.eval import evaluate

    job = plan.job
    opts = options_json(job.eval)
    if man.doc.get("eval_options") != opts:
        for e in man.entries.values():
            e["eval"] = None
    todo = [e for e in (man.entries.get(o.path) for o in job.outputs if o.kind in MODEL_KINDS)
            if e is not None and e.get("roundtrip") == "ok" and e.get("eval") is None]
    if not todo:
        return
    try:
        rep = evaluate(job.source, [plan.dir / e["path"] for e in todo], job.eval, job.compute,
                       progress=progress)
    except Exception as e:
        emit(Row(job.name, "eval", "", "", "failed", error=_first_line(e), code=_code(e)))
        return
    b = rep.models[0]
    man.doc["eval_base"] = {"ppl": b.ppl["ppl"], "text": rep.text, "n_ctx": rep.n_ctx,
                            "n_chunks": rep.n_chunks}
    man.doc["eval_options"] = opts
    for e, m in zip(todo, rep.models[1:]):
        e["eval"] = {"ppl": m.ppl["ppl"], "kld": m.kl["kld_mean"], "kld_p99": m.kl["kld_p99"],
                     "same_top": m.kl["same_top"]}
    man.write()


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
              on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Make the planned models one after the other in this process (:func:`run_model`)."""
    rows: list[Row] = []
    for p in plans:
        rows += run_model(p, progress, on_row)
    return rows


def plan_text(plans: list[ModelPlan]) -> str:
    """The ``--dry-run`` plan: per model, its stages, each output (to make or kept, estimated
    size) and the estimated disk and peak memory."""
    from quantpress.batch.jobfile import estimate

    lines = []
    for p in plans:
        j = p.job
        est = estimate(j)
        kinds = {o.kind for o in p.make}
        stages = []
        if "gguf" in kinds:
            stages.append("GGUF policies from one read of each tensor")
        if any(o.after_imatrix for o in p.make):
            stages.append("GGUF policies with the model's imatrix, once it is made")
        shared = [k for k in ("imatrix", "awq", "measurement") if k in kinds
                  and not (k == "awq" and all(o.options.rtn for o in p.make if o.kind == "awq"))]
        if any(o.kind == "fp8" and o.options.scheme == "static" for o in p.make):
            shared.append("fp8 static input scales")
        if shared:
            stages.append(f"one calibration pass ({j.calib.samples} x {j.calib.seqlen} tokens) "
                          f"feeding {', '.join(shared)}")
        if "gptq" in kinds:
            stages.append(f"{sum(o.kind == 'gptq' for o in p.make)} GPTQ pass(es)")
        if "exl2" in kinds:
            stages.append(f"{sum(o.kind == 'exl2' for o in p.make)} EXL2 quantization pass(es)")
        if j.eval is not None:
            stages.append("evaluation against the source")
        lines += [f"{j.where}: {j.source} -> {p.dir}/",
                  f"  device {j.compute.device}; stages: {'; '.join(stages) or 'none (all kept)'}"]
        for o in j.outputs:
            state = "kept" if o in p.keep else "make"
            lines.append(f"  {state}  {o.path:<40} ~{est['bytes'][o.path] / 2 ** 20:,.1f} MiB")
        lines.append(f"  estimated disk ~{est['disk'] / 2 ** 20:,.1f} MiB, peak memory "
                     f"~{est['peak_memory'] / 2 ** 20:,.0f} MiB (calibrated stages)")
    return "\n".join(lines)
