"""What a target declares besides its options: its command-line verbs (:class:`Verb`, with the
:class:`Step` list a verb runs), what one of its outputs needs from another output of the
same model (:class:`Needs`), and the figures of ``quantize batch --dry-run``
(:class:`ModelInfo` in, :class:`Estimate` out). :func:`registered` lists the target classes;
:func:`load_plugins` imports the ones other installed packages declare as entry points.

``cli/`` builds every verb and ``batch/`` every job-file key, stage and estimate from these
declarations, so a new output kind is one module under ``targets/`` (or a plugin): see
``docs/adding-a-format.md`` and ``tests/test_extra_target.py``.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from quantpress.errors import InputError

#: the entry-point group other packages declare their target modules in (imported by
#: :func:`load_plugins`: installed code only, never a path from the command line)
PLUGIN_GROUP = "quantpress.targets"

#: options type → the :class:`~quantpress.targets.target.Target` subclass that makes its
#: outputs (filled by ``Target.__init_subclass__``)
TARGETS: dict[type, type] = {}


@dataclass(frozen=True)
class Step:
    """One output a verb makes: ``options`` at ``out``; ``calibrated``: the source carries the
    calibration options; ``aside``: its summary goes to stderr (an output made on the way,
    such as ``--imatrix auto``'s importance matrix); ``report``: also write its JSON summary
    to this path."""

    options: Any
    out: str | Path
    calibrated: bool = True
    aside: bool = False
    report: str | None = None


@dataclass(frozen=True)
class Verb:
    """A command-line verb of a target: ``command`` (``quantize`` or ``convert``), ``name``
    and ``help``; its positional argument ``arg`` (what it reads: ``input``, ``hf`` a Hugging
    Face directory, ``gguf`` a GGUF file, ``any`` either; ``arg_help``); ``out_help`` and
    ``out_required`` of ``-o``; ``calibrated`` (offers the calibration options), ``dtype``
    (offers ``--dtype``: the compute dtype changes the output); ``report`` (help of
    ``--report``, None: not offered); ``overrides``: per option field, :class:`Opt` attributes
    changed for this verb; ``extra``: (flags, argparse keywords) of arguments of the verb
    alone; ``check_input(path)``: InputError for an input the verb does not read; ``steps(args,
    options)``: the :class:`Step` list (default: one step, ``options`` at ``-o``)."""

    command: str
    name: str
    help: str
    input: str = "hf"
    arg: str = "model"
    arg_help: str = "Hugging Face model directory (FP16/BF16/F32 safetensors)"
    out_help: str = "output directory"
    out_required: bool = True
    calibrated: bool = True
    dtype: bool = True
    report: str | None = None
    overrides: dict = field(default_factory=dict)
    extra: tuple = ()
    check_input: Callable[[str], None] | None = None
    steps: Callable[[argparse.Namespace, Any], list[Step]] | None = None

    def plan(self, args: argparse.Namespace, options: Any) -> list[Step]:
        """The steps of one command (:attr:`steps`, or ``options`` at ``args.output``)."""
        if self.steps is not None:
            return self.steps(args, options)
        return [Step(options, args.output, self.calibrated, report=getattr(args, "report", None))]


@dataclass(frozen=True)
class Needs:
    """An output that needs another output of the same model: the output of options type
    ``provider`` (made first, by the same batch, with its default options unless the job
    asks for it), whose path is set to this output's field ``option``; ``what`` names it in
    messages; ``when(options)``: whether this output needs it; ``reuse_key``: a [[model]] key
    naming an existing file to use instead (``reuse_what``: what that file is); ``together``:
    a local run makes this kind's outputs that need one provider in one stage."""

    provider: type
    option: str
    what: str
    when: Callable[[Any], bool]
    reuse_key: str | None = None
    reuse_what: str = ""
    together: bool = False


@dataclass
class ModelInfo:
    """What ``--dry-run`` knows of a model without reading a weight: ``shapes`` / ``numel``
    per checkpoint tensor, ``cfg`` (config.json), ``layers``, ``hidden``, ``ffn`` (MLP
    width), ``vocab``, ``heads``, ``head_dim``; bytes in float32: ``layer`` (one decoder layer),
    ``emb`` (vocab × hidden); ``linear`` / ``total``: elements of the decoder linears / of
    every tensor; ``tokens``: calibration tokens; ``device``: the torch device it will run on."""

    shapes: dict[str, tuple[int, ...]]
    numel: dict[str, int]
    cfg: dict
    layers: int
    hidden: int
    ffn: int
    vocab: int
    heads: int
    head_dim: int
    layer: int
    emb: int
    linear: int
    total: int
    tokens: int
    device: Any


@dataclass
class Estimate:
    """A kind's ``--dry-run`` figures for its outputs of one model: ``sizes`` (bytes on disk,
    one per output, in order), ``stages`` (working memory in bytes of the stages the kind runs
    on its own, by name) and ``consumers`` (working set of each consumer it puts on the shared
    calibration pass)."""

    sizes: list[int]
    stages: dict[str, int] = field(default_factory=dict)
    consumers: list[int] = field(default_factory=list)


def registered() -> list[type]:
    """Every registered target class, in job-file order (``job_order``, then registration)."""
    return sorted(TARGETS.values(), key=lambda c: c.job_order)


def verbs(command: str) -> list[tuple[type, Verb]]:
    """(target class, verb) of every verb of ``command``, in job-file order (:func:`registered`:
    GGUF, imatrix, AWQ, GPTQ, FP8, EXL2, then other kinds)."""
    return [(cls, v) for cls in registered() for v in cls.verbs if v.command == command]


def load_plugins() -> list[str]:
    """Import the target modules that installed distributions declare under the entry-point
    group :data:`PLUGIN_GROUP` (importing one registers its targets); their names. An entry
    point names a module that defines a target (``int8 = mypkg.int8_target``) or a target
    class (``mypkg.int8_target:Int8Target``). Nothing is imported from a path given at run
    time. InputError, one line naming the entry point, for one that fails to import or names
    no registered target."""
    from importlib.metadata import entry_points

    names = []
    for ep in entry_points(group=PLUGIN_GROUP):
        where = f"plugin entry point '{ep.name} = {ep.value}' (group {PLUGIN_GROUP})"
        try:
            obj = ep.load()
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise InputError(f"{where}: cannot be imported: {type(e).__name__}: {first}") from e
        if not _defines_target(obj):
            raise InputError(f"{where}: {obj!r} is not a target module or a Target subclass "
                             f"(a Target subclass registers itself when its module is imported)")
        names.append(ep.name)
    return names


def _defines_target(obj: Any) -> bool:
    """Whether ``obj`` is a registered target class, or a module (or package) that defines one."""
    classes = list(TARGETS.values())
    if isinstance(obj, type):
        return obj in classes
    return isinstance(obj, ModuleType) and any(
        c.__module__ == obj.__name__ or c.__module__.startswith(obj.__name__ + ".") for c in classes)
