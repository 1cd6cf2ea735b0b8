"""Shared CLI plumbing: one-line errors with a non-zero exit code."""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Callable

from quantize.errors import InputError

EXIT_BAD_INPUT = 2
EXIT_FAILED_CHECK = 3


def run_command(fn: Callable[[], int]) -> int:
    """Run ``fn``; print bad input (InputError, ValueError, OSError, KeyError, and
    NotImplementedError for unsupported tokenizers) as one line
    ``error: ...`` and return 2, a failed round trip (RuntimeError) as one line and return 3.
    Set QUANTPRESS_DEBUG=1 for tracebacks."""
    try:
        return fn()
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    except (InputError, ValueError, OSError, KeyError, NotImplementedError) as e:
        code, msg = EXIT_BAD_INPUT, e.args[0] if isinstance(e, KeyError) and e.args else e
    except RuntimeError as e:
        code, msg = EXIT_FAILED_CHECK, e
    if os.environ.get("QUANTPRESS_DEBUG"):
        traceback.print_exc()
    print(f"error: {str(msg).splitlines()[0] if str(msg) else type(msg).__name__}", file=sys.stderr)
    return code


def check_output(out: Path, force: bool) -> None:
    """Refuse an existing output without ``force`` and an unwritable directory (InputError)."""
    out = Path(out)
    check_output_dir(out, force)
    if out.is_dir():
        raise InputError(f"{out}: is a directory, expected a file path")


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing output directory (or file) without ``force``, and a missing or
    unwritable parent directory (InputError)."""
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out}: already exists (use --force to overwrite)")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{parent}: output directory does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{parent}: output directory is not writable")
