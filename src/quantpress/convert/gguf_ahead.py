"""GGUF tensors quantized before the header is written: while a file's metadata (its KVs) is
still computed elsewhere (:class:`PendingKVs`, a forked call), :func:`quantpress.convert.gguf_file.write_gguf_many`
quantizes the first tensors into memory (:class:`AheadOfHeader`) and writes them once the
header is out."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from quantpress.quantize.ggml.common import intra_op_threads

from .gguf_checks import SourceTensor

KV = tuple  # (key, value, GGUFValueType, sub_type or None)


class PlanChanged(Exception):
    """The metadata computed beside the writing (:class:`PendingKVs`) came with a tensor side
    other than the one the writer was given: nothing was written; the caller plans again."""


class PendingKVs:
    """A file's KVs still being computed elsewhere (a forked process,
    :func:`quantpress.workers.fork_call`), for :func:`write_gguf_many`, which quantizes the
    first tensors while it waits.

    ``call``: a :class:`quantpress.workers.ForkedCall` whose value is ``(key, kvs)``;
    ``key``: what the writer's tensors (names, shapes, transforms) were derived from, as the
    caller computed it without the metadata: :meth:`get` raises :class:`PlanChanged` when the
    call's key differs. ``pending + more`` appends KVs to the ones computed."""

    def __init__(self, call, key, extra: tuple = ()):
        self.call, self.key, self.extra = call, key, tuple(extra)

    def __add__(self, more) -> "PendingKVs":
        return PendingKVs(self.call, self.key, self.extra + tuple(more))

    def ready(self) -> bool:
        """Whether :meth:`get` would return at once."""
        return self.call.ready()

    def close(self) -> None:
        """Stop the computation if it is still running (its KVs are not wanted)."""
        self.call.close()

    def get(self) -> list[KV]:
        """The KVs, in order (waits for them). Raises what the computation raised
        (InputError for bad input), or :class:`PlanChanged`."""
        key, kvs = self.call.result()
        if key != self.key:
            raise PlanChanged("the metadata's tensor side differs from the writer's")
        return list(kvs) + list(self.extra)


#: output bytes :func:`write_gguf_many` may quantize ahead of its header while a file's KVs
#: are pending (:class:`PendingKVs`): held in memory until the header is written
AHEAD_OF_HEADER_BYTES = 256 << 20

#: elements of a matrix quantized ahead of the header at a time (whole rows): the writer
#: looks for the pending KVs between pieces, and once they are there quantizes the rest of the
#: tensor on every lane (looking only between tensors, a large tensor begun just before the
#: KVs came went on one lane to its end while the other core idled)
AHEAD_PIECE_ELEMENTS = 1 << 22


class AheadOfHeader:
    """Step 2 of :func:`quantpress.convert.gguf_file.write_gguf_many`: encodings made before the header, while a file's KVs
    are computed elsewhere (``pending``, :class:`PendingKVs`): the first tensors, in order,
    until the KVs are there or :data:`AHEAD_OF_HEADER_BYTES` are held; a matrix in pieces of
    rows (:data:`AHEAD_PIECE_ELEMENTS`), so that the KVs' arrival is seen within a piece. A
    matrix begun when they came is left at ``rest`` = ``(index, first row not quantized)``, its
    remaining rows quantized on every lane when the stream reaches it (:meth:`finish_rest`);
    when the budget ran out first, they are quantized at once, before the header, while it
    waits for the KVs. :meth:`take` hands the stream a tensor's encoding for a file."""

    def __init__(self, encode: Callable[[list], dict], n_files: int, pending: list[PendingKVs]):
        self.encode, self.n_files, self.pending = encode, n_files, pending
        self.held = 0
        self.rest: tuple[int, int] | None = None
        self.pieces: dict[tuple[int, int], list[np.ndarray]] = {}
        self.done: dict[tuple[int, int], np.ndarray] = {}

    def enough(self) -> bool:
        """Whether to stop: the budget is held or every KV is there."""
        return self.held >= AHEAD_OF_HEADER_BYTES or all(p.ready() for p in self.pending)

    def quantize(self, index: int, x: torch.Tensor, whole: bool = False) -> int | None:
        """Quantize ``x`` (a tensor's source, or its rows from some row on) into the pieces: a
        matrix in pieces of rows until :meth:`enough` says stop (``whole``: in one piece).
        Returns the first row not quantized (``x.shape[0]``: all), or None (that tensor's
        pieces dropped) where it raised: the stream meets the error again and reports it."""
        in_pieces = x.dim() == 2 and not whole
        step = max(1, AHEAD_PIECE_ELEMENTS // x.shape[-1]) if in_pieces else x.shape[0]
        for r0 in range(0, x.shape[0], step):
            if r0 and self.enough():
                return r0
            try:
                done = self.encode([(index, x[r0:r0 + step])])
            except Exception:   # noqa: BLE001
                for f in range(self.n_files):
                    self.pieces.pop((index, f), None)
                return None
            for k, raw in done.items():
                self.pieces.setdefault(k, []).append(raw)
            self.held += sum(r.nbytes for r in {id(r): r for r in done.values()}.values())
        return x.shape[0]

    def run(self, tensors: list[SourceTensor], device: torch.device,
            to_encode: Callable[[SourceTensor, torch.Tensor, torch.device], torch.Tensor]) -> None:
        """Quantize the first tensors while the KVs are pending (a no-op when none is), on
        one lane less (the computation of the KVs keeps a core); ``to_encode(st, loaded,
        device)``: the loaded source as it is encoded (checked, on ``device``)."""
        x = None
        with intra_op_threads(max(1, torch.get_num_threads() - 1) if self.pending else None):
            for index, st in enumerate(tensors):
                if not self.pending or self.enough():
                    break
                try:
                    x = to_encode(st, st.load(), device)
                except Exception:   # noqa: BLE001 -- the stream meets it again and reports it
                    break
                r0 = self.quantize(index, x)
                if r0 is None:
                    break
                if r0 < x.shape[0]:
                    self.rest = (index, r0)
                    break
        if self.rest is not None and not all(p.ready() for p in self.pending):
            # the budget is held and the header waits for the KVs: the rest meanwhile, in one
            # piece on every lane
            self.quantize(self.rest[0], x[self.rest[1]:], whole=True)
            self.rest = None
        del x
        for index in sorted({k[0] for k in self.pieces} - ({self.rest[0]} if self.rest else set())):
            self.complete(index)

    def complete(self, index: int) -> None:
        """A tensor's pieces, all quantized, joined into its encodings."""
        for f in range(self.n_files):
            parts = self.pieces.pop((index, f), None)
            if parts:
                self.done[index, f] = parts[0] if len(parts) == 1 else np.concatenate(parts)

    def finish_rest(self, t: torch.Tensor, device: torch.device) -> None:
        """The rest of the rows of the matrix at ``rest`` (``t``: its source), quantized at
        once on every lane (its rows checked for NaN/Inf with the whole source before)."""
        rows = t[self.rest[1]:]
        if self.quantize(self.rest[0], rows if device.type == "cpu" else rows.to(device), whole=True) is not None:
            self.complete(self.rest[0])
        self.rest = None

    def has(self, index: int) -> bool:
        """Whether tensor ``index`` was quantized here."""
        return (index, 0) in self.done

    def take(self, index: int, f: int) -> np.ndarray | None:
        """Tensor ``index``'s encoding for file ``f``, if quantized here (given once)."""
        return self.done.pop((index, f), None)
