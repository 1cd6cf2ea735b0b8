"""Peak anonymous memory per stage of a quantpress run, and the CPU clock of a run: the names
the benchmark scripts imported from here before their shared set-up moved into
``scripts/bench_common.py``, which defines them (:class:`PhaseWatch`,
:func:`libraries_baseline`, :func:`status`, :class:`CPUClock`, :func:`cpu_line`,
:func:`truncated_model`). No script of this checkout imports this module any more; it is kept
for commands written against it."""
from __future__ import annotations

from bench_common import CPUClock, PhaseWatch, cpu_line, libraries_baseline, status, truncated_model

__all__ = ["CPUClock", "PhaseWatch", "cpu_line", "libraries_baseline", "status", "truncated_model"]
