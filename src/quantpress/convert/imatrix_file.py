"""llama.cpp's GGUF importance-matrix file (``llama-imatrix -o imatrix.gguf``), written and read.

Format, as llama.cpp 0c1e57098 writes it (``tools/imatrix/imatrix.cpp``
``IMatrixCollector::save_imatrix`` with ``ggml/src/gguf.cpp`` ``gguf_write_to_file``) and reads
it (``common/imatrix-loader.cpp`` ``common_imatrix_load``; ``tools/quantize/quantize.cpp``
``load_imatrix``):

- GGUF v3, little-endian, alignment 32, **no** ``general.architecture``;
- KVs, in this order: ``general.type`` = "imatrix" (string), ``imatrix.datasets`` (array of
  strings: the calibration sources), ``imatrix.chunk_count`` (u32: chunks of ``chunk_size``
  tokens seen), ``imatrix.chunk_size`` (u32: tokens per chunk, ``n_ctx / n_parallel``).
  llama-quantize refuses a GGUF imatrix without all three ``imatrix.*`` keys ("missing
  imatrix metadata");
- for every weight, in ascending name order (``std::sort`` of the names, i.e. byte order),
  two F32 tensors: ``<weight>.in_sum2`` with ne = [n_per_row, n_mat] holding Σx² of the
  weight's input column over all tokens (raw sums, one row per expert matrix), and
  ``<weight>.counts`` with ne = [1, n_mat], the number of tokens (as floats) per matrix.
  ``<weight>`` is the GGUF tensor name (``blk.0.attn_q.weight``). ggml drops trailing
  dimensions of size 1 from the tensor info (``ggml_n_dims``), so a dense weight's tensors
  are 1-D: ``in_sum2`` ne = [n_per_row], ``counts`` ne = [1];
- llama-quantize uses ``in_sum2 / counts`` per matrix as the importance of each input column
  (a matrix with count 0 gets importance 1).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np

from quantpress.errors import InputError

GGUF_VERSION = 3
ALIGNMENT = 32
KEY_TYPE = "general.type"
KEY_DATASETS = "imatrix.datasets"
KEY_CHUNK_COUNT = "imatrix.chunk_count"
KEY_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"

_T_UINT32, _T_STRING, _T_ARRAY = 4, 8, 9
_GGML_F32 = 0


@dataclass
class Imatrix:
    """An importance matrix.

    ``sums[name]``: float32 [n_mat, n_per_row], Σx² per input column (``in_sum2``);
    ``counts[name]``: float32 [n_mat], tokens seen per matrix; ``name`` is a GGUF weight name.
    ``datasets``: calibration sources; ``chunk_count`` / ``chunk_size``: chunks and tokens per
    chunk (llama-imatrix's ``m_last_chunk`` and ``n_ctx / n_parallel``)."""

    sums: dict[str, np.ndarray] = field(default_factory=dict)
    counts: dict[str, np.ndarray] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    def add(self, name: str, in_sum2, count) -> None:
        """Add the entry of weight ``name``: ``in_sum2`` [n_per_row] or [n_mat, n_per_row]
        (any float array/tensor), ``count`` a number or [n_mat]. Raises InputError if the
        values are not finite or the shapes disagree."""
        s = np.asarray(_numpy(in_sum2), dtype=np.float32)
        s = s.reshape(1, -1) if s.ndim == 1 else s
        c = np.asarray(_numpy(count), dtype=np.float32).reshape(-1)
        if s.ndim != 2 or c.shape[0] != s.shape[0]:
            raise InputError(f"imatrix entry '{name}': in_sum2 {s.shape} and counts {c.shape} disagree")
        if not (np.isfinite(s).all() and np.isfinite(c).all()):
            raise InputError(f"imatrix entry '{name}': non-finite values (NaN/Inf)")
        self.sums[name] = s
        self.counts[name] = c

    def importance(self) -> dict[str, np.ndarray]:
        """What llama-quantize hands to the quantizer (``quantize.cpp`` ``load_imatrix``):
        name → float32 [n_mat · n_per_row], ``in_sum2 / count`` per matrix (1 where count is 0).
        The values to put in ``llama_model_quantize_params.imatrix``."""
        out = {}
        for name, s in self.sums.items():
            c = self.counts[name].astype(np.float32)[:, None]
            out[name] = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32).reshape(-1)
        return out


def _numpy(x):
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return x


# --------------------------------------------------------------------------------------------
# Writing

def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pad(n: int) -> int:
    return (ALIGNMENT - n % ALIGNMENT) % ALIGNMENT


def _ne(shape_np: tuple[int, ...]) -> list[int]:
    """ggml ne of a numpy shape, with trailing 1s dropped (``ggml_n_dims``, at least 1 dim)."""
    ne = list(reversed(shape_np))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return ne


def imatrix_bytes(im: Imatrix) -> bytes:
    """The complete file contents, byte for byte as ``gguf_write_to_file`` lays them out."""
    names = sorted(im.sums, key=lambda n: n.encode("utf-8"))
    tensors: list[tuple[str, np.ndarray]] = []
    for n in names:
        tensors.append((n + SUFFIX_SUMS, np.ascontiguousarray(im.sums[n], dtype="<f4")))
        tensors.append((n + SUFFIX_COUNTS, np.ascontiguousarray(im.counts[n].reshape(-1, 1), dtype="<f4")))
    kv = bytearray()
    kv += _str(KEY_TYPE) + struct.pack("<I", _T_STRING) + _str("imatrix")
    kv += _str(KEY_DATASETS) + struct.pack("<IIQ", _T_ARRAY, _T_STRING, len(im.datasets))
    for d in im.datasets:
        kv += _str(d)
    kv += _str(KEY_CHUNK_COUNT) + struct.pack("<II", _T_UINT32, int(im.chunk_count))
    kv += _str(KEY_CHUNK_SIZE) + struct.pack("<II", _T_UINT32, int(im.chunk_size))
    info = bytearray()
    offset = 0
    for name, arr in tensors:
        ne = _ne(arr.shape)
        info += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        info += struct.pack("<IQ", _GGML_F32, offset)
        offset += arr.nbytes + _pad(arr.nbytes)
    head = b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), 4) + bytes(kv) + bytes(info)
    out = bytearray(head)
    out += b"\0" * _pad(len(out))
    for _, arr in tensors:
        out += arr.tobytes()
        out += b"\0" * _pad(arr.nbytes)
    return bytes(out)


def write_imatrix(path: str | Path, im: Imatrix) -> Path:
    """Write ``im`` to ``path`` (llama.cpp's GGUF imatrix; see the module doc). The bytes go
    to ``path`` directly: callers write to a temporary name and rename. Raises InputError if
    there are no entries or the metadata is incomplete."""
    if not im.sums:
        raise InputError(f"{path}: no imatrix entries to write")
    if im.chunk_size <= 0:
        raise InputError(f"{path}: imatrix chunk_size must be positive")
    data = imatrix_bytes(im)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


# --------------------------------------------------------------------------------------------
# Reading

def read_imatrix(path: str | Path) -> Imatrix:
    """Read a GGUF imatrix file (ours or llama-imatrix's) with gguf-py.

    Checks what ``common_imatrix_load`` and llama-quantize check: at least one tensor; every
    ``.in_sum2`` has its ``.counts`` and both are F32; the three ``imatrix.*`` keys are present
    (llama-quantize's "missing imatrix metadata"); the number of values is a multiple of the
    number of counts. Raises InputError naming the file and entry otherwise."""
    from gguf import GGMLQuantizationType

    from quantpress.convert.gguf_file import open_reader

    p = Path(path)
    r = open_reader(p)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    missing = [k for k in (KEY_DATASETS, KEY_CHUNK_COUNT, KEY_CHUNK_SIZE) if k not in fields]
    if missing:
        raise InputError(f"{p}: missing imatrix metadata ({', '.join(missing)})")
    if not r.tensors:
        raise InputError(f"{p}: no data (0 tensors)")
    im = Imatrix(datasets=list(fields[KEY_DATASETS]), chunk_count=int(fields[KEY_CHUNK_COUNT]),
                 chunk_size=int(fields[KEY_CHUNK_SIZE]))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for t in r.tensors:
        for suffix in (SUFFIX_SUMS, SUFFIX_COUNTS):
            if t.name.endswith(suffix):
                if t.tensor_type != GGMLQuantizationType.F32:
                    raise InputError(f"{p}: tensor '{t.name}' must be F32")
                pairs.setdefault(t.name[: -len(suffix)], {})[suffix] = np.array(t.data, dtype=np.float32)
    for name, d in sorted(pairs.items()):
        if len(d) != 2:
            raise InputError(f"{p}: mismatched sums and counts for '{name}'")
        c = d[SUFFIX_COUNTS].reshape(-1)
        s = d[SUFFIX_SUMS].reshape(-1)
        if s.size % c.size:
            raise InputError(f"{p}: '{name}' has {s.size} values for {c.size} counts")
        im.sums[name] = s.reshape(c.size, -1)
        im.counts[name] = c
    return im


def from_stats(entries: Mapping[str, tuple[object, int]], datasets: list[str], chunk_count: int,
               chunk_size: int) -> Imatrix:
    """An :class:`Imatrix` from ``{gguf_weight_name: (in_sum2 [K], token_count)}`` (what
    :meth:`calibration.stats.LinearStats.imatrix` returns)."""
    im = Imatrix(datasets=list(datasets), chunk_count=chunk_count, chunk_size=chunk_size)
    for name, (s, c) in entries.items():
        im.add(name, s, c)
    return im
