"""Resumable layer-streamed passes: what :func:`quantpress.calibration.engine.run` keeps on disk
after each finished decoder layer, so that a pass killed at layer k restarts at layer k.

The hidden states are kept on disk (``hidden-<i>.pt``, the pass's stream after layer i) rather
than replayed through the finished layers: a replay of a quantizing pass (EXL2) would need the
quantized layers rebuilt from the written parts, and a replay of the reference pass would cost
a forward of every finished layer; one file of ``rows × seqlen × hidden`` values per layer is
cheap next to either. Each consumer's share of the layer (statistics, option scores, the part
files its writer made and the records for the round trip) goes to ``layer-<i>.pt``; ``done.json``
names the last committed layer and is replaced last (the commit point), so a kill at any moment
leaves either the previous or the new layer committed. ``key.json`` holds what the pass depends
on (job options, code digest); a checkpoint with another key is discarded with a message.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import torch

#: environment variable of the tests' kill hook: "<checkpoint name>:<layer>" kills the process
#: with SIGKILL right after that layer is committed
KILL_HOOK = "QUANTPRESS_TEST_KILL_AFTER"


def code_digest() -> str:
    """SHA-256 (hex, 16 characters) over every source and data file of the installed quantpress
    package: saved work is only reused by the code that made it."""
    import quantpress

    root = Path(quantpress.__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class LayerCheckpoint:
    """The saved progress of one streamed pass in ``directory`` (created), named ``name`` in
    messages and in the kill hook. ``key``: JSON-able description of everything the pass's
    results depend on; ``log(message)`` reports a discarded or resumed checkpoint."""

    def __init__(self, directory: str | Path, name: str, key: dict,
                 log: Callable[[str], None] | None = None):
        self.dir = Path(directory)
        self.name = name
        self.key = json.loads(json.dumps(key, sort_keys=True, default=str))
        self.log = log or (lambda m: None)
        self.resumed_at = 0
        self._started: tuple | None = None

    def _last(self) -> int:
        try:
            return int(json.loads((self.dir / "done.json").read_text())["layer"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1

    def start(self) -> tuple[int, torch.Tensor | None, list[Any]]:
        """``(first layer to run, hidden states after the layer before it or None, the saved
        per-layer states of the finished layers in order)``. A checkpoint made for another
        key, or unreadable, is discarded (message through ``log``) and the pass starts at 0.
        Later calls return the first call's answer (the caller may look before the engine)."""
        if self._started is None:
            self._started = self._start()
        return self._started

    def _start(self) -> tuple[int, torch.Tensor | None, list[Any]]:
        if self.dir.is_dir():
            try:
                old = json.loads((self.dir / "key.json").read_text())
            except (OSError, ValueError):
                old = None
            if old != self.key:
                self.log(f"{self.name}: saved work under {self.dir} was made by another job or "
                         f"code version; discarded")
                shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "key.json").write_text(json.dumps(self.key, sort_keys=True))
        last = self._last()
        if last < 0:
            return 0, None, []
        try:
            hidden = torch.load(self.dir / f"hidden-{last}.pt", weights_only=True)
            states = [torch.load(self.dir / f"layer-{i}.pt", weights_only=False) for i in range(last + 1)]
        except (OSError, RuntimeError, EOFError) as e:
            self.log(f"{self.name}: saved work under {self.dir} is unreadable ({type(e).__name__}); "
                     f"discarded")
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            (self.dir / "key.json").write_text(json.dumps(self.key, sort_keys=True))
            return 0, None, []
        self.resumed_at = last + 1
        self.log(f"{self.name}: resuming at layer {last + 1} (layers 0-{last} kept from the "
                 f"interrupted run)")
        return last + 1, hidden, states

    def commit(self, index: int, hidden: torch.Tensor, state: Any) -> None:
        """Save layer ``index``'s consumer ``state`` and the hidden states after it, then make
        it the last finished layer (the previous hidden states are then deleted)."""
        _atomic_save(state, self.dir / f"layer-{index}.pt")
        _atomic_save(hidden.detach().cpu(), self.dir / f"hidden-{index}.pt")
        tmp = self.dir / "done.json.tmp"
        tmp.write_text(json.dumps({"layer": index}))
        os.replace(tmp, self.dir / "done.json")
        old = self.dir / f"hidden-{index - 1}.pt"
        if old.exists():
            old.unlink()
        if os.environ.get(KILL_HOOK) == f"{self.name}:{index}":
            os.kill(os.getpid(), signal.SIGKILL)

    def remove(self) -> None:
        """Delete the saved work (the pass's outputs are finished or abandoned)."""
        shutil.rmtree(self.dir, ignore_errors=True)
