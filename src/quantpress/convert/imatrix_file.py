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

    from quantpress.convert.gguf_reading import open_reader

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


# --------------------------------------------------------------------------------------------
# Importance weights for the quantizers (llama-quantize --imatrix)

KEY_Q_FILE = "quantize.imatrix.file"
KEY_Q_DATASET = "quantize.imatrix.dataset"
KEY_Q_ENTRIES = "quantize.imatrix.entries_count"
KEY_Q_CHUNKS = "quantize.imatrix.chunks_count"


@dataclass
class Importance:
    """What ``llama-quantize --imatrix FILE`` hands to the quantizers, and the keys it records.

    ``weights[name]``: float32 [n_mat · n_per_row] (GGUF weight name → importance of each
    input column, one row per expert matrix); ``datasets``: calibration sources;
    ``chunk_count``: chunks seen (0 when unknown); ``file``: the path as given on the command
    line (recorded in ``quantize.imatrix.file``). Reproduces ``tools/quantize/quantize.cpp``
    ``load_imatrix`` and ``prepare_imatrix`` (llama.cpp 0c1e57098)."""

    weights: dict[str, np.ndarray]
    datasets: list[str]
    chunk_count: int
    file: str

    def kvs(self) -> list[tuple[str, object, str]]:
        """The ``quantize.imatrix.*`` KVs llama-quantize appends (in its order), as
        (key, value, "str"|"u32"): file (truncated to 127 bytes), the first dataset if any,
        entries_count, and chunks_count when > 0. Empty when no entry is left."""
        if not self.weights:
            return []
        out: list[tuple[str, object, str]] = [(KEY_Q_FILE, _c_str127(self.file), "str")]
        if self.datasets:
            out.append((KEY_Q_DATASET, _c_str127(self.datasets[0]), "str"))
        out.append((KEY_Q_ENTRIES, len(self.weights), "u32"))
        if self.chunk_count > 0:
            out.append((KEY_Q_CHUNKS, int(self.chunk_count), "u32"))
        return out

    def filtered(self, include: tuple[str, ...] = (), exclude: tuple[str, ...] = ()) -> "Importance":
        """``prepare_imatrix``'s ``--exclude-weights`` (drop entries whose name contains any of
        ``exclude``) then ``--include-weights`` (keep only entries containing one of
        ``include``); substring matches, as llama-quantize."""
        w = {k: v for k, v in self.weights.items() if not any(e in k for e in exclude)}
        if include:
            w = {k: v for k, v in w.items() if any(i in k for i in include)}
        return Importance(w, list(self.datasets), self.chunk_count, self.file)


def _c_str127(s: str) -> str:
    """``strncpy(val_str, s, 127)``: at most 127 bytes (cut at a byte boundary, as C does;
    an incomplete UTF-8 tail is dropped)."""
    return s.encode("utf-8")[:127].decode("utf-8", errors="ignore")


def load_importance(path: str | Path, shown_as: str | None = None) -> Importance:
    """Read an imatrix as ``llama-quantize --imatrix`` does (``common_imatrix_load``): a GGUF
    imatrix (ours or llama-imatrix's: ``in_sum2 / counts`` per matrix, importance 1 where the
    count is 0, counts rounded with ``lround``) or, for any file that is not GGUF, the legacy
    ``.dat`` format of older llama-imatrix (``int32 n_entries``; per entry ``int32 len, name,
    int32 ncall, int32 nval, float32[nval]`` holding Σx²/count·ncall; optionally ``int32
    chunk_count, int32 len, dataset``): importance = value / ncall (the value itself when
    ncall is 0). ``shown_as``: the path string recorded in ``quantize.imatrix.file``
    (default ``str(path)``).

    Raises InputError naming the file (and the entry) for a file that cannot be read, a
    truncated file, a non-imatrix GGUF (missing ``imatrix.*`` metadata), a bad entry count
    or value count, or non-finite values."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise InputError(f"{p}: cannot read the imatrix ({e.strerror})") from None
    if magic == b"GGUF":
        try:
            im = read_imatrix(p)
        except InputError:
            raise
        except Exception as e:  # gguf-py on a truncated or corrupt file
            raise InputError(f"{p}: not a readable GGUF imatrix ({type(e).__name__}: {e})") from None
        weights = {}
        for name, s in im.sums.items():
            c = np.floor(im.counts[name].astype(np.float64) + 0.5).astype(np.float32)[:, None]
            weights[name] = np.where(c > 0, s / np.where(c > 0, c, 1), np.float32(1)).astype(np.float32).reshape(-1)
        return Importance(weights, im.datasets, im.chunk_count, shown_as or str(path))
    return _load_legacy(p, shown_as or str(path))


def _load_legacy(p: Path, shown: str) -> Importance:
    data = p.read_bytes()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if pos + n > len(data):
            raise InputError(f"{p}: truncated legacy imatrix (.dat): {what} at byte {pos} "
                             f"needs {n} bytes, {len(data) - pos} left")
        b = data[pos:pos + n]
        pos += n
        return b

    def i32(what: str) -> int:
        return struct.unpack("<i", take(4, what))[0]

    n_entries = i32("entry count") if len(data) >= 4 else 0
    if n_entries < 1:
        raise InputError(f"{p}: not an imatrix (no GGUF header and legacy entry count "
                         f"{n_entries}, expected >= 1)")
    weights: dict[str, np.ndarray] = {}
    for i in range(n_entries):
        n = i32(f"entry {i + 1} name length")
        if n < 0:
            raise InputError(f"{p}: entry {i + 1} has a negative name length {n}")
        name = take(n, f"entry {i + 1} name").decode("utf-8", errors="replace").split("\0")[0]
        ncall = i32(f"entry '{name}' ncall")
        nval = i32(f"entry '{name}' value count")
        if nval < 1:
            raise InputError(f"{p}: entry '{name}' has {nval} values, expected >= 1")
        v = np.frombuffer(take(4 * nval, f"entry '{name}' values"), dtype="<f4").astype(np.float32)
        if not np.isfinite(v).all():
            raise InputError(f"{p}: imatrix entry '{name}': non-finite values (NaN/Inf)")
        weights[name] = (v / np.float32(ncall)).astype(np.float32) if ncall > 0 else v.copy()
    chunk_count, datasets = 0, []
    if pos + 4 <= len(data):
        chunk_count = i32("chunk count")
        if pos + 4 <= len(data):
            n = i32("dataset name length")
            if 0 < n <= len(data) - pos:
                datasets.append(take(n, "dataset name").decode("utf-8", errors="replace").split("\0")[0])
    return Importance(weights, datasets, chunk_count, shown)
