"""Peak anonymous memory per phase of a pipeline run, for the benchmark scripts' child
processes (scripts/bench_awq.py, scripts/bench_exl2.py).

A :class:`PhaseWatch` samples ``RssAnon`` of this process every 2 ms on a thread and keeps,
per phase, the peak, the level at the phase's start (after giving freed heap memory back), and
the innermost frames of this repository's code at the moment of the peak. Phases are entered by
wrapping the functions that make them (:meth:`PhaseWatch.wrap`); a function called inside
another phase counts toward the outer one.

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

REPO = str(Path(__file__).resolve().parent.parent)


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
    from calibration import engine
    from cli import calib_pipeline as cp

    sm = engine.StreamingModel(model)
    tok = cp.find_loader(Path(model)).tokenizer(Path(model))
    tok(["warm up"], add_special_tokens=False)
    del sm, tok
    cp.trim_heap()
    return status("RssAnon")


class PhaseWatch:
    """Per-phase peaks of anonymous RSS (bytes): ``peaks``, ``starts``, ``where``."""

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
                                  for x in st if REPO in x.filename][-3:]
            time.sleep(self.period)

    def wrap(self, name: str, fn):
        """``fn`` running as phase ``name`` (unless called from inside another phase)."""
        from cli import calib_pipeline as cp

        def wrapped(*a, **k):
            prev = self.phase
            if prev != "setup":
                return fn(*a, **k)
            cp.trim_heap()
            self.starts[name] = status("RssAnon")
            self.phase = name
            try:
                return fn(*a, **k)
            finally:
                self.phase = prev
        return wrapped

    def start(self) -> "PhaseWatch":
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling; returns {"phases", "starts", "where"} for the parent."""
        self._done.set()
        self._thread.join()
        return {"phases": self.peaks, "starts": self.starts, "where": self.where}
