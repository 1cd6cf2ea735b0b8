"""The checks of a GGUF round trip, tensor by tensor: a tensor's layout against its plan
(:func:`layout_mismatch`), gguf-py's dequantization against ours bit for bit and the error
against the source, chunk by chunk (:func:`chunk_figures`), the report and mismatches made from
a tensor's figures (:func:`tensor_report`), and the row checksums with which the writer, where it
computed our half itself, hands a checker only what gguf-py's values must match
(:func:`writer_figures`, :func:`row_checksums`). Used by :mod:`quantpress.convert.gguf_roundtrip`
(whole files, threads) and :mod:`quantpress.convert.gguf_checkers` (checker processes)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from quantpress.convert.gguf_reading import gguf_py_decoder, reader_raw
from quantpress.quantize import ggml


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
    """Result of :func:`~quantpress.convert.gguf_roundtrip.verify_gguf`: per-tensor reports and the mismatches found."""

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


# rows per verification chunk: bounds the float32 copies (gguf-py's, ours, the source's,
# the error) to a few times this many elements, whatever the tensor size
VERIFY_CHUNK_ELEMENTS = 1 << 22

# rows of a chunk that the check (gguf-py's dequantization and ours, the bit comparison, the
# error against the source) takes at a time on the CPU: about this many elements, so that
# the pieces' float32 copies stay in the cache and no codec slices are concatenated.
# verify_gguf of the 554M random llama's Q4_K_M on one thread is faster this way than with
# whole chunks (SmolLM2's the same within noise), also with gguf-py's values per piece
# (gguf_py_decoder); figures and the command in docs/benchmarks.md, "Figures behind the
# code", ``convert/gguf_roundtrip.py``
CHECK_PIECE_ELEMENTS = 1 << 18


def chunk_step(cols: int) -> int:
    # rows of a verification chunk of rows ``cols`` wide
    return max(1, VERIFY_CHUNK_ELEMENTS // max(1, cols))


def chunk_rows(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """The row ranges ``(r0, r1)`` a tensor of ``rows`` x ``cols`` elements is checked in:
    consecutive, from 0 to ``rows``, about :data:`VERIFY_CHUNK_ELEMENTS` elements each (at
    least one row)."""
    step = chunk_step(cols)
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
    step = chunk_step(cols)
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


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether int32 tensors ``a`` and ``b`` (same shape, one device) hold the same values:
    numpy's ``array_equal`` on the CPU (on a piece of 2^18 values in the cache, several times
    faster than torch.equal or counting the differences through a bool tensor: figures and the
    command in docs/benchmarks.md, "Figures behind the code", ``convert/gguf_roundtrip.py``),
    ``torch.equal`` elsewhere. The differences are counted only where this finds some."""
    if a.device.type == "cpu":
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return torch.equal(a, b)


def layout_mismatch(rt, st: SourceTensor, planned: str) -> str | None:
    """The mismatch of file tensor ``rt`` against its plan (``st``, ggml type ``planned``):
    another type or shape, or None."""
    tname = GGMLQuantizationType(rt.tensor_type).name
    shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
    if tname != planned or shape != tuple(st.shape):
        return f"{st.name}: file has {tname}{shape}, expected {planned}{st.shape}"
    return None


def chunk_figures(rt, src: torch.Tensor, r0: int, r1: int, device: torch.device) -> list[tuple]:
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
    step = chunk_step(cols)
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
            diff = ours.new_zeros(()) if same_bits(ref_bits, our_bits) else (ref_bits != our_bits).sum()
            x = src[p0 - r0:p1 - r0].to(device=device, dtype=torch.float32).reshape(-1)
            e = torch.sub(ours, x, out=ours)    # (ours is this piece's own, compared above)
            lo, hi = torch.aminmax(e)
            figures.append(torch.stack([diff.to(torch.float64), torch.dot(e, e).double(),
                                        torch.dot(x, x).double(), -lo.double(), hi.double()]))
        f = torch.stack(figures)
        d, se_c, sig_c, err_c = torch.cat([f[:, :3].sum(0), f[:, 3:].max().reshape(1)]).tolist()
        out.append((int(d), se_c, sig_c, err_c))
    return out


def tensor_report(st: SourceTensor, tname: str, n_bytes: int, figures: list[tuple], rep: RoundTrip,
                   unit: str = "values") -> None:
    """Conclude the check of tensor ``st`` (in the file: ggml type ``tname``, ``n_bytes``
    bytes) from its chunks' figures (:func:`chunk_figures`, all of its rows in order, summed
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


def check_tensor(rt, st: SourceTensor, planned: str, source: torch.Tensor | None,
                  device: torch.device, rep: RoundTrip) -> None:
    """The round trip of one tensor (:func:`~quantpress.convert.gguf_roundtrip.verify_gguf`): ``rt`` the reader's tensor, ``st``
    its plan, ``planned`` its ggml type, ``source`` the source tensor (None: ``st.load()``).
    Appends a :class:`TensorReport` or the mismatch to ``rep``."""
    bad = layout_mismatch(rt, st, planned)
    if bad is not None:
        rep.mismatches.append(bad)
        return
    rows = reader_raw(rt).shape[0]
    src = (st.load() if source is None else source).reshape(rows, -1)
    tensor_report(st, planned, int(rt.n_bytes), chunk_figures(rt, src, 0, rows, device), rep)


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
    device) chunk by chunk (:func:`chunk_rows`): the chunks' figures as :func:`chunk_figures`
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


def rows_differing(rt, sums: np.ndarray, r0: int, r1: int) -> int:
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


def tensor_index(reader: GGUFReader, tensors: list[SourceTensor], rep: RoundTrip) -> dict:
    by_name = {t.name: t for t in reader.tensors}
    if len(by_name) != len(tensors):
        rep.mismatches.append(f"file has {len(by_name)} tensors, expected {len(tensors)}")
    return by_name


def conclude(rep: RoundTrip, path: Path, size: int, tensors: list[SourceTensor], checked: set[str]) -> RoundTrip:
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
