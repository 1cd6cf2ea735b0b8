"""The verification protocol every output goes through: the output path checked before any
work, a hidden temporary sibling written and verified, then one rename into place; nothing
left behind otherwise."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from quantpress.errors import InputError


def check_output(out: Path, is_dir: bool, force: bool) -> None:
    """Refuse an existing ``out`` without ``force``, a missing or unwritable parent directory,
    and a directory where a file is expected (InputError naming the path)."""
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out}: already exists (use --force to overwrite)")
    if out.is_dir() and not is_dir:
        raise InputError(f"{out}: is a directory, expected a file path")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{parent}: output directory does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{parent}: output directory is not writable")


def temp_path(out: Path) -> Path:
    """The hidden temporary sibling of ``out`` (with the process id) that is renamed into
    place once verified."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def remove_path(p: Path) -> None:
    """Remove a file, a link or a directory tree at ``p`` (nothing when there is none)."""
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def install(tmp: Path, out: Path) -> None:
    """Move the verified ``tmp`` to ``out`` with one rename. An existing ``out`` (allowed by
    ``--force``) is first renamed aside and removed only after the new one is in place."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        remove_path(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        remove_path(old)
