"""FP8 E4M3 directories in the compressed-tensors format (``quantize fp8``): the config block,
the streaming writer, and the reader with the reference dequantization (the round trip and,
once registered as a loader, ``quantize eval``).

Layout (what llm-compressor 0.14 saves through compressed-tensors 0.20's ``ModelCompressor``
with the ``float-quantized`` format, ``compressors/naive_quantized/base.py``
``FloatQuantizationCompressor``; what vLLM's ``compressed_tensors`` quantization and
transformers 5.23's ``CompressedTensorsHfQuantizer`` load), per quantized linear ``<m>``:

- ``<m>.weight``: float8_e4m3fn [N, K] (safetensors ``F8_E4M3``);
- ``<m>.weight_scale``: the model's dtype, [N, 1] (strategy ``channel``), [1] (``tensor``) or
  [⌈N/bn⌉, ⌈K/bk⌉] (``block``, ``block_structure`` [bn, bk]);
- ``<m>.input_scale``: the model's dtype, [1], when the input activations are static;
- its bias, if any, as in the source.

Every other tensor (embeddings, norms, the head, the linears listed in ``ignore``) is stored
as in the source, in its dtype. ``config.json`` is the source config with a
``quantization_config`` of ``quant_method: compressed-tensors``, ``format: float-quantized``,
``quantization_status: compressed``, one config group ``group_0`` targeting ``Linear``, and
``ignore`` (built with compressed-tensors' own ``QuantizationConfig`` / ``QuantizationScheme``
/ ``QuantizationArgs``, :func:`fp8_config`); keys sorted, indent 2, as ``update_config``
writes them. The weight a linear stands for is ``weight.to(scale dtype) * weight_scale``,
each scale broadcast over its row, the tensor or its block (:func:`dequantize_reference`).

The writer keeps nothing in memory between layers (:class:`quantpress.convert.shards.ModelDirWriter`:
a part file per call, assembled into shards at the end).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quantpress.convert.quant_weights import QuantizedWeights, quantized_config
from quantpress.convert.shards import DirLayout, ModelDirWriter, RowChunks, copied_source_file
from quantpress.errors import InputError

#: ``quantize fp8 --scheme`` → the compressed-tensors 0.20 preset it reproduces
PRESETS = {"dynamic": "FP8_DYNAMIC", "static": "FP8", "block": "FP8_BLOCK"}
#: weight rows and columns of one block of the ``block`` scheme
BLOCK_STRUCTURE = (128, 128)


# --------------------------------------------------------------------------------------------
# The quantization block of config.json

def require_compressed_tensors() -> None:
    """InputError unless compressed-tensors (whose classes build and check the config) can be
    imported."""
    try:
        import compressed_tensors.quantization  # noqa: F401
    except ImportError:
        raise InputError("quantize fp8 needs the compressed-tensors package "
                         "(pip install compressed-tensors==0.20.0)") from None


def fp8_scheme(scheme: str):
    """compressed-tensors' ``QuantizationScheme`` of ``scheme`` (dynamic, static, block): the
    FP8_DYNAMIC, FP8 or FP8_BLOCK preset of compressed-tensors 0.20
    (``quantization/quant_scheme.py``) targeting ``Linear``, with ``format: float-quantized``
    as llm-compressor 0.14 records it (``infer_model_format``). ValueError for another name."""
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    fp8 = dict(num_bits=8, type="float", symmetric=True)
    if scheme == "dynamic":
        weights = QuantizationArgs(**fp8, strategy="channel", dynamic=False)
        inputs = QuantizationArgs(**fp8, strategy="token", dynamic=True)
    elif scheme == "static":
        weights = QuantizationArgs(**fp8, strategy="tensor", dynamic=False)
        inputs = QuantizationArgs(**fp8, strategy="tensor", dynamic=False, observer="static_minmax")
    elif scheme == "block":
        weights = QuantizationArgs(**fp8, strategy="block", dynamic=False,
                                   block_structure=list(BLOCK_STRUCTURE))
        inputs = QuantizationArgs(**fp8, strategy="group", dynamic=True, group_size=BLOCK_STRUCTURE[1])
    else:
        raise ValueError(f"unknown FP8 scheme {scheme!r}; known: {', '.join(PRESETS)}")
    return QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs,
                              format=CompressionFormat.float_quantized.value)


def fp8_quantization_config(scheme: str, ignore: list[str]):
    """compressed-tensors' ``QuantizationConfig``: ``{"group_0": fp8_scheme(scheme)}``,
    ``format: float-quantized``, ``quantization_status: compressed``, ``ignore``."""
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups={"group_0": fp8_scheme(scheme)}, format="float-quantized",
                              quantization_status="compressed", ignore=list(ignore))


def _sorted(v):
    if isinstance(v, dict):
        return {k: _sorted(v[k]) for k in sorted(v)}
    if isinstance(v, list):
        return [_sorted(x) for x in v]
    return v


def fp8_config(source_config: dict, scheme: str, ignore: list[str]) -> dict:
    """config.json of the output: the source config (its dtype kept) with the
    ``quantization_config`` compressed-tensors 0.20's ``ModelCompressor.update_config`` writes
    for llm-compressor 0.14 (``version``, ``quant_method: compressed-tensors``, empty
    ``sparsity_config`` and ``transform_config``, then :func:`fp8_quantization_config` dumped),
    every key sorted as its ``json.dump(sort_keys=True)`` leaves them. ``ignore``: module names
    kept in the source precision. ValueError for an unknown scheme."""
    import compressed_tensors

    q = fp8_quantization_config(scheme, ignore).model_dump(mode="json", exclude={"quant_method"})
    cfg = {k: v for k, v in source_config.items() if k != "quantization_config"}
    cfg["quantization_config"] = {"version": compressed_tensors.__version__,
                                  "quant_method": "compressed-tensors", "sparsity_config": {},
                                  "transform_config": {}, **q}
    return _sorted(cfg)


def matches(name: str, pattern: str) -> bool:
    """Whether module ``name`` matches an ``ignore`` entry: ``re:<regex>`` (``re.match`` from
    the start of the name) or the exact name (compressed-tensors 0.20 ``utils/match.py``
    ``match_name``). Raises re.error for a bad regex."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


# --------------------------------------------------------------------------------------------
# Writer

#: ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``,
#: safetensors metadata {"format": "pt"} (transformers' ``save_pretrained``), config.json with
#: indent 2 and no final newline (``update_config``'s ``json.dump``), the tokenizer and other
#: non-weight files copied
FP8_LAYOUT = DirLayout("model", {"format": "pt"}, index=True, config_indent=2, config_newline=False,
                       copied=copied_source_file, keep_file_metadata=True)

def dir_writer(tmp_dir: Path, max_shard_bytes: int = 5 * 10 ** 9, resume: bool = False) -> ModelDirWriter:
    """The writer of an FP8 directory in ``tmp_dir`` (created; with ``resume`` it may exist,
    see :meth:`ModelDirWriter.adopt`): shards of at most ``max_shard_bytes`` of tensor data."""
    return ModelDirWriter(tmp_dir, FP8_LAYOUT, max_shard_bytes, resume)


def source_rows(weights, name: str, block: int = 4096) -> RowChunks | torch.Tensor:
    """Checkpoint tensor ``name`` of ``weights`` exactly as stored (its dtype, its values), for
    the writer: a :class:`quantpress.convert.shards.RowChunks` reading ``block`` rows at a time
    when the reader reads row ranges (an embedding or head is never held whole), else the
    whole tensor on CPU. InputError when the tensor is absent."""
    if not hasattr(weights, "get_rows"):
        return weights.get(name, "cpu")
    shape = tuple(weights.shape(name))
    if len(shape) < 2:
        return weights.get(name, "cpu")
    dtype = weights.get_rows(name, 0, 1).dtype
    return RowChunks(shape, dtype, lambda lo, hi: weights.get_rows(name, lo, hi), block)


# --------------------------------------------------------------------------------------------
# Reference dequantization, from the format description (independent of quantize/fp8.py)

def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, strategy: str,
                         block_structure: tuple[int, int] | None = None) -> torch.Tensor:
    """The weight [N, K] a stored float8_e4m3fn ``q`` [N, K] and its ``weight_scale`` stand
    for, in the scale's dtype: every element ``float(q[i, j]) · s[i, j]`` rounded once to the
    scale's dtype, ``s`` the scale of element (i, j): ``scale[0]`` (strategy ``tensor``,
    scale [1]), ``scale[i, 0]`` (``channel``, [N, 1]) or ``scale[i // bn, j // bk]``
    (``block``, [⌈N/bn⌉, ⌈K/bk⌉], each scale expanded over its block). This is what
    compressed-tensors 0.20 ``dequantize`` computes (``x_q.to(scale.dtype) * scale``) and what
    vLLM's kernels assume. Raises ValueError for a wrong dtype or shape."""
    if q.dtype != torch.float8_e4m3fn or q.ndim != 2:
        raise ValueError(f"weight is {q.dtype} {tuple(q.shape)}, expected 2-D float8_e4m3fn")
    if scale.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"weight_scale is {scale.dtype}, expected float16, bfloat16 or float32")
    n, k = q.shape
    if strategy == "tensor":
        if scale.numel() != 1:
            raise ValueError(f"per-tensor weight_scale has shape {tuple(scale.shape)}, expected (1,)")
        s = scale.reshape(1, 1)
    elif strategy == "channel":
        if tuple(scale.shape) not in ((n, 1), (n,)):
            raise ValueError(f"per-channel weight_scale has shape {tuple(scale.shape)}, expected ({n}, 1)")
        s = scale.reshape(n, 1)
    elif strategy == "block":
        bn, bk = block_structure or BLOCK_STRUCTURE
        want = ((n + bn - 1) // bn, (k + bk - 1) // bk)
        if tuple(scale.shape) != want:
            raise ValueError(f"block weight_scale has shape {tuple(scale.shape)}, expected {want}")
        s = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    else:
        raise ValueError(f"unknown weight strategy {strategy!r}")
    return q.to(scale.dtype) * s


# --------------------------------------------------------------------------------------------
# Reader

def _quant_block(cfg) -> dict | None:
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return q if isinstance(q, dict) else None


def is_fp8_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory whose config.json says ``quant_method:
    compressed-tensors`` with ``format: float-quantized``."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    q = _quant_block(cfg)
    return (q is not None and q.get("quant_method") == "compressed-tensors"
            and q.get("format") == "float-quantized")


@dataclass(frozen=True)
class FP8Format:
    """What an FP8 directory's config says: ``strategy`` of the weight scales (tensor, channel,
    block), ``block_structure`` (block only), ``static_inputs`` (the linears carry an
    ``input_scale``), ``activations`` (the input strategy: token, group, tensor), ``ignore``."""

    strategy: str
    block_structure: tuple[int, int] | None
    static_inputs: bool
    activations: str
    ignore: tuple[str, ...]


def read_fp8_config(path: str | Path) -> tuple[dict, FP8Format]:
    """(config dict, :class:`FP8Format`) of an FP8 directory. The quantization block is checked
    by compressed-tensors' ``QuantizationConfig.model_validate``, then must be ``compressed``
    ``float-quantized`` with one config group of 8-bit symmetric float weights (strategy
    tensor, channel or block) targeting ``Linear``. Raises InputError naming the directory
    otherwise (and when config.json is unreadable)."""
    p = Path(path)
    config, q = quantized_config(p, "compressed-tensors", "compressed-tensors")
    require_compressed_tensors()
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    try:
        qc = QuantizationConfig.model_validate(q)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"{p}: quantization_config is not a valid compressed-tensors config ({first})") from None
    groups = list(qc.config_groups.values())
    w = groups[0].weights if len(groups) == 1 else None
    if (qc.format != "float-quantized" or qc.quantization_status != QuantizationStatus.COMPRESSED
            or w is None or w.type != "float" or w.num_bits != 8 or not w.symmetric
            or w.strategy not in ("tensor", "channel", "block") or "Linear" not in groups[0].targets):
        raise InputError(f"{p}: quantization_config is not one compressed float-quantized group of "
                         f"8-bit symmetric float weights per tensor, channel or block over Linear "
                         f"layers (what quantpress reads)")
    ia = groups[0].input_activations
    fmt = FP8Format(w.strategy, tuple(w.block_structure) if w.block_structure else None,
                    ia is not None and not ia.dynamic, ia.strategy if ia is not None else "none",
                    tuple(qc.ignore or ()))
    return config, fmt


class FP8Weights(QuantizedWeights):
    """The tensors of an FP8 directory under HF names, quantized linears dequantized by
    :func:`dequantize_reference` on demand (the weights protocol of
    :class:`calibration.engine.StreamingModel`); ``raw`` reads the stored tensors.

    Raises InputError for a directory without a usable FP8 config or a quantized linear
    without its ``weight`` (naming it)."""

    def __init__(self, path: str | Path):
        from quantpress.calibration.engine import SafetensorsDir

        self.path = Path(path)
        self.config, self.format = read_fp8_config(self.path)
        self.raw = SafetensorsDir(self.path)
        self._index("weight_scale", ("weight",))
        hidden = {m + ".input_scale" for m in self.quantized}
        self._keys = [k for k in self._keys if k not in hidden]

    def dequantized(self, module: str, device="cpu") -> torch.Tensor:
        """[out, in] of quantized linear ``module`` in its scale's dtype (the reference
        procedure). InputError naming the tensor for a wrong dtype or shape."""
        q = self.raw.get(module + ".weight", device)
        s = self.raw.get(module + ".weight_scale", device)
        try:
            return dequantize_reference(q, s, self.format.strategy, self.format.block_structure)
        except ValueError as e:
            raise InputError(f"{self.path}: '{module}': {e}") from None


def streaming_model(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
                    attn_implementation: str = "sdpa"):
    """A :class:`calibration.engine.StreamingModel` over an FP8 directory: transformers'
    decoder layers built from its config.json (without the quantization block), weights
    dequantized layer by layer from the directory."""
    return FP8Weights(path).streaming_model(device, dtype, attn_implementation)
