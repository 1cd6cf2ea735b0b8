"""``convert``: format conversion verbs. One verb per registered target verb of the command
``convert`` (built from the targets' declarations; every verb and option: docs/commands.md),
and:

  convert inspect FILE.gguf [--json]
"""
from __future__ import annotations

import json
from typing import NoReturn

from quantpress.cli import common


def add_verbs(sub) -> None:
    """Add the ``convert`` verbs to an argparse subparsers object: one per registered target
    verb (:func:`quantpress.cli.common.add_target_verbs`), then ``inspect``."""
    common.add_target_verbs(sub, "convert")
    i = sub.add_parser("inspect", help="metadata and per-tensor table of any GGUF file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    common.verb_options(i, _inspect, compute=False)


def _inspect(args) -> int:
    from quantpress.convert.gguf_inspect import format_inspection, inspect_gguf

    info = inspect_gguf(args.file)
    print(json.dumps(info, indent=1) if args.json else format_inspection(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``convert`` entry point; returns the exit code (0, 1, 2 or 3)."""
    return common.main("convert", "quantpress format conversion", add_verbs, argv)


def console() -> NoReturn:
    """The ``convert`` command (console script): :func:`main` on ``sys.argv``, then
    :func:`~quantpress.cli.common.exit_with` its code."""
    common.exit_with(main())


if __name__ == "__main__":
    console()
