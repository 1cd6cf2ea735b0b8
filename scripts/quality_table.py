"""The Markdown quality table the quality scripts print: :func:`bench_common.print_table`,
which defines it (the scripts' shared set-up lives in ``scripts/bench_common.py``). No script
of this checkout imports this module any more; it is kept for commands written against it."""
from __future__ import annotations

from bench_common import print_table

__all__ = ["print_table"]
