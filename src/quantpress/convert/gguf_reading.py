"""GGUF files read with gguf-py for the round trip and for inspection: the reader over a plain
view of the file's memory map (:class:`GGUFFileReader`), the checkers' faster parse that skips
the values of metadata arrays (:class:`GGUFTensorsReader`), a tensor's bytes as rows
(:func:`reader_raw`), gguf-py's dequantizer of a type (:func:`gguf_py_decoder`), and the release
of a tensor's pages once read (:func:`drop_pages`)."""
from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf import quants as gguf_quants

from quantpress.errors import InputError
from quantpress.quantize import ggml


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
