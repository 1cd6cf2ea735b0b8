"""``quantize batch``: every output of every model of a job file, sharing what they can.

Per model, its stages (:func:`~quantpress.batch.stages.model_stages`), with one
:class:`~quantpress.targets.base.Source` (config, tokenizer and calibration rows read once)
per process:

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
process that owns the model (:class:`~quantpress.batch.model_run.ModelRun`), which alone
renames each output into place, after its entry is written. :func:`run_model` runs the
stages in this process (one lane, or two with :mod:`quantpress.batch.lanes`' side lane);
``--ray`` runs each as a Ray task once what it waits for is finished
(:mod:`quantpress.batch.ray_exec`). What a stage does wherever it runs is
:mod:`quantpress.batch.stage_work`; the rows and the closing table :mod:`quantpress.batch.rows`.

Re-running the same command resumes: outputs whose manifest entry is ``ok`` with the same
options and unchanged checksums are kept (reported as kept), the others are made; a pass
that was killed goes on from the last finished layer (``.work/``, see :func:`run_model`). An output
path that exists but was not made by this batch is refused unless ``--force``. A model whose
output fails keeps what finished, marks the failure in its manifest and the batch goes on.
"""
from __future__ import annotations

from typing import Any, Callable

from quantpress.batch.model_run import ModelRun
from quantpress.batch.rows import Row
from quantpress.batch.stage_work import log_stderr, open_source, run_stage
from quantpress.batch.stages import (ModelPlan, Stage, lane_budget, model_stages, on_side_lane,
                                     stage_memory, two_lanes)
from quantpress.devices import pick_device
from quantpress.targets.base import Source
# the command line (cli/quantize_main.py) plans, prints the plan and reports through this module
from quantpress.batch.rows import closing_table, exit_code  # noqa: F401
from quantpress.batch.stages import plan_model, plan_text  # noqa: F401


def run_model(plan: ModelPlan, progress: bool = True,
              on_row: Callable[[Row], None] | None = None,
              log: Callable[[str], None] = log_stderr, side=None) -> list[Row]:
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
    Only this process records outcomes, writes the manifest and renames the outputs into
    place (:meth:`~quantpress.batch.model_run.ModelRun.record`).

    Work in progress lives in ``OUT_ROOT/<name>/.work/`` (temporary outputs, the checkpoints
    of the layer-streamed passes, the verified outputs waiting for their manifest entry): a
    run killed inside a pass resumes at the layer it reached (the row's ``resumed_at``);
    ``log`` gets the messages about saved work (resumed, or discarded because the job or the
    code changed)."""
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

