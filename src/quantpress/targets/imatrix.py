"""llama.cpp importance matrices (``quantize imatrix``): Σx² of the input of every decoder
linear over the calibration rows, in llama.cpp's GGUF imatrix format
(:mod:`quantpress.convert.imatrix_file`), which ``llama-quantize --imatrix`` reads.

The model (an HF directory or a GGUF file) runs through the layer-streaming engine, one
decoder layer at a time; the file's ``imatrix.chunk_count`` is the number of calibration rows
and ``imatrix.chunk_size`` their length (llama-imatrix's chunks). The round trip re-reads the
file with gguf-py (:func:`quantpress.convert.imatrix_file.read_imatrix`) and compares every
value bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quantpress.calibration import engine
from quantpress.calibration.stats import StatsCollector
from quantpress.convert import gguf_arch
from quantpress.convert.imatrix_file import Imatrix, from_stats, read_imatrix, write_imatrix
from quantpress.errors import InputError, RoundTripError
from quantpress.runtime import bound_heap, trim_heap
from quantpress.targets.base import Run, Source, Summary, Target


@dataclass(frozen=True)
class ImatrixOptions:
    """``quantize imatrix``: no options of its own (calibration and compute are the source's,
    as ``llama-imatrix -f FILE --chunks N -c L``)."""

    def validate(self) -> None:
        """Nothing to check."""


def imatrix_from_rows(source: Source, rows: torch.Tensor,
                      progress: bool = True) -> dict[str, tuple[torch.Tensor, int]]:
    """Σx² of the input of every decoder-layer linear over all tokens of ``rows`` (int64
    [n, seqlen]), keyed by GGUF weight name (``blk.0.attn_q.weight``): ``(in_sum2 float32 [K],
    token count)``, i.e. llama.cpp ``IMatrixCollector::collect_imatrix`` for dense weights
    (``output.weight`` is left out, as llama-imatrix does without ``--process-output``).
    The model runs through the streaming engine in the source's compute dtype (float32 by
    default) one layer at a time. Raises InputError on NaN/Inf activations (naming the linear)
    and unsupported models."""
    arch = source.loader.gguf_arch(source.path)
    sm = source.streaming_model()
    col = StatsCollector(kinds={"sq"}, prefix=sm.layer_prefix)
    engine.run(sm, rows, hooks_factory=col, batch_size=source.batch_rows(rows.shape[1]),
               progress=progress, on_layer=trim_heap)
    n_layers = int(sm.config.num_hidden_layers)
    out = {}
    for hf_name, st in col.stats.items():
        try:
            g = gguf_arch.gguf_tensor_name(hf_name + ".weight", arch, n_layers=n_layers)
        except ValueError as e:
            raise InputError(f"{source.path}: {e}") from None
        out[g] = st.imatrix()
    return out


def verify_imatrix(path: Path, im: Imatrix) -> str:
    """Round trip of a written imatrix: re-read with gguf-py, the same entries, every in_sum2
    and count bit for bit, the same datasets, chunk count and chunk size. RoundTripError
    naming the first difference."""
    try:
        back = read_imatrix(path)
    except InputError as e:
        raise RoundTripError(f"round trip: {e}") from None
    if sorted(back.sums) != sorted(im.sums):
        raise RoundTripError(f"round trip: {path} holds entries {sorted(set(back.sums) ^ set(im.sums))[:3]} "
                             f"that differ from those computed")
    for name in im.sums:
        for what, a, b in (("in_sum2", back.sums[name], im.sums[name]),
                           ("counts", back.counts[name], im.counts[name])):
            a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if a32.shape != b32.shape or a32.tobytes() != b32.tobytes():
                raise RoundTripError(f"round trip failed: '{name}.{what}' read back from {path} "
                                     f"differs from the computed values")
    if (back.datasets, back.chunk_count, back.chunk_size) != (im.datasets, im.chunk_count, im.chunk_size):
        raise RoundTripError(f"round trip: {path} metadata {back.datasets, back.chunk_count, back.chunk_size} "
                             f"differs from {im.datasets, im.chunk_count, im.chunk_size}")
    return f"ok ({len(im.sums)} entries re-read bit for bit with gguf-py)"


class ImatrixTarget(Target, kind="imatrix", options=ImatrixOptions):
    """An importance matrix file (:class:`ImatrixOptions`) of an HF directory or GGUF file."""

    def prepare(self, run: Run) -> None:
        bound_heap()
        with run.stage("tokenize"):
            self.rows, self.text = self.source.calibration_rows()

    def write(self, tmp: Path, run: Run) -> None:
        with run.stage("forward"):
            self.entries = imatrix_from_rows(self.source, self.rows, run.progress)
        with run.stage("write"):
            self.im = from_stats(self.entries, [self.text], chunk_count=self.rows.shape[0],
                                 chunk_size=self.rows.shape[1])
            write_imatrix(tmp, self.im)

    def verify(self, tmp: Path, run: Run) -> str:
        return verify_imatrix(tmp, self.im)

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        samples, seqlen = tuple(self.rows.shape)
        tokens = samples * seqlen
        rate = tokens / max(run.stages.get("forward", 0.0), 1e-9)
        return Summary(self.kind, f"{samples}x{seqlen}", out, str(self.source.path), roundtrip=roundtrip,
                       lines=[f"entries    {len(self.entries)} weights (in_sum2 + counts each)",
                              f"data       {samples} samples x {seqlen} tokens = {tokens:,} tokens "
                              f"from {self.text}, {rate:,.0f} tokens/s"],
                       details={"entries": len(self.entries), "samples": samples, "seqlen": seqlen,
                                "tokens": tokens, "datasets": [self.text]})
