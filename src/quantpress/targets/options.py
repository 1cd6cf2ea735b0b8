"""One declaration per option: the field of an options dataclass says, once, its default, its
command-line flag and help, its job-file key and its type, and both the CLI and the batch job
files are built from that declaration (:mod:`quantpress.cli.common`,
:mod:`quantpress.batch.jobfile`)::

    @dataclass(frozen=True)
    class MyOptions:
        group_size: int = option(128, flag="--group-size", help="columns per scale (default {default})")
        sym: bool = option(True, flag="--sym", off="--asym", help="symmetric", off_help="asymmetric")
        ignore: tuple[str, ...] = option((), flag="--ignore", nargs="+", metavar="NAME", help="...")

The value checks stay in the dataclass's ``validate()`` (InputError naming the flag), which
both paths call; the type of a job-file value is checked here against the field's annotation.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from quantpress.errors import InputError

#: the key of an :class:`Opt` in a dataclass field's metadata
META = "quantpress"


@dataclass(frozen=True)
class Opt:
    """How one option appears: ``flag`` on the command line (None: not offered there),
    ``help`` (``{default}`` is replaced by the default), ``off`` the flag that sets a boolean
    False (``--asym``, ``--no-clip``: with no ``flag`` only that one exists), ``append``
    (repeatable flag), ``nargs`` (a list after one flag), ``choices``, ``metavar``,
    ``required`` on the command line, and ``job``: whether job-file tables take it (under the
    field's name)."""

    flag: str | None = None
    help: str = ""
    off: str | None = None
    off_help: str = ""
    append: bool = False
    nargs: str | None = None
    choices: tuple | None = None
    metavar: str | None = None
    required: bool = False
    job: bool = True


def option(default: Any = MISSING, *, flag: str | None = None, help: str = "", off: str | None = None,
           off_help: str = "", append: bool = False, nargs: str | None = None,
           choices: tuple | None = None, metavar: str | None = None, required: bool = False,
           job: bool = True) -> Any:
    """A dataclass field carrying its :class:`Opt` declaration (see :class:`Opt` for the
    arguments; ``default``: the one default of the option, MISSING for a field without one).
    Returns what ``dataclasses.field`` returns."""
    meta = {META: Opt(flag, help, off, off_help, append, nargs,
                      None if choices is None else tuple(choices), metavar, required, job)}
    return field(default=default, metadata=meta)


def declaration(f: Field) -> Opt:
    """The :class:`Opt` of a dataclass field (a field declared without :func:`option`: a job
    key only, no flag)."""
    return f.metadata.get(META) or Opt()


def default_of(f: Field) -> Any:
    """A field's default (None when it has none)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None


def _scalar(annotation: str):
    names = [a.strip() for a in str(annotation).split("|")]
    for n in names:
        if n in ("int", "float", "str"):
            return {"int": int, "float": float, "str": str}[n]
    return str


def help_text(f: Field, opt: Opt) -> str:
    """The help of a field's flag, ``{default}`` filled in."""
    return opt.help.replace("{default}", str(default_of(f)))


def add_arguments(parser: argparse.ArgumentParser, options_type: type,
                  overrides: dict[str, dict] | None = None) -> None:
    """Add a flag per declared field of ``options_type`` to ``parser`` (dest: the field's
    name; default: the field's). ``overrides``: per field name, :class:`Opt` attributes this
    verb changes (e.g. ``{"policy": {"required": True}}``)."""
    for f in fields(options_type):
        opt = declaration(f)
        if overrides and f.name in overrides:
            opt = Opt(**{**opt.__dict__, **overrides[f.name]})
        if opt.flag is None and opt.off is None:
            continue
        default = default_of(f)
        text = help_text(f, opt)
        if "bool" in str(f.type):
            if opt.flag is not None:
                parser.add_argument(opt.flag, dest=f.name, action="store_true", default=default, help=text)
            if opt.off is not None:
                parser.add_argument(opt.off, dest=f.name, action="store_false", default=default,
                                    help=opt.off_help or text)
            continue
        kw: dict[str, Any] = {"dest": f.name, "help": text}
        if opt.metavar:
            kw["metavar"] = opt.metavar
        if opt.choices:
            kw["choices"] = opt.choices
        if opt.required:
            kw["required"] = True
        typ = _scalar(f.type)
        if opt.append:
            kw.update(action="append", default=[], type=typ)
        elif opt.nargs:
            kw.update(nargs=opt.nargs, default=list(default or ()), type=typ)
        else:
            kw.update(default=None if opt.required else default, type=typ)
        parser.add_argument(opt.flag, **kw)


def from_args(options_type: type, args: argparse.Namespace, **given: Any) -> Any:
    """``options_type`` from parsed arguments (:func:`add_arguments`): each field offered on
    the command line from its dest (lists become tuples), the others their defaults;
    ``given``: values set by the caller instead. Not validated."""
    values = {}
    for f in fields(options_type):
        if f.name in given:
            values[f.name] = given[f.name]
        elif hasattr(args, f.name) and (declaration(f).flag or declaration(f).off):
            v = getattr(args, f.name)
            values[f.name] = tuple(v) if isinstance(v, list) else v
        elif f.default is MISSING and f.default_factory is MISSING:
            values[f.name] = None
    return options_type(**values)


# --------------------------------------------------------------------------------------------
# Job-file tables

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),),
          "tuple[str, ...]": (list, tuple)}
_WORDS = {"int": "an integer", "float": "a number", "bool": "true/false", "str": "a string",
          "None": "absent", "tuple[str, ...]": "a list of strings"}


def check_type(where: str, key: str, value: Any, annotation: Any) -> None:
    """InputError ``where: key = value: expected <type>`` unless ``value`` (a TOML value) fits
    the field annotation ``annotation`` (int, float, bool, str, None, tuple[str, ...], unions)."""
    names = [a.strip() for a in str(annotation).split("|")]
    for n in names:
        allowed = _TYPES.get(n)
        if allowed is None:
            continue
        if n in ("int", "float") and isinstance(value, bool):
            continue
        if n == "tuple[str, ...]" and isinstance(value, (list, tuple)) \
                and not all(isinstance(v, str) for v in value):
            continue
        if isinstance(value, allowed):
            return
    raise InputError(f"{where}: {key} = {value!r}: expected "
                     f"{' or '.join(_WORDS.get(n, n) for n in names)}")


def job_keys(options_type: type, exclude: tuple[str, ...] = ()) -> list[str]:
    """The job-file keys of ``options_type``: its fields declared with ``job=True`` (every
    field of a dataclass without declarations), in order."""
    return [f.name for f in fields(options_type) if declaration(f).job and f.name not in exclude]


def from_table(options_type: type, table: Any, where: str, exclude: tuple[str, ...] = ()) -> Any:
    """``options_type`` from a TOML table: unknown keys refused (naming ``where``, the key and
    the keys the options declare), values type-checked against the fields' annotations,
    required fields demanded (a TOML array becomes the tuple a ``tuple[...]`` field holds),
    then ``validate()``; every InputError is prefixed with ``where``."""
    if not isinstance(table, dict):
        raise InputError(f"{where}: expected a table {{ key = value, ... }}, got {table!r}")
    names = job_keys(options_type, exclude)
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(names)}")
    table = dict(table)
    for f in fields(options_type):
        if f.name in table:
            check_type(where, f.name, table[f.name], f.type)
            if str(f.type).startswith("tuple[") and isinstance(table[f.name], list):
                table[f.name] = tuple(table[f.name])
        elif f.name in names and f.default is MISSING and f.default_factory is MISSING:
            raise InputError(f"{where}: missing key {f.name!r}")
    opts = options_type(**table)
    validate = getattr(opts, "validate", None)
    if validate is not None:
        try:
            validate()
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
    return opts
