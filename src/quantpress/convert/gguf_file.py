"""Streaming GGUF writing and round-trip verification, on gguf-py's GGUFWriter/GGUFReader.

Tensors are described up front (name, shape, ggml type), then produced, quantized and
written one at a time (on an accelerator, a window of tensors at a time), so peak memory
follows the largest tensor, not the model. The file
goes to a temporary path next to the output and is renamed only after it has been re-read
and verified. Several files of one model (policies sharing a tensor order) are written side
by side from one read of each source tensor (:func:`write_gguf_many`).
"""
from __future__ import annotations

import contextlib
import math
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf import quants as gguf_quants

from quantpress.quantize import ggml
from quantpress.quantize.ggml.common import serial_codecs, single_threaded_ops
from quantpress.errors import InputError

from .hf import check_finite


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
    #: seconds spent checking (beside the writing, for :class:`RoundTripWatch`)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when no mismatch was found."""
        return not self.mismatches


KV = tuple  # (key, value, GGUFValueType, sub_type or None)


def encode(t: torch.Tensor, type_name: str, device: torch.device,
           imatrix: torch.Tensor | None = None) -> np.ndarray:
    """Quantize ``t`` [..., n] to ``type_name`` on ``device``; returns uint8 numpy
    [rows, row_bytes] ready to be written (ggml block bytes, little-endian).

    ``imatrix``: importance weights, float32 [n] for every row, or [n_mat · n] for a 3-D
    tensor [n_mat, rows, n] (one slice per expert matrix, as ``llama_tensor_quantize_impl``'s
    ``imatrix_for_row``); passed to :func:`quantpress.quantize.ggml.quantize`. ValueError when
    its size fits neither. :func:`encode_many` with one tensor."""
    return encode_many([(t, type_name, imatrix)], device)[0]


def encode_many(items: list[tuple[torch.Tensor, str, torch.Tensor | None]],
                device: torch.device) -> list[np.ndarray]:
    """:func:`encode` of several ``(tensor, type_name, imatrix)`` items, each type's tensors
    quantized in one :func:`quantpress.quantize.ggml.quantize_many` call (on an accelerator
    the codecs cost their op count, so a window of tensors costs about what one did).
    Returns the uint8 numpy [rows, row_bytes] of each item, in order; the bytes are each
    item's :func:`encode`. ValueError as :func:`encode`."""
    groups: dict[str, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}
    on_device: dict[int, torch.Tensor] = {}            # a tensor of several items moves once
    for i, (t, type_name, imatrix) in enumerate(items):
        x = on_device.setdefault(id(t), t.to(device))
        n = x.shape[-1]
        g = groups.setdefault(type_name, [])
        if imatrix is None or imatrix.numel() == n:
            g.append((i, x, None if imatrix is None else imatrix.reshape(n).to(device)))
        elif x.dim() == 3 and imatrix.numel() == n * x.shape[0]:
            w = imatrix.reshape(x.shape[0], n).to(device)
            g.extend((i, x[e], w[e]) for e in range(x.shape[0]))
        else:
            raise ValueError(f"imatrix of {imatrix.numel()} values for a tensor of shape {tuple(x.shape)}")
    parts: list[list[torch.Tensor]] = [[] for _ in items]
    for type_name, g in groups.items():
        raws = ggml.quantize_many([x for _, x, _ in g], type_name, [w for _, _, w in g])
        for (i, _, _), raw in zip(g, raws):
            parts[i].append(raw.reshape(-1, raw.shape[-1]))
    return [(p[0] if len(p) == 1 else torch.cat(p)).cpu().numpy() for p in parts]


#: one output file of :func:`write_gguf_many`: (path, KVs after ``general.architecture`` in
#: order, GGUF tensor name → ggml type name[, GGUF tensor name → importance weights float32
#: tensor for the tensors quantized with an imatrix])
GGUFFile = tuple  # (Path, Iterable[KV], dict[str, str][, dict[str, torch.Tensor]])


#: tensors read ahead and quantized together off the CPU (:func:`write_gguf_many`), in
#: elements: a window is written once it holds this many (or the end is reached), so host
#: memory holds about this much source data beyond the largest tensor (2^27 = 134M: two
#: thirds of a decoder layer of a 7B llama, whose layers hold 202M weights)
WINDOW_ELEMENTS = 1 << 27
#: most round-trip threads per file when quantizing off the CPU (each holds a source tensor)
VERIFY_WORKERS = 8


def _verify_workers(device: torch.device) -> int:
    """Threads of a :class:`RoundTripWatch`: one on the CPU (the codecs use the other cores),
    else up to :data:`VERIFY_WORKERS` of the idle cores, since gguf-py's dequantization runs
    on the CPU and would hold back a GPU's writing."""
    return 1 if device.type == "cpu" else max(1, min(VERIFY_WORKERS, (os.cpu_count() or 2) - 1))


def _window_elements(device: torch.device) -> int:
    """Elements read ahead before a window is encoded: 0 on the CPU (one tensor at a time),
    else :data:`WINDOW_ELEMENTS`."""
    return 0 if device.type == "cpu" else WINDOW_ELEMENTS


def write_gguf_many(files: list[GGUFFile], arch: str, tensors: list[SourceTensor],
                    device: torch.device,
                    progress: Callable[[Iterable], Iterable] = lambda it: it,
                    verify: bool = False) -> list[RoundTrip] | None:
    """Write several GGUF v3 files that share ``arch`` and one tensor list, reading each
    source tensor once (no rename; callers use temporary paths).

    ``files``: ``(path, kvs, types)`` or ``(path, kvs, types, imatrix)`` per output file;
    ``kvs`` its metadata after ``general.architecture`` (written by GGUFWriter), in order;
    ``types[name]`` the ggml type name of every tensor in that file; ``imatrix[name]`` the
    importance weights of a tensor quantized with them (:func:`encode`). ``tensors`` in output order, the same order in every
    file; each ``load()`` returns a float tensor (any float dtype, CPU) of ``shape``.

    One gguf-py ``GGUFWriter`` per file writes the header, the KVs and the tensor infos
    (alignment 32, as llama.cpp). Then, tensor by tensor: ``load()`` once; the shape and
    NaN/Inf checks once; the tensor moved to ``device`` once; for each distinct ggml type the
    files ask for (a norm is F32 in every policy) and importance weights, one encoding
    (uint8 [rows, row_bytes]) written to every file of that type; then the next tensor. On
    the CPU peak memory is one source tensor and one encoded copy, whatever the number of
    files. Off the CPU, tensors are read ahead into a window of :data:`WINDOW_ELEMENTS`
    elements (or one tensor, if larger) and the window is encoded with :func:`encode_many`
    (one codec pass per type), then written in order: a GPU codec's time is its op count,
    not its data. Each file's bytes equal a
    :func:`write_gguf` of it alone, i.e. what ``convert_hf_to_gguf.py`` + ``llama-quantize``
    write (llama.cpp as vendored in llama-cpp-python 0.3.36) when the plan is theirs.

    ``verify``: also run each file's round trip beside the writing (:class:`RoundTripWatch`:
    the file is given its final size once its header is written, gguf-py's reader parses it
    in a thread of its own, and each tensor is checked as soon as it is on disk, against the
    source tensor just read, while the next is quantized; peak memory grows by two source
    tensors) and return the :class:`RoundTrip` of each file, in the order of ``files``; else
    None.

    Raises ValueError for no files; InputError naming the tensor when a loaded tensor's
    shape is not ``shape`` or it holds NaN/Inf (the source weights are corrupt); KeyError
    when a ``types`` lacks a tensor. Every file opened is closed, on error too (the partial
    files are left for the caller to remove).
    """
    if not files:
        raise ValueError("write_gguf_many: no files to write")
    watches: list[RoundTripWatch] = []
    with contextlib.ExitStack() as closing:
        writers = []
        for path, kvs, types, *rest in files:
            imatrix = rest[0] if rest else None
            w = GGUFWriter(str(path), arch)
            closing.callback(w.close)  # opens its file in write_header_to_file
            for key, value, vtype, sub in kvs:
                w.add_key_value(key, value, vtype, sub_type=sub)
            data_bytes = 0
            for st in tensors:
                gt = ggml.get(types[st.name])
                rb = gt.row_bytes(st.shape[-1])
                # a uint8 byte shape: gguf-py turns it back into elements (ne) for the tensor info
                w.add_tensor_info(st.name, (*st.shape[:-1], rb), np.dtype(np.uint8),
                                  math.prod(st.shape[:-1]) * rb,
                                  raw_dtype=GGMLQuantizationType[gt.name])
                data_bytes += GGUFWriter.ggml_pad(math.prod(st.shape[:-1]) * rb, w.data_alignment)
            writers.append((w, types, imatrix or {}, data_bytes))
        for (w, types, _, data_bytes), (path, *_) in zip(writers, files):
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            if verify:
                for f in w.fout:
                    f.flush()
                size = GGUFWriter.ggml_pad(w.fout[0].tell(), w.data_alignment) + data_bytes
                os.truncate(path, size)     # the reader maps the whole file from the start
                watch = RoundTripWatch(Path(path), tensors, types, device, size, _verify_workers(device))
                closing.callback(watch.stop)
                watch.start()
                watches.append(watch)
        window: list[tuple[int, torch.Tensor]] = []     # tensors read, not yet written

        def flush() -> None:
            # quantize the window (one codec pass per type on an accelerator), then write its
            # tensors in order to every file and hand each to the round trip
            items, slots, slot_of = [], {}, {}     # slot_of[index, file]: that file's encoding
            for index, t in window:
                name = tensors[index].name
                for f, (_, types, imatrix, _) in enumerate(writers):
                    qw = imatrix.get(name)
                    key = (index, types[name], None if qw is None else id(qw))
                    if key not in slots:
                        slots[key] = len(items)
                        items.append((t, types[name], qw))
                    slot_of[index, f] = slots[key]
            raws = encode_many(items, device)
            del items
            for index, t in window:
                for f, (w, *_) in enumerate(writers):
                    w.write_tensor_data(raws[slot_of[index, f]].reshape(-1))
                if watches:
                    for w, *_ in writers:
                        for f in w.fout:
                            f.flush()
                    for watch in watches:
                        watch.written(index, t)
            raws.clear()
            window.clear()

        size, limit = 0, _window_elements(device)
        for index, st in enumerate(progress(tensors)):
            t = st.load()
            if tuple(t.shape) != tuple(st.shape):
                raise InputError(f"tensor '{st.name}': shape {tuple(t.shape)}, expected {st.shape}")
            check_finite(st.name, t)
            window.append((index, t))
            size += t.numel()
            del t
            if size >= limit:
                flush()
                size = 0
        flush()
        for w, *_ in writers:
            w.close()
        return [watch.finish() for watch in watches] if verify else None


def write_gguf(path: Path, arch: str, kvs: Iterable[KV], tensors: list[SourceTensor],
               types: dict[str, str], device: torch.device,
               progress: Callable[[Iterable], Iterable] = lambda it: it) -> None:
    """Write a GGUF v3 file at ``path`` (no rename; callers use a temporary path).

    ``kvs``: metadata after ``general.architecture`` (written by GGUFWriter), in order.
    ``tensors`` in output order; ``types[name]`` the ggml type name of each. Each tensor is
    loaded, checked for NaN/Inf (InputError naming it), quantized on ``device`` and written
    before the next is loaded. Alignment 32, as llama.cpp. :func:`write_gguf_many` with one
    file (same errors).
    """
    write_gguf_many([(path, kvs, types)], arch, tensors, device, progress)


class GGUFFileReader(GGUFReader):
    """gguf-py's ``GGUFReader``, parsing the file exactly as it does, over a plain ndarray view
    of its memory map (kept as ``memmap``). gguf-py slices its ``data`` once or twice for every
    metadata value, and numpy's ``memmap`` subclass makes each slice run a Python-level
    ``__array_finalize__``: SmolLM2's 49,152-token vocabulary and 48,900 merges took 1.9 s to
    parse that way, 0.5 s over the plain view (scripts/micro_figures.py). Fields and tensors
    are the same arrays' values (the tensors' ``data`` are ndarray views of the same map)."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mm: np.memmap) -> None:
        self.memmap = mm
        self._plain = mm.view(np.ndarray)


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

#: Lowest signal-to-noise ratio (dB) of a tensor's decoded data against its source that the
#: round trip accepts. Both dequantizers agree on whatever bytes are in the file, so data
#: written in the wrong place (another tensor's of the same shape: about −3 dB; zeros: 0 dB;
#: shifted by a block: about −3 dB) is caught only here. Every ggml type stays far above it:
#: Q2_K, the coarsest written, gives 7.9–10.5 dB on random Gaussian, Student-t and
#: outlier-column tensors, Q3_K 16.4–16.6 dB, the 4-bit types 18.9–22.9 dB
#: (scripts/micro_figures.py).
MIN_SNR_DB = 3.0


def drop_pages(reader: GGUFReader, rt) -> None:
    """Release the process's mapping of tensor ``rt``'s pages in ``reader``'s memory map
    (``madvise(MADV_DONTNEED)``; the pages stay in the page cache and are read again if the
    tensor is), so that reading a file tensor by tensor does not grow the process's RSS with
    the whole file. A no-op where the platform has no ``madvise``."""
    mm = getattr(getattr(reader, "memmap", reader.data), "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = (int(rt.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
    length = int(rt.data_offset) + int(rt.n_bytes) - start
    try:
        mm.madvise(mmap.MADV_DONTNEED, start, length)
    except (OSError, ValueError):
        pass


def _check_tensor(rt, st: SourceTensor, planned: str, source: torch.Tensor | None,
                  device: torch.device, rep: RoundTrip) -> None:
    """The round trip of one tensor (:func:`verify_gguf`): ``rt`` the reader's tensor, ``st``
    its plan, ``planned`` its ggml type, ``source`` the source tensor (None: ``st.load()``).
    Appends a :class:`TensorReport` or the mismatch to ``rep``."""
    tname = GGMLQuantizationType(rt.tensor_type).name
    shape = tuple(int(d) for d in reversed(rt.shape.tolist()))
    if tname != planned or shape != tuple(st.shape):
        rep.mismatches.append(f"{st.name}: file has {tname}{shape}, expected {planned}{st.shape}")
        return
    raw = reader_raw(rt)
    src = (st.load() if source is None else source).reshape(raw.shape[0], -1)
    step = max(1, VERIFY_CHUNK_ELEMENTS // src.shape[1])
    neq, se, sig, max_err = 0, 0.0, 0.0, 0.0
    for r0 in range(0, raw.shape[0], step):
        chunk = raw[r0:r0 + step]
        ref = np.ascontiguousarray(gguf_quants.dequantize(chunk, GGMLQuantizationType[tname]),
                                   dtype=np.float32).reshape(-1)
        # our dequantization and the comparisons run on ``device`` (one sync per chunk)
        ours = ggml.dequantize(torch.from_numpy(chunk.copy()).to(device), tname).reshape(-1)
        ref_t = torch.from_numpy(ref if ref.flags.writeable else ref.copy())  # F32: a view of the map
        diff = (ref_t.to(device).view(torch.int32) != ours.view(torch.int32)).sum()
        x = src[r0:r0 + step].to(device=device, dtype=torch.float32).reshape(-1)
        e = ours - x
        lo, hi = torch.aminmax(e)
        d, se_c, sig_c, lo, hi = torch.stack([diff.to(torch.float64), torch.dot(e, e).double(),
                                              torch.dot(x, x).double(), lo.double(), hi.double()]).tolist()
        neq += int(d)
        se += se_c
        sig += sig_c
        max_err = max(max_err, -lo, hi)
    if neq:
        rep.mismatches.append(f"{st.name}: gguf-py and quantpress dequantize differ in {neq} values ({tname})")
    ratio = sig / se if se else math.inf
    snr = 10 * math.log10(ratio) if 0 < ratio < math.inf else (math.inf if se == 0 else -math.inf)
    if snr < MIN_SNR_DB:
        rep.mismatches.append(f"{st.name}: its {tname} data decodes to {snr:.1f} dB SNR against the "
                              f"source tensor, below {MIN_SNR_DB:g} dB (another tensor's data?)")
    rep.tensors.append(TensorReport(st.name, tname, tuple(st.shape), int(rt.n_bytes),
                                    math.sqrt(se / max(1, st.numel)), max_err, snr))


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
        reader = GGUFFileReader(str(path))
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
    in a thread of its own (checking tensor i while the writer quantizes tensor i + 1).

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

    def written(self, index: int, source: torch.Tensor) -> None:
        """Tensor ``tensors[index]`` is on disk; ``source`` is what it was quantized from."""
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
            self._reader = GGUFFileReader(str(self.path))
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
        actual = self.path.stat().st_size
        if actual != self.size:
            self.rep.mismatches.append(f"file is {actual} bytes, expected {self.size}")
        missed = [st.name for st in self.tensors if st.name not in self._checked]
        if missed and not self.rep.mismatches:
            self.rep.mismatches.append(f"{missed[0]}: not checked ({len(missed)} tensors)")
        order = {st.name: i for i, st in enumerate(self.tensors)}   # checks end out of order
        self.rep.tensors.sort(key=lambda r: order.get(r.name, len(order)))
        return self.rep
