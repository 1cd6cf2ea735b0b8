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
from quantpress.memory import bound_heap, trim_heap
from quantpress.targets.base import Run, Source, Summary, Target, reference_pass
from quantpress.targets.registry import Estimate, Verb


@dataclass(frozen=True)
class ImatrixOptions:
    """``quantize imatrix``: no options of its own (calibration and compute are the source's,
    as ``llama-imatrix -f FILE --chunks N -c L``)."""

    def validate(self) -> None:
        """Nothing to check."""


class ImatrixCollector:
    """The importance-matrix consumer of a streamed pass (``hooks``, for
    :class:`quantpress.calibration.engine.FanOut` or as :func:`quantpress.calibration.engine.run`'s
    ``hooks_factory``): Σx² of the input of every decoder-layer linear of ``source``'s model
    (:class:`quantpress.calibration.stats.StatsCollector`); :meth:`entries` gives them by GGUF
    weight name once the pass is over."""

    def __init__(self, source: Source):
        self.source = source
        self.arch = source.loader.gguf_arch(source.path)
        sm = source.streaming_model()
        self.n_layers = int(sm.config.num_hidden_layers)
        self.col = StatsCollector(kinds={"sq"}, prefix=sm.layer_prefix)

    def hooks(self, index: int, layer: torch.nn.Module):
        """Hook layer ``index``'s linears (removed by the engine after its forward)."""
        return self.col(index, layer)

    def layer_state(self, index: int) -> dict:
        """The statistics of layer ``index``'s linears (a checkpointed pass)."""
        p = f"{self.col.prefix}{index}."
        return {k: v for k, v in self.col.stats.items() if k.startswith(p)}

    def restore(self, index: int, saved: dict) -> None:
        """Take back layer ``index``'s saved statistics (a resumed pass)."""
        self.col.stats.update(saved)

    def entries(self) -> dict[str, tuple[torch.Tensor, int]]:
        """``{GGUF weight name: (in_sum2 float32 [K], token count)}`` (llama.cpp
        ``IMatrixCollector::collect_imatrix`` for dense weights; ``output.weight`` left out, as
        llama-imatrix does without ``--process-output``). InputError for a linear without a
        GGUF name."""
        out = {}
        for hf_name, st in self.col.stats.items():
            try:
                g = gguf_arch.gguf_tensor_name(hf_name + ".weight", self.arch, n_layers=self.n_layers)
            except ValueError as e:
                raise InputError(f"{self.source.path}: {e}") from None
            out[g] = st.imatrix()
        return out


def imatrix_from_rows(source: Source, rows: torch.Tensor,
                      progress: bool = True) -> dict[str, tuple[torch.Tensor, int]]:
    """Σx² of the input of every decoder-layer linear over all tokens of ``rows`` (int64
    [n, seqlen]), keyed by GGUF weight name (``blk.0.attn_q.weight``): ``(in_sum2 float32 [K],
    token count)`` (:meth:`ImatrixCollector.entries`). The model runs through the streaming
    engine in the source's compute dtype (float32 by default) one layer at a time. Raises
    InputError on NaN/Inf activations (naming the layer) and unsupported models."""
    c = ImatrixCollector(source)
    engine.run(source.streaming_model(), rows, hooks_factory=c.hooks,
               batch_size=source.batch_rows(rows.shape[1]), progress=progress,
               on_layer=lambda *a: trim_heap(), keep_inputs=False)
    return c.entries()


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

    reference_stage = "forward"
    collector: ImatrixCollector | None = None
    verbs = (Verb("quantize", "imatrix", "llama.cpp importance matrix (GGUF imatrix file for "
                                         "llama-quantize --imatrix)", input="any",
                  arg_help="Hugging Face model directory or GGUF file",
                  out_help="output imatrix .gguf path"),)
    job_key = "imatrix"
    job_value = "flag"
    job_order = 20
    runtimes = "llama-quantize --imatrix"
    stream = "reference"
    is_model = False
    job_target_format = "{kind}"
    job_path_format = "{name}.imatrix.gguf"

    @classmethod
    def estimate(cls, info, options: list[ImatrixOptions]) -> Estimate:
        """Σx² and counts per linear input (float64), statistics that cost no working memory
        to speak of."""
        return Estimate([8 * 7 * info.hidden * info.layers for _ in options], consumers=[0 for _ in options])

    def prepare(self, run: Run) -> None:
        bound_heap()
        with run.stage("tokenize"):
            self.rows, self.text = self.source.calibration_rows()

    def wants_reference(self) -> bool:
        """Σx² is taken on the reference hidden states, as llama-imatrix does."""
        return True

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> ImatrixCollector:
        """The Σx² collector (the file is written at the end: nothing to resume in ``tmp``)."""
        self.collector = ImatrixCollector(self.source)
        return self.collector

    def write(self, tmp: Path, run: Run) -> None:
        if self.collector is None:
            self.reference_consumer(tmp, run)
            with run.stage("forward"):
                reference_pass(self.source, [self.collector], run.progress)
        with run.stage("write"):
            self.entries = self.collector.entries()
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
