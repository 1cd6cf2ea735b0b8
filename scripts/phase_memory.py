"""Peak anonymous memory per stage of a quantpress run, for the benchmark scripts' child
processes (scripts/bench_awq.py, scripts/bench_exl2.py).

A :class:`PhaseWatch` samples ``RssAnon`` of this process every 2 ms on a thread and keeps,
per phase, the peak, the level at the phase's start (after giving freed heap memory back), and
the innermost frames of quantpress's code at the moment of the peak. Phases are the runner's
stages (:data:`quantpress.targets.base.STAGE_OBSERVERS`: tokenize, layers, measurement,
allocation, quantization, head, write, verify, ...): :meth:`PhaseWatch.start` subscribes.

:func:`libraries_baseline` loads what every run loads whatever the model (torch, transformers'
model classes and what they import, the tokenizer) so that the figures above it are the
model's and the data's.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from pathlib import Path

import quantpress

PACKAGE = str(Path(quantpress.__file__).resolve().parent)


def status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmHWM``, ``RssAnon``, ...)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def libraries_baseline(model: str | Path) -> int:
    """Build ``model``'s streaming skeleton and tokenizer once, drop them, trim the heap;
    returns the anonymous RSS then (bytes)."""
    from quantpress.calibration import engine
    from quantpress.convert import loaders
    from quantpress.runtime import trim_heap

    sm = engine.StreamingModel(model)
    tok = loaders.find_loader(Path(model)).tokenizer(Path(model))
    tok(["warm up"], add_special_tokens=False)
    del sm, tok
    trim_heap()
    return status("RssAnon")


class PhaseWatch:
    """Per-stage peaks of anonymous RSS (bytes): ``peaks``, ``starts``, ``where``."""

    def __init__(self, period: float = 0.002):
        self.period = period
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self.where: dict[str, list[str]] = {}
        self._main = threading.get_ident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            a, ph = status("RssAnon"), self.phase
            if a > self.peaks.get(ph, 0):
                self.peaks[ph] = a
                f = sys._current_frames().get(self._main)
                st = traceback.extract_stack(f) if f is not None else []
                self.where[ph] = [f"{Path(x.filename).name}:{x.name}:{x.lineno}"
                                  for x in st if PACKAGE in x.filename][-3:]
            time.sleep(self.period)

    def observe(self, stage: str, event: str) -> None:
        """A runner stage starts or ends (``quantpress.targets.base.STAGE_OBSERVERS``)."""
        from quantpress.runtime import trim_heap

        if event == "start":
            trim_heap()
            self.starts.setdefault(stage, status("RssAnon"))
            self.phase = stage
        else:
            self.phase = "setup"

    def start(self) -> "PhaseWatch":
        """Start sampling and follow the runner's stages."""
        from quantpress.targets.base import STAGE_OBSERVERS

        STAGE_OBSERVERS.append(self.observe)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling; returns {"phases", "starts", "where"} for the parent."""
        from quantpress.targets.base import STAGE_OBSERVERS

        self._done.set()
        self._thread.join()
        STAGE_OBSERVERS.remove(self.observe)
        return {"phases": self.peaks, "starts": self.starts, "where": self.where}
