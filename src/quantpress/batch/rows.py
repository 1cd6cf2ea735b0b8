"""What ``quantize batch`` reports: one :class:`Row` per output (kept, made or failed), the
closing table of them (:func:`closing_table`) and the exit code (:func:`exit_code`).
"""
from __future__ import annotations

from dataclasses import dataclass

from quantpress.errors import InputError, RoundTripError


@dataclass
class Row:
    """One line of the closing table."""

    model: str
    kind: str
    target: str
    path: str
    status: str          # made, kept, failed
    seconds: float = 0.0
    bytes: int = 0
    bpw: float | None = None
    error: str = ""
    code: int = 0        # exit code class of a failure (1, 2, 3)
    resumed_at: int = 0  # first layer run by this process when a pass resumed saved work


def error_code(e: Exception) -> int:
    """The exit code class of a failure: 2 for bad input (InputError), 3 for a failed round
    trip (RoundTripError), 1 otherwise."""
    return 2 if isinstance(e, InputError) else 3 if isinstance(e, RoundTripError) else 1


def first_line(e: Exception) -> str:
    """The first line of an exception's message (its class name when it has none): what a
    row and a manifest entry say about a failure."""
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def closing_table(rows: list[Row]) -> str:
    """The table printed when the batch ends: one line per output."""
    head = f"{'model':<20} {'output':<36} {'status':<7} {'size':>11} {'bpw':>7} {'time':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r.bytes / 2 ** 20:,.1f} MiB" if r.bytes else ""
        bpw = f"{r.bpw:.3f}" if r.bpw else ""
        t = f"{r.seconds:.1f} s" if r.seconds else ""
        lines.append(f"{r.model[:20]:<20} {r.path[:36]:<36} {r.status:<7} {size:>11} {bpw:>7} {t:>8}"
                     + (f"  {r.error}" if r.error else "")
                     + (f"  (resumed at layer {r.resumed_at})" if r.resumed_at else ""))
    made = sum(r.status == "made" for r in rows)
    kept = sum(r.status == "kept" for r in rows)
    failed = sum(r.status == "failed" for r in rows)
    lines.append(f"{made} made, {kept} kept from an earlier run, {failed} failed")
    return "\n".join(lines)


def exit_code(rows: list[Row]) -> int:
    """0 when nothing failed; else 3 if a round trip failed, 2 for bad input, 1 otherwise."""
    codes = {r.code for r in rows if r.status == "failed"}
    if not codes:
        return 0
    return 3 if 3 in codes else 2 if 2 in codes else 1

