"""What a run reports: the timed stages of one output (:class:`Run`, observed by
:data:`STAGE_OBSERVERS`) and its :class:`Summary`, one shape for every kind."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator


# --------------------------------------------------------------------------------------------
# Stages

#: called with (stage name, "start" | "end") around every stage of every run: the benchmark
#: scripts measure memory per stage through it
STAGE_OBSERVERS: list[Callable[[str, str], None]] = []


class Run:
    """Timings per stage (seconds, in order) and progress bars of one output."""

    def __init__(self, progress: bool = True):
        self.progress = progress
        self.stages: dict[str, float] = {}
        self._depth = 0

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` (added to an earlier stage of that name). Stages
        may nest; observers see only the outermost."""
        outer = self._depth == 0
        if outer:
            for f in STAGE_OBSERVERS:
                f(name, "start")
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0
            self._depth -= 1
            if outer:
                for f in STAGE_OBSERVERS:
                    f(name, "end")

    def split(self, name: str, parts: dict[str, float]) -> None:
        """Replace stage ``name`` by ``parts`` (seconds; what remains of ``name`` after them
        goes to the first part), keeping the order of the stages."""
        total = self.stages.get(name, 0.0)
        first, *rest = parts
        rem = max(0.0, total - sum(parts[k] for k in rest))
        new = {}
        for k, v in self.stages.items():
            if k == name:
                new[first] = rem
                for r in rest:
                    new[r] = parts[r]
            else:
                new[k] = v
        self.stages = new

    def bar(self, iterable: Iterable, desc: str, unit: str = "it", total: int | None = None):
        """A tqdm bar over ``iterable`` (none when progress is off)."""
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not self.progress, leave=False)


# --------------------------------------------------------------------------------------------
# The summary

@dataclass
class Summary:
    """What one output is, in one shape for every kind.

    ``kind``: gguf, awq, exl2, imatrix, measurement. ``target``: what was asked (``Q4_K_M``,
    ``w4g128``, ``4.0`` bpw, ...). ``output``: the final path. ``source``: the input model.
    ``files``: bytes per file relative to ``output`` (a single-file output: its name).
    ``tensor_bytes`` / ``parameters``: bytes of tensor data written and weights they stand for
    (``bpw`` = 8 · tensor_bytes / parameters; None when the output is no model).
    ``roundtrip``: what the round trip checked ("ok (...)"). ``seconds`` and ``stages``:
    wall time, in total and per stage. ``details``: the kind's own figures (JSON-able);
    ``lines``: the kind's own text lines."""

    kind: str
    target: str
    output: Path
    source: str
    files: dict[str, int] = field(default_factory=dict)
    tensor_bytes: int = 0
    parameters: int = 0
    roundtrip: str = ""
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Bytes of every file of the output."""
        return sum(self.files.values())

    @property
    def bpw(self) -> float | None:
        """Bits per weight: 8 · tensor bytes / weights (None when the output is no model)."""
        return 8.0 * self.tensor_bytes / self.parameters if self.parameters else None

    def text(self) -> str:
        """Human-readable summary: what was written, the kind's lines, size, time per stage,
        the round trip."""
        st = ", ".join(f"{k} {v:.1f} s" for k, v in self.stages.items())
        size = f"{self.bytes:,} bytes ({self.bytes / 2 ** 20:.2f} MiB)"
        if len(self.files) > 1:
            size += f" in {len(self.files)} files"
        if self.bpw is not None:
            size += f", {self.bpw:.4f} bits per weight over {self.parameters:,} weights"
        return "\n".join([f"wrote      {self.output}",
                          f"{self.kind:<10} {self.target} from {self.source}",
                          *self.lines,
                          f"size       {size}",
                          f"time       {self.seconds:.1f} s ({st})",
                          f"round trip {self.roundtrip}"])

    def to_json(self) -> dict:
        """The summary as a JSON-able dict (``details`` merged under its own key)."""
        bpw = self.bpw
        return {"kind": self.kind, "target": self.target, "output": str(self.output),
                "source": self.source, "files": dict(self.files), "bytes": self.bytes,
                "tensor_bytes": self.tensor_bytes, "parameters": self.parameters,
                "bpw": None if bpw is None else round(bpw, 4), "roundtrip": self.roundtrip,
                "seconds": round(self.seconds, 2),
                "stages": {k: round(v, 2) for k, v in self.stages.items()},
                "details": self.details}


def output_files(path: Path) -> dict[str, int]:
    """Bytes per file of an output: a file → {its name: size}; a directory → every regular
    file below it by relative path, sorted."""
    path = Path(path)
    if path.is_file():
        return {path.name: path.stat().st_size}
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
