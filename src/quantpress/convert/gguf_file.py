"""Streaming GGUF writing and round-trip verification, on gguf-py's GGUFWriter/GGUFReader.

Tensors are described up front (name, shape, ggml type), then produced, quantized and
written one at a time (on an accelerator, or on the CPU with codec processes, a window of
tensors at a time, the next window read meanwhile), so peak memory follows the largest tensor
or window, not the model. The file
goes to a temporary path next to the output and is renamed only after it has been re-read
and verified. Several files of one model (policies sharing a tensor order) are written side
by side from one read of each source tensor (:func:`write_gguf_many`).
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from quantpress.quantize import ggml
from quantpress.quantize.ggml import common as ggml_common
from quantpress.quantize.ggml.common import intra_op_threads
from quantpress.quantize.ggml.processes import codec_process_ids
from quantpress.errors import InputError
from quantpress.memory import trim_heap

from .gguf_ahead import KV, AheadOfHeader, PendingKVs
from .gguf_checks import RoundTrip, SourceTensor
from .gguf_roundtrip import cores_taken, watch_round_trip
from .hf import check_finite




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
#: memory holds about this much source data beyond the largest tensor, twice with the next
#: window read meanwhile (:data:`READ_AHEAD`) (2^27 = 134M: two thirds of a decoder layer of
#: a 7B llama, whose layers hold 202M weights)
WINDOW_ELEMENTS = 1 << 27
#: ggml types whose quantization without importance weights costs about what its round-trip
#: check costs, or less (no scale search); the others (K-quants, i-quants, any type with an
#: imatrix) cost several times their check (:func:`codecs_leave_a_core`)
LIGHT_TYPES = frozenset({"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"})
#: where windows are used (:func:`_window_elements`), load the next window's tensors in a
#: background thread while one is encoded, written and handed to the round trip: on CUDA
#: and on 16 CPU cores with codec processes reading ahead was faster or equal in every
#: setting measured, never slower beyond noise (`scripts/bench_gguf.py --model synth4x
#: --quantize-only --windows`; figures in docs/benchmarks.md)
READ_AHEAD = True


def codecs_leave_a_core(files: list, tensors: list[SourceTensor]) -> bool:
    """Whether at most half of the weights (by count) are in tensors whose quantization costs
    several times their check: a type not in :data:`LIGHT_TYPES`, or one that uses importance
    weights and is given them in some file (Q8_0 ignores them). Then the writer on the CPU
    leaves the checker processes their cores (its codecs run on the calling thread alone, and
    no codec process is needed); else its codecs keep every core (over the codec processes,
    where started, in windows of several tensors: :data:`CPU_WINDOW_ROUNDS`, so a tensor's
    size does not matter) and the checks share them. ``files`` as :func:`write_gguf_many`'s
    (the paths are not used). The half-of-the-weights rule is where the two choices crossed
    on two cores: SmolLM2's Q4_K_M (20% of its weights heavy) was faster leaving the checker
    its core, the same with its imatrix (79% heavy) and the 554M random llama's Q4_K_M were
    faster on both cores (`scripts/bench_gguf.py --quantize-only --windows`; figures in
    docs/benchmarks.md)."""
    plans = [(types, (rest[0] if rest else None) or {}) for _, _, types, *rest in files]

    def heavy_in(st: SourceTensor, types: dict, imatrix: dict) -> bool:
        t = types[st.name]
        return t not in LIGHT_TYPES or (st.name in imatrix and ggml.get(t).quantize_blocks_weighted is not None)
    heavy = sum(st.numel for st in tensors if any(heavy_in(st, types, imatrix) for types, imatrix in plans))
    return 2 * heavy <= sum(st.numel for st in tensors)


#: on the CPU with codec processes (:mod:`quantpress.quantize.ggml.processes`), a window holds
#: this many codec slices (``CPU_SLICE_ELEMENTS``) per lane, so that every lane has work until
#: the window's end, whatever its tensors' sizes (one tensor at a time, a 1536 x 512 tensor's
#: two slices kept two of 16 lanes busy). On 16 cores windows of 2^21, 2^22 or 2^23 elements
#: per lane did alike, about twice as fast as one tensor at a time (scripts/bench_gguf.py
#: --windows; figures in docs/benchmarks.md); 16 slices of 2^18: 2^22 per lane. The
#: same count as ``quantize.ggml.CPU_WEIGHTED_ROUNDS``, the slices per lane whose importance
#: weights quantize_many expands at a time, so that a window's go to the codecs in one call
CPU_WINDOW_ROUNDS = ggml.CPU_WEIGHTED_ROUNDS


def _window_elements(device: torch.device) -> int:
    """Elements read before a window is encoded: off the CPU :data:`WINDOW_ELEMENTS`; on the
    CPU :data:`CPU_WINDOW_ROUNDS` slices per lane where codec processes are running (the
    calling thread and each worker a lane), else 0 (one tensor at a time). The slice size
    is read at the call (``quantize.ggml.common.CPU_SLICE_ELEMENTS``), so that a window is
    always that many of the slices the codecs cut."""
    if device.type != "cpu":
        return WINDOW_ELEMENTS
    lanes = len(codec_process_ids()) + 1
    return 0 if lanes < 2 else CPU_WINDOW_ROUNDS * lanes * ggml_common.CPU_SLICE_ELEMENTS


class _ReadAhead:
    """``tensors``' ``load()``, in order, in one background thread, at most ``limit`` elements
    (or one tensor) loaded and not yet taken, so that reading the next window overlaps the
    encoding of this one. :meth:`take` returns them in order (raising what ``load`` raised);
    :meth:`close` cancels what is not started and waits for the load under way."""

    def __init__(self, tensors: list[SourceTensor], limit: int):
        self._tensors, self._limit = tensors, limit
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quantpress-read")
        self._loads: collections.deque = collections.deque()
        self._next = self._ahead = 0
        self._top_up()

    def _top_up(self) -> None:
        while self._next < len(self._tensors) and (
                not self._loads or self._ahead + self._tensors[self._next].numel <= self._limit):
            st = self._tensors[self._next]
            self._loads.append(self._pool.submit(st.load))
            self._ahead += st.numel
            self._next += 1

    def take(self) -> torch.Tensor:
        """The next tensor's ``load()``."""
        index = self._next - len(self._loads)
        t = self._loads.popleft().result()
        self._ahead -= self._tensors[index].numel
        self._top_up()
        return t

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _to_encode(st: SourceTensor, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The loaded source ``t`` of ``st`` as it is encoded: its shape checked, on ``device``,
    checked for NaN/Inf (InputError naming the tensor)."""
    if tuple(t.shape) != tuple(st.shape):
        raise InputError(f"tensor '{st.name}': shape {tuple(t.shape)}, expected {st.shape}")
    # off the CPU the NaN/Inf check runs on the device's copy (the CPU's cores are the
    # checkers'; on the device it takes a fraction of the CPU's time: scripts/bench_gguf.py
    # --stages, figures in docs/benchmarks.md)
    x = t if device.type == "cpu" else t.to(device)
    check_finite(st.name, x)
    return x


def write_gguf_many(files: list[GGUFFile], arch: str, tensors: list[SourceTensor],
                    device: torch.device,
                    progress: Callable[[Iterable], Iterable] = lambda it: it,
                    verify: bool = False) -> list[RoundTrip] | None:
    """Write several GGUF v3 files that share ``arch`` and one tensor list, reading each
    source tensor once (no rename; callers use temporary paths).

    ``files``: ``(path, kvs, types)`` or ``(path, kvs, types, imatrix)`` per output file;
    ``kvs`` its metadata after ``general.architecture`` (written by GGUFWriter), in order, or
    a :class:`~quantpress.convert.gguf_ahead.PendingKVs` still being computed: then the first tensors are read and quantized
    on one lane less (in memory, up to :data:`~quantpress.convert.gguf_ahead.AHEAD_OF_HEADER_BYTES` of output; a matrix in
    pieces of :data:`~quantpress.convert.gguf_ahead.AHEAD_PIECE_ELEMENTS`) until it is there; then the header is written, the
    tensors quantized whole are written (and handed to the round trip), and the rest of a
    matrix begun then is quantized on every lane (where the budget ended it, before the
    header, while the header waits for the KVs);
    ``types[name]`` the ggml type name of every tensor in that file; ``imatrix[name]`` the
    importance weights of a tensor quantized with them (:func:`encode`). ``tensors`` in output order, the same order in every
    file; each ``load()`` returns a float tensor (any float dtype, CPU) of ``shape``.

    One gguf-py ``GGUFWriter`` per file writes the header, the KVs and the tensor infos
    (alignment 32, as llama.cpp). Then, tensor by tensor: ``load()`` once; the shape and
    NaN/Inf checks once; the tensor moved to ``device`` once; for each distinct ggml type the
    files ask for (a norm is F32 in every policy) and importance weights, one encoding
    (uint8 [rows, row_bytes]) written to every file of that type; then the next tensor. On
    the CPU without codec processes peak memory is one source tensor and one encoded copy,
    whatever the number of files. Off the CPU, tensors are read into a window of
    :data:`WINDOW_ELEMENTS` elements (or one tensor, if larger) and the window is encoded
    with :func:`encode_many` (one codec pass per type), then written in order: a GPU codec's
    time is its op count, not its data. On the CPU with codec processes the window holds
    :data:`CPU_WINDOW_ROUNDS` codec slices per lane, so that every lane is busy to its end.
    Where windows are used (:data:`READ_AHEAD`) a background thread loads the next window's
    tensors while this one is encoded, written and handed to the round trip (host memory
    then holds two windows of source tensors). Each file's bytes equal a
    :func:`write_gguf` of it alone, i.e. what ``convert_hf_to_gguf.py`` + ``llama-quantize``
    write (llama.cpp as vendored in llama-cpp-python 0.3.36) when the plan is theirs.

    ``verify``: also run each file's round trip beside the writing
    (:func:`quantpress.convert.gguf_roundtrip.watch_round_trip`: the file is given its final
    size once its header is written, gguf-py's reader parses it in a checker process of its
    own, and each tensor is checked there as soon as it is on disk, against the source tensor
    just read, while the next is quantized; the sources wait in the checkers' staging areas
    (``SOLE_STAGING_BYTES``, or ``STAGING_BYTES`` together); off the CPU the writer computes
    our half of each check on its device from the bytes it wrote, and the checkers compare gguf-py's values of the file
    with checksums of ours, :func:`~quantpress.convert.gguf_checks.writer_figures`;
    with the codecs off the CPU the writer's own torch ops on the
    CPU leave the checker processes their cores, on the CPU the codecs do so when most weights
    go to :data:`LIGHT_TYPES`) and return the :class:`RoundTrip` of each file, in the order of
    ``files``; else None. RuntimeError when a checker process dies.

    Raises ValueError for no files; :class:`~quantpress.convert.gguf_ahead.PlanChanged` (nothing written) or what its
    computation raised from a :class:`~quantpress.convert.gguf_ahead.PendingKVs`; InputError naming the tensor when a loaded tensor's
    shape is not ``shape`` or it holds NaN/Inf (the source weights are corrupt); KeyError
    when a ``types`` lacks a tensor. Every file opened is closed, on error too (the partial
    files are left for the caller to remove).
    """
    if not files:
        raise ValueError("write_gguf_many: no files to write")
    with contextlib.ExitStack() as closing:
        writers = _open_writers(files, arch, tensors, closing)
        encode = _Encodings(writers, tensors, device)
        pending = [kvs for _, kvs, *_ in files if isinstance(kvs, PendingKVs)]
        for p in pending:
            closing.callback(p.close)       # (on an error before its KVs were taken)
        ahead = AheadOfHeader(encode, len(writers), pending)
        ahead.run(tensors, device, _to_encode)
        watches = _write_headers(writers, files, tensors, device, verify, closing)
        if watches and (device.type != "cpu" or codecs_leave_a_core(files, tensors)):
            # the writer's torch ops on the CPU leave the checker processes their cores. Off
            # the CPU those ops (the copies into the staging areas, and the NaN/Inf checks
            # before they moved to the device) in one thread per core fought eight busy
            # checkers for the cores and lost; with the checks on the device leaving them
            # their cores neither gains nor loses beyond noise (scripts/bench_gguf.py --model
            # synth4x --quantize-only --device cuda --windows; figures in docs/benchmarks.md)
            closing.enter_context(intra_op_threads(max(1, torch.get_num_threads() - cores_taken(watches))))
        _stream_tensors(writers, tensors, device, encode, ahead, watches, progress, closing)
        for w, *_ in writers:
            w.close()
        return [watch.finish() for watch in watches] if verify else None


def _open_writers(files: list[GGUFFile], arch: str, tensors: list[SourceTensor],
                  closing: contextlib.ExitStack) -> list[tuple]:
    """Step 1 of :func:`write_gguf_many`: one gguf-py ``GGUFWriter`` per file, its tensor infos
    added (a uint8 byte shape, which gguf-py turns back into elements for the tensor info),
    closed by ``closing``: ``(writer, types, imatrix or {}, bytes of the tensor data)`` per file."""
    writers = []
    for path, kvs, types, *rest in files:
        imatrix = rest[0] if rest else None
        w = GGUFWriter(str(path), arch)
        closing.callback(w.close)  # opens its file in write_header_to_file
        data_bytes = 0
        for st in tensors:
            gt = ggml.get(types[st.name])
            rb = gt.row_bytes(st.shape[-1])
            w.add_tensor_info(st.name, (*st.shape[:-1], rb), np.dtype(np.uint8),
                              math.prod(st.shape[:-1]) * rb,
                              raw_dtype=GGMLQuantizationType[gt.name])
            data_bytes += GGUFWriter.ggml_pad(math.prod(st.shape[:-1]) * rb, w.data_alignment)
        writers.append((w, types, imatrix or {}, data_bytes))
    return writers


class _Encodings:
    """The encodings of a window of tensors (:func:`write_gguf_many`): each ``(index, source)``
    encoded once per distinct ggml type and importance weights among the files, in one
    :func:`encode_many` call; returns ``{(index, file): uint8 ndarray [rows, row_bytes]}``."""

    def __init__(self, writers: list[tuple], tensors: list[SourceTensor], device: torch.device):
        self.writers, self.tensors, self.device = writers, tensors, device

    def __call__(self, entries) -> dict[tuple[int, int], np.ndarray]:
        items, slots, slot_of = [], {}, {}
        for index, x in entries:
            name = self.tensors[index].name
            for f, (_, types, imatrix, _) in enumerate(self.writers):
                qw = imatrix.get(name)
                key = (index, types[name], None if qw is None else id(qw))
                if key not in slots:
                    slots[key] = len(items)
                    items.append((x, types[name], qw))
                slot_of[index, f] = slots[key]
        raws = encode_many(items, self.device)
        return {k: raws[slot] for k, slot in slot_of.items()}


def _write_headers(writers: list[tuple], files: list[GGUFFile], tensors: list[SourceTensor],
                   device: torch.device, verify: bool, closing: contextlib.ExitStack) -> list:
    """Step 3 of :func:`write_gguf_many`: each file's KVs (waiting for pending ones), header,
    KV data and tensor infos written; with ``verify`` the file given its final size and its
    round trip started (:func:`watch_round_trip`, stopped by ``closing``). Returns the watches."""
    watches: list = []
    for (w, *_), (_, kvs, *_) in zip(writers, files):
        for key, value, vtype, sub in (kvs.get() if isinstance(kvs, PendingKVs) else kvs):
            w.add_key_value(key, value, vtype, sub_type=sub)
    for (w, types, _, data_bytes), (path, *_) in zip(writers, files):
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        if verify:
            for f in w.fout:
                f.flush()
            size = GGUFWriter.ggml_pad(w.fout[0].tell(), w.data_alignment) + data_bytes
            os.truncate(path, size)     # the reader maps the whole file from the start
            watch = watch_round_trip(Path(path), tensors, types, device, size)
            closing.callback(watch.stop)
            watch.start()
            watches.append(watch)
    return watches


def _stream_tensors(writers: list[tuple], tensors: list[SourceTensor], device: torch.device,
                    encode: _Encodings, ahead: AheadOfHeader, watches: list,
                    progress: Callable[[Iterable], Iterable], closing: contextlib.ExitStack) -> None:
    """Step 4 of :func:`write_gguf_many`: every tensor read (by a :class:`_ReadAhead` where
    windows are used), windows of them encoded (:func:`_window_elements`), written in order to
    every file and handed to the round trips."""
    # tensors read, not yet written: (index, the source for the round trip, what is encoded:
    # the source itself on the CPU, else its copy on the device; None when it was encoded
    # ahead of the header)
    window: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = []

    def flush() -> None:
        # quantize the window (one codec pass per type on an accelerator; tensors quantized
        # ahead of the header are not quantized again), then write its tensors in order to
        # every file and hand each to the round trip
        raws = encode([(index, x) for index, _, x in window if x is not None])
        for index, t, x in window:
            written = []
            for f, (w, *_) in enumerate(writers):
                raw = ahead.take(index, f)
                written.append(raws[index, f] if raw is None else raw)
                w.write_tensor_data(written[-1].reshape(-1))
            if watches:
                for w, *_ in writers:
                    for f in w.fout:
                        f.flush()
                for watch, raw in zip(watches, written):
                    watch.written(index, t, raw, x if device.type != "cpu" else None)
        raws.clear()
        window.clear()
        trim_heap()     # (only past TRIM_KEEP of growth: see memory.bound_heap)

    size, limit = 0, _window_elements(device)
    reader = None
    if limit and READ_AHEAD:
        # (only now: watch_round_trip may fork checker processes, which no thread of this
        # process should be running beside)
        reader = _ReadAhead(tensors, limit)
        closing.callback(reader.close)
    for index, st in enumerate(progress(tensors)):
        t = st.load() if reader is None else reader.take()
        if ahead.rest is not None and index == ahead.rest[0]:
            # the KVs came within this matrix: the tensors before it, quantized ahead of the
            # header, are written and handed to the round trip first (so that their checks
            # run meanwhile, not all at once after it), then the rest of its rows
            if window:
                flush()
                size = 0
            ahead.finish_rest(t, device)
        # (a tensor quantized ahead of the header was checked then: it is read again only
        # for the round trip)
        x = None if ahead.has(index) else _to_encode(st, t, device)
        window.append((index, t if watches else None, x))
        size += t.numel()
        del t, x
        if size >= limit:
            flush()
            size = 0
    if window:
        flush()


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
