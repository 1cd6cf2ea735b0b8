"""A stage's work, in whichever process computes it (this one, the side lane's, a Ray
worker): the model's :class:`~quantpress.targets.base.Source` (:func:`open_source`), one
stage's outputs (:func:`run_stage`) and the evaluation of finished outputs
(:func:`run_eval`).

The outputs a stage makes are verified and left among the model's verified outputs
(:func:`quantpress.batch.manifest.staged_path`), not in place: the process that owns the
model's manifest renames each into place once its entry is written
(:meth:`quantpress.batch.model_run.ModelRun.record`), so that a batch killed between the two
leaves no output its manifest does not know.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from quantpress.batch import manifest as mf
from quantpress.batch.jobfile import OutputJob
from quantpress.batch.stages import ModelPlan, model_key
from quantpress.targets.base import Outcome, Source, produce_many


def log_stderr(message: str) -> None:
    """The default logger of the messages about saved work: one line on stderr."""
    print(message, file=sys.stderr)


def open_source(plan: ModelPlan, progress: bool = False) -> Source:
    """The model's :class:`Source`, its device and dtype resolved (so that a model that cannot
    be opened fails here, with whatever error opening it raises)."""
    job = plan.job
    source = Source(job.source, job.compute, job.calib, progress=progress, repo_id=job.repo_id)
    source.device, source.dtype
    return source


def run_stage(plan: ModelPlan, inputs: list[tuple[OutputJob, Any]], source: Source,
              on_done: Callable[[Outcome], None], progress: bool = False,
              log: Callable[[str], None] = log_stderr) -> None:
    """Make one stage's outputs (``inputs`` from :meth:`ModelRun.start`) with one
    :func:`~quantpress.targets.base.produce_many`, its resumable work in the model's
    ``.work/`` (keyed by :func:`~quantpress.batch.stages.model_key`). Each verified output is
    left at its :func:`~quantpress.batch.manifest.staged_path`; ``on_done`` gets each
    :class:`Outcome` as it finishes, ``out`` (and the summary's ``output``) its final path,
    where :meth:`ModelRun.record` installs it. Failures are in the outcomes; this raises only
    what stops the whole stage (KeyboardInterrupt, SystemExit)."""
    finals: dict[Path, Path] = {}
    items = []
    for o, opt in inputs:
        staged = mf.staged_path(plan.dir, o.path)
        staged.parent.mkdir(parents=True, exist_ok=True)
        finals[staged] = plan.dir / o.path
        items.append((opt, staged))

    def done(oc: Outcome) -> None:
        oc.out = finals[Path(oc.out)]
        if oc.summary is not None:
            oc.summary.output = oc.out
        on_done(oc)

    produce_many(items, source, force=True, progress=progress, on_done=done,
                 work=plan.dir / mf.WORK, work_key=model_key(plan.job), log=log)


def run_eval(plan: ModelPlan, paths: list[str], progress: bool = False):
    """:func:`~quantpress.targets.eval.evaluate` of the source against the outputs ``paths``
    (relative to the model's directory, in place): the EvalReport."""
    from quantpress.targets.eval import evaluate

    job = plan.job
    return evaluate(job.source, [plan.dir / p for p in paths], job.eval, job.compute, progress=progress)
