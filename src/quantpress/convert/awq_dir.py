"""AutoAWQ "GEMM" directories on disk: the streaming writer, the reader with the reference
dequantization (the round-trip check and ``quantize eval``'s loader).

Layout (AutoAWQ 0.2.9 ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM`` and
``awq/models/base.py`` ``save_quantized``): per quantized linear ``qweight`` int32
[in, out/8], ``qzeros`` int32 [in/g, out/8], ``scales`` float16 [in/g, out] (+ float16
``bias``); every other tensor (embeddings, norms with the folded scales, lm_head, layers
that cannot be quantized) float16 ``.weight``; ``config.json`` with ``quantization_config``
and ``torch_dtype: float16``; the tokenizer and generation files copied;
``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` shards with
``model.safetensors.index.json`` past the shard size.

The writer keeps nothing in memory between layers: each decoder layer's tensors go to a
part file in the temporary output directory as soon as they exist; the finish step
(:class:`quantpress.convert.shards.ModelDirWriter`) copies them into the shards piece by piece
(never a whole tensor in memory), writes the index and the config, and the runner renames the
directory into place after the round trip.
"""
from __future__ import annotations

from pathlib import Path

import torch

from quantpress.convert.quant_weights import QuantizedWeights, quantized_as, quantized_config
from quantpress.convert.shards import DirLayout, ModelDirWriter, copied_source_file
from quantpress.errors import InputError

#: AutoAWQ's unpack order (inverse of the pack order [0, 2, 4, 6, 1, 3, 5, 7])
REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def parse_size(text: str) -> int:
    """Bytes in a size like "5GB", "500MB", "2GiB" or a plain number (InputError otherwise)."""
    t = str(text).strip().upper().replace(" ", "")
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10 ** 3, "MB": 10 ** 6,
             "GB": 10 ** 9, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * m)
            except ValueError:
                break
    try:
        return int(t)
    except ValueError:
        raise InputError(f"--max-shard-size {text}: expected a size such as 5GB or 500MB") from None


# --------------------------------------------------------------------------------------------
# Reference dequantization (AutoAWQ 0.2.9 `awq/utils/packing_utils.py` `dequantize_gemm`),
# independent of quantize/awq.py's packer

def unpack_awq_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] → int16 [R, 8C] of 4-bit values in the logical column order: nibble k of
    column c is ``(P[:, c] >> 4k) & 0xF`` (arithmetic shift, mask after), laid out at 8c + k,
    then the columns reordered with ``arange(8C).reshape(-1, 8)[:, [0,4,1,5,2,6,3,7]]``
    (AutoAWQ ``packing_utils.unpack_awq`` + ``reverse_awq_order``)."""
    r, c = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, C, 8]
    nib = nib.reshape(r, c * 8)
    idx = torch.arange(c * 8, device=packed.device).reshape(-1, 8)[:, list(REVERSE_ORDER)].reshape(-1)
    return nib[:, idx].to(torch.int16)


def dequantize_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """float16 weight [out, in] of one AWQ GEMM linear: ``W_T = (iw − repeat(iz, g)) ·
    repeat(scales, g)`` in float16, transposed (AutoAWQ ``packing_utils.dequantize_gemm``).
    ``qweight`` int32 [in, out/8], ``qzeros`` int32 [in/g, out/8], ``scales`` float16
    [in/g, out]. Raises ValueError on inconsistent shapes."""
    k, c = qweight.shape
    if qzeros.shape[1] != c or scales.shape[1] != 8 * c or qzeros.shape[0] != scales.shape[0] \
            or k != scales.shape[0] * group_size:
        raise ValueError(f"inconsistent AWQ shapes: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, group_size {group_size}")
    iw = unpack_awq_int4(qweight)
    iz = unpack_awq_int4(qzeros).repeat_interleave(group_size, dim=0)
    sc = scales.to(torch.float16).repeat_interleave(group_size, dim=0)
    w_t = (iw - iz).to(torch.float16) * sc
    return w_t.T.contiguous()


# --------------------------------------------------------------------------------------------
# Writer

#: ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``,
#: safetensors metadata {"format": "pt"} (as transformers' ``save_pretrained``), config.json with
#: indent 2, the tokenizer and other non-weight files copied (not dotfiles, weights, indexes)
AWQ_LAYOUT = DirLayout("model", {"format": "pt"}, index=True, config_indent=2, config_newline=True,
                       copied=copied_source_file, keep_file_metadata=True)


def dir_writer(tmp_dir: Path, max_shard_bytes: int = 5 * 10 ** 9, resume: bool = False) -> ModelDirWriter:
    """The writer of an AWQ directory in ``tmp_dir`` (created; with ``resume`` it may exist,
    see :meth:`ModelDirWriter.adopt`): :class:`ModelDirWriter` in :data:`AWQ_LAYOUT`, shards
    of at most ``max_shard_bytes`` of tensor data."""
    return ModelDirWriter(tmp_dir, AWQ_LAYOUT, max_shard_bytes, resume)


def awq_config(source_config: dict, bits: int, group_size: int,
               modules_to_not_convert: list[str] | None) -> dict:
    """config.json of the output: the source config with ``torch_dtype``/``dtype`` float16
    and ``quantization_config`` = {quant_method "awq", bits, group_size, zero_point true,
    version "gemm", modules_to_not_convert} (as AutoAWQ 0.2.9 writes it; the keys vLLM's
    ``quantization/awq.py`` / ``awq_marlin.py`` and transformers 5.23 read)."""
    cfg = dict(source_config)
    cfg["torch_dtype"] = "float16"
    if "dtype" in cfg:
        cfg["dtype"] = "float16"
    cfg["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group_size,
                                  "zero_point": True, "version": "gemm",
                                  "modules_to_not_convert": modules_to_not_convert or None}
    return cfg


# --------------------------------------------------------------------------------------------
# Reader

def is_awq_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory whose config.json says ``quant_method: awq``."""
    return quantized_as(path, "awq")


def read_awq_config(path: str | Path) -> tuple[dict, int, int]:
    """(config dict, bits, group_size) of an AWQ directory. Accepts the HF keys and AutoAWQ's
    legacy names (``w_bit``, ``q_group_size``). Raises InputError naming the directory when
    config.json is unreadable or its quantization_config is not 4-bit GEMM with zero points."""
    p = Path(path)
    config, q = quantized_config(p, "awq", "AWQ")
    try:
        bits = int(q.get("bits", q.get("w_bit", 0)))
        group_size = int(q.get("group_size", q.get("q_group_size", 0)))
    except (TypeError, ValueError):
        bits, group_size = 0, 0
    version = str(q.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm" or not q.get("zero_point", False) or group_size <= 0:
        raise InputError(f"{p}: quantization_config {q} is not 4-bit GEMM with zero points and "
                         f"a positive group_size (what quantpress reads)")
    return config, bits, group_size


class AWQWeights(QuantizedWeights):
    """The tensors of an AWQ GEMM directory under HF ``.weight`` names, quantized linears
    dequantized by :func:`dequantize_gemm` on demand (the weights protocol of
    :class:`calibration.engine.StreamingModel`: ``keys()``, ``in``, ``get(name, device, dtype)``).

    Raises InputError for a directory without an AWQ config, a config other than 4-bit GEMM
    with zero points, or missing/inconsistent tensors (naming them)."""

    def __init__(self, path: str | Path):
        from quantpress.calibration.engine import SafetensorsDir

        self.path = Path(path)
        self.config, self.bits, self.group_size = read_awq_config(self.path)
        self.raw = SafetensorsDir(self.path)
        self._index("qweight", ("qzeros", "scales"))

    def dequantized(self, module: str, device="cpu") -> torch.Tensor:
        """float16 [out, in] of quantized linear ``module`` by the reference procedure."""
        qw = self.raw.get(module + ".qweight", device)
        qz = self.raw.get(module + ".qzeros", device)
        sc = self.raw.get(module + ".scales", device)
        if qw.dtype != torch.int32 or qz.dtype != torch.int32 or sc.dtype != torch.float16:
            raise InputError(f"{self.path}: '{module}' has dtypes qweight {qw.dtype}, qzeros "
                             f"{qz.dtype}, scales {sc.dtype}; expected int32, int32, float16")
        try:
            return dequantize_gemm(qw, qz, sc, self.group_size)
        except ValueError as e:
            raise InputError(f"{self.path}: '{module}': {e}") from None


def streaming_model(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
                    attn_implementation: str = "sdpa"):
    """A :class:`calibration.engine.StreamingModel` over an AWQ directory: transformers'
    decoder layers built from its config.json (without the quantization block), weights
    dequantized layer by layer from the directory."""
    return AWQWeights(path).streaming_model(device, dtype, attn_implementation)
