"""Lazy reader of Hugging Face model directories (config.json + safetensors, sharded or not).

Tensors are read one at a time from memory-mapped safetensors files, so a caller that
processes and releases them in turn never holds the model in memory.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from quantpress.errors import InputError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(model_dir: Path) -> dict:
    """Parse ``model_dir/config.json``.

    Raises InputError when the file is missing, not JSON, not an object, or lacks
    ``architectures``.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise InputError(f"{path}: missing (a Hugging Face model directory needs config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if not config.get("architectures"):
        raise InputError(f"{path}: no 'architectures' list (cannot tell the model type)")
    return config


class HFModel:
    """A Hugging Face checkpoint directory, read lazily.

    ``names`` lists tensor names in file order (shards sorted by file name, as llama.cpp's
    converter reads them). ``shape(name)`` / ``dtype(name)`` come from the safetensors
    headers without reading data; ``tensor(name)`` reads one tensor (its stored dtype, CPU).

    Raises InputError for a missing/invalid config.json, no safetensors files, a corrupt or
    truncated shard (naming the file), or an index that lists a tensor its shard lacks.
    """

    def __init__(self, model_dir: Path | str):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise InputError(f"{self.dir}: not a directory")
        self.config = read_config(self.dir)
        self._where: dict[str, str] = {}
        self._info: dict[str, tuple[tuple[int, ...], str]] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                assert isinstance(weight_map, dict)
            except Exception:
                raise InputError(f"{index}: invalid index (expected JSON with a 'weight_map' object)") from None
            shards = sorted(set(weight_map.values()))
        elif (self.dir / SINGLE_FILE).is_file():
            weight_map, shards = None, [SINGLE_FILE]
        else:
            raise InputError(f"{self.dir}: no {SINGLE_FILE} or {INDEX_FILE} found")
        for shard in shards:
            with self._open(shard) as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    self._where[name] = shard
                    self._info[name] = (tuple(sl.get_shape()), sl.get_dtype())
        if weight_map is not None:
            for name, shard in weight_map.items():
                if self._where.get(name) != shard:
                    raise InputError(f"{self.dir / shard}: tensor '{name}' is listed in {INDEX_FILE} but absent from that file")
        self.names: list[str] = list(self._where)

    def _open(self, shard: str):
        """Open one shard. Each read opens and closes its shard: a safetensors handle keeps
        its memory map, and the pages read through it would stay in the process's RSS."""
        path = self.dir / shard
        if not path.is_file():
            raise InputError(f"{path}: shard listed in {INDEX_FILE} is missing")
        try:
            return safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise InputError(f"{path}: corrupt or truncated safetensors file ({e})") from None

    def file_of(self, name: str) -> Path:
        """Path of the shard holding ``name``."""
        return self.dir / self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` (torch order) from the header."""
        return self._info[name][0]

    def dtype(self, name: str) -> str:
        """safetensors dtype string of ``name`` ("F16", "BF16", "F32", ...)."""
        return self._info[name][1]

    def tensor(self, name: str) -> torch.Tensor:
        """Read ``name`` in its stored dtype on CPU. Raises InputError naming file and tensor
        if the bytes cannot be read."""
        if name not in self._where:
            raise InputError(f"{self.dir}: no tensor '{name}'")
        try:
            with self._open(self._where[name]) as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise InputError(f"{self.file_of(name)}: cannot read tensor '{name}' ({e})") from None

    def n_params(self) -> int:
        """Total number of elements over all tensors."""
        total = 0
        for n in self.names:
            c = 1
            for d in self.shape(n):
                c *= d
            total += c
        return total


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise InputError naming the tensor if ``t`` holds NaN or Inf.

    Every element is finite exactly when the smallest and the largest are (torch's min and
    max propagate NaN): one ``aminmax`` pass in the tensor's own dtype, cheaper than a
    float32 sum (figures in docs/benchmarks.md). Only a tensor that fails it has its bad
    elements counted."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        bad = int((~torch.isfinite(t)).sum())
        raise InputError(f"tensor '{name}': {bad} NaN/Inf value(s); the source weights are corrupt")
