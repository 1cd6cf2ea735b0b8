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

:class:`CPUClock` gives a child's wall, user and system seconds and minor page faults over a
run; :func:`truncated_model` makes a model of the first N decoder layers of another, so a
bench can run the default calibration (128 x 512) in minutes and still see every per-layer
cost (forwards, searches, page faults of [rows, seq, hidden] temporaries) at full size.
"""
from __future__ import annotations

import json
import os
import resource
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


def truncated_model(model: str | Path, layers: int, dest: str | Path) -> Path:
    """A copy of the Hugging Face directory ``model`` under ``dest`` with its first ``layers``
    decoder layers: config.json's ``num_hidden_layers`` = ``layers``, one model.safetensors
    with every tensor but those of the later layers (``*.layers.<i>.*``, i ≥ ``layers``), the
    other files symlinked. Returns the copy's path. ValueError when ``layers`` is not in
    1..num_hidden_layers."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    model, dest = Path(model), Path(dest) / f"{Path(model).name}-{layers}L"
    cfg = json.loads((model / "config.json").read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: {model} has {cfg['num_hidden_layers']} decoder layers")
    dest.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json" and not f.name.startswith("model") and not (dest / f.name).exists():
            os.symlink(f.resolve(), dest / f.name)
    keep = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                m = re.search(r"\.layers\.(\d+)\.", k)
                if m is None or int(m.group(1)) < layers:
                    keep[k] = st.get_tensor(k)
    save_file(keep, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}, indent=2))
    return dest


class CPUClock:
    """Wall, user and system seconds and minor page faults since construction, of this
    process (``who`` = ``resource.RUSAGE_SELF``) or of its waited-for children
    (``resource.RUSAGE_CHILDREN``)."""

    def __init__(self, who: int = resource.RUSAGE_SELF):
        self.who = who
        self.r0, self.t0 = resource.getrusage(who), time.perf_counter()

    def read(self) -> dict:
        """{"wall_s", "user_s", "sys_s", "minflt"} since construction."""
        r1 = resource.getrusage(self.who)
        return {"wall_s": time.perf_counter() - self.t0, "user_s": r1.ru_utime - self.r0.ru_utime,
                "sys_s": r1.ru_stime - self.r0.ru_stime, "minflt": r1.ru_minflt - self.r0.ru_minflt}


def cpu_line(c: dict) -> str:
    """``CPUClock.read()`` as one line: user and system seconds, system share, page faults."""
    return (f"CPU user {c['user_s']:.1f} s, system {c['sys_s']:.1f} s ({c['sys_s'] / max(c['wall_s'], 1e-9):.1%} "
            f"of wall {c['wall_s']:.1f} s), {c['minflt'] / 1e6:.2f} M page faults")


def libraries_baseline(model: str | Path) -> int:
    """Build ``model``'s streaming skeleton and tokenizer once, drop them, trim the heap;
    returns the anonymous RSS then (bytes)."""
    from quantpress.calibration import engine
    from quantpress.convert import loaders
    from quantpress.memory import trim_heap

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
        from quantpress.memory import trim_heap

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
