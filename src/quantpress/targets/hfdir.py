"""What every quantized Hugging Face directory (AWQ, EXL2, ...) writes around its quantized
decoder layers: the token embedding, the final norm and, for an untied model whose head is not
quantized, the head, all float16, read a block of rows at a time so that no float32 copy of a
large vocabulary matrix is ever made (:func:`quantpress.convert.shards.float16_rows`)."""
from __future__ import annotations

from quantpress.calibration.engine import StreamingModel
from quantpress.convert.shards import RowChunks, checked_float16, float16_rows


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
