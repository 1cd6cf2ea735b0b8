"""What every quantized Hugging Face directory (AWQ, GPTQ, FP8, EXL2, ...) writes around its
quantized decoder layers: the token embedding, the final norm and, for an untied model whose
head is not quantized, the head, all float16, read a block of rows at a time so that no float32
copy of a large vocabulary matrix is ever made (:func:`quantpress.convert.shards.float16_rows`);
the round trip of its linears (:func:`verify_linears`, :func:`nonzero_scales`); and the
summary's list of the linears it kept (:func:`shown`)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from quantpress.calibration.awq import tensor_digest
from quantpress.calibration.engine import StreamingModel
from quantpress.convert.shards import RowChunks, checked_float16, float16_rows
from quantpress.errors import RoundTripError


def embedding_fp16(sm: StreamingModel) -> dict:
    """``{embed_tokens.weight: float16 rows}``: the token embedding as written (InputError naming
    it when a value is outside float16)."""
    name = sm.embed_name + ".weight"
    return {name: float16_rows(sm.weights, name)}


def norm_fp16(sm: StreamingModel) -> dict:
    """``{model.norm.weight: float16}``: the final norm as written."""
    name = sm.norm_name + ".weight"
    return {name: checked_float16(sm.weights.get(name, "cpu"), name)}


def head_fp16(sm: StreamingModel) -> dict[str, RowChunks]:
    """``{lm_head.weight: float16 rows}`` for an untied model, ``{}`` when the head is the
    embedding (``tie_word_embeddings``)."""
    if sm.tied_embeddings:
        return {}
    name = sm.lm_head_name + ".weight"
    return {name: float16_rows(sm.weights, name)}


def verify_linears(path: Path, weights, records: list, check: Callable | None = None) -> int:
    """The round trip every quantized directory shares: for each record (``name``,
    ``quantized``, ``shape`` [out, in], ``digest``), a linear kept unquantized must be in
    ``weights`` (a :class:`quantpress.convert.quant_weights.QuantizedWeights` reader of the
    final files) as a plain ``.weight``; a quantized one must be stored quantized, pass
    ``check(record)`` (the format's own checks: dtypes, scales), and dequantize, by the
    reader's reference procedure, to ``shape`` with the SHA-256 ``digest`` of what the
    quantizer made. Returns the number of quantized linears checked; raises RoundTripError
    naming the first linear that differs."""
    n = 0
    for r in records:
        wname = r.name + ".weight"
        if not r.quantized:
            if wname not in weights or weights.is_quantized(wname):
                raise RoundTripError(f"round trip: '{wname}' (kept unquantized) is missing from {path}")
            continue
        if not weights.is_quantized(wname):
            raise RoundTripError(f"round trip: '{r.name}' is not stored quantized in {path}")
        if check is not None:
            check(r)
        deq = weights.dequantized(r.name)
        if tuple(deq.shape) != tuple(r.shape):
            raise RoundTripError(f"round trip: '{r.name}' dequantizes to {tuple(deq.shape)}, "
                                 f"expected {tuple(r.shape)}")
        if tensor_digest(deq) != r.digest:
            raise RoundTripError(f"round trip failed: '{r.name}' dequantized from {path} differs "
                                 f"from the quantizer's weights")
        n += 1
    return n


def nonzero_scales(weights) -> Callable:
    """The ``check`` of :func:`verify_linears` for a format that stores a ``<linear>.scales``
    tensor (AWQ, GPTQ): RoundTripError naming the linear whose scales hold a zero
    (``weights.raw``: the reader of the final files)."""
    def check(r) -> None:
        if bool((weights.raw.get(r.name + ".scales") == 0).any()):
            raise RoundTripError(f"round trip: '{r.name}.scales' holds a zero scale")
    return check


def shown(names: list[str], most: int = 4) -> str:
    """The first ``most`` of ``names`` joined by commas, `` ...`` after them when there are
    more (``""`` for none): a summary's list of the linears kept unquantized."""
    return ", ".join(names[:most]) + (" ..." if len(names) > most else "")
