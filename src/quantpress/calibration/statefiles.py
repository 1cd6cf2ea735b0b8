"""Saved Python state without pickle: a value made of containers, numbers, strings, tensors and
dataclass records is written as a JSON file (its structure) and a safetensors file (its
tensors), and read back without running any code stored in either file.

Why not ``torch.save``: reading a pickle runs whatever callables it names, so a planted file in
a resume directory would execute code (issue 56, item 5). JSON and safetensors carry data only;
the reader below builds values from a fixed set of node kinds, and the only classes it
instantiates are dataclasses that this process has already imported (looked up in
``sys.modules``, never imported by name), created as :mod:`pickle` would create them
(``object.__new__`` and the saved ``__dict__``, no ``__init__`` or ``__post_init__`` run), so a
resumed pass gets back objects equal in type and value to those it saved.

Node kinds of the JSON structure (``"state"`` of the document):

- ``null``, ``true``/``false``, integers, finite floats and strings stand for themselves
  (Python's float ``repr`` round-trips exactly);
- ``{"float": "nan" | "inf" | "-inf"}``;
- ``{"list": [...]}``, ``{"tuple": [...]}``, ``{"set": [...]}``, ``{"frozenset": [...]}``;
- ``{"map": {str: node}}`` (a dict with string keys, order kept) and ``{"dict": [[key node,
  value node], ...]}`` (any other keys);
- ``{"tensor": key, "device": "cpu", "grad": false}``: tensor ``key`` of the safetensors file,
  moved back to the device it was saved from; ``{"ndarray": key}`` and ``{"npscalar": key}``:
  a numpy array / scalar kept as a tensor;
- ``{"dtype": "float32"}`` (a ``torch.dtype``), ``{"device": "cuda:0"}`` (a ``torch.device``);
- ``{"dataclass": "module:QualName", "fields": {name: node}}``.

A tensor object met twice is stored once and comes back as one object; tensors that share
storage otherwise are stored as copies (safetensors refuses shared storage).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantpress.errors import InputError

#: the ``format`` field of the JSON documents and the safetensors metadata written here
STATE_FORMAT = "quantpress.saved-state"
#: the ``format`` metadata of a single-tensor file (:func:`save_tensor`)
TENSOR_FORMAT = "quantpress.saved-tensor"
VERSION = 1
_TENSOR_KEY = "tensor"


def _atomic(path: Path, write) -> None:
    """``write(tmp)`` then rename over ``path``: a kill leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_safetensors(tensors: dict[str, torch.Tensor], fmt: str, path: Path) -> None:
    from safetensors.torch import save_file

    # straight to the file: no second copy of the tensors in memory (hidden states are large)
    _atomic(path, lambda p: save_file(tensors, str(p), metadata={"format": fmt, "version": str(VERSION)}))


class _Encoder:
    """One value's JSON structure and its tensors (``self.tensors``: key -> CPU tensor)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._keys: dict[int, str] = {}          # id(tensor) -> key: one object, one entry
        self._held: list[torch.Tensor] = []      # keeps those ids alive while encoding
        self._storages: set[tuple[int, int]] = set()

    def _tensor_key(self, t: torch.Tensor) -> str:
        k = self._keys.get(id(t))
        if k is not None:
            return k
        k = f"t{len(self.tensors)}"
        self._keys[id(t)] = k
        self._held.append(t)
        c = t.detach().to("cpu").contiguous()
        # safetensors refuses two entries over one storage: a view of something already kept
        # (or of the original when .contiguous() returned it as is) is stored as its own copy
        if c.numel():
            st = c.untyped_storage()
            ident = (st.data_ptr(), st.nbytes())
            if ident in self._storages or c.data_ptr() != st.data_ptr() or c.nbytes != st.nbytes():
                c = c.clone()
                st = c.untyped_storage()
                ident = (st.data_ptr(), st.nbytes())
            self._storages.add(ident)
        self.tensors[k] = c
        return k

    def node(self, x: Any, where: str) -> Any:
        t = type(x)
        if x is None or t is bool or t is int or t is str:
            return x
        if t is float:
            return x if math.isfinite(x) else {"float": "nan" if x != x else ("inf" if x > 0 else "-inf")}
        if t is list or t is tuple:
            return {t.__name__: [self.node(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if t is set or t is frozenset:
            # sorted by their JSON form so that equal sets give equal files
            items = [self.node(v, f"{where}{{}}") for v in x]
            return {t.__name__: sorted(items, key=lambda n: json.dumps(n, sort_keys=True))}
        if t is dict:
            if all(type(k) is str for k in x):
                return {"map": {k: self.node(v, f"{where}[{k!r}]") for k, v in x.items()}}
            return {"dict": [[self.node(k, f"{where} key"), self.node(v, f"{where}[{k!r}]")]
                             for k, v in x.items()]}
        if t is torch.Tensor:
            return {"tensor": self._tensor_key(x), "device": str(x.device), "grad": bool(x.requires_grad)}
        if t is np.ndarray:
            return {"ndarray": self._tensor_key(torch.from_numpy(np.ascontiguousarray(x)))}
        if isinstance(x, np.generic) and t.__module__ == "numpy":
            return {"npscalar": self._tensor_key(torch.from_numpy(np.asarray(x).reshape(1)))}
        if t is torch.dtype:
            return {"dtype": str(x).removeprefix("torch.")}
        if t is torch.device:
            return {"device": str(x)}
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and hasattr(x, "__dict__"):
            name = f"{t.__module__}:{t.__qualname__}"
            return {"dataclass": name,
                    "fields": {k: self.node(v, f"{where}.{k}") for k, v in vars(x).items()}}
        raise TypeError(f"saved state at {where}: {t.__module__}.{t.__qualname__} cannot be saved "
                        f"(containers, numbers, strings, tensors, numpy arrays, dtypes, devices "
                        f"and dataclasses can)")


def save_state(value: Any, json_path: str | Path, tensors_path: str | Path) -> None:
    """Write ``value`` as the JSON document ``json_path`` (structure, see the module docstring)
    and the safetensors file ``tensors_path`` (its tensors, flat keys ``t0``, ``t1``, ...;
    always written, empty when there are none). Each file is replaced atomically; the tensors
    first, so that a JSON document never names tensors its file lacks. Raises TypeError for a
    value of a kind not listed (a bug in the caller, not bad input)."""
    json_path, tensors_path = Path(json_path), Path(tensors_path)
    enc = _Encoder()
    doc = {"format": STATE_FORMAT, "version": VERSION, "tensors": tensors_path.name,
           "state": enc.node(value, "state")}
    text = json.dumps(doc, allow_nan=False)
    _write_safetensors(enc.tensors, STATE_FORMAT, tensors_path)
    _atomic(json_path, lambda p: p.write_text(text))


def _read_tensors(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path`` (its metadata must say ``fmt``), read into
    memory (the file is closed again: no map is kept). InputError naming the file otherwise."""
    from safetensors import safe_open

    if not path.is_file():
        raise InputError(f"{path}: missing (expected a {fmt} safetensors file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != fmt:
                raise InputError(f"{path}: not a {fmt} safetensors file (metadata format "
                                 f"{meta.get('format')!r})")
            return {k: f.get_tensor(k) for k in f.keys()}
    except InputError:
        raise
    except Exception as e:  # safetensors' own error for anything that is not its format
        raise InputError(f"{path}: not a safetensors file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'unreadable'})") from e


class _Decoder:
    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]):
        self.path, self.tensors = path, tensors
        self.used: set[str] = set()
        self._made: dict[tuple[str, str], Any] = {}   # (kind, key) -> object: shared stays shared

    def bad(self, what: str) -> InputError:
        return InputError(f"{self.path}: {what} (not a saved state written by quantpress)")

    def _tensor(self, key: Any) -> torch.Tensor:
        if type(key) is not str or key not in self.tensors:
            raise self.bad(f"tensor {key!r} is not in {self.path.name}'s safetensors file")
        self.used.add(key)
        return self.tensors[key]

    def node(self, n: Any) -> Any:
        t = type(n)
        if n is None or t in (bool, int, float, str):
            return n
        if t is not dict or len(n) == 0:
            raise self.bad(f"unexpected JSON value {json.dumps(n)[:60]}")
        kind = next(iter(n))
        v = n[kind]
        if kind in ("list", "tuple", "set", "frozenset") and len(n) == 1:
            if type(v) is not list:
                raise self.bad(f"'{kind}' node without a list")
            items = [self.node(x) for x in v]
            try:
                return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
            except TypeError as e:  # an unhashable member of a set
                raise self.bad(f"'{kind}' node: {e}") from e
        if kind == "map" and len(n) == 1:
            if type(v) is not dict:
                raise self.bad("'map' node without an object")
            return {k: self.node(x) for k, x in v.items()}
        if kind == "dict" and len(n) == 1:
            if type(v) is not list or any(type(p) is not list or len(p) != 2 for p in v):
                raise self.bad("'dict' node without [key, value] pairs")
            try:
                return {self.node(k): self.node(x) for k, x in v}
            except TypeError as e:
                raise self.bad(f"'dict' node: {e}") from e
        if kind == "float" and len(n) == 1 and v in ("nan", "inf", "-inf"):
            return float(v)
        if kind == "tensor" and set(n) == {"tensor", "device", "grad"} and type(n["grad"]) is bool:
            ck = ("tensor", v, n["device"], n["grad"])
            if ck not in self._made:
                x = self._tensor(v)
                if n["device"] != "cpu":
                    try:
                        x = x.to(torch.device(n["device"]))
                    except (RuntimeError, TypeError) as e:
                        raise InputError(f"{self.path}: tensor {v} was saved on device "
                                         f"{n['device']!r}, which this process cannot use ({e})") from e
                if n["grad"]:
                    x.requires_grad_(True)
                self._made[ck] = x
            return self._made[ck]
        if kind == "ndarray" and len(n) == 1:
            return self._tensor(v).numpy()
        if kind == "npscalar" and len(n) == 1:
            a = self._tensor(v)
            if a.shape != (1,):
                raise self.bad(f"numpy scalar {v} has shape {tuple(a.shape)}")
            return a.numpy()[0]
        if kind == "dtype" and len(n) == 1:
            d = getattr(torch, v, None) if type(v) is str else None
            if not isinstance(d, torch.dtype):
                raise self.bad(f"unknown torch dtype {v!r}")
            return d
        if kind == "device" and len(n) == 1:
            try:
                return torch.device(v)
            except (RuntimeError, TypeError) as e:
                raise self.bad(f"bad device {v!r}") from e
        if kind == "dataclass" and set(n) == {"dataclass", "fields"} and type(n["fields"]) is dict:
            cls = self._dataclass(v)
            obj = object.__new__(cls)
            # as unpickling does: the saved attributes, no __init__/__post_init__ (which may
            # normalise or validate differently from the object that was saved)
            obj.__dict__.update({k: self.node(x) for k, x in n["fields"].items()})
            return obj
        raise self.bad(f"unknown node {json.dumps(n)[:80]}")

    def _dataclass(self, name: Any) -> type:
        if type(name) is not str or name.count(":") != 1:
            raise self.bad(f"bad dataclass name {name!r}")
        mod, qual = name.split(":")
        # only a class of a module this process has imported already: nothing is imported
        # (which would run that module's code) on the word of a file
        obj = sys.modules.get(mod)
        for part in qual.split("."):
            obj = getattr(obj, part, None) if obj is not None and not part.startswith("__") else None
        if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
            raise InputError(f"{self.path}: class {name} is not a dataclass of a loaded module "
                             f"(a saved state names only the classes of the code that made it)")
        return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (non-finite floats are written as float nodes)")


def load_state(json_path: str | Path, tensors_path: str | Path | None = None) -> Any:
    """The value :func:`save_state` wrote to ``json_path`` and its tensors file (the document
    names it; ``tensors_path``, when given, must be that file). Nothing stored runs: see the
    module docstring. Raises InputError naming the file when either file is missing, is not
    what :func:`save_state` writes (not JSON, another format or version, an unknown node, a
    tensor key its safetensors file lacks or an extra tensor) or names a class that is not a
    dataclass of an imported module."""
    json_path = Path(json_path)
    if not json_path.is_file():
        raise InputError(f"{json_path}: missing (expected a saved state, JSON)")
    try:
        doc = json.loads(json_path.read_bytes(), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:   # UnicodeDecodeError is a ValueError
        raise InputError(f"{json_path}: not a JSON saved state ({type(e).__name__})") from e
    if (type(doc) is not dict or doc.get("format") != STATE_FORMAT or type(doc.get("version")) is not int
            or doc["version"] != VERSION
            or set(doc) != {"format", "version", "tensors", "state"} or type(doc["tensors"]) is not str):
        raise InputError(f"{json_path}: not a saved state of format {STATE_FORMAT} version {VERSION}")
    name = doc["tensors"]
    if not name or "/" in name or "\\" in name or name.startswith(".") or "\0" in name:
        raise InputError(f"{json_path}: tensors file {name!r} is not a sibling file name")
    expected = json_path.with_name(name)
    if tensors_path is not None and Path(tensors_path).name != name:
        raise InputError(f"{json_path}: names tensors file {name!r}, expected "
                         f"{Path(tensors_path).name!r}")
    dec = _Decoder(json_path, _read_tensors(expected, STATE_FORMAT))
    try:
        value = dec.node(doc["state"])
    except RecursionError as e:
        raise InputError(f"{json_path}: structure nested too deeply") from e
    extra = set(dec.tensors) - dec.used
    if extra:
        raise InputError(f"{expected}: holds tensors its state {json_path.name} does not name "
                         f"({sorted(extra)[:3]})")
    return value


def save_tensor(t: torch.Tensor, path: str | Path) -> None:
    """Write one tensor (any dtype safetensors has, moved to CPU, made contiguous) as the
    safetensors file ``path`` (one entry, metadata format :data:`TENSOR_FORMAT`), replaced
    atomically."""
    _write_safetensors({_TENSOR_KEY: t.detach().to("cpu").contiguous()}, TENSOR_FORMAT, Path(path))


def load_tensor(path: str | Path) -> torch.Tensor:
    """The CPU tensor :func:`save_tensor` wrote at ``path``. InputError naming the file when it
    is missing or not such a file."""
    path = Path(path)
    tensors = _read_tensors(path, TENSOR_FORMAT)
    if set(tensors) != {_TENSOR_KEY}:
        raise InputError(f"{path}: holds tensors {sorted(tensors)[:3]}, expected one named "
                         f"'{_TENSOR_KEY}'")
    return tensors[_TENSOR_KEY]
