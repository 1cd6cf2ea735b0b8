"""Safetensors files written tensor by tensor, and shards assembled without loading them.

``safetensors.torch.save_file`` serializes a whole dict at once (every tensor plus a bytes
copy of it in memory), and the library has no append mode. A quantized model written that
way holds a whole shard — by default most of the model — in memory twice. This module writes
the same file format (https://github.com/huggingface/safetensors, "Format"): an 8-byte
little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces to a multiple
of 8, then the raw little-endian tensor bytes, each tensor once, contiguous, without gaps.
Within a file, tensors are ordered by element size, largest first (as the library does), so
every tensor starts at a multiple of its element size.

Memory: :func:`write_safetensors` writes each tensor from a zero-copy view of its storage;
a :class:`RowChunks` tensor is produced and written a block of rows at a time, so the
largest tensor (the embedding) need never exist whole in the output dtype. :class:`ShardSet`
keeps one part file per :meth:`ShardSet.add` and, at the end, copies the parts' bytes into
the final shards in fixed-size pieces: its peak is one piece, not one shard.

Every file written here is read back by the caller's round trip through ``safetensors``
itself (``safe_open``), which validates the header and offsets.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

from quantpress.errors import InputError
from quantpress.quantize.ggml.common import all_finite

#: safetensors dtype names of the torch dtypes we write
DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.int64: "I64", torch.float64: "F64", torch.bool: "BOOL",
               torch.float8_e4m3fn: "F8_E4M3"}
_SIZES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1,
          "U8": 1, "BOOL": 1, "F8_E4M3": 1}
COPY_PIECE = 16 * 2 ** 20  # bytes copied at a time when assembling shards


@dataclass(frozen=True)
class RowChunks:
    """A tensor of ``shape`` and ``dtype`` produced in blocks of rows: ``rows(lo, hi)``
    returns the tensor's rows ``[lo, hi)`` (``dtype``, shape ``(hi − lo, *shape[1:])``).
    :func:`write_safetensors` asks for ``block`` rows at a time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    rows: Callable[[int, int], torch.Tensor]
    block: int = 4096


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def _raw(t: torch.Tensor) -> memoryview:
    """Zero-copy bytes of a contiguous CPU tensor (numpy has no bfloat16 or float8: viewed as
    int16 / uint8)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.dtype in (torch.bool, torch.float8_e4m3fn):
        t = t.view(torch.uint8)
    return memoryview(t.numpy()).cast("B")


def _header_bytes(entries: Mapping[str, dict], metadata: Mapping[str, str] | None) -> bytes:
    head = dict(entries)
    if metadata:
        head = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}, **head}
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _order(items: Iterable[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """(name, dtype name, nbytes) by element size, largest first, else in the given order."""
    return sorted(items, key=lambda it: -_SIZES[it[1]])


def write_safetensors(path: str | Path, tensors: Mapping[str, torch.Tensor | RowChunks],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write ``tensors`` (name → CPU/any-device tensor or :class:`RowChunks`) as one
    safetensors file at ``path``, one tensor (or one block of rows) in memory at a time.
    Returns the bytes of tensor data written. Raises ValueError for a dtype safetensors does
    not have or a :class:`RowChunks` producer that returns the wrong shape or dtype."""
    meta = []
    for name, t in tensors.items():
        shape, dtype = (tuple(t.shape), t.dtype)
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor '{name}': dtype {dtype} cannot be stored in safetensors")
        meta.append((name, DTYPE_NAMES[dtype], _nbytes(shape, dtype)))
    entries, off = {}, 0
    for name, dn, nb in _order(meta):
        entries[name] = {"dtype": dn, "shape": [int(d) for d in tensors[name].shape],
                         "data_offsets": [off, off + nb]}
        off += nb
    with open(path, "wb") as f:
        f.write(_header_bytes(entries, metadata))
        for name in entries:
            t = tensors[name]
            if isinstance(t, RowChunks):
                n = t.shape[0] if t.shape else 1
                for lo in range(0, n, t.block):
                    hi = min(n, lo + t.block)
                    c = t.rows(lo, hi)
                    if tuple(c.shape) != (hi - lo, *t.shape[1:]) or c.dtype != t.dtype:
                        raise ValueError(f"tensor '{name}': rows [{lo}, {hi}) came as "
                                         f"{tuple(c.shape)} {c.dtype}, expected "
                                         f"{(hi - lo, *t.shape[1:])} {t.dtype}")
                    f.write(_raw(c))
                    del c
            else:
                f.write(_raw(t))
    return off


def read_header(path: str | Path) -> tuple[dict, int]:
    """(header dict without ``__metadata__``, byte offset where the data starts) of a
    safetensors file. Raises ValueError if the header is unreadable."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        try:
            head = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    head.pop("__metadata__", None)
    return head, 8 + n


class ShardSet:
    """Tensors added as they are produced (one part file per :meth:`add`, written with
    :func:`write_safetensors`), then :meth:`finish` distributes them, in the order added, into
    shards of at most ``max_shard_bytes`` of tensor data (0 = one file; a tensor is never
    split, a tensor bigger than the limit gets a shard of its own) and copies their bytes
    from the parts in :data:`COPY_PIECE`-sized pieces. The parts are deleted."""

    def __init__(self, directory: str | Path, max_shard_bytes: int = 0):
        self.dir = Path(directory)
        self.max_shard_bytes = int(max_shard_bytes)
        self._parts: list[Path] = []
        self._part_sizes: list[dict[str, int]] = []  # per part: name → bytes
        self.sizes: dict[str, int] = {}  # name → bytes, in the order added

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data added so far."""
        return sum(self.sizes.values())

    def add(self, tensors: Mapping[str, torch.Tensor | RowChunks]) -> None:
        """Write ``tensors`` to a new part file now. Raises ValueError for a name already
        added."""
        if not tensors:
            return
        dup = sorted(set(tensors) & set(self.sizes))
        if dup:
            raise ValueError(f"tensor(s) {dup[:3]} written twice")
        p = self.dir / f".part-{len(self._parts):05d}.safetensors"
        write_safetensors(p, tensors)
        sizes = {k: _nbytes(tuple(t.shape), t.dtype) for k, t in tensors.items()}
        self._parts.append(p)
        self._part_sizes.append(sizes)
        self.sizes.update(sizes)

    def state(self) -> list[tuple[str, dict[str, int]]]:
        """The parts written so far: ``[(part file name, {tensor name: bytes})]`` in order (what
        a resumed writer adopts, :meth:`adopt`)."""
        return [(p.name, dict(sizes)) for p, sizes in zip(self._parts, self._part_sizes)]

    def adopt(self, parts: list[tuple[str, dict[str, int]]]) -> None:
        """Take over the part files of an interrupted writer in this directory: ``parts`` as
        :meth:`state` gave them (checked: every file present with its tensors); they replace
        whatever this set held, and any other part file (written after that state was saved)
        is deleted. ValueError when a part is missing or differs."""
        self._parts, self._part_sizes, self.sizes, keep = [], [], {}, set()
        for name, sizes in parts:
            p = self.dir / name
            if not p.is_file():
                raise ValueError(f"{p}: part file of the interrupted run is missing")
            head, _ = read_header(p)
            if set(head) != set(sizes):
                raise ValueError(f"{p}: part file holds other tensors than recorded")
            self._parts.append(p)
            self._part_sizes.append(dict(sizes))
            self.sizes.update(sizes)
            keep.add(name)
        for p in self.dir.glob(".part-*.safetensors"):
            if p.name not in keep:
                p.unlink()

    def plan(self) -> list[list[str]]:
        """Tensor names per shard, in the order added."""
        shards: list[list[str]] = [[]]
        size = 0
        for k, b in self.sizes.items():
            if self.max_shard_bytes and shards[-1] and size + b > self.max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(k)
            size += b
        return shards

    def finish(self, names: Callable[[int], list[str]],
               metadata: Mapping[str, str] | None = None) -> dict[str, str]:
        """Assemble the shards: ``names(n)`` gives the n file names. Returns the weight map
        (tensor name → file name)."""
        where: dict[str, tuple[Path, dict, int]] = {}
        for p in self._parts:
            head, start = read_header(p)
            for k, e in head.items():
                where[k] = (p, e, start)
        plan = self.plan()
        files = names(len(plan))
        weight_map = {}
        for fname, keys in zip(files, plan):
            items = _order((k, where[k][1]["dtype"], self.sizes[k]) for k in keys)
            entries, off = {}, 0
            for k, dn, nb in items:
                entries[k] = {"dtype": dn, "shape": where[k][1]["shape"], "data_offsets": [off, off + nb]}
                off += nb
            with open(self.dir / fname, "wb") as out:
                out.write(_header_bytes(entries, metadata))
                handles: dict[Path, object] = {}
                try:
                    for k, _, nb in items:
                        p, e, start = where[k]
                        h = handles.get(p)
                        if h is None:
                            h = handles[p] = open(p, "rb")
                        h.seek(start + e["data_offsets"][0])
                        left = nb
                        while left:
                            piece = h.read(min(COPY_PIECE, left))
                            if not piece:
                                raise ValueError(f"{p}: truncated part file (tensor '{k}')")
                            out.write(piece)
                            left -= len(piece)
                finally:
                    for h in handles.values():
                        h.close()
            weight_map.update({k: fname for k in keys})
        for p in self._parts:
            os.unlink(p)
        self._parts.clear()
        self._part_sizes.clear()
        return weight_map


#: files of a source directory never copied into a written model directory: weights, their
#: indexes, the config (written anew) and quantization configs
NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")
NOT_COPIED = frozenset({"config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                        "quantize_config.json", "quant_config.json"})


def copied_source_file(f: Path) -> bool:
    """Whether a regular file of the source directory goes into a quantized model directory
    (:attr:`DirLayout.copied` of the AWQ, GPTQ and FP8 layouts): the tokenizer, generation
    config, chat template, license and the like; not dotfiles or :data:`NOT_COPIED`."""
    return (f.name not in NOT_COPIED and not f.name.endswith(NOT_COPIED_SUFFIXES)
            and not f.name.startswith("."))


@dataclass(frozen=True)
class DirLayout:
    """How one format's model directory names and describes its files.

    ``stem``: shard file stem (``model`` → ``model.safetensors`` or
    ``model-0000k-of-0000N.safetensors``); ``metadata``: safetensors ``__metadata__`` of every
    shard (None: none); ``index``: write ``<stem>.safetensors.index.json`` (``metadata.total_size``
    and ``weight_map``, indent 2) when there is more than one shard; ``config_indent`` and
    ``config_newline``: how ``config.json`` is dumped; ``copied(path) -> bool``: which regular
    files of the source directory are copied; ``keep_file_metadata``: copy with
    ``shutil.copy2`` (times kept) rather than ``shutil.copy``."""

    stem: str
    metadata: Mapping[str, str] | None
    index: bool
    config_indent: int
    config_newline: bool
    copied: Callable[[Path], bool]
    keep_file_metadata: bool = False

    def shard_names(self, n: int) -> list[str]:
        """File names of ``n`` shards."""
        return ([f"{self.stem}.safetensors"] if n == 1 else
                [f"{self.stem}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])


class ModelDirWriter:
    """A quantized model directory written into ``tmp_dir`` (created; a temporary sibling of
    the final path, renamed by the caller after the round trip) in one format's
    :class:`DirLayout`. :meth:`add` takes tensors as they are produced (one part file per
    call, order kept; tensors or :class:`RowChunks`), :meth:`finish` assembles the shards
    (copied from the parts piece by piece, :class:`ShardSet`), the index, ``config.json`` and
    the copied source files. Nothing is held in memory between calls."""

    def __init__(self, tmp_dir: str | Path, layout: DirLayout, max_shard_bytes: int = 0,
                 resume: bool = False):
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=resume)
        self.layout = layout
        self.max_shard_bytes = int(max_shard_bytes)
        self._set = ShardSet(self.dir, self.max_shard_bytes)

    def state(self) -> list[tuple[str, dict[str, int]]]:
        """The parts written so far (:meth:`ShardSet.state`), for a checkpoint."""
        return self._set.state()

    def adopt(self, parts: list[tuple[str, dict[str, int]]]) -> None:
        """Continue an interrupted writer in the same directory (:meth:`ShardSet.adopt`)."""
        self._set.adopt(parts)

    @property
    def sizes(self) -> dict[str, int]:
        """Bytes per tensor name, in the order written."""
        return self._set.sizes

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data written so far."""
        return self._set.total_bytes

    def add(self, tensors: Mapping[str, torch.Tensor | RowChunks]) -> None:
        """Write ``tensors`` (name → tensor or :class:`RowChunks`) to a new part file now.
        Raises ValueError for a name written twice."""
        self._set.add(tensors)

    def finish(self, config: dict, source_dir: str | Path) -> list[Path]:
        """Distribute the tensors, in the order added, into shards of at most
        ``max_shard_bytes`` (0: one file), write the index (when the layout has one and there
        are several shards), ``config.json`` and the copied files of ``source_dir``. Returns
        the shard paths."""
        lay = self.layout
        weight_map = self._set.finish(lay.shard_names, metadata=lay.metadata)
        out_paths = [self.dir / f for f in dict.fromkeys(weight_map.values())]
        if lay.index and len(out_paths) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.dir / f"{lay.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        copy = shutil.copy2 if lay.keep_file_metadata else shutil.copy
        for f in sorted(Path(source_dir).iterdir()):
            if f.is_file() and f.name != "config.json" and lay.copied(f):
                copy(f, self.dir / f.name)
        (self.dir / "config.json").write_text(json.dumps(config, indent=lay.config_indent)
                                              + ("\n" if lay.config_newline else ""))
        return out_paths


def checked_float16(t: torch.Tensor, name: str, first_row: int = 0) -> torch.Tensor:
    """``t`` cast to float16 (CPU). Raises InputError naming tensor ``name`` (and the row,
    counting from ``first_row``) when a value is NaN/Inf or outside the float16 range."""
    h = t.detach().to(device="cpu", dtype=torch.float16)
    if not all_finite(h):               # (a value beyond the float16 range is Inf here)
        bad = ~torch.isfinite(h)
        row = first_row + int(bad.reshape(bad.shape[0], -1).any(1).nonzero()[0, 0]) if h.ndim else first_row
        if all_finite(t):
            raise InputError(f"tensor '{name}' (row {row}) has values outside the float16 range "
                             f"(max |w| = {float(t.abs().max()):.4g}); the output is float16")
        raise InputError(f"tensor '{name}' (row {row}) holds NaN or Inf")
    return h


def float16_rows(weights, name: str, block: int = 4096) -> RowChunks | torch.Tensor:
    """Checkpoint tensor ``name`` of ``weights`` as float16 for :func:`write_safetensors`:
    a :class:`RowChunks` reading ``block`` rows at a time when ``weights`` reads row ranges
    (:class:`calibration.engine.SafetensorsDir`: ``shape``/``get_rows``), so an embedding or
    head is converted and written without being held whole; else the whole tensor. Values
    are checked by :func:`checked_float16` (InputError naming the tensor)."""
    if not hasattr(weights, "get_rows"):
        return checked_float16(weights.get(name, "cpu"), name)
    shape = tuple(weights.shape(name))
    if len(shape) < 2:
        return checked_float16(weights.get(name, "cpu"), name)
    return RowChunks(shape, torch.float16,
                     lambda lo, hi: checked_float16(weights.get_rows(name, lo, hi), name, lo), block)
