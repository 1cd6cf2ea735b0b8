"""The state of one model's batch run in the process that owns its manifest
(:class:`ModelRun`): which stages are started and finished, the rows, and the manifest itself,
written after every recorded output, locally (:func:`quantpress.batch.runner.run_model`) or
for Ray tasks (:func:`quantpress.batch.ray_exec.run_batch_ray`).

An output goes into place only through :meth:`ModelRun.record`: the stage left it verified
among the model's verified outputs (:func:`quantpress.batch.manifest.staged_path`), the
record writes its manifest entry, then renames it into place. A run killed before the entry
is written leaves the output only under ``.work/`` (a re-run makes it again); one killed
between the two leaves an entry whose files a re-run finds there, installs and keeps.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from quantpress.batch import manifest as mf
from quantpress.batch.jobfile import OutputJob
from quantpress.batch.rows import Row, error_code, first_line
from quantpress.batch.stages import ModelPlan, Stage, model_key, model_stages
from quantpress.errors import InputError
from quantpress.targets.base import Outcome, install, options_json, remove_path


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
        if job.repo_id:     # the snapshot path says where, the repo id and revision say what
            self.doc.update(repo_id=job.repo_id, revision=job.revision)
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
        """Write ``o``'s entry for the outcome ``oc`` and, for a made output still at its
        staged path, install it afterwards (an install that fails turns the entry into a
        failure); the row."""
        p = self.plan.dir / o.path
        if oc.ok:
            staged = mf.staged_path(self.plan.dir, o.path)
            made = staged if staged.exists() or staged.is_symlink() else p
            s = oc.summary
            self.entries[o.path] = {"kind": o.kind, "target": o.target, "path": o.path,
                                    "is_dir": made.is_dir(), "options": options_json(o.options),
                                    "files": mf.file_digests(made), "bytes": s.bytes,
                                    "bpw": None if s.bpw is None else round(s.bpw, 4),
                                    "roundtrip": "ok", "seconds": round(s.seconds, 2), "eval": None}
            if s.details.get("resumed_at_layer"):
                self.entries[o.path]["resumed_at_layer"] = s.details["resumed_at_layer"]
            # the entry first: a kill before the rename leaves an output a re-run installs
            self.write()
            try:
                if made is staged:
                    install(staged, p)
            except OSError as e:
                return self._failed(o, e)
            return Row(self.plan.job.name, o.kind, o.target, o.path, "made", s.seconds, s.bytes, s.bpw,
                       resumed_at=int(s.details.get("resumed_at_layer", 0)))
        return self._failed(o, oc.error)

    def _failed(self, o: OutputJob, error: Exception) -> Row:
        p = self.plan.dir / o.path
        # a failed output leaves nothing, also not what its stage verified before it failed
        remove_path(mf.staged_path(self.plan.dir, o.path))
        self.entries[o.path] = {"kind": o.kind, "target": o.target, "path": o.path, "is_dir": p.is_dir(),
                                "options": options_json(o.options), "files": {}, "bytes": 0, "bpw": None,
                                "roundtrip": "failed", "error": first_line(error), "seconds": 0.0,
                                "eval": None}
        self.write()
        return Row(self.plan.job.name, o.kind, o.target, o.path, "failed",
                   error=first_line(error), code=error_code(error))

    def write(self) -> None:
        """Write manifest.json (atomically) and the model card from the entries, in the job's
        order of the outputs."""
        order = [o.path for o in self.plan.job.outputs]
        self.doc["outputs"] = [self.entries[p] for p in order if p in self.entries]
        mf.write_json_atomic(self.plan.dir / mf.MANIFEST, self.doc)
        (self.plan.dir / mf.CARD).write_text(mf.model_card(self.doc), encoding="utf-8")


class ModelRun:
    """What the process that owns a model's manifest knows while its stages run, locally
    (:func:`quantpress.batch.runner.run_model`) or as Ray tasks
    (:func:`quantpress.batch.ray_exec.run_batch_ray`): the rows, the manifest (written here
    only, after every recorded output) and which stages are started and finished. Creating it makes the output directory and reports the kept
    outputs (installing one that was recorded but not yet renamed into place, and dropping
    the verified outputs that were never recorded). ``eval_each`` / ``together``: as
    :func:`~quantpress.batch.stages.model_stages` (Ray scores each stage's outputs; a local
    run makes its EXL2 targets in one stage)."""

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
            staged = mf.staged_path(plan.dir, o.path)
            # recorded, then killed before its rename: kept from where it waits
            if (staged.exists() or staged.is_symlink()) and not mf.intact(plan.dir, e):
                install(staged, plan.dir / o.path)
            self.emit(Row(job.name, o.kind, o.target, o.path, "kept", e.get("seconds", 0.0),
                          e.get("bytes", 0), e.get("bpw")))
        # what else waits there was never recorded: its output is made again
        remove_path(mf.staged_dir(plan.dir))
        self.man = _Manifest(plan)

    def emit(self, r: Row) -> None:
        """Keep the row ``r`` and hand it to ``on_row``."""
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
        """Record one output's outcome ``oc`` (``out`` its final path): its manifest entry
        and row; a made output left at its staged path is renamed into place once the entry
        is written. ``device`` / ``dtype``: where it was computed (None: not known)."""
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
                self.emit(Row(self.plan.job.name, "eval", "", "", "failed", error=first_line(error),
                              code=error_code(error)))
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
        for d in (mf.staged_dir(self.plan.dir), self.plan.dir / mf.WORK):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        return self.rows
