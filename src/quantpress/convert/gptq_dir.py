"""GPTQ checkpoint directories ("gptq" format: AutoGPTQ / GPTQModel v1,
``checkpoint_format: "gptq"``): the packer, the reference dequantization, the streaming
writer and the reader (the round-trip check and ``quantize eval``'s loader).

Layout (GPTQModel 7.7 ``gptqmodel/nn_modules/qlinear/__init__.py`` ``GPTQQuantLinear`` /
``PackableQuantLinear``, saved by ``gptqmodel/models/writer.py`` ``save_quantized``; the
same tensors AutoGPTQ wrote). Per quantized linear ``<m>`` with K = in_features,
N = out_features, b bits and G groups:

* ``<m>.qweight`` int32 [K·b/32, N]: the codes packed along the input dimension;
* ``<m>.qzeros`` int32 [G, N·b/32]: the zero points packed along the output dimension,
  stored as zero − 1 (v1's historical offset, see :func:`pack_gptq`);
* ``<m>.scales`` float16 [G, N];
* ``<m>.g_idx`` int32 [K]: the group of each input row (``i // group_size``, or any
  assignment with act-order);
* ``<m>.bias`` float16 [N] when the linear has one.

Packing: along the packed dimension every column is one little-endian bit stream; value i
(0-based) occupies bits ``[b·i, b·i + b)``, bit j of the stream being bit ``j % 32`` of
word ``j // 32``. For 2/4/8 bits word r therefore holds values ``r·32/b … r·32/b + 32/b − 1``
at bit offsets ``0, b, 2b, …``; for 3 bits 32 values fill 3 words and values 10 and 21
straddle a word boundary (AutoGPTQ's "10 | 1 | 10 | 1 | 10" layout).

Dequantization: ``W[k, n] = scales[g_idx[k], n] · (q[k, n] − zero[g_idx[k], n])``, one float16
rounding; the transformers weight is Wᵀ [N, K].

Every other tensor (embeddings, norms, lm_head, linears left unquantized) is a float16
``.weight``; ``config.json`` carries ``quantization_config`` (:func:`gptq_config`) and
``quantize_config.json`` the same block (GPTQModel writes both); the tokenizer and generation
files are copied; ``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` shards with
``model.safetensors.index.json`` past the shard size, safetensors metadata
``{"format": "pt"}``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from quantpress.convert.quant_weights import QuantizedWeights, quantized_as, quantized_config
from quantpress.convert.shards import DirLayout, ModelDirWriter, copied_source_file
from quantpress.errors import InputError

#: bit widths of the packer and the reader
BITS = (2, 3, 4, 8)
#: the GPTQModel release whose checkpoints these match
GPTQMODEL_VERSION = "7.7.0"
_WORD = 1 << 32


# --------------------------------------------------------------------------------------------
# Packer

def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or int(bits) != bits or int(bits) not in BITS:
        raise ValueError(f"bits {bits!r}: GPTQ packs 2, 3, 4 or 8 bits")
    return int(bits)


def _block(bits: int) -> tuple[int, int]:
    """(values, words) of the smallest whole packing block: 32/b values in one word for
    2/4/8 bits, 32 values in 3 words for 3 bits."""
    g = math.gcd(bits, 32)
    return 32 // g, bits // g


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2³²) → int32 with the same 32 bits (two's complement)."""
    return torch.where(u >= (1 << 31), u - _WORD, u).to(torch.int32)


def _pack_dim0(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer [R, C] of values in [0, 2^bits) → int64 words [R·bits/32, C] in [0, 2³²): each
    column one little-endian bit stream (value i at bits [bits·i, bits·i + bits)). R must be a
    multiple of the block (:func:`_block`). Memory: the output plus one [R/block, C] slice."""
    nv, nw = _block(bits)
    r, c = v.shape
    vb = v.reshape(r // nv, nv, c)
    out = torch.zeros((r // nv, nw, c), dtype=torch.int64, device=v.device)
    for j in range(nv):  # positions inside one block
        w, s = divmod(bits * j, 32)
        x = vb[:, j].to(torch.int64)
        out[:, w] |= (x << s) & (_WORD - 1)
        if s + bits > 32:  # the value's high bits continue in the next word
            out[:, w + 1] |= x >> (32 - s)
    return out.reshape(r // nv * nw, c)


def _v1_offset_word(bits: int) -> int:
    """The int32 word with a 1 in every field of a 2/4/8-bit word (0x11111111 for 4 bits)."""
    return sum(1 << (bits * j) for j in range(32 // bits))


def _integer(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"{name}: dtype {t.dtype}, expected an integer dtype")


def pack_gptq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """The stored tensors of one GPTQ v1 linear (without the ``<prefix>.`` and ``bias``).

    Inputs (one device; the outputs are on it):

    * ``codes``: integer (uint8) [K, N], the code 0 … 2^bits − 1 of input row k and output
      column n, rows in the ORIGINAL input order (act-order only changes ``g_idx``);
    * ``zeros``: integer [G, N], the integer zero point 0 … 2^bits − 1 of each group and output
      column (symmetric quantization: 2^(bits−1));
    * ``scales``: float16 [G, N];
    * ``g_idx``: integer [K], values in [0, G): the group of each input row;
    * ``bits``: 2, 3, 4 or 8.

    Returns ``qweight`` int32 [K·bits/32, N] (codes packed along the input dimension),
    ``qzeros`` int32 [G, N·bits/32] (zero − 1 packed along the output dimension),
    ``scales`` float16 [G, N] and ``g_idx`` int32 [K] (layout: the module docstring).

    The v1 offset is applied as GPTQModel 7.7 applies it when it saves a "gptq" checkpoint
    (``gptqmodel/utils/model.py`` ``convert_gptq_v2_to_v1_format_module``, after
    ``PackableQuantLinear.pack_original``/``pack_block`` packed the zeros themselves): for
    2/4/8 bits the word with a 1 in every field is subtracted from each packed word modulo 2³²;
    for 3 bits each field becomes (zero − 1) mod 8 (``gptqmodel/utils/model_dequant.py``
    ``_revert_gptq_v1_qzeros_correction``).
    Both equal zero − 1 in every field whenever every zero is ≥ 1 (always so with symmetric
    quantization). A zero of 0 (asymmetric only) borrows from the next field for 2/4/8 bits:
    GPTQModel's loader reverses it exactly, but readers that add 1 per field (vLLM's
    ``gptq_gemm`` path, AutoGPTQ) cannot represent a zero of 0 in v1 at all.

    Raises ValueError naming the tensor when a dtype, shape or value does not fit: K not a
    multiple of 32/bits (of 32 for 3 bits), N not a multiple of 32/bits (of 32 for 3 bits),
    G or N differing between the tensors, codes/zeros outside 0 … 2^bits − 1, g_idx outside
    [0, G), non-finite scales, tensors on different devices."""
    bits = _check_bits(bits)
    maxq = (1 << bits) - 1
    nv, _ = _block(bits)
    _integer(codes, "codes")
    _integer(zeros, "zeros")
    _integer(g_idx, "g_idx")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float16:
        raise ValueError(f"scales: expected a float16 tensor, got "
                         f"{getattr(scales, 'dtype', type(scales).__name__)}")
    if codes.ndim != 2:
        raise ValueError(f"codes: shape {tuple(codes.shape)}, expected [K, N]")
    k, n = codes.shape
    if k == 0 or n == 0:
        raise ValueError(f"codes: empty shape {tuple(codes.shape)}")
    if k % nv:
        raise ValueError(f"codes: K = {k} input rows (shape {tuple(codes.shape)}) is not a "
                         f"multiple of {nv}, as {bits}-bit packing along the input needs")
    if n % nv:
        raise ValueError(f"codes: N = {n} output columns (shape {tuple(codes.shape)}) is not a "
                         f"multiple of {nv}, as {bits}-bit packing of qzeros needs")
    if scales.ndim != 2 or scales.shape[1] != n or scales.shape[0] == 0:
        raise ValueError(f"scales: shape {tuple(scales.shape)}, expected [G, N] with N = {n}")
    g = scales.shape[0]
    if tuple(zeros.shape) != (g, n):
        raise ValueError(f"zeros: shape {tuple(zeros.shape)}, expected [G, N] = {(g, n)} "
                         f"(as scales)")
    if tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx: shape {tuple(g_idx.shape)}, expected [K] = ({k},)")
    devs = {t.device for t in (codes, zeros, scales, g_idx)}
    if len(devs) > 1:
        raise ValueError(f"codes, zeros, scales and g_idx are on different devices {sorted(map(str, devs))}")
    for t, name in ((codes, "codes"), (zeros, "zeros")):
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi > maxq:
            raise ValueError(f"{name}: values outside 0 … {maxq} for {bits} bits (min {lo}, max {hi})")
    z64, gi = zeros.to(torch.int64), g_idx.to(torch.int64)
    if bool((gi < 0).any()) or bool((gi >= g).any()):
        raise ValueError(f"g_idx: values outside [0, {g}) (min {int(gi.min())}, max {int(gi.max())})")
    if not bool(torch.isfinite(scales).all()):
        raise ValueError("scales: NaN or Inf")

    qweight = _to_int32(_pack_dim0(codes, bits))
    if bits == 3:
        qz = _pack_dim0(((z64 - 1) & maxq).T.contiguous(), bits).T
    else:
        qz = (_pack_dim0(z64.T.contiguous(), bits).T - _v1_offset_word(bits)) % _WORD
    return {"qweight": qweight.contiguous(), "qzeros": _to_int32(qz).contiguous(),
            "scales": scales.contiguous(), "g_idx": gi.to(torch.int32).contiguous()}


# --------------------------------------------------------------------------------------------
# Reference dequantization, written from the layout (module docstring) and independent of
# pack_gptq: each field is read by indexing the word(s) it lies in

def unpack_gptq_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] of words packed along dim 0 → int16 [R·32/bits, C]: value i of a column
    is bits [bits·i, bits·i + bits) of the column's little-endian bit stream (taken from word
    ``bits·i // 32`` and, when it straddles, the next word). R must be a multiple of
    ``bits / gcd(bits, 32)`` (3 for 3 bits). Raises ValueError otherwise."""
    bits = _check_bits(bits)
    if packed.dtype != torch.int32 or packed.ndim != 2:
        raise ValueError(f"packed: {packed.dtype} {tuple(packed.shape)}, expected int32 [R, C]")
    r = packed.shape[0]
    if (r * 32) % bits:
        raise ValueError(f"packed: {r} words per column do not hold whole {bits}-bit values")
    n_vals = r * 32 // bits
    dev = packed.device
    off = torch.arange(n_vals, device=dev, dtype=torch.int64) * bits
    word, s = off // 32, (off % 32).to(torch.int32).unsqueeze(1)  # field i: word, bit offset
    n_low = torch.clamp(32 - s, max=bits)  # bits of the field inside its first word
    low_mask = torch.bitwise_left_shift(torch.ones_like(n_low), n_low) - 1
    # arithmetic shift: the sign bits it brings in lie above n_low and are masked off
    val = torch.bitwise_right_shift(packed[word], s) & low_mask
    spill = (s + bits > 32).squeeze(1)
    if bool(spill.any()):  # 3 bits: the field's high bits are the low bits of the next word
        nxt = packed[torch.clamp(word + 1, max=r - 1)]
        high = torch.bitwise_left_shift(nxt, n_low) & ((1 << bits) - 1)
        val = torch.where(spill.unsqueeze(1), val | high, val)
    return val.to(torch.int16)


def v1_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """int16 [G, N] zero points of a v1 ``qzeros`` int32 [G, N·bits/32], as GPTQModel 7.7
    reads a "gptq" checkpoint (``gptqmodel/utils/model.py``
    ``convert_gptq_v1_to_v2_format_module``): for 2/4/8 bits the word with a 1 in every field
    is added to each packed word modulo 2³² and the fields are read; for 3 bits each field f
    gives (f + 1) mod 8 (``_correct_gptq_v1_qzeros``). Raises ValueError on a bad shape."""
    bits = _check_bits(bits)
    if qzeros.dtype != torch.int32 or qzeros.ndim != 2:
        raise ValueError(f"qzeros: {qzeros.dtype} {tuple(qzeros.shape)}, expected int32 [G, N·{bits}/32]")
    if bits == 3:
        return ((unpack_gptq_rows(qzeros.T.contiguous(), bits).T + 1) & 7).contiguous()
    word = (qzeros.to(torch.int64) & (_WORD - 1)) + _v1_offset_word(bits)
    word = _to_int32(word % _WORD)
    return unpack_gptq_rows(word.T.contiguous(), bits).T.contiguous()


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """float16 weight [N, K] (transformers' orientation) of one GPTQ v1 linear.

    ``qweight`` int32 [K·bits/32, N], ``qzeros`` int32 [G, N·bits/32] (v1: zero − 1),
    ``scales`` float16 [G, N], ``g_idx`` integer [K] with values in [0, G), ``bits`` 2/3/4/8.
    ``W[k, n] = scales[g_idx[k], n] · (q[k, n] − zero[g_idx[k], n])`` with the integer
    difference multiplied by the float16 scale in float16 (one rounding), zeros read by
    :func:`v1_zeros`, then transposed: the arithmetic of GPTQModel 7.7's torch kernel
    (``gptqmodel/nn_modules/qlinear/torch.py`` ``TorchLinear._dequantize_weight_cached_248``
    for 2/4/8 bits, ``PackableQuantLinear.dequantize_weight`` for 3 bits, both
    ``scales[g_idx] * (weight - zeros[g_idx])``; its result is [K, N]).

    Raises ValueError naming the tensor when dtypes or shapes do not fit together or g_idx
    points outside the groups."""
    bits = _check_bits(bits)
    if qweight.dtype != torch.int32 or qweight.ndim != 2:
        raise ValueError(f"qweight: {qweight.dtype} {tuple(qweight.shape)}, expected int32 [K·{bits}/32, N]")
    if scales.dtype != torch.float16 or scales.ndim != 2:
        raise ValueError(f"scales: {scales.dtype} {tuple(scales.shape)}, expected float16 [G, N]")
    _integer(g_idx, "g_idx")
    _, nw = _block(bits)
    kw, n = qweight.shape
    if kw % nw:
        raise ValueError(f"qweight: shape {tuple(qweight.shape)}: {kw} rows do not hold whole "
                         f"blocks of {bits}-bit codes (a multiple of {nw} words)")
    k = kw * 32 // bits
    g = scales.shape[0]
    if scales.shape[1] != n or g == 0:
        raise ValueError(f"scales: shape {tuple(scales.shape)}, expected [G, N] with N = {n} (qweight "
                         f"{tuple(qweight.shape)})")
    if qzeros.ndim != 2 or qzeros.shape[0] != g or qzeros.shape[1] * 32 != n * bits:
        cols = str(n * bits // 32) if (n * bits) % 32 == 0 else f"{n}·{bits}/32, not whole"
        raise ValueError(f"qzeros: shape {tuple(qzeros.shape)}, expected [G, N·{bits}/32] = "
                         f"({g}, {cols}) (scales {tuple(scales.shape)})")
    if tuple(g_idx.shape) != (k,):
        raise ValueError(f"g_idx: shape {tuple(g_idx.shape)}, expected [K] = ({k},) (qweight "
                         f"{tuple(qweight.shape)}, {bits} bits)")
    gi = g_idx.to(device=qweight.device, dtype=torch.int64)
    if bool((gi < 0).any()) or bool((gi >= g).any()):
        raise ValueError(f"g_idx: values outside [0, {g}) (min {int(gi.min())}, max {int(gi.max())})")
    q = unpack_gptq_rows(qweight, bits)  # [K, N]
    z = v1_zeros(qzeros, bits)  # [G, N]
    w_kn = scales[gi] * (q - z[gi]).to(torch.float16)
    return w_kn.T.contiguous()


# --------------------------------------------------------------------------------------------
# Writer

#: ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` + ``model.safetensors.index.json``,
#: safetensors metadata {"format": "pt"} (GPTQModel 7.7 ``models/writer.py`` sets it on every
#: shard), config.json with indent 2, the tokenizer and other non-weight files copied (not
#: dotfiles, weights, indexes, quantize configs)
GPTQ_LAYOUT = DirLayout("model", {"format": "pt"}, index=True, config_indent=2, config_newline=True,
                        copied=copied_source_file, keep_file_metadata=True)


class GPTQDirWriter(ModelDirWriter):
    """:class:`ModelDirWriter` for GPTQ directories: :meth:`finish` completes the
    ``quantization_config`` from the tensors written and also writes ``quantize_config.json``."""

    def finish(self, config: dict, source_dir: str | Path) -> list[Path]:
        """:meth:`ModelDirWriter.finish` with ``config`` (from :func:`gptq_config`; not
        modified), then ``quantize_config.json`` (the ``quantization_config`` block alone,
        indent 2, as GPTQModel and AutoGPTQ write it; GPTQModel's
        ``QuantizeConfig.from_pretrained`` reads it first, vLLM when config.json has no block).

        When the block declares linears left unquantized (negative ``dynamic`` rules), it gains
        ``modules_in_block_to_quantize`` = [[full name of every linear with a ``qweight``
        written here]]: transformers 5.23 loads GPTQ through optimum's ``GPTQQuantizer``
        (``optimum/gptq/quantizer.py`` ``convert_model``), which ignores ``dynamic`` and would
        otherwise build a quantized module, with uninitialized tensors, for every linear of the
        decoder blocks; it keeps the linears whose name ends with a listed entry. vLLM reads the
        key too (``gptq_utils.is_layer_gptq_quantized``: substring match), GPTQModel ignores it.

        Raises ValueError when ``config`` has no ``quantization_config`` dict."""
        q = config.get("quantization_config") if isinstance(config, dict) else None
        if not isinstance(q, dict):
            raise ValueError("config has no quantization_config (build it with gptq_config)")
        dyn = q.get("dynamic") or {}
        if any(str(k).startswith("-:") for k in dyn):
            quantized = sorted(k[: -len(".qweight")] for k in self.sizes if k.endswith(".qweight"))
            q = {**q, "modules_in_block_to_quantize": [quantized]}
            config = {**config, "quantization_config": q}
        paths = super().finish(config, source_dir)
        (self.dir / "quantize_config.json").write_text(json.dumps(q, indent=2) + "\n")
        return paths


def dir_writer(tmp_dir: Path, max_shard_bytes: int = 5 * 10 ** 9, resume: bool = False) -> ModelDirWriter:
    """The writer of a GPTQ directory in ``tmp_dir`` (created; with ``resume`` it may exist,
    see :meth:`ModelDirWriter.adopt`): :class:`GPTQDirWriter` in :data:`GPTQ_LAYOUT`, shards of
    at most ``max_shard_bytes`` of tensor data."""
    return GPTQDirWriter(tmp_dir, GPTQ_LAYOUT, max_shard_bytes, resume)


def skip_pattern(module: str) -> str:
    """The ``dynamic`` key that excludes exactly module ``module`` (full name, e.g.
    ``model.layers.0.mlp.down_proj``) from quantization: ``-:`` + an anchored, escaped regex."""
    return "-:^" + re.escape(module) + "$"


def gptq_config(source_config: dict, *, bits: int, group_size: int, desc_act: bool, sym: bool,
                damp_percent: float, true_sequential: bool,
                modules_not_quantized: list[str] | None = None,
                static_groups: bool = False) -> dict:
    """config.json of the output: the source config with ``torch_dtype``/``dtype`` float16
    and ``quantization_config`` holding the keys GPTQModel 7.7 writes
    (``gptqmodel/quantization/config.py`` ``QuantizeConfig.to_dict`` plus the ``meta`` entries
    of ``models/writer.py`` ``save_quantized``):

    * ``quant_method``/``method`` "gptq", ``format``/``checkpoint_format`` "gptq" (v1 zeros),
      ``bits``, ``group_size`` (−1: one group per column), ``desc_act``, ``sym``,
      ``lm_head`` false, ``pack_dtype`` "int32";
    * ``damp_percent``, ``true_sequential``, ``static_groups`` at the top level (AutoGPTQ's
      and transformers' ``GPTQConfig`` names) and in ``meta`` (where GPTQModel 7.7 keeps them),
      ``meta.quantizer`` ["quantpress:<version>"] ("name:version" entries); for ``sym: false``
      ["gptqmodel:7.7.0", "quantpress:<version>"], as GPTQModel's writer lists itself then the
      caller's quantizer: that entry declares the tensor layout, not the quantizer —
      :func:`pack_gptq` writes GPTQModel 7.7's v1 bytes (the zero − 1 borrow included), and
      GPTQModel's loader (``models/loader.py``) refuses a ``sym: false`` "gptq" checkpoint
      unless ``meta.quantizer`` names gptqmodel ≥ 0.9.0, because older AutoGPTQ asymmetric v1
      checkpoints stored zeros of 0 differently;
    * ``dynamic``: {:func:`skip_pattern` (module): {}} for each of ``modules_not_quantized``
      (full module names), the negative rules with which GPTQModel (``dynamic_get`` →
      False: no quantized module built) and vLLM (``gptq_utils.get_dynamic_override``) leave a
      linear unquantized; omitted when there are none (GPTQModel drops an empty ``dynamic``).

    Raises ValueError for bits outside 2/3/4/8, a group_size that is neither −1 nor positive,
    or damp_percent outside (0, 1)."""
    from quantpress import __version__

    bits = _check_bits(bits)
    if isinstance(group_size, bool) or int(group_size) != group_size or \
            (int(group_size) != -1 and int(group_size) <= 0):
        raise ValueError(f"group_size {group_size!r}: expected -1 or a positive integer")
    if not 0 < float(damp_percent) < 1:
        raise ValueError(f"damp_percent {damp_percent!r}: expected a value in (0, 1)")
    cfg = dict(source_config)
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float16"
    if "dtype" in cfg:
        cfg["dtype"] = "float16"
    q = {
        "bits": bits,
        "group_size": int(group_size),
        "desc_act": bool(desc_act),
        "sym": bool(sym),
        "lm_head": False,
        "method": "gptq",
        "quant_method": "gptq",
        "format": "gptq",
        "checkpoint_format": "gptq",
        "pack_dtype": "int32",
        "damp_percent": float(damp_percent),
        "true_sequential": bool(true_sequential),
        "static_groups": bool(static_groups),
    }
    skip = list(dict.fromkeys(modules_not_quantized or []))
    if skip:
        q["dynamic"] = {skip_pattern(m): {} for m in skip}
    layout = [] if sym else [f"gptqmodel:{GPTQMODEL_VERSION}"]
    q["meta"] = {"quantizer": [*layout, f"quantpress:{__version__}"],
                 "damp_percent": float(damp_percent),
                 "static_groups": bool(static_groups),
                 "true_sequential": bool(true_sequential)}
    cfg["quantization_config"] = q
    return cfg


# --------------------------------------------------------------------------------------------
# Reader

def is_gptq_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory whose config.json says ``quant_method: gptq``."""
    return quantized_as(path, "gptq")


def _read_config(path: Path) -> tuple[dict, dict]:
    """(config dict, its validated quantization_config) of a GPTQ v1 directory."""
    config, q = quantized_config(path, "gptq", "GPTQ")
    fmt = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
    try:
        bits, group_size = int(q.get("bits", 0)), int(q.get("group_size", 0))
    except (TypeError, ValueError):
        bits, group_size = 0, 0
    if fmt != "gptq" or bits not in BITS or not (group_size == -1 or group_size > 0):
        raise InputError(f"{path}: quantization_config {q} is not a GPTQ v1 (checkpoint_format "
                         f"gptq) block with bits 2/3/4/8 and group_size -1 or positive "
                         f"(what quantpress reads)")
    dyn = q.get("dynamic") or {}
    if not isinstance(dyn, dict) or any(not str(k).startswith("-:") and isinstance(v, dict) and "bits" in v
                                        for k, v in dyn.items()):
        raise InputError(f"{path}: quantization_config dynamic {dyn} overrides bits per module "
                         f"(quantpress reads one bit width)")
    return config, q


def read_gptq_config(path: str | Path) -> dict:
    """The ``quantization_config`` block of a GPTQ v1 directory's config.json (``bits``,
    ``group_size``, ``desc_act``, ``sym``, … as written). Raises InputError naming the
    directory when config.json is unreadable, has no GPTQ block, or the block is not what
    quantpress reads: ``checkpoint_format`` (or ``format``) "gptq" (absent counts as "gptq",
    as AutoGPTQ wrote none; "gptq_v2" stores other zeros), bits 2/3/4/8, group_size −1 or
    positive, no ``dynamic`` rule that changes bits (negative ``-:`` rules are fine)."""
    return _read_config(Path(path))[1]


class GPTQWeights(QuantizedWeights):
    """The tensors of a GPTQ v1 directory under HF ``.weight`` names, quantized linears
    dequantized by :func:`dequantize_gptq` on demand (the weights protocol of
    :class:`calibration.engine.StreamingModel`: ``keys()``, ``in``, ``get(name, device, dtype)``);
    ``raw``: the stored tensors by checkpoint name, shards opened lazily with safetensors.

    Raises InputError for a directory without a GPTQ v1 config or a quantized linear missing
    ``qzeros``/``scales``/``g_idx`` (naming it); :meth:`dequantized` raises InputError naming
    the module when its tensors have wrong dtypes or shapes."""

    def __init__(self, path: str | Path):
        from quantpress.calibration.engine import SafetensorsDir

        self.path = Path(path)
        self.config, q = _read_config(self.path)
        self.bits, self.group_size = int(q["bits"]), int(q["group_size"])
        self.desc_act, self.sym = bool(q.get("desc_act", False)), bool(q.get("sym", True))
        self.raw = SafetensorsDir(self.path)
        self._index("qweight", ("qzeros", "scales", "g_idx"))

    def dequantized(self, module: str, device="cpu") -> torch.Tensor:
        """float16 [out, in] of quantized linear ``module`` by the reference procedure."""
        qw = self.raw.get(module + ".qweight", device)
        qz = self.raw.get(module + ".qzeros", device)
        sc = self.raw.get(module + ".scales", device)
        gi = self.raw.get(module + ".g_idx", device)
        if qw.dtype != torch.int32 or qz.dtype != torch.int32 or sc.dtype != torch.float16 \
                or gi.dtype != torch.int32:
            raise InputError(f"{self.path}: '{module}' has dtypes qweight {qw.dtype}, qzeros "
                             f"{qz.dtype}, scales {sc.dtype}, g_idx {gi.dtype}; expected int32, "
                             f"int32, float16, int32")
        try:
            return dequantize_gptq(qw, qz, sc, gi, self.bits)
        except ValueError as e:
            raise InputError(f"{self.path}: '{module}': {e}") from None

    def close(self) -> None:
        """Drop the open shard handles (and their memory maps)."""
        self.raw.close()


def streaming_model(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
                    attn_implementation: str = "sdpa"):
    """A :class:`calibration.engine.StreamingModel` over a GPTQ directory: transformers'
    decoder layers built from its config.json (without the quantization block), weights
    dequantized layer by layer from the directory."""
    return GPTQWeights(path).streaming_model(device, dtype, attn_implementation)
