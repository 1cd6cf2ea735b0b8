"""What ``quantize batch`` will do for each model, planned from the job and the target
registry before anything runs: which outputs are kept or made (:func:`plan_model`), the
stages and what each waits for (:func:`model_stages`), their estimated working memory
(:func:`stage_memory`, :func:`memory_peak`), which lane makes each (:func:`on_side_lane`,
:func:`two_lanes`) and the ``--dry-run`` text (:func:`plan_text`). :mod:`.runner` runs the
plans locally, :mod:`.ray_exec` as Ray tasks."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantpress.batch import manifest as mf
from quantpress.batch.jobfile import ModelJob, OutputJob
from quantpress.errors import InputError
from quantpress.devices import pick_device
from quantpress.targets.base import options_json


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
    """Which outputs of ``job`` are finished (kept: recorded ok with the job's options, and
    intact in place or still waiting to be installed, :func:`~quantpress.batch.manifest.staged_dir`)
    and which are to be made. InputError when an output path exists that no earlier run of
    this batch made (unless ``force``)."""
    mdir = Path(out_root) / job.name
    prev = mf.read_manifest(mdir) if mdir.is_dir() else None
    same_model = prev is not None and prev.get("job") == model_key(job)
    by_path = {e.get("path"): e for e in (prev or {}).get("outputs", [])}
    keep, make = [], []
    for o in job.outputs:
        e = by_path.get(o.path)
        if (same_model and e is not None and e.get("roundtrip") == "ok"
                and e.get("options") == options_json(o.options)
                and (mf.intact(mdir, e) or mf.intact(mf.staged_dir(mdir), e))):
            keep.append(o)
            continue
        p = mdir / o.path
        if (p.exists() or p.is_symlink()) and e is None and not force:
            raise InputError(f"{p}: already exists and was not made by this batch "
                             f"(use --force to overwrite)")
        make.append(o)
    return ModelPlan(job, mdir, keep, make, prev)


#: the name of the evaluation stage (:func:`model_stages`)
EVAL = "eval"


@dataclass
class Stage:
    """One step of a model's run: the ``outputs`` one
    :func:`~quantpress.batch.stage_work.run_stage` call makes together (one
    :func:`~quantpress.targets.base.produce_many`), the stages it waits for (``after``, by
    name; a name the plan lacks counts as finished) and what it takes from an earlier output
    (``needs``: (its path, what it is, the option set to it), e.g. the EXL2 measurement as
    ``measurement``). Evaluation stages (:attr:`is_eval`) have no outputs."""

    name: str
    outputs: list[OutputJob]
    after: tuple[str, ...] = ()
    needs: tuple[str, str, str] | None = None
    evaluates: tuple[str, ...] | None = None
    #: what its outputs are made from (:attr:`Target.stream`; ``eval`` for an evaluation)
    stream: str = "eval"
    #: the names of the ``--dry-run`` memory figures of the stage (:func:`stage_memory`)
    memory: tuple[str, ...] = ()

    @property
    def is_eval(self) -> bool:
        """An evaluation stage: :data:`EVAL` (every output still without one) or one that
        evaluates the outputs of one stage (``evaluates``, their paths)."""
        return self.name == EVAL or self.evaluates is not None


#: the stage of the outputs fed by the shared pass over the reference hidden states
CALIBRATED = "calibrated"
#: its ``--dry-run`` memory figure (:func:`~quantpress.batch.jobfile.estimate`)
CALIBRATION_PASS = "calibration pass"


def model_stages(plan: ModelPlan, eval_each: bool = False, together: bool = False) -> list[Stage]:
    """The stages of one planned model, in an order that runs each after what it waits for
    (the order :func:`~quantpress.batch.runner.run_model` uses; Ray runs every stage whose
    ``after`` are finished at once, :mod:`quantpress.batch.ray_exec`), from what each output's target declares
    (:attr:`Target.stream`, :attr:`Target.needs`):

    * ``<key>``: per kind made from the checkpoint's tensors (``stream = "tensors"``, e.g. the
      GGUF policies from one read of each tensor), its outputs that need no other output;
    * ``calibrated``: every output fed by one streamed pass over the reference hidden states
      (``stream = "reference"``: the imatrix, the AWQ and FP8 targets, the EXL2 measurement);
    * ``<key> <target>``: each output with a pass of its own (``stream = "own"``, e.g. GPTQ)
      of a kind that needs no other output;
    * then per kind that may need another output: its outputs that do not (a reused file:
      ``<key> <target>`` each), and those that do after the stage that makes it, taking its
      path: ``<key>+<provider kind>`` for a tensors kind (``gguf+imatrix``), ``<key>
      <target>`` each for the others; with ``together`` (a local run) a kind whose
      :class:`~quantpress.targets.registry.Needs` says ``together`` makes them in one stage
      ``<key> <target>+<target>...`` (EXL2: its passes side by side,
      :meth:`quantpress.targets.exl2.EXL2Target.write_together`; Ray runs the separate
      stages side by side instead);
    * ``eval``: every model output against the source, after all the others.

    ``eval_each`` (Ray): also an ``eval <stage>`` stage after each stage that makes model
    outputs, evaluating those (each such task scores the source again: on a cluster the
    outputs of the early stages are scored while the later ones are made); ``eval`` then
    scores what is left (the kept outputs whose evaluation is missing)."""
    job, make = plan.job, plan.make
    stages: list[Stage] = []
    kinds: list[type] = []
    for o in make:
        if o.maker not in kinds:
            kinds.append(o.maker)
    kinds.sort(key=lambda c: c.job_order)

    def of(cls, waiting):
        return [o for o in make if o.maker is cls and (o.needs is not None) == waiting]

    def key(cls):
        return cls.job_key or cls.kind

    for cls in kinds:
        if cls.stream == "tensors" and of(cls, False):
            stages.append(Stage(key(cls), of(cls, False), stream="tensors", memory=cls.memory_stages))
    calibrated = [o for o in make if o.maker.stream == "reference"]
    if calibrated:
        stages.append(Stage(CALIBRATED, calibrated, stream="reference", memory=(CALIBRATION_PASS,)))
    for cls in kinds:
        if cls.stream == "own" and cls.needs is None:
            stages += [Stage(f"{key(cls)} {o.target}", [o], stream="own", memory=cls.memory_stages)
                       for o in of(cls, False)]
    for cls in kinds:
        n = cls.needs
        if n is None:
            continue
        if cls.stream == "own":
            stages += [Stage(f"{key(cls)} {o.target}", [o], stream="own", memory=cls.memory_stages)
                       for o in of(cls, False)]
        waiting = of(cls, True)
        if not waiting:
            continue
        provider = next(o for o in job.outputs if type(o.options) is n.provider)
        made_in = next((s.name for s in stages if provider in s.outputs), CALIBRATED)
        needs = (provider.path, n.what, n.option)
        if cls.stream == "tensors":
            groups = [(f"{key(cls)}+{provider.maker.kind}", waiting)]
        elif together and n.together:
            groups = [(f"{key(cls)} " + "+".join(o.target for o in waiting), waiting)]
        else:
            groups = [(f"{key(cls)} {o.target}", [o]) for o in waiting]
        stages += [Stage(name, g, (made_in,), needs, stream=cls.stream, memory=cls.memory_stages)
                   for name, g in groups]
    if job.eval is not None:
        if eval_each:
            stages += [Stage(f"eval {s.name}", [], (s.name,),
                             evaluates=tuple(o.path for o in s.outputs if o.maker.is_model),
                             memory=("evaluation",))
                       for s in list(stages) if any(o.maker.is_model for o in s.outputs)]
        stages.append(Stage(EVAL, [], tuple(s.name for s in stages), memory=("evaluation",)))
    return stages


def stage_memory(plan: ModelPlan) -> Callable[[Stage], int]:
    """Working memory of a stage of ``plan`` in bytes: the largest of
    :func:`~quantpress.batch.jobfile.estimate`'s figures the stage names (``Stage.memory``:
    its kind's own, the calibration pass, the evaluation); 0 for a stage the estimate does
    not know."""
    from quantpress.batch.jobfile import estimate

    est = estimate(plan.job)["stages"]

    def of(stage: Stage) -> int:
        return max((est.get(k, 0) for k in stage.memory), default=0)
    return of


def lane_budget() -> int:
    """Bytes of working memory the stages running at once in a local run may take together:
    half of MemAvailable now (unbounded where /proc does not tell)."""
    from quantpress.memory import available_memory

    return (available_memory() or 1 << 62) // 2


def on_side_lane(stage: Stage) -> bool:
    """Whether a local run with two lanes makes ``stage`` in the side lane
    (:mod:`quantpress.batch.lanes`): the outputs made from the checkpoint's tensors (the GGUF
    policies) and every evaluation; the calibrated pass and the passes of the outputs' own
    (GPTQ, EXL2) run in this process."""
    return stage.is_eval or stage.stream == "tensors"


def memory_peak(plan: ModelPlan, lanes: bool) -> tuple[int, list[str]]:
    """The largest estimated working memory (:func:`stage_memory`) of ``plan``'s stages running
    at once in a local run, and those stages' names: one stage at a time without ``lanes``; with
    them, each stage of one lane beside the largest stage of the other lane that may run at the
    same time (neither waits for the other, directly or not) when the two fit the admission
    budget of :func:`~quantpress.batch.runner.run_model`, and a scoring that waits for every
    stage of this process's lane at twice its memory ("<stage> x2", two outputs at once) when
    that fits the budget."""
    stages = model_stages(plan, eval_each=lanes, together=True)
    mem = stage_memory(plan)
    budget = lane_budget()
    by_name = {st.name: st for st in stages}
    before: dict[str, set[str]] = {}
    for st in stages:   # in order: what a stage waits for comes first
        before[st.name] = set()
        for a in st.after:
            if a in by_name:
                before[st.name] |= {a} | before[a]
    best: tuple[int, list[str]] = (0, [])
    main = {st.name for st in stages if not on_side_lane(st)}
    for st in stages:
        group, total = [st.name], mem(st)
        if lanes and st.is_eval and main <= before[st.name] and 2 * total <= budget:
            group, total = [f"{st.name} x2"], 2 * total    # the last scoring: two outputs at once
        beside = [t for t in stages if lanes and on_side_lane(t) != on_side_lane(st)
                  and st.name not in before[t.name] and t.name not in before[st.name]
                  and total + mem(t) <= budget]
        if beside:
            t = max(beside, key=mem)
            group, total = sorted([st.name, t.name], key=lambda n: on_side_lane(by_name[n])), total + mem(t)
        if total > best[0]:
            best = (total, group)
    return best


def two_lanes(device) -> bool:
    """Whether a local run may make a model's stages in two lanes on ``device``: CPU, torch on
    one intra-op thread and more than one core
    (:func:`~quantpress.calibration.engine.side_by_side_threads`; the side lane's process
    also runs its ops on one thread, so no output depends on which lane made it)."""
    from quantpress.calibration.engine import side_by_side_threads

    return side_by_side_threads(device, 2) > 1


def plan_words(p: ModelPlan) -> list[str]:
    """What each stage kind of ``p`` does, in the ``--dry-run`` plan's words: the kinds made
    from the tensors (:meth:`Target.describe`), the shared calibration pass and what it feeds
    (:meth:`Target.feeds`), the kinds with passes of their own, the evaluation."""
    j = p.job
    kinds: list[type] = []
    for o in p.make:
        if o.maker not in kinds:
            kinds.append(o.maker)
    kinds.sort(key=lambda c: c.job_order)
    words = []

    def describe(cls):
        for waiting in (False, True):
            mine = [o.options for o in p.make if o.maker is cls and (o.needs is not None) == waiting]
            if mine and cls.describe(mine, waiting):
                words.append(cls.describe(mine, waiting))
    for cls in kinds:
        if cls.stream == "tensors":
            describe(cls)
    fed = []
    for o in p.make:
        if o.maker.stream == "reference":
            f = o.maker.feeds(o.options)
            if f and f not in fed:
                fed.append(f)
    if fed:
        words.append(f"one calibration pass ({j.calib.samples} x {j.calib.seqlen} tokens) "
                     f"feeding {', '.join(fed)}")
    for cls in kinds:
        if cls.stream == "own":
            mine = [o.options for o in p.make if o.maker is cls]
            if cls.describe(mine):
                words.append(cls.describe(mine))
    if j.eval is not None:
        words.append("evaluation against the source")
    return words


def plan_text(plans: list[ModelPlan]) -> str:
    """The ``--dry-run`` plan: per model, its stages, each output (to make or kept, estimated
    size), the estimated disk and the largest stage's working memory
    (:func:`~quantpress.batch.jobfile.estimate`)."""
    from quantpress.batch.jobfile import estimate

    lines = []
    for p in plans:
        j = p.job
        est = estimate(j)
        stages = plan_words(p)
        lines += [f"{j.where}: {j.source} -> {p.dir}/",
                  f"  device {j.compute.device}; stages: {'; '.join(stages) or 'none (all kept)'}"]
        for o in j.outputs:
            state = "kept" if o in p.keep else "make"
            lines.append(f"  {state}  {o.path:<40} ~{est['bytes'][o.path] / 2 ** 20:,.1f} MiB")
        lanes = two_lanes(pick_device(j.compute.device))
        most, together = memory_peak(p, True) if lanes else (est["peak_memory"], [est["peak_stage"]])
        peak = (f"working memory ~{most / 2 ** 20:,.0f} MiB at its largest ({' beside '.join(together)}), "
                f"above the libraries' own" if most else "no working memory to speak of")
        lines.append(f"  estimated disk ~{est['disk'] / 2 ** 20:,.1f} MiB; {peak}")
    return "\n".join(lines)
