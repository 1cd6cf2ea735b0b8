"""Resumable layer-streamed passes: what :func:`quantpress.calibration.engine.run` keeps on disk
after each finished decoder layer, so that a pass killed at layer k restarts at layer k.

The hidden states are kept on disk (``hidden-<i>.safetensors``, the pass's stream after layer
i) rather than replayed through the finished layers: a replay of a quantizing pass (EXL2) would
need the quantized layers rebuilt from the written parts, and a replay of the reference pass
would cost a forward of every finished layer; one file of ``rows × seqlen × hidden`` values per
layer is cheap next to either. Each consumer's share of the layer (statistics, option scores,
the part files its writer made and the records for the round trip) goes to ``layer-<i>.json``
(its structure) and ``layer-<i>.safetensors`` (its tensors), written by
:func:`quantpress.calibration.statefiles.save_state`; ``done.json`` names the last committed
layer and is replaced last (the commit point), so a kill at any moment leaves either the
previous or the new layer committed. ``key.json`` holds what the pass depends on (job options,
code digest); a checkpoint with another key is discarded with a message.

Nothing read back runs code (no pickle): a checkpoint whose key matches but whose files are
not what this module writes (a file of another name such as an old ``layer-0.pt``, a layer
file that is not its JSON or safetensors format, a missing layer) is bad input: InputError
naming the file, the directory left as it is for the user to look at or remove.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

import torch

from quantpress.calibration.statefiles import load_state, load_tensor, save_state, save_tensor
from quantpress.errors import InputError

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


#: the names :meth:`LayerCheckpoint.commit` writes (group 2: the layer index), each possibly
#: with ``.tmp`` (a kill between writing a file and renaming it into place)
_NAME = re.compile(r"(key\.json|done\.json|(?:layer-(\d+)\.(?:json|safetensors))|hidden-(\d+)\.safetensors)(\.tmp)?")


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
        """The last committed layer (-1: none). InputError when ``done.json`` is not what
        :meth:`commit` writes."""
        path = self.dir / "done.json"
        if not path.exists():
            return -1
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise InputError(f"{path}: not the JSON a checkpoint writes ({type(e).__name__}); "
                             f"remove {self.dir} to start the pass over") from e
        if type(doc) is not dict or set(doc) != {"layer"} or type(doc["layer"]) is not int or doc["layer"] < 0:
            raise InputError(f"{path}: expected {{\"layer\": <index>}}, found {json.dumps(doc)[:60]}; "
                             f"remove {self.dir} to start the pass over")
        return doc["layer"]

    def _check_names(self, last: int) -> None:
        """InputError naming the first entry of the directory that :meth:`commit` would not
        have left there with ``last`` committed: another name (an old ``layer-<i>.pt``, a
        directory, ...) or a layer beyond the one being written when the pass stopped."""
        for p in sorted(self.dir.iterdir()):
            m = _NAME.fullmatch(p.name)
            ok = m is not None and p.is_file()
            if ok and m.group(2) is not None:
                ok = int(m.group(2)) <= last + 1
            if ok and m.group(3) is not None:
                ok = last - 1 <= int(m.group(3)) <= last + 1
            if not ok:
                raise InputError(f"{p}: not a file this checkpoint writes (expected key.json, "
                                 f"done.json, layer-<i>.json, layer-<i>.safetensors, "
                                 f"hidden-<i>.safetensors); remove {self.dir} to start the pass over")

    def start(self) -> tuple[int, torch.Tensor | None, list[Any]]:
        """``(first layer to run, hidden states after the layer before it or None, the saved
        per-layer states of the finished layers in order)``. A checkpoint made for another
        key (or without a readable ``key.json``) is discarded (message through ``log``) and the
        pass starts at 0. Raises InputError naming the file when a checkpoint of this key holds
        a file that is not what :meth:`commit` writes (the directory is left as it is).
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
        self._check_names(last)
        if last < 0:
            return 0, None, []
        try:
            hidden = load_tensor(self.dir / f"hidden-{last}.safetensors")
            states = [load_state(self.dir / f"layer-{i}.json", self.dir / f"layer-{i}.safetensors")
                      for i in range(last + 1)]
        except InputError as e:
            raise InputError(f"{e}; remove {self.dir} to start the pass over") from e
        except OSError as e:  # a file that cannot be read at all (permissions, I/O)
            raise InputError(f"{self.dir}: saved work unreadable ({e})") from e
        self.resumed_at = last + 1
        self.log(f"{self.name}: resuming at layer {last + 1} (layers 0-{last} kept from the "
                 f"interrupted run)")
        return last + 1, hidden, states

    def commit(self, index: int, hidden: torch.Tensor, state: Any) -> None:
        """Save layer ``index``'s consumer ``state`` and the hidden states after it, then make
        it the last finished layer (the previous hidden states are then deleted)."""
        save_state(state, self.dir / f"layer-{index}.json", self.dir / f"layer-{index}.safetensors")
        save_tensor(hidden, self.dir / f"hidden-{index}.safetensors")
        tmp = self.dir / "done.json.tmp"
        tmp.write_text(json.dumps({"layer": index}))
        os.replace(tmp, self.dir / "done.json")
        old = self.dir / f"hidden-{index - 1}.safetensors"
        if old.exists():
            old.unlink()
        if os.environ.get(KILL_HOOK) == f"{self.name}:{index}":
            os.kill(os.getpid(), signal.SIGKILL)

    def remove(self) -> None:
        """Delete the saved work (the pass's outputs are finished or abandoned)."""
        shutil.rmtree(self.dir, ignore_errors=True)
