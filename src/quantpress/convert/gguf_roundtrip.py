"""GGUF round trips: re-reading a written file with gguf-py's GGUFReader and checking every
tensor against its source (:func:`verify_gguf`), or checking each tensor as soon as the
writer has put it on disk (:func:`watch_round_trip`).

The checks beside the writing run in checker processes of their own where they can
(:class:`CheckerProcesses`, :class:`RoundTripProcessWatch`), else in threads
(:class:`RoundTripWatch`): gguf-py's dequantization and our codecs are many numpy and torch
calls issued from Python, each holding the interpreter lock while it is dispatched, so a
check in a thread slows the quantization beside it even on idle cores, and several threads
of checks serialize (``scripts/bench_gguf.py`` prints the round trip's share of the stage).
Off the CPU the writer computes our half of each check on its device (our dequantization of
the bytes it wrote, the error against the source, checksums of each row of our values) and the
checkers only re-read the file, dequantize it with gguf-py and compare the rows' checksums
(:func:`figures_on_writer`, :func:`writer_figures`).
"""
from __future__ import annotations

import collections
import contextlib
import math
import mmap
import multiprocessing
import multiprocessing.connection
import os
import queue
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensors' memory
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants

from quantpress.errors import InputError
from quantpress.quantize import ggml
from quantpress.quantize.ggml.common import serial_codecs, single_threaded_ops
from quantpress.workers import SharedArea, Worker, announce_ready, can_fork_workers, sendable, start_worker, wait_ready


@dataclass
class SourceTensor:
    """One output tensor before quantization.

    ``name``: GGUF tensor name; ``shape``: torch order (last axis = ggml ne[0], the row);
    ``load()``: returns the float tensor (any float dtype, CPU) with that shape.
    """

    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]

    @property
    def numel(self) -> int:
        """Elements of the tensor."""
        return math.prod(self.shape)


@dataclass
class TensorReport:
    """Round-trip figures of one tensor: dequantized file contents against the source."""

    name: str
    type: str
    shape: tuple[int, ...]
    n_bytes: int
    rmse: float
    max_abs_err: float
    snr_db: float  # 10 log10(Σx² / Σ(x−x̂)²); inf when exact

    @property
    def bpw(self) -> float:
        """Bits per weight of the stored tensor (8 · bytes / elements)."""
        return 8.0 * self.n_bytes / math.prod(self.shape)


@dataclass
class RoundTrip:
    """Result of :func:`verify_gguf`: per-tensor reports and the mismatches found."""

    tensors: list[TensorReport] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    #: seconds spent checking (beside the writing: the wall time during which a check ran)
    seconds: float = 0.0
    #: checker processes that answered (0: the checks ran in threads)
    checker_processes: int = 0

    @property
    def ok(self) -> bool:
        """True when no mismatch was found."""
        return not self.mismatches


class GGUFFileReader(GGUFReader):
    """gguf-py's ``GGUFReader``, parsing the file exactly as it does, over a plain ndarray view
    of its memory map (kept as ``memmap``). gguf-py slices its ``data`` once or twice for every
    metadata value, and numpy's ``memmap`` subclass makes each slice run a Python-level
    ``__array_finalize__``: SmolLM2's 49,152-token vocabulary and 48,900 merges parse several
    times faster over the plain view (figures and the command in docs/benchmarks.md,
    "Figures behind the code", ``convert/gguf_roundtrip.py``). Fields and tensors are the
    same arrays' values (the tensors' ``data`` are ndarray views of the same map)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mm: np.memmap) -> None:
        self.memmap = mm
        self._plain = mm.view(np.ndarray)


class GGUFTensorsReader(GGUFFileReader):
    """:class:`GGUFFileReader` for the round trip's checks, which read tensors only: gguf-py
    parses the header, the tensor infos and every metadata value as it does, except arrays
    (a tokenizer's vocabulary, merges and token types), whose extent alone is found: numbers
    in one read, strings by a walk over their lengths, each array kept as one part; their
    fields list no values (``field.data`` is empty). gguf-py's parse takes a few numpy
    slices per element of an array, far slower on SmolLM2's Q8_0 file than this way (figures
    and the command in docs/benchmarks.md, "Figures behind the code",
    ``convert/gguf_roundtrip.py``), a cost paid in every checker process, before its first
    check. A wrong extent shifts what gguf-py reads next, so the tensor infos and the file stop
    agreeing: the parse fails, and with it the round trip. It overrides gguf-py
    0.19.0's ``GGUFReader._get_field_parts`` (returns the field's byte size, its parts, the
    indices of its values among them, its types), the version pyproject.toml pins;
    ``tests/test_gguf_many.py`` compares the two parses."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        types = [GGUFValueType.ARRAY, GGUFValueType(int(itype[0]))]
        nptype = self.gguf_scalar_to_np.get(types[1])
        if nptype is not None:                                  # numbers: one read
            values = self._get(orig_offs + 12, nptype, int(alen[0]))
            if values.shape[0] != int(alen[0]):
                raise ValueError(f"array at offset {orig_offs} runs past the end of the file")
            return 12 + int(values.nbytes), [itype, alen, values], [], types
        if types[1] != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        little = (self.byte_order == "I") == (sys.byteorder == "little")
        length = struct.Struct("<Q" if little else ">Q")       # each string's uint64 length
        buf = memoryview(self.data)
        offs = start = orig_offs + 12
        for _ in range(int(alen[0])):
            offs += 8 + length.unpack_from(buf, offs)[0]       # (struct.error past the end)
        if offs > len(buf):
            raise ValueError(f"string array at offset {orig_offs} runs past the end of the file")
        strings = self._get(start, np.uint8, offs - start)
        return offs - orig_offs, [itype, alen, strings], [], types


def open_reader(path: str | Path) -> GGUFReader:
    """gguf-py's reader (:class:`GGUFFileReader`) of ``path``. Raises InputError naming the
    file when it is missing or gguf-py cannot parse it (truncated, not GGUF)."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    try:
        return GGUFFileReader(str(path))
    except Exception as e:  # gguf-py raises ValueError / struct errors on bad files
        raise InputError(f"{path}: not a readable GGUF file ({e})") from None


def reader_raw(rt) -> np.ndarray:
    """The bytes of a GGUFReader tensor as uint8 [rows, row_bytes] (ne[0] is the row)."""
    data = np.asarray(rt.data)
    ne0 = int(rt.shape[0])
    gt = ggml.get(GGMLQuantizationType(rt.tensor_type).name)
    return data.view(np.uint8).reshape(-1, gt.row_bytes(ne0))


# rows per verification chunk: bounds the float32 copies (gguf-py's, ours, the source's,
# the error) to a few times this many elements, whatever the tensor size
VERIFY_CHUNK_ELEMENTS = 1 << 22


def gguf_py_decoder(tname: str) -> Callable[[np.ndarray], np.ndarray]:
    """gguf-py's dequantizer of ggml type ``tname`` for whole rows: uint8 ndarray [rows,
    row_bytes] -> float32 ndarray [rows · values per row], flat (a view of the input for F32).
    The class ``gguf.quants.<tname>``'s own ``dequantize_blocks`` on all of the rows' blocks
    at once where gguf-py has one (every quantized type and BF16; its grid set up first, as
    ``gguf.quants.dequantize`` does), else ``gguf.quants.dequantize`` (F32, F16).
    ``gguf.quants.dequantize`` runs the same ``dequantize_blocks`` over groups of 16 rows and
    copies the groups' results into one array: on the check's pieces of
    :data:`CHECK_PIECE_ELEMENTS` values, taking the blocks at once skips that copy and keeps
    the piece in the cache for the comparison that follows (``scripts/micro_figures.py
    --dequantize``, ``--round-trip``)."""
    cls = getattr(gguf_quants, tname, None)
    if cls is None or not hasattr(cls, "dequantize_blocks"):
        qtype = GGMLQuantizationType[tname]
        return lambda rows: np.asarray(gguf_quants.dequantize(rows, qtype), dtype=np.float32).reshape(-1)
    cls.init_grid()
    return lambda rows: cls.dequantize_blocks(rows.reshape(-1, cls.type_size)).reshape(-1)


# rows of a chunk that the check (gguf-py's dequantization and ours, the bit comparison, the
# error against the source) takes at a time on the CPU: about this many elements, so that
# the pieces' float32 copies stay in the cache and no codec slices are concatenated.
# verify_gguf of the 554M random llama's Q4_K_M on one thread is faster this way than with
# whole chunks (SmolLM2's the same within noise), also with gguf-py's values per piece
# (gguf_py_decoder); figures and the command in docs/benchmarks.md, "Figures behind the
# code", ``convert/gguf_roundtrip.py``
CHECK_PIECE_ELEMENTS = 1 << 18


def _chunk_step(cols: int) -> int:
    # rows of a verification chunk of rows ``cols`` wide
    return max(1, VERIFY_CHUNK_ELEMENTS // max(1, cols))


def chunk_rows(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """The row ranges ``(r0, r1)`` a tensor of ``rows`` x ``cols`` elements is checked in:
    consecutive, from 0 to ``rows``, about :data:`VERIFY_CHUNK_ELEMENTS` elements each (at
    least one row)."""
    step = _chunk_step(cols)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


#: most elements of one tensor's check handed to one checker process: a larger tensor goes
#: in parts of whole chunks (:func:`check_parts`), which the watch's checkers take side by
#: side, so that the largest tensors (the 554M random llama's embedding and output head, 13.6%
#: of its weights each) do not hold back the round trip's end on one core
CHECK_PART_ELEMENTS = 1 << 24


def check_parts(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """The row ranges ``(r0, r1)`` in which a tensor of ``rows`` x ``cols`` elements is handed
    to checker processes: consecutive, from 0 to ``rows``, on the boundaries of
    :func:`chunk_rows`, about :data:`CHECK_PART_ELEMENTS` elements each (at least one chunk)."""
    step = _chunk_step(cols)
    per = step * max(1, CHECK_PART_ELEMENTS // (step * max(1, cols)))
    for r0 in range(0, rows, per):
        yield r0, min(rows, r0 + per)


#: Lowest signal-to-noise ratio (dB) of a tensor's decoded data against its source that the
#: round trip accepts. Both dequantizers agree on whatever bytes are in the file, so data
#: written in the wrong place (another tensor's of the same shape: about −3 dB; zeros: 0 dB;
#: shifted by a block: about −3 dB) is caught only here. Every ggml type stays far above it:
#: Q2_K, the coarsest written, gives 7.9–10.5 dB on random Gaussian, Student-t and
#: outlier-column tensors, Q3_K 16.4–16.6 dB, the 4-bit types 18.9–22.9 dB
#: (scripts/micro_figures.py).
MIN_SNR_DB = 3.0


def drop_pages(reader: GGUFReader, rt, rows: tuple[int, int] | None = None) -> None:
    """Release the process's mapping of tensor ``rt``'s pages in ``reader``'s memory map
    (``madvise(MADV_DONTNEED)``; the pages stay in the page cache and are read again if the
    tensor is), so that reading a file tensor by tensor does not grow the process's RSS with
    the whole file; ``rows``: only those of rows ``[r0, r1)`` (the pages they lie on). A
    no-op where the platform has no ``madvise``."""
    mm = getattr(getattr(reader, "memmap", reader.data), "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    begin, end = int(rt.data_offset), int(rt.data_offset) + int(rt.n_bytes)
    if rows is not None:
        row_bytes = reader_raw(rt).shape[1]
        begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
    start = (begin // mmap.PAGESIZE) * mmap.PAGESIZE
    length = end - start
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, length)
    except (OSError, ValueError):
        pass


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether int32 tensors ``a`` and ``b`` (same shape, one device) hold the same values:
    numpy's ``array_equal`` on the CPU (on a piece of 2^18 values in the cache, several times
    faster than torch.equal or counting the differences through a bool tensor: figures and the
    command in docs/benchmarks.md, "Figures behind the code", ``convert/gguf_roundtrip.py``),
    ``torch.equal`` elsewhere. The differences are counted only where this finds some."""
    if a.device.type == "cpu":
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return torch.equal(a, b)


def _layout_mismatch(rt, st: SourceTensor, planned: str) -> str | None:
    """The mismatch of file tensor ``rt`` against its plan (``st``, ggml type ``planned``):
    another type or shape, or None."""
    tname = GGMLQuantizationType(rt.tensor_type).name
    shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
    if tname != planned or shape != tuple(st.shape):
        return f"{st.name}: file has {tname}{shape}, expected {planned}{st.shape}"
    return None


def _chunk_figures(rt, src: torch.Tensor, r0: int, r1: int, device: torch.device) -> list[tuple]:
    """The checks of rows ``[r0, r1)`` of file tensor ``rt`` (its layout as planned), whose
    source rows are ``src`` (float, [r1 - r0, values per row], CPU): for each verification
    chunk (:func:`chunk_rows`; ``r0`` and ``r1`` on chunk boundaries, :func:`check_parts`),
    ``(values where gguf-py's and our dequantization differ, Σ(x−x̂)², Σx², max |x−x̂|)``, the
    sums in float64 of float32 pieces."""
    tname = GGMLQuantizationType(rt.tensor_type).name
    raw = reader_raw(rt)
    cols = src.shape[1]
    theirs = gguf_py_decoder(tname)
    # in pieces of rows on the CPU (the whole chunk elsewhere): see CHECK_PIECE_ELEMENTS
    piece = max(1, CHECK_PIECE_ELEMENTS // cols) if device.type == "cpu" else raw.shape[0]
    step = _chunk_step(cols)
    out = []
    for c0 in range(r0, r1, step):
        c1 = min(r1, c0 + step)
        # gguf-py's values, then ours and the comparisons on ``device``, one sync per chunk
        figures = []
        for p0 in range(c0, c1, piece):
            p1 = min(c1, p0 + piece)
            ref = theirs(raw[p0:p1])
            ref_t = torch.from_numpy(ref if ref.flags.writeable else ref.copy()).to(device)  # (F32: a view of the map)
            ours = ggml.dequantize(torch.from_numpy(raw[p0:p1].copy()).to(device), tname).reshape(-1)
            ref_bits = ref_t.view(torch.int32)
            our_bits = ours.view(torch.int32)
            diff = ours.new_zeros(()) if _same_bits(ref_bits, our_bits) else (ref_bits != our_bits).sum()
            x = src[p0 - r0:p1 - r0].to(device=device, dtype=torch.float32).reshape(-1)
            e = torch.sub(ours, x, out=ours)    # (ours is this piece's own, compared above)
            lo, hi = torch.aminmax(e)
            figures.append(torch.stack([diff.to(torch.float64), torch.dot(e, e).double(),
                                        torch.dot(x, x).double(), -lo.double(), hi.double()]))
        f = torch.stack(figures)
        d, se_c, sig_c, err_c = torch.cat([f[:, :3].sum(0), f[:, 3:].max().reshape(1)]).tolist()
        out.append((int(d), se_c, sig_c, err_c))
    return out


def _tensor_report(st: SourceTensor, tname: str, n_bytes: int, figures: list[tuple], rep: RoundTrip,
                   unit: str = "values") -> None:
    """Conclude the check of tensor ``st`` (in the file: ggml type ``tname``, ``n_bytes``
    bytes) from its chunks' figures (:func:`_chunk_figures`, all of its rows in order, summed
    in that order; their first fields count differences in ``unit``): appends the
    :class:`TensorReport`, and the mismatches (the dequantizations differ; SNR below
    :data:`MIN_SNR_DB`) to ``rep``."""
    neq, se, sig, max_err = 0, 0.0, 0.0, 0.0
    for d, se_c, sig_c, err_c in figures:
        neq += d
        se += se_c
        sig += sig_c
        max_err = max(max_err, err_c)
    if neq:
        rep.mismatches.append(f"{st.name}: gguf-py and quantpress dequantize differ in {neq} {unit} ({tname})")
    ratio = sig / se if se else math.inf
    snr = 10 * math.log10(ratio) if 0 < ratio < math.inf else (math.inf if se == 0 else -math.inf)
    if snr < MIN_SNR_DB:
        rep.mismatches.append(f"{st.name}: its {tname} data decodes to {snr:.1f} dB SNR against the "
                              f"source tensor, below {MIN_SNR_DB:g} dB (another tensor's data?)")
    rep.tensors.append(TensorReport(st.name, tname, tuple(st.shape), n_bytes,
                                    math.sqrt(se / max(1, st.numel)), max_err, snr))


def _check_tensor(rt, st: SourceTensor, planned: str, source: torch.Tensor | None,
                  device: torch.device, rep: RoundTrip) -> None:
    """The round trip of one tensor (:func:`verify_gguf`): ``rt`` the reader's tensor, ``st``
    its plan, ``planned`` its ggml type, ``source`` the source tensor (None: ``st.load()``).
    Appends a :class:`TensorReport` or the mismatch to ``rep``."""
    bad = _layout_mismatch(rt, st, planned)
    if bad is not None:
        rep.mismatches.append(bad)
        return
    rows = reader_raw(rt).shape[0]
    src = (st.load() if source is None else source).reshape(rows, -1)
    _tensor_report(st, planned, int(rt.n_bytes), _chunk_figures(rt, src, 0, rows, device), rep)


def _checksum_period(cols: int) -> int:
    # the period of row_checksums' position weights (1 .. period): the largest up to 127 (a
    # prime) with which |Σ bits x weight| < 2^31 x period x cols stays below 2^53, so that
    # NumPy's float64 product with the weights is exact
    return max(1, min(127, (1 << 22) // max(1, cols)))


def row_checksums(values: torch.Tensor) -> torch.Tensor:
    """Two checksums of each row of float32 ``values`` [rows, cols] (any device), int64
    [rows, 2]: the sum of the values' bits as int32, and the sum of those bits times a
    position's weight, (j mod p) + 1 for position j, with p = 127 (less for rows wider than
    33,026 values, so that every sum stays below 2^53). Equal rows have equal checksums; one
    value that differs changes the first; two values of a row exchanged change the second
    unless their positions differ by a multiple of p. :func:`row_checksums_np` computes the
    same on NumPy arrays."""
    bits = values.contiguous().view(torch.int32).to(torch.int64)
    cols = bits.shape[1]
    weights = torch.arange(cols, device=bits.device, dtype=torch.int64) % _checksum_period(cols) + 1
    return torch.stack([bits.sum(1), (bits * weights).sum(1)], dim=1)


def row_checksums_np(values: np.ndarray) -> np.ndarray:
    """:func:`row_checksums` of float32 ndarray ``values`` [rows, cols], int64 ndarray [rows,
    2] (the checkers' side): one float64 product with the [1, weight] columns (BLAS; exact,
    every partial sum an integer below 2^53): per value, at or below gguf-py's cost for the
    same rows (figures and the command in docs/benchmarks.md, "Figures behind the code",
    ``convert/gguf_roundtrip.py``)."""
    bits = values.view(np.int32)
    cols = bits.shape[1]
    weights = np.stack([np.ones(cols), np.arange(cols) % _checksum_period(cols) + 1.0], axis=1)
    return (bits.astype(np.float64) @ weights).astype(np.int64)


@dataclass
class RowChecksums:
    """What the writer hands a checker instead of a source when it computed a tensor's error
    itself (:func:`writer_figures`): :func:`row_checksums` of its dequantized rows, int64
    ndarray [rows, 2]."""

    sums: np.ndarray


def writer_figures(raw: np.ndarray, tname: str, source: torch.Tensor,
                   device: torch.device) -> tuple[list[tuple], np.ndarray]:
    """The writer's half of a round trip whose error sums run where it quantizes: the bytes
    it wrote, ``raw`` (uint8 ndarray [rows, row_bytes] of ggml type ``tname``), dequantized by
    quantpress on ``device`` and compared with ``source`` (float, the tensor's shape, any
    device) chunk by chunk (:func:`chunk_rows`): the chunks' figures as :func:`_chunk_figures`
    gives them with no difference counted (0, Σ(x−x̂)², Σx², max |x−x̂|; float32 sums of whole
    chunks, in float64), and :func:`row_checksums` of the dequantized rows (int64 ndarray
    [rows, 2]), which the checker compares with gguf-py's values of the rows in the file
    (:class:`RowChecksums`). One transfer back per tensor."""
    rows = raw.shape[0]
    x = source.reshape(rows, -1)
    cols = x.shape[1]
    figures, sums = [], []
    for c0, c1 in chunk_rows(rows, cols):
        ours = ggml.dequantize(torch.from_numpy(raw[c0:c1].copy()).to(device), tname).reshape(c1 - c0, cols)
        sums.append(row_checksums(ours))
        xc = x[c0:c1].to(device=device, dtype=torch.float32).reshape(-1)
        e = torch.sub(ours.reshape(-1), xc, out=ours.reshape(-1))
        lo, hi = torch.aminmax(e)
        figures.append(torch.stack([torch.dot(e, e).double(), torch.dot(xc, xc).double(),
                                    -lo.double(), hi.double()]))
    f = torch.stack(figures)
    f = torch.cat([f[:, :2], f[:, 2:].amax(1, keepdim=True)], dim=1).cpu().tolist()
    return [(0, se, sig, err) for se, sig, err in f], torch.cat(sums).cpu().numpy()


def _rows_differing(rt, sums: np.ndarray, r0: int, r1: int) -> int:
    """Rows among ``[r0, r1)`` of file tensor ``rt`` (its layout as planned) whose gguf-py
    values' :func:`row_checksums` are not ``sums`` (int64 [r1 - r0, 2], the writer's of our
    values), gguf-py's values taken in pieces of :data:`CHECK_PIECE_ELEMENTS`."""
    tname = GGMLQuantizationType(rt.tensor_type).name
    raw = reader_raw(rt)
    theirs = gguf_py_decoder(tname)
    piece = max(1, CHECK_PIECE_ELEMENTS // max(1, int(rt.shape[0])))     # (ne[0]: the row)
    differ = 0
    for p0 in range(r0, r1, piece):
        p1 = min(r1, p0 + piece)
        ref = theirs(raw[p0:p1]).reshape(p1 - p0, -1)
        differ += int(np.count_nonzero((row_checksums_np(ref) != sums[p0 - r0:p1 - r0]).any(axis=1)))
    return differ


def _tensor_index(reader: GGUFReader, tensors: list[SourceTensor], rep: RoundTrip) -> dict:
    by_name = {t.name: t for t in reader.tensors}
    if len(by_name) != len(tensors):
        rep.mismatches.append(f"file has {len(by_name)} tensors, expected {len(tensors)}")
    return by_name


def verify_gguf(path: Path, tensors: list[SourceTensor], types: dict[str, str],
                device: torch.device,
                progress: Callable[[Iterable], Iterable] = lambda it: it) -> RoundTrip:
    """Re-read ``path`` with gguf-py's GGUFReader and check every tensor.

    For each tensor: name, ggml type and shape must be as planned; gguf-py's independent
    dequantizer (``gguf.quants.dequantize``) must equal ours (``quantize.ggml.dequantize``)
    bit for bit; and the result is compared with the source tensor: RMSE, max |error| and
    SNR in dB (10 log10 Σx²/Σ(x−x̂)², float32 sums), which must reach :data:`MIN_SNR_DB` (the
    bytes are this tensor's, in their place). Works through each tensor in row chunks
    of about VERIFY_CHUNK_ELEMENTS, so memory follows that, not the tensor or the file.
    Returns a :class:`RoundTrip`; its ``mismatches`` lists every failure.
    (:class:`RoundTripWatch` runs the same checks while the file is being written.)
    """
    t0 = time.perf_counter()
    rep = RoundTrip()
    try:
        reader = GGUFTensorsReader(str(path))
    except Exception as e:
        rep.mismatches.append(f"gguf-py cannot read the file ({e})")
        return rep
    by_name = _tensor_index(reader, tensors, rep)
    for st in progress(tensors):
        rt = by_name.get(st.name)
        if rt is None:
            rep.mismatches.append(f"{st.name}: missing from the file")
            continue
        _check_tensor(rt, st, types[st.name], None, device, rep)
        drop_pages(reader, rt)
    rep.seconds = time.perf_counter() - t0
    return rep


class RoundTripWatch:
    """The round trip of :func:`verify_gguf`, run on a GGUF file while it is being written,
    in a thread of its own (checking tensor i while the writer quantizes tensor i + 1), where
    no checker process can be started (:class:`RoundTripProcessWatch` is the rule).

    ``path``: the file, whose header, metadata and tensor infos are on disk and which has been
    given its final ``size`` (zero-filled: the writer then fills it in order), so gguf-py's
    reader (:class:`GGUFFileReader`) parses it once, at :meth:`start`, with every tensor's
    offset where it will be; ``tensors`` / ``types``: the plan. :meth:`written` hands over
    tensor ``index`` once its bytes are flushed to the file, with the source tensor just read
    (checked as :func:`verify_gguf` checks it: gguf-py's and our dequantization bit for bit,
    and the error against that source); at most ``workers`` wait, so the writer is held back
    when the checks fall behind. :meth:`finish` waits for the last check, verifies the file's size
    and returns the :class:`RoundTrip` (``seconds``: the wall time during which a check ran;
    ``tensors`` in plan order). ``workers`` threads check tensors side by side (one on the
    CPU; several when the quantization runs on an accelerator and the cores are idle). The threads quantize nothing: their dequantization runs on each alone
    (:func:`quantpress.quantize.ggml.common.serial_codecs`), one torch thread each."""

    def __init__(self, path: Path, tensors: list[SourceTensor], types: dict[str, str],
                 device: torch.device, size: int, workers: int = 1):
        self.path, self.tensors, self.types, self.device, self.size = Path(path), tensors, types, device, size
        self.workers = max(1, workers)
        self.checkers: list = []        # checker processes: none, the checks run in threads
        self.rep = RoundTrip()
        self._queue: queue.Queue = queue.Queue(maxsize=self.workers)
        self._threads: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._checked: set[str] = set()
        self._parsed = threading.Event()
        self._lock = threading.Lock()
        self._busy, self._busy_since = 0, 0.0
        self._reader = self._by_name = None

    def start(self) -> None:
        """Start the threads: the first parses the file, then all check tensors as they are
        handed over."""
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"quantpress-roundtrip-{i}",
                                          daemon=True) for i in range(self.workers)]
        for t in self._threads:
            t.start()

    def written(self, index: int, source: torch.Tensor, raw: np.ndarray | None = None,
                on_device: torch.Tensor | None = None) -> None:
        """Tensor ``tensors[index]`` is on disk; ``source`` is what it was quantized from
        (``raw`` and ``on_device``, :meth:`RoundTripProcessWatch.written`'s, are not used: the
        threads check the file against the source)."""
        self._queue.put((index, source))

    def _run(self, worker: int) -> None:
        # on a GPU each thread queues its work on a stream of its own, so that its syncs do not
        # wait for the quantization kernels queued by the writer
        own = contextlib.nullcontext()
        if self.device.type == "cuda":
            try:
                own = torch.cuda.stream(torch.cuda.Stream(self.device))
            except RuntimeError:            # no stream of its own: the default stream serves
                pass
        with own, single_threaded_ops(), serial_codecs(), torch.no_grad():
            if worker == 0:
                self._parse()
            self._parsed.wait()
            self._check_all()

    def _timed(self, begin: bool) -> None:
        # seconds during which at least one thread was checking (wall time, not thread time)
        with self._lock:
            now = time.perf_counter()
            if begin:
                if self._busy == 0:
                    self._busy_since = now
                self._busy += 1
            else:
                self._busy -= 1
                if self._busy == 0:
                    self.rep.seconds += now - self._busy_since

    def _parse(self) -> None:
        self._timed(True)
        try:
            self._reader = GGUFTensorsReader(str(self.path))
            self._by_name = _tensor_index(self._reader, self.tensors, self.rep)
        except Exception as e:  # gguf-py cannot parse what was written: the round trip fails
            self.rep.mismatches.append(f"gguf-py cannot read the file ({e})")
            self._reader = None
        finally:
            self._timed(False)
            self._parsed.set()

    def _check_all(self) -> None:
        reader, by_name = self._reader, self._by_name
        while (item := self._queue.get()) is not None:
            if reader is None or self._error is not None:
                continue                        # keep taking what the writer hands over
            self._timed(True)
            index, source = item
            item = None
            try:
                st = self.tensors[index]
                rt = by_name.get(st.name)
                if rt is None:
                    self.rep.mismatches.append(f"{st.name}: missing from the file")
                else:
                    _check_tensor(rt, st, self.types[st.name], source, self.device, self.rep)
                    drop_pages(reader, rt)
                    self._checked.add(st.name)
            except BaseException as e:  # reported by finish()
                self._error = e
            finally:
                del source
                self._timed(False)

    def stop(self) -> None:
        """End the threads (after the last checks they were handed); idempotent."""
        alive = [t for t in self._threads if t.is_alive()]
        for _ in alive:
            self._queue.put(None)
        for t in alive:
            t.join()
        self._threads = []

    def finish(self) -> RoundTrip:
        """Wait for the checks, then check the file's size and that every planned tensor was
        checked; returns the :class:`RoundTrip`. Re-raises an error of the thread."""
        self.stop()
        if self._error is not None:
            raise self._error
        return _conclude(self.rep, self.path, self.size, self.tensors, self._checked)


def _conclude(rep: RoundTrip, path: Path, size: int, tensors: list[SourceTensor], checked: set[str]) -> RoundTrip:
    # after the last check of a watch: the file's size, every planned tensor checked, the
    # reports in plan order (checks end out of order)
    actual = path.stat().st_size
    if actual != size:
        rep.mismatches.append(f"file is {actual} bytes, expected {size}")
    missed = [st.name for st in tensors if st.name not in checked]
    if missed and not rep.mismatches:
        rep.mismatches.append(f"{missed[0]}: not checked ({len(missed)} tensors)")
    order = {st.name: i for i, st in enumerate(tensors)}
    rep.tensors.sort(key=lambda r: order.get(r.name, len(order)))
    return rep


# ---------------------------------------------------------------- checks in processes

#: most checkers (processes, or threads where no process can be started) of one file's round
#: trip when quantizing off the CPU
VERIFY_WORKERS = 8
#: bytes of the staging areas of several checkers started together (off the CPU), split evenly
#: among them (each at least a quarter of it: a GPU box's eight checkers then hold two of a 554M
#: model's float32 feed-forward matrices each); a checker started alone (the CPU's one) has
#: :data:`SOLE_STAGING_BYTES`. Each checker process has one: shared memory that it and this
#: process map (inherited when it is forked), through which the writer hands it its source
#: tensors: one copy into pages the checker touched at its start, not a new shared-memory
#: segment per tensor (whose fresh pages each source would fault in). It is also the
#: backlog: the writer waits while no checker's area can hold the next source. Checks cost
#: unlike their quantization. A larger source goes alone, in shared memory of its own, at most
#: one per checker at a time. (An area shared by several checkers would free its room in
#: order, so a slow check would hold back the room of the checks after it.)
STAGING_BYTES = 1 << 28
#: bytes of the staging area of a checker started alone (the CPU's one checker,
#: :func:`checkers_for`). The checker touches its whole area when it starts, so the area is
#: memory of the process tree for the whole conversion: 256 MiB made SmolLM2's Q4_K_M peak
#: 743 MiB, 64 MiB 543 MiB (the 554M random llama's 1,103 against 922), at no measured cost in
#: time since the checks no longer wait for a slow parse of the file (figures and commands in
#: docs/benchmarks.md, "Where the peak goes" and "Figures behind the code",
#: ``convert/gguf_roundtrip.py``).
SOLE_STAGING_BYTES = 1 << 26
#: False: round trips beside the writing run in threads (:class:`RoundTripWatch`) even where
#: processes can be started
USE_PROCESSES = True


def checkers_for(device: torch.device) -> int:
    """Checkers of one file's round trip when quantizing on ``device``: one on the CPU (the
    codecs use the other cores), else up to :data:`VERIFY_WORKERS` of the idle cores (all
    but one), since gguf-py's dequantization runs on the CPU and would hold back a GPU's
    writing."""
    return 1 if device.type == "cpu" else min(VERIFY_WORKERS, checker_limit())


#: whether the writer computes our half of the round trip (our dequantization, the error against
#: the source) where it quantizes and hands the checker processes only checksums
#: (:class:`RoundTripProcessWatch`'s ``figures_on``): None, off the CPU (whose cores are the
#: checkers'; on the CPU the writer's cores are the codecs'); True / False, on every device /
#: on none
FIGURES_ON_WRITER: bool | None = None


def figures_on_writer(device: torch.device) -> torch.device | None:
    """The device on which the writer computes our half of the round trip
    (:data:`FIGURES_ON_WRITER`): ``device``, or None (the checkers compute it)."""
    on = device.type != "cpu" if FIGURES_ON_WRITER is None else FIGURES_ON_WRITER
    return device if on else None


def checker_limit() -> int:
    """Most checker processes that files written side by side get together: all cores but
    one (at least one each, :func:`checkers_for`)."""
    return max(1, (os.cpu_count() or 2) - 1)


def cores_taken(watches: list) -> int:
    """The cores these watches' checker processes take (their ``checkers``: empty for a
    :class:`RoundTripWatch`, whose checks run in threads), which the writer's torch ops on the
    CPU may leave them (:func:`quantpress.convert.gguf_file.write_gguf_many`). Watches of
    several files may share checkers (counted once)."""
    return len({id(c) for w in watches for c in w.checkers})


def checker_processes_usable() -> bool:
    """Whether round trips may run in checker processes: :data:`USE_PROCESSES` and this
    process is not daemonic (:mod:`multiprocessing` forbids a daemonic process children; the
    batch's side lane is one)."""
    return USE_PROCESSES and can_fork_workers()


class _Staging(SharedArea):
    """A checker's staging area (:data:`STAGING_BYTES`): a :class:`SharedArea` used as a ring
    of byte ranges handed out in order and reclaimed from the oldest as their checks are
    answered."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)
        self._live: collections.deque = collections.deque()    # [start, end, answered]
        self._head = 0

    def take(self, nbytes: int) -> list | None:
        """A range of ``nbytes`` (rounded up to 64) as ``[start, end, answered]``, or None
        while the area cannot hold it."""
        n = -(-nbytes // 64) * 64
        if not self._live:
            self._head = 0
        tail = self._live[0][0] if self._live else 0
        if not self._live or self._head > tail:     # free: [head, size) and [0, tail)
            start = self._head if self._head + n <= self.size else (0 if n <= tail else None)
        elif self._head < tail:                     # free: [head, tail)
            start = self._head if self._head + n <= tail else None
        else:                                       # full
            start = None
        if start is None or n > self.size:
            return None
        entry = [start, start + n, False]
        self._live.append(entry)
        self._head = start + n
        return entry

    def give_back(self, entry: list) -> None:
        """The check of ``entry``'s source was answered."""
        entry[2] = True
        while self._live and self._live[0][2]:
            self._live.popleft()


def _serve_checks(conn, staging: _Staging) -> None:
    """A checker process's loop (:func:`quantpress.workers.start_worker`, which closed the
    pipe ends of its siblings): touches ``staging`` and answers ``("ready",)`` (the writer copies
    nothing into the area before). Requests: ``("open", key, path, [(name, shape)], types)``
    (a file to check, whose header is on disk: parsed at once), ``("check", key, index, (r0,
    r1), source)`` (rows ``[r0, r1)`` of tensor ``index``, a part of :func:`check_parts`;
    ``source``: those rows of its source, a CPU float tensor in shared memory, or ``(start,
    dtype, shape)``: where they lie in ``staging``; or the writer's :class:`RowChecksums` of
    those rows) and ``("close", key)`` (forget the file, unmapping it). Each check is answered
    ``("checked", key, index, r0, result, mismatches, found, spans, error, pid)``: ``(ggml
    type, bytes in the file, the chunks' figures of :func:`_chunk_figures`)``, or for
    checksums ``(ggml type, bytes, rows whose checksums differ)``, or None (the tensor's
    layout is not as planned, or it is not in the file: ``mismatches`` says which), whether
    the tensor was in the file, the check's (t0, t1) span in ``time.monotonic`` seconds (the
    first check of a file also the parse's), the exception it raised (or None) and the
    process id. Ends when the pipe closes (the writer's exit, however it ends, closes it) or
    with the writer (:mod:`quantpress.workers`' shutdown)."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    if not announce_ready(conn, staging):   # its pages now exist: the writer's copies do not fault them in
        return
    files: dict[int, dict] = {}
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        kind, key = request[0], request[1]
        if kind == "open":
            _, _, path, plan, types = request
            f = files[key] = {"tensors": [SourceTensor(n, tuple(s), None) for n, s in plan], "types": types,
                              "reader": None, "mismatches": []}
            t0 = time.monotonic()
            try:
                f["reader"] = GGUFTensorsReader(path)
                f["by_name"] = _tensor_index(f["reader"], f["tensors"], rep := RoundTrip())
                f["mismatches"] = rep.mismatches
            except Exception as e:  # gguf-py cannot parse what was written: the round trip fails
                f["mismatches"] = [f"gguf-py cannot read the file ({e})"]
            f["parse"] = (t0, time.monotonic())
            continue
        if kind == "close":
            files.pop(key, None)
            continue
        _, _, index, (r0, r1), source = request
        request = None
        if isinstance(source, tuple):
            source = staging.view(*source)
        t0 = time.monotonic()
        mismatches, result, found, error, spans = [], None, False, None, []
        try:
            f = files[key]
            spans = [f.pop("parse")] if "parse" in f else []
            mismatches.extend(f["mismatches"])
            if f["reader"] is not None:
                st = f["tensors"][index]
                rt = f["by_name"].get(st.name)
                if rt is None:
                    mismatches.append(f"{st.name}: missing from the file")
                else:
                    found = True
                    planned = f["types"][st.name]
                    bad = _layout_mismatch(rt, st, planned)
                    if bad is not None:
                        mismatches.append(bad)
                    elif isinstance(source, RowChecksums):
                        result = (planned, int(rt.n_bytes), _rows_differing(rt, source.sums, r0, r1))
                    else:
                        with torch.no_grad():
                            figures = _chunk_figures(rt, source.reshape(r1 - r0, -1), r0, r1, cpu)
                        result = (planned, int(rt.n_bytes), figures)
                    drop_pages(f["reader"], rt, (r0, r1))
        except Exception as e:  # noqa: BLE001 - the check's failure, sent back
            error, found = sendable(e), False
        del source
        spans.append((t0, time.monotonic()))
        conn.send(("checked", key, index, r0, result, mismatches, found, spans, error, os.getpid()))


@dataclass
class _Parts:
    # a tensor's checks handed over and not yet all answered (RoundTripProcessWatch)
    count: int                              # parts handed over
    left: int                               # parts not answered
    results: dict = field(default_factory=dict)     # r0 -> the checker's result
    found: bool = True                      # every part found the tensor in the file
    figures: list | None = None             # the writer's figures (writer_figures), if it made them


@dataclass
class _Checker:
    proc: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    staging: _Staging
    pending: list = field(default_factory=list)    # (watch, staging range / None / False) per check waiting
    ready: bool = False                             # its ("ready",) was read: its area may be written
    worker: Worker | None = None                    # the pool's handle (proc and conn are its)


class CheckerProcesses:
    """Checker processes (forked, one torch thread each, ending when this process closes their
    pipes or dies) shared by every :class:`RoundTripProcessWatch` of this process. Forked, not spawned: a checker
    starts at once as a copy of this process (nothing to import, nothing of the caller's
    main module to run again) and uses no GPU; they are forked early, when a GGUF target is
    prepared (:func:`start_checkers`), and kept. Each check goes to the watch's checker
    with the fewest checks waiting whose staging area (:data:`STAGING_BYTES`) can hold its
    source, copied there; the writer waits while none can. Answers are taken in whenever the
    writer hands over a check or waits. A checker that dies fails the watches that were waiting on it (RuntimeError with
    its exit code), not the others; the next watch starts a new one."""

    def __init__(self):
        self._checkers: list[_Checker] = []
        self._keys = 0
        self._open: dict[int, RoundTripProcessWatch] = {}      # watches started, not stopped

    def grow(self, n: int) -> None:
        """Have at least ``n`` live checkers (forking the missing ones, each with its staging
        area). Raises OSError when a process cannot be started."""
        self._checkers = [c for c in self._checkers if c.proc.is_alive() or c.pending]
        while len(self._checkers) < n:
            size = SOLE_STAGING_BYTES if n == 1 else max(64, STAGING_BYTES // n, STAGING_BYTES // 4)
            staging = _Staging(size)
            w = start_worker(_serve_checks, (staging,), f"quantpress-check-{len(self._checkers)}")
            self._checkers.append(_Checker(w.proc, w.conn, staging, worker=w))

    def open(self, watch: "RoundTripProcessWatch", n: int) -> list[_Checker]:
        """Give ``watch`` a key and announce its file to ``n`` checkers, those serving the
        fewest open files (files written side by side get checkers of their own, up to
        :func:`checker_limit` in all); returns them."""
        serving = {id(c): 0 for c in self._checkers}
        for other in self._open.values():
            for c in other.checkers:
                if id(c) in serving:
                    serving[id(c)] += 1
        free = sum(1 for v in serving.values() if v == 0)
        self.grow(min(max(n, checker_limit()), len(self._checkers) + max(0, n - free)))
        self._keys += 1
        watch.key = self._keys
        self._open[watch.key] = watch
        plan = [(st.name, tuple(st.shape)) for st in watch.tensors]
        members = sorted(self._checkers, key=lambda c: serving.get(id(c), 0))[:n]
        for c in members:
            self._send(c, ("open", watch.key, str(watch.path), plan, watch.types))
        return [c for c in members if c in self._checkers]

    def submit(self, watch: "RoundTripProcessWatch", index: int, rows: tuple[int, int],
               source: torch.Tensor) -> None:
        """Hand rows ``[r0, r1)`` of ``watch``'s tensor ``index`` and their source to the one
        of its checkers with the fewest checks waiting that can take it: copied into that
        checker's staging area, or if larger than the area, alone in shared memory of its
        own, at most one such waiting per checker; :class:`RowChecksums` in the request
        itself. Waits (taking answers in) while none can."""
        self._take(0)
        sums = isinstance(source, RowChecksums)
        if not sums:
            source = source.detach()
            nbytes = source.numel() * source.element_size()
        while True:
            live = [c for c in watch.checkers if c in self._checkers]
            if not live:
                raise watch.error or RuntimeError(f"round trip of {watch.path.name}: its checker "
                                                  f"processes died")
            for c in sorted(live, key=lambda c: len(c.pending)):
                if not self._ready(c):
                    break               # that checker is gone: look again
                if sums:
                    entry, request = False, source      # (in the request itself: nothing held)
                elif nbytes > c.staging.size:
                    if any(entry is None for _, entry in c.pending):
                        continue
                    entry, request = None, _own_shared_memory(source)
                else:
                    entry = c.staging.take(nbytes)
                    if entry is None:
                        continue
                    request = (entry[0], source.dtype, tuple(source.shape))
                    c.staging.view(*request).copy_(source)
                if self._send(c, ("check", watch.key, index, rows, request)):
                    c.pending.append((watch, entry))
                    watch.pending += 1
                    return
                break                   # that checker is gone: look again
            else:
                self._take(None)

    def wait(self, watch: "RoundTripProcessWatch") -> None:
        """Take in answers until every check of ``watch`` is answered (or its checkers died)."""
        while watch.pending > 0:
            self._take(None)

    def forget(self, watch: "RoundTripProcessWatch") -> None:
        """Have ``watch``'s checkers forget its file (unmapping it)."""
        self._open.pop(watch.key, None)
        for c in watch.checkers:
            if c in self._checkers:
                self._send(c, ("close", watch.key))

    def pids(self) -> list[int]:
        """Process ids of the live checkers."""
        return [c.proc.pid for c in self._checkers if c.proc.is_alive()]

    def close(self) -> None:
        """End the checkers (each at its next request, or killed after 5 s) and unmap their
        staging areas; the object is unusable afterwards."""
        for c in self._checkers:
            c.worker.forget()
        for c in self._checkers:
            c.worker.close()
        for c in self._checkers:
            c.staging.close()
        self._checkers = []

    def _ready(self, c: _Checker) -> bool:
        # wait for the checker's ("ready",): its staging area is touched and may be written;
        # False when it died first (buried)
        if not c.ready:
            c.ready = wait_ready(c.conn)
            if not c.ready:
                self._bury(c)
        return c.ready

    def _send(self, c: _Checker, request: tuple) -> bool:
        # False when the checker is gone (buried)
        try:
            c.conn.send(request)
            return True
        except OSError:
            self._bury(c)
            return False

    def _bury(self, c: _Checker) -> None:
        # a checker died: fail the watches waiting on it, forget it
        c.proc.join(5)
        dead = RuntimeError(f"round trip: checker process {c.proc.name} died (exit code "
                            f"{c.proc.exitcode}) with {len(c.pending)} checks unanswered")
        for watch, entry in c.pending:
            watch.pending -= 1
            watch.error = watch.error or dead
            if entry:
                c.staging.give_back(entry)
        c.pending = []
        if c in self._checkers:
            self._checkers.remove(c)
        c.worker.forget()
        c.staging.close()

    def _take(self, timeout: float | None) -> None:
        # receive what the checkers answered (waiting up to ``timeout`` for one, None: until one
        # answers or dies); a dead checker fails the watches waiting on it
        busy = [c for c in self._checkers if c.pending]
        if not busy:
            return
        ready = multiprocessing.connection.wait([c.conn for c in busy], timeout)
        for c in busy:
            if c.conn not in ready:
                continue
            try:
                while c.pending and c.conn.poll():
                    _, key, index, r0, result, mismatches, found, spans, error, pid = c.conn.recv()
                    watch, entry = c.pending.pop(0)
                    if entry:                   # (None: shared memory of its own; False: nothing held)
                        c.staging.give_back(entry)
                    watch.answered(index, r0, result, mismatches, found, spans, error, pid)
            except (EOFError, OSError):
                self._bury(c)


_PROCESSES: CheckerProcesses | None = None


def checker_processes(n: int) -> CheckerProcesses:
    """This process's :class:`CheckerProcesses`, grown to ``n`` live checkers. OSError when
    a process cannot be started."""
    global _PROCESSES
    if _PROCESSES is None:
        _PROCESSES = CheckerProcesses()
    _PROCESSES.grow(n)
    return _PROCESSES


def close_checkers() -> None:
    """End this process's checker processes, if any (the next round trip starts new ones,
    with the :data:`STAGING_BYTES` then in force)."""
    global _PROCESSES
    if _PROCESSES is not None:
        _PROCESSES.close()
        _PROCESSES = None


def start_checkers(device: torch.device) -> None:
    """Start, ahead of a GGUF write on ``device``, the checker processes its round trip will
    use (:func:`checkers_for`): forked from this process while it is still small, their first
    touch of their staging areas overlapping the work before the write. A
    no-op where they cannot run (:func:`checker_processes_usable`, or a process cannot be
    started: the round trip then runs in threads)."""
    if checker_processes_usable():
        try:
            checker_processes(checkers_for(device))
        except OSError:
            pass


def _own_shared_memory(t: torch.Tensor) -> torch.Tensor:
    # a CPU tensor owning exactly its storage, which sending moves into shared memory (a
    # view would share the whole storage it is cut from)
    t = t.cpu()
    if (not t.is_contiguous() or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


class RoundTripProcessWatch:
    """:class:`RoundTripWatch`'s checks (the same interface, the same checks of
    :func:`verify_gguf`, the same :class:`RoundTrip`) run in ``workers`` checker processes of
    ``pool`` (:class:`CheckerProcesses`) instead of threads: they neither hold back the
    quantization in this process nor each other. Each process parses the file as soon as it
    is announced (:meth:`start`). :meth:`written` copies the source tensor into checkers'
    staging areas (:data:`STAGING_BYTES`) and hands it over, a large one in parts of rows
    (:func:`check_parts`) that several checkers take side by side; the tensor's report is
    made from its parts' figures in row order, so it is the one a single check makes. Our
    dequantization runs on the checker's CPU, whatever the writer's device (the codecs' bytes
    and values are the same on every device: ``scripts/gpu_checks.py``).

    With ``figures_on`` (a device: :func:`figures_on_writer`) the writer computes our half
    itself, there (:func:`writer_figures`: our dequantization of the bytes it wrote, the error
    against the source, :func:`row_checksums` of our values), and hands the checkers only the
    checksums (:class:`RowChecksums`): each re-reads its rows from the file, dequantizes them
    with gguf-py and compares their checksums; a row that differs fails the round trip as
    values that differ do. The checkers then do gguf-py's half alone and no source is copied.
    ``seconds``: the wall time during which any checker was checking this file."""

    def __init__(self, path: Path, tensors: list[SourceTensor], types: dict[str, str],
                 size: int, pool: CheckerProcesses, workers: int = 1,
                 figures_on: torch.device | None = None):
        self.path, self.tensors, self.types, self.size = Path(path), tensors, types, size
        self.pool, self.workers, self.figures_on = pool, max(1, workers), figures_on
        self.rep = RoundTrip()
        self.key, self.pending, self.checkers = 0, 0, []
        self.error: BaseException | None = None
        self._checked: set[str] = set()
        self._spans: list[tuple[float, float]] = []
        self._pids: set[int] = set()
        self._parts: dict[int, _Parts] = {}

    def start(self) -> None:
        """Announce the file to the checkers (each parses it at once)."""
        self.checkers = self.pool.open(self, self.workers)

    def written(self, index: int, source: torch.Tensor, raw: np.ndarray | None = None,
                on_device: torch.Tensor | None = None) -> None:
        """Tensor ``tensors[index]`` is on disk; ``source`` is what it was quantized from (CPU),
        ``raw`` the bytes written (uint8 [rows, row_bytes]; used with ``figures_on``, there
        from ``on_device``, the source's copy on that device, when given). Raises the error of
        an earlier check (a checker died or raised)."""
        if self.error is not None:
            raise self.error
        st = self.tensors[index]
        rows, cols = st.numel // st.shape[-1], st.shape[-1]
        parts = list(check_parts(rows, cols))
        self._parts[index] = _Parts(len(parts), len(parts))
        if self.figures_on is not None:
            self._parts[index].figures, sums = writer_figures(
                raw, self.types[st.name], source if on_device is None else on_device, self.figures_on)
            for r0, r1 in parts:
                self.pool.submit(self, index, (r0, r1), RowChecksums(sums[r0:r1]))
            return
        source = source.detach().reshape(rows, cols)
        for r0, r1 in parts:
            self.pool.submit(self, index, (r0, r1), source[r0:r1])

    def answered(self, index: int, r0: int, result: tuple | None, mismatches: list[str], found: bool,
                 spans: list[tuple[float, float]], error: BaseException | None, pid: int) -> None:
        """A checker's answer for the part of tensor ``index`` from row ``r0``
        (:func:`_serve_checks`); the tensor's report once all of its parts are answered."""
        self.pending -= 1
        self.rep.mismatches.extend(m for m in mismatches if m not in self.rep.mismatches)
        part = self._parts[index]
        part.left -= 1
        part.found = part.found and found
        if result is not None:
            part.results[r0] = result
        if part.left == 0:
            del self._parts[index]
            st, results = self.tensors[index], [part.results[r] for r in sorted(part.results)]
            if part.found:
                self._checked.add(st.name)
            if len(results) == part.count:      # (else a mismatch or an error says why)
                tname, n_bytes, _ = results[0]
                if part.figures is None:
                    _tensor_report(st, tname, n_bytes, [f for *_, fs in results for f in fs], self.rep)
                else:                           # the rows whose checksums differ, then the writer's sums
                    rows = sum(r[2] for r in results)
                    _tensor_report(st, tname, n_bytes, [(rows, 0.0, 0.0, 0.0)] + part.figures, self.rep,
                                   unit="rows")
        if error is not None and self.error is None:
            self.error = error
        self._spans.extend(spans)
        self._pids.add(pid)
        self.rep.checker_processes = len(self._pids)

    def stop(self) -> None:
        """Wait for the checks handed over, then have the checkers forget the file; idempotent."""
        if self.checkers:
            try:
                self.pool.wait(self)
            finally:
                self.pool.forget(self)
                self.checkers = []

    def finish(self) -> RoundTrip:
        """Wait for the checks, then check the file's size and that every planned tensor was
        checked; returns the :class:`RoundTrip`. Raises what a check raised, or RuntimeError
        when a checker process died."""
        self.stop()
        if self.error is not None:
            raise self.error
        busy, end = 0.0, -math.inf
        for t0, t1 in sorted(self._spans):
            busy += max(0.0, t1 - max(t0, end))
            end = max(end, t1)
        self.rep.seconds = busy
        return _conclude(self.rep, self.path, self.size, self.tensors, self._checked)


def watch_round_trip(path: Path, tensors: list[SourceTensor], types: dict[str, str],
                     device: torch.device, size: int) -> RoundTripWatch | RoundTripProcessWatch:
    """The round trip beside the writing of ``path`` (not started): a
    :class:`RoundTripProcessWatch` on :func:`checkers_for` ``(device)`` checker processes, or
    where none can be started (:func:`checker_processes_usable`, OSError) a
    :class:`RoundTripWatch` with as many threads."""
    n = checkers_for(device)
    if checker_processes_usable():
        try:
            return RoundTripProcessWatch(path, tensors, types, size, checker_processes(n), n,
                                         figures_on_writer(device))
        except OSError:
            pass
    return RoundTripWatch(path, tensors, types, device, size, n)
