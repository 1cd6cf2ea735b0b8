"""The :class:`Target` every output kind subclasses, and the registry of them by options type
(:data:`TARGETS`, :func:`target_for`)."""
from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Callable, ClassVar

from quantpress.calibration.checkpoint import LayerCheckpoint
from quantpress.errors import InputError
from quantpress.targets.registry import TARGETS, Estimate
from quantpress.targets.source import Source
from quantpress.targets.summary import Run, Summary


# --------------------------------------------------------------------------------------------
# Targets and the runner

class Target(abc.ABC):
    """One output kind. A subclass declares itself with class keywords and is registered for
    its options type::

        class ImatrixTarget(Target, kind="imatrix", options=ImatrixOptions): ...

    (``output_is_dir=True`` for a directory output) and implements the four steps;
    ``self.source`` and ``self.options`` are the input model and the validated options."""

    kind: ClassVar[str]
    options_type: ClassVar[type]
    output_is_dir: ClassVar[bool] = False
    #: the stage name under which a shared reference pass is timed (:meth:`reference_consumer`)
    reference_stage: ClassVar[str] = "reference pass"
    #: the stage name under which :meth:`verify` is timed (a target whose round trip runs
    #: beside its writing names the stage that holds that time, so one figure shows it)
    verify_stage: ClassVar[str] = "verify"
    #: whether the target continues an interrupted temporary output in a work directory
    #: (:func:`produce_many` ``work``); the others start it afresh
    resumable: ClassVar[bool] = False
    #: set by :func:`produce_many` with ``work``: the directory, the checkpoint key, the logger
    work: Path | None = None
    work_key: dict = {}
    log: Callable[[str], None] | None = None

    # ---- the wiring (:mod:`quantpress.targets.registry`): read by cli/ and batch/ ----------
    #: the command-line verbs that make this kind (:class:`~quantpress.targets.registry.Verb`)
    verbs: ClassVar[tuple] = ()
    #: the [[model]] key of job files (None: made only when another output needs it)
    job_key: ClassVar[str | None] = None
    #: what the key takes: ``tables`` (a list of option tables) or ``flag`` (true: one output)
    job_value: ClassVar[str] = "tables"
    #: order of the kinds in job files, manifests and plans
    job_order: ClassVar[int] = 100
    #: what an output is called in the batch table (:meth:`job_target`): a ``str.format``
    #: template of ``o`` (the options) and ``kind``; None: the options' ``label``, else the kind
    job_target_format: ClassVar[str | None] = None
    #: boolean option fields marked on :meth:`job_target` as ``-<field>`` when true (``rtn``:
    #: ``w4g128-rtn``)
    job_marks: ClassVar[tuple[str, ...]] = ()
    #: the output's path in the model's batch directory (:meth:`job_path`): a ``str.format``
    #: template of ``name`` (the model's prefix), ``target`` (:meth:`job_target`) and ``o``
    job_path_format: ClassVar[str] = "{name}-{target}"
    #: what the outputs are made from in a batch: ``tensors`` (the checkpoint's tensors, all
    #: outputs of the kind together, beside the passes), ``reference`` (the shared pass over
    #: the reference hidden states) or ``own`` (a pass of each output's own)
    stream: ClassVar[str] = "own"
    #: whether the output is a model (scored by a batch's ``eval``)
    is_model: ClassVar[bool] = True
    #: the output of the same model this kind may need (:class:`~quantpress.targets.registry.Needs`)
    needs: ClassVar[Any] = None
    #: the names of the ``--dry-run`` memory figures of this kind's own stages
    memory_stages: ClassVar[tuple[str, ...]] = ()
    #: which runtimes load the output (a batch's model card)
    runtimes: ClassVar[str] = ""
    #: libraries besides torch, transformers, safetensors and numpy whose code decides the
    #: output's bytes (their versions go into a batch's manifest)
    packages: ClassVar[tuple[str, ...]] = ()
    #: ``--dry-run``'s words for the kind's own stages (``{n}``: the number of outputs), or for
    #: a kind of the shared pass what it feeds
    plan_words: ClassVar[str] = ""

    @classmethod
    def job_entries(cls, value: Any, where: str, base: Path) -> list[Any]:
        """The options of this kind's outputs from the value of its job-file key (``where``
        names the model entry; ``base``: the job file's directory). InputError naming the key."""
        from quantpress.targets.options import from_table

        if cls.job_value == "flag":
            if not isinstance(value, bool):
                raise InputError(f"{where}: {cls.job_key} = {value!r}: expected true or false")
            return [cls.options_type()] if value else []
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise InputError(f"{where}: {cls.job_key} = {value!r}: expected a list of tables")
        return [from_table(cls.options_type, t, f"{where}: {cls.job_key}[{i}]") for i, t in enumerate(value)]

    @classmethod
    def job_target(cls, options: Any) -> str:
        """What was asked, in words (``Q4_K_M``, ``w4g128``, ``4.0``): the batch table's column
        (:attr:`job_target_format`, then a ``-<field>`` per true field of :attr:`job_marks`)."""
        if cls.job_target_format is None:
            words = getattr(options, "label", cls.kind)
        else:
            words = cls.job_target_format.format(o=options, kind=cls.kind)
        return words + "".join(f"-{m}" for m in cls.job_marks if getattr(options, m))

    @classmethod
    def job_path(cls, name: str, options: Any) -> str:
        """The output's path in the model's batch directory, ``name`` the model's prefix
        (:attr:`job_path_format`)."""
        return cls.job_path_format.format(name=name, target=cls.job_target(options), o=options)

    @classmethod
    def describe(cls, options: list[Any], waiting: bool = False) -> str:
        """``--dry-run``'s words for the kind's own stages of ``options`` (``waiting``: those
        that wait for the output they need)."""
        return cls.plan_words.format(n=len(options))

    @classmethod
    def feeds(cls, options: Any) -> str | None:
        """For a kind of the shared pass: what this output's consumer is, in the plan's words
        (None: it takes nothing from the pass)."""
        return cls.plan_words or cls.kind

    @classmethod
    def estimate(cls, info: Any, options: list[Any]) -> Any:
        """``--dry-run``'s :class:`~quantpress.targets.registry.Estimate` of this kind's
        outputs ``options`` of one model (``info``: :class:`~quantpress.targets.registry.ModelInfo`).
        The default: the source's size on disk, no working memory of its own."""
        return Estimate([2 * info.total for _ in options])

    def __init_subclass__(cls, *, kind: str, options: type, output_is_dir: bool = False, **kw):
        super().__init_subclass__(**kw)
        cls.kind, cls.options_type, cls.output_is_dir = kind, options, output_is_dir
        TARGETS[options] = cls

    def __init__(self, source: Source, options: Any):
        self.source = source
        self.options = options

    def prepare(self, run: Run) -> None:
        """Check everything against the model before anything is written (InputError)."""

    def wants_reference(self) -> bool:
        """Whether :meth:`reference_consumer` has a consumer for the shared reference pass."""
        return False

    def checkpoint(self, extra: dict | None = None) -> LayerCheckpoint | None:
        """The checkpoint of a pass of this target's own, ``<work>/<output name>.ckpt``, keyed
        by ``work_key`` and ``extra`` (None without a work directory)."""
        if self.work is None:
            return None
        name = self.work_key["output"]
        return LayerCheckpoint(self.work / f"{name}.ckpt", name, {**self.work_key, **(extra or {})}, self.log)

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> Any:
        """For an output computed from the reference (unquantized) hidden states of the
        calibration rows: start the output at ``tmp`` and return its consumer (``hooks`` /
        ``on_layer``, :class:`quantpress.calibration.engine.FanOut`), which
        :func:`produce_many` feeds from one streamed pass shared by every such output of the
        source; :meth:`write` then finishes without a pass of its own. ``resume``: the pass
        continues a checkpoint, so an interrupted temporary output at ``tmp`` is continued
        (its consumer implements ``layer_state`` / ``restore`` / ``resumed``). Called only when
        :meth:`wants_reference`."""
        return None

    @classmethod
    def write_together(cls, targets: list["Target"], tmps: list[Path],
                       runs: list[Run]) -> list[Exception | None] | None:
        """Write several prepared targets of this kind and of one source, ``targets[i]`` at
        ``tmps[i]``, timed in ``runs[i]``. Returns, per target, the error that stopped it (its
        output alone fails), or None when all were written; raising fails them all. The
        default writes them one by one (a kind overrides it to share reads or to run side by
        side)."""
        errors: list[Exception | None] = []
        for t, tmp, r in zip(targets, tmps, runs):
            try:
                t.write(tmp, r)
            except Exception as e:
                errors.append(e)
            else:
                errors.append(None)
        return errors

    @abc.abstractmethod
    def write(self, tmp: Path, run: Run) -> None:
        """Write the whole output at ``tmp`` (a file path, or a directory to create)."""

    @abc.abstractmethod
    def verify(self, tmp: Path, run: Run) -> str:
        """Re-read ``tmp`` and check it against what :meth:`write` produced; return what was
        checked ("ok (...)"), raise :class:`quantpress.errors.RoundTripError` otherwise."""

    @abc.abstractmethod
    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        """The :class:`Summary` of the finished output at ``out``."""


def target_for(options: Any) -> type[Target]:
    """The registered :class:`Target` class for an options object (TypeError when none)."""
    try:
        return TARGETS[type(options)]
    except KeyError:
        raise TypeError(f"no output target for options of type {type(options).__name__}") from None
