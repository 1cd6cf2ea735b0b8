"""The runner that turns declared targets into verified outputs (:func:`produce_many`,
:func:`produce`), and the one place that gathers the skeleton every format shares, defined by
concern in :mod:`.source` (options shared by a model's outputs, the :class:`Source`),
:mod:`.summary` (:class:`Run`, :class:`Summary`), :mod:`.target` (:class:`Target`, the
registry), :mod:`.verification` (output paths, temporary paths, install) and :mod:`.streams`
(the shared reference pass, :class:`WriterShare`); their names are importable from here.

An output kind is a :class:`Target` subclass declared for its options dataclass
(``class GGUFTarget(Target, kind="gguf", options=GGUFOptions)``), and the runner picks the
target by the options' type, as torchao's ``quantize_(model, config)`` dispatches on the
config's type:

- ``options_type``: a frozen dataclass of the kind's own options, with ``validate()`` raising
  InputError that names the option (the CLI verbs and, later, batch job files build it);
- :meth:`Target.prepare`: every check against the model, before anything is written;
- :meth:`Target.write`: produce the output at a temporary path;
- :meth:`Target.verify`: the round trip, re-reading what :meth:`write` left there (raises
  :class:`quantpress.errors.RoundTripError`);
- :meth:`Target.summary`: a :class:`Summary`, one shape for every kind (text and JSON).

:func:`produce` owns what no target repeats: refusing an existing output without ``force``
(and a missing or unwritable output directory), the temporary sibling path (a file, or a
directory), the round trip, the atomic rename, the timings per stage, progress bars, and
leaving nothing behind on any error. Options shared by every calibrated output of one model
(:class:`CalibOptions`, :class:`ComputeOptions`) belong to the :class:`Source`, which computes
the calibration rows once for all the targets that use it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from quantpress.calibration.checkpoint import LayerCheckpoint, code_digest
# the names the targets and their callers import from here, defined by concern
from quantpress.targets.source import (CalibOptions, ComputeOptions, Source, calibration_rows,  # noqa: F401
                                       default_cal_dir)
from quantpress.targets.streams import WriterShare, options_json, reference_pass  # noqa: F401
from quantpress.targets.summary import STAGE_OBSERVERS, Run, Summary, output_files  # noqa: F401
from quantpress.targets.target import TARGETS, Target, target_for  # noqa: F401
from quantpress.targets.verification import check_output, install, remove_path, temp_path  # noqa: F401

__all__ = ["STAGE_OBSERVERS", "TARGETS", "CalibOptions", "ComputeOptions", "Outcome", "Run", "Source",
           "Summary", "Target", "WriterShare", "calibration_rows", "check_output", "default_cal_dir",
           "install", "options_json", "output_files", "produce", "produce_many", "reference_pass",
           "remove_path", "target_for", "temp_path"]


@dataclass
class Outcome:
    """What became of one output of :func:`produce_many`: its ``options`` and final path
    ``out``, and either its :class:`Summary` or the ``error`` that stopped it (nothing is left
    at ``out`` then)."""

    options: Any
    out: Path
    summary: Summary | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        """True when the output was written and verified."""
        return self.error is None and self.summary is not None


def produce_many(items: list[tuple[Any, str | Path]], source: Source | str | Path, *,
                 force: bool = False, progress: bool = True,
                 on_done: Callable[[Outcome], None] | None = None,
                 work: str | Path | None = None, work_key: dict | None = None,
                 log: Callable[[str], None] | None = None) -> list[Outcome]:
    """Make several verified outputs of one source, sharing what they can: the runner every
    output goes through (:func:`produce` is this with one item).

    ``items``: (registered options dataclass, output path) pairs. For each: options validated,
    output path checked, :meth:`Target.prepare`. Then the outputs computed from the reference
    hidden states (:meth:`Target.wants_reference`, :meth:`Target.reference_consumer`) are fed
    by one shared streamed pass (:func:`reference_pass`, timed as each target's
    ``reference_stage``); the others are written by their kind's :meth:`Target.write_together`
    (GGUF policies from one read of each tensor). Each output is then finished
    (:meth:`Target.write`), verified (stage ``verify_stage``) and renamed into place, and ``on_done``
    is called with its :class:`Outcome`.

    ``work``: a directory for resumable work (``quantize batch``'s ``.work/``): the temporary
    outputs live there as ``<name>.partial`` and the layer-streamed passes keep checkpoints
    (:class:`quantpress.calibration.checkpoint.LayerCheckpoint`, keyed by ``work_key``, the
    outputs' options and the code digest), so that a run killed in a pass resumes at the layer
    it reached (``details["resumed_at_layer"]`` of the summaries says where); ``log`` gets the
    messages about saved work. Without ``work``, temporary siblings of the outputs.

    A failure (bad input, failed round trip, NaN activations, out of memory) fails the outputs
    it concerns (a shared stage: all of its outputs), leaves nothing of them behind and does
    not stop the others. Returns the outcomes in the order of ``items``."""
    if not isinstance(source, Source):
        source = Source(source, progress=progress)
    work = None if work is None else Path(work)
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    key = {**(work_key or {}), "code": code_digest()} if work is not None else {}
    outcomes = [Outcome(o, Path(out)) for o, out in items]
    live: list[tuple[Outcome, Target, Run, Path, float]] = []
    tmps: list[Path] = []
    interrupted = True

    def fail(oc: Outcome, e: Exception) -> None:
        oc.error = e
        if on_done is not None:
            on_done(oc)

    try:
        for oc in outcomes:
            t0 = time.perf_counter()
            try:
                cls = target_for(oc.options)
                oc.options.validate()
                check_output(oc.out, cls.output_is_dir, force)
                run = Run(progress)
                target = cls(source, oc.options)
                if work is not None:
                    target.work = work
                    target.work_key = {**key, "output": oc.out.name, "options": options_json(oc.options)}
                    target.log = log
                target.prepare(run)
            except Exception as e:
                fail(oc, e)
                continue
            tmp = temp_path(oc.out) if work is None else work / f"{oc.out.name}.partial"
            if work is None or not cls.resumable:
                remove_path(tmp)
            tmps.append(tmp)
            live.append((oc, target, run, tmp, t0))

        fed = [e for e in live if e[1].wants_reference()]
        ckpt = None
        if fed and work is not None:
            ckpt = LayerCheckpoint(work / "reference.ckpt", "reference",
                                   {**key, "outputs": [[e[0].out.name, options_json(e[0].options)] for e in fed]},
                                   log)
        first = ckpt.start()[0] if ckpt is not None else 0
        consumers = []
        for entry in fed:
            oc, target, run, tmp, _ = entry
            if not first:
                remove_path(tmp)
            try:
                consumers.append(target.reference_consumer(tmp, run, resume=bool(first)))
            except Exception as e:
                fail(oc, e)
        fed = [e for e in fed if e[0].error is None]
        if fed:
            t0 = time.perf_counter()
            names = {type(e[1]).reference_stage for e in fed}
            stage = names.pop() if len(names) == 1 else Target.reference_stage
            for f in STAGE_OBSERVERS:
                f(stage, "start")
            try:
                reference_pass(source, [c for c in consumers if c is not None], progress, ckpt)
            except Exception as e:
                for oc, *_ in fed:
                    fail(oc, e)
            finally:
                for f in STAGE_OBSERVERS:
                    f(stage, "end")
            dt = time.perf_counter() - t0
            for oc, target, run, _, _ in fed:
                run.stages[type(target).reference_stage] = dt
        fed_ids = {id(e[1]) for e in fed}

        groups: dict[type, list] = {}
        for entry in live:
            if entry[0].error is None and id(entry[1]) not in fed_ids:
                groups.setdefault(type(entry[1]), []).append(entry)
        for cls, group in groups.items():
            try:
                errors = cls.write_together([e[1] for e in group], [e[3] for e in group],
                                            [e[2] for e in group])
            except Exception as e:
                errors = [e] * len(group)
            for entry, err in zip(group, errors or [None] * len(group)):
                if err is not None:
                    fail(entry[0], err)

        for oc, target, run, tmp, t0 in live:
            if oc.error is not None:
                remove_path(tmp)
                continue
            try:
                if id(target) in fed_ids:
                    target.write(tmp, run)
                with run.stage(target.verify_stage):
                    roundtrip = target.verify(tmp, run)
                install(tmp, oc.out)
                if work is not None:  # the output's own pass checkpoint, kept until now
                    remove_path(work / f"{oc.out.name}.ckpt")
            except Exception as e:
                remove_path(tmp)
                if work is not None:  # a failed output's own checkpoint is no use
                    remove_path(work / f"{oc.out.name}.ckpt")
                fail(oc, e)
                continue
            s = target.summary(oc.out, roundtrip, run)
            s.files = output_files(oc.out)
            s.stages = dict(run.stages)
            s.seconds = time.perf_counter() - t0
            if id(target) in fed_ids and ckpt is not None and ckpt.resumed_at:
                s.details["resumed_at_layer"] = ckpt.resumed_at
            elif getattr(target, "resumed_at", 0):
                s.details["resumed_at_layer"] = target.resumed_at
            oc.summary = s
            if on_done is not None:
                on_done(oc)
        if ckpt is not None:
            ckpt.remove()
        interrupted = False
    finally:
        if work is None or not interrupted:  # an interrupted batch keeps its work to resume
            for tmp in tmps:
                remove_path(tmp)
    return outcomes


def produce(options: Any, source: Source | str | Path, out: str | Path, *, force: bool = False,
            progress: bool = True) -> Summary:
    """Make one verified output: :func:`produce_many` with one item.

    ``options``: a registered options dataclass (the target is chosen by its type);
    ``source``: a :class:`Source` (or a path, with default compute and calibration options);
    ``out``: the output path; ``force``: replace an existing one. Order: options validated,
    output path checked, :meth:`Target.prepare`, :meth:`Target.write` to a hidden temporary
    sibling (with the shared reference pass when the target has one), :meth:`Target.verify`
    (stage ``verify_stage``), one rename into place. Returns the :class:`Summary`. Raises InputError
    for bad input and RoundTripError when the round trip fails; on any error nothing is left
    at ``out`` or at the temporary path."""
    (oc,) = produce_many([(options, out)], source, force=force, progress=progress)
    if oc.error is not None:
        raise oc.error
    return oc.summary
