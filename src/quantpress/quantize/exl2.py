"""EXL2 (ExLlamaV2 0.3.2) codec: quantization parameters, bit costs, tensor packing, a
pure-torch reconstruction and the CUDA kernel's layout constraints (exllamav2 0.3.2
``conversion/qparams.py``, ``exllamav2_ext/cuda/pack_tensor.cu`` and ``q_matrix.cu``,
``conversion/compile.py``; the reconstruction is a pure-torch equivalent of
``ExLlamaV2Linear.get_weight_tensor_dq``).

Conventions (exllamav2's): a linear's weight is ``[N, K]`` (out_features, in_features); the
quantizer works on its transpose, rows = the K inputs in act-order, columns = the N outputs.

Tensors of one quantized linear (prefix = module key, e.g. ``model.layers.0.mlp.up_proj``):

============  =======  ==========================  ===========================================
name          dtype    shape                       content
============  =======  ==========================  ===========================================
q_weight      int32    (packed rows, N_pad)        per column, each group a little-endian
                                                   bitstream of b-bit codes (value j at bit j·b)
q_scale       int32    (G, N_pad / 8)              4-bit scale codes ``qs - 1``, nibble i of
                                                   word c = column 8c + i
q_scale_max   float16  (G,)                        group max scale (without the 1/256)
q_groups      int16    (2G,)                       [b_0, off_0, b_1, off_1, ...]; off_g = first
                                                   packed row of group g
q_invperm     int32    (K,)                        argsort(perm) of the act-order permutation
============  =======  ==========================  ===========================================

N_pad is N rounded up to a multiple of 32. Dequantized value of stored code v in group g,
column n: ``fp16(v - 2^(b-1)) * fp16(fp16(qs^2) * fp16(q_scale_max[g] * 2^-8))``, all in fp16.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

#: Bit widths the EXL2 kernel has a dequantizer for, in the order it walks them along K.
KERNEL_BITS = (8, 6, 5, 4, 3, 2)
#: Largest in_features the loader accepts (q_perm is held as uint16 on the GPU).
MAX_IN_FEATURES = 65535
#: Largest packed-row offset a q_groups entry holds (int16 on disk).
MAX_GROUP_OFFSET = 32767
#: Output columns are padded to a multiple of this (exllamav2 ``pad32``).
COLUMN_PAD = 32
#: output columns packed at a time by :func:`pack` (a multiple of COLUMN_PAD)
PACK_COLUMNS = 4096

_U32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Quantization parameters and bit cost (exllamav2 0.3.2 `conversion/qparams.py` `QParams`)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Group:
    """One quantization group: input rows ``[start, end)`` (act-order) at ``bits`` bits."""

    bits: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, init=False)
class QParams:
    """Quantization parameters of one linear (exllamav2 0.3.2 ``conversion/qparams.py`` QParams).

    ``bits``: bit widths in strictly descending order, each in {8, 6, 5, 4, 3, 2}.
    ``bits_prop``: fraction of the input rows K given to each width (same order).
    ``group_size``: rows per group, one per width (tuple aligned with ``bits``); the
    constructor also takes a single int, a list aligned with ``bits``, or a dict bits -> size
    (keys may be strings, as in measurement.json).
    ``scale_bits``: bits of the per-column scale code; exllamav2 supports only 4.

    Frozen and hashable, so equal settings can be de-duplicated with a set.
    """

    bits: tuple[int, ...]
    bits_prop: tuple[float, ...]
    group_size: tuple[int, ...]
    scale_bits: int

    def __init__(self, group_size: int | Sequence[int] | Mapping, bits: Sequence[int],
                 bits_prop: Sequence[float], scale_bits: int = 4):
        bits_t = tuple(int(b) for b in bits)
        prop_t = tuple(float(p) for p in bits_prop)
        if not bits_t:
            raise ValueError("QParams: bits is empty")
        bad = [b for b in bits_t if b not in KERNEL_BITS]
        if bad:
            raise ValueError(f"QParams: bit width(s) {bad} not supported; EXL2 has {sorted(KERNEL_BITS)}")
        if any(b1 <= b2 for b1, b2 in zip(bits_t, bits_t[1:])):
            raise ValueError(f"QParams: bits {list(bits_t)} must be strictly descending")
        if len(prop_t) != len(bits_t):
            raise ValueError(f"QParams: {len(prop_t)} bits_prop for {len(bits_t)} bit widths")
        if any(not (0.0 < p <= 1.0) for p in prop_t):
            raise ValueError(f"QParams: bits_prop {list(prop_t)} must each be in (0, 1]")
        if isinstance(group_size, Mapping):
            gmap = {int(b): int(g) for b, g in group_size.items()}
            if set(gmap) != set(bits_t):
                raise ValueError(f"QParams: group_size keys {sorted(gmap)} differ from bits {list(bits_t)}")
            gs_t = tuple(gmap[b] for b in bits_t)
        elif isinstance(group_size, numbers.Integral) and not isinstance(group_size, bool):
            gs_t = (int(group_size),) * len(bits_t)
        else:
            gs_t = tuple(int(g) for g in group_size)
            if len(gs_t) != len(bits_t):
                raise ValueError(f"QParams: {len(gs_t)} group sizes for {len(bits_t)} bit widths")
        if any(g <= 0 for g in gs_t):
            raise ValueError(f"QParams: group sizes {list(gs_t)} must be positive")
        if scale_bits != 4:
            raise ValueError(f"QParams: scale_bits={scale_bits}; EXL2 supports only 4")
        object.__setattr__(self, "bits", bits_t)
        object.__setattr__(self, "bits_prop", prop_t)
        object.__setattr__(self, "group_size", gs_t)
        object.__setattr__(self, "scale_bits", int(scale_bits))

    # -- serialisation (measurement.json, as exllamav2 0.3.2 `conversion/measure.py` writes it) --

    def as_dict(self) -> dict:
        """measurement.json form: ``{"group_size": {"3": 64, ...}, "bits": [...],
        "bits_prop": [...], "scale_bits": 4}`` (group_size keys are strings, as JSON needs)."""
        return {"group_size": {str(b): g for b, g in zip(self.bits, self.group_size)},
                "bits": list(self.bits), "bits_prop": list(self.bits_prop),
                "scale_bits": self.scale_bits}

    @classmethod
    def from_dict(cls, d: Mapping) -> "QParams":
        """Inverse of :meth:`as_dict` (also reads exllamav2's own measurement.json entries)."""
        try:
            return cls(d["group_size"], d["bits"], d["bits_prop"], d.get("scale_bits", 4))
        except KeyError as e:
            raise ValueError(f"QParams: missing key {e.args[0]!r} in {dict(d)!r}") from None

    def __str__(self) -> str:
        """Compact notation, e.g. ``4/3 (.1/.9) g128`` or ``8/4 (.05/.95) g32/128``."""
        def frac(p: float) -> str:
            s = f"{p:g}"
            return s[1:] if s.startswith("0.") else s
        b = "/".join(str(x) for x in self.bits)
        g = (str(self.group_size[0]) if len(set(self.group_size)) == 1
             else "/".join(str(x) for x in self.group_size))
        if len(self.bits) == 1:
            return f"{b} g{g}"
        return f"{b} ({'/'.join(frac(p) for p in self.bits_prop)}) g{g}"

    # -- row allocation (exllamav2 0.3.2 `QParams.total_bits`) -----------------------------

    def group_counts(self, in_features: int) -> tuple[int, ...]:
        """Number of groups per bit width for ``in_features`` = K input rows.

        Row allocation of exllamav2 0.3.2 ``QParams.total_bits`` / ``AdaptiveGPTQ.configure``:
        ``rem = K``; for each (b, p) in order ``n_b = ceil(min(K*p, rem) / gs_b)``,
        ``rem -= n_b*gs_b``; ``rem <= 0`` at the end (the last group may be partial).
        Raises ValueError when K < 1, when rows are left over (bits_prop sums below 1) or when
        a width would get a negative number of groups.
        """
        K = int(in_features)
        if K < 1:
            raise ValueError(f"QParams {self}: in_features must be >= 1, got {in_features}")
        rem = K
        counts = []
        for b, p, gs in zip(self.bits, self.bits_prop, self.group_size):
            n = math.ceil(min(K * p, rem) / gs)
            if n < 0:
                raise ValueError(f"QParams {self}: {b}-bit width gets {n} groups for K={K} "
                                 f"(earlier widths overran K by {-rem} rows)")
            rem -= n * gs
            counts.append(n)
        if rem > 0:
            raise ValueError(f"QParams {self}: {rem} of K={K} input rows left unallocated "
                             f"(bits_prop sums to {sum(self.bits_prop):g})")
        return tuple(counts)

    def groups(self, in_features: int) -> list[Group]:
        """The groups along K in order: list of :class:`Group` (bits, start, end); every group
        has ``gs_b`` rows except the last, which ends at K. See :meth:`group_counts`."""
        K = int(in_features)
        out: list[Group] = []
        a = 0
        for b, gs, n in zip(self.bits, self.group_size, self.group_counts(K)):
            for _ in range(n):
                e = min(a + gs, K)
                out.append(Group(b, a, e))
                a = e
        return out


def bits_cost(qp: QParams, in_features: int, out_features: int, bias: bool = False) -> int:
    """Total stored bits of one linear quantized with ``qp`` (exllamav2 0.3.2
    ``QParams.total_bits``; the ``total_bits`` of measurement.json sums it over a module).

    K = in_features, N = out_features, G = total groups::

        Σ_g rows_g·N·b_g + 16·G (q_scale_max) + 32·G (q_groups) + 4·G·N (q_scale)
        + 32·K (q_invperm) [+ 16·N (fp16 bias)]

    N is the unpadded width, as upstream counts it. Returns an int (bits).
    """
    K, N = int(in_features), int(out_features)
    if N < 1:
        raise ValueError(f"bits_cost: out_features must be >= 1, got {out_features}")
    groups = qp.groups(K)
    G = len(groups)
    total = sum(g.rows * N * g.bits for g in groups)
    total += 16 * G + 32 * G + qp.scale_bits * G * N + 32 * K
    if bias:
        total += 16 * N
    return total


def bpw(qp: QParams, in_features: int, out_features: int, bias: bool = False) -> float:
    """Bits per weight: :func:`bits_cost` / (K·N) (exllamav2 0.3.2 ``QParams.total_bits`` /
    (K·N); the bias bits, if any, count as overhead of the K·N weights)."""
    return bits_cost(qp, in_features, out_features, bias) / (int(in_features) * int(out_features))


# ---------------------------------------------------------------------------------------------
# Candidate options (configs/exl2_options.toml, data from exllamav2 0.3.2 qparams.py)
# ---------------------------------------------------------------------------------------------

_OPTIONS_FILE = "exl2_options.toml"


def _qp_of(entry: Mapping) -> QParams:
    return QParams(entry["group_size"], entry["bits"], entry["bits_prop"], entry.get("scale_bits", 4))


def _load_options() -> dict:
    from quantpress.configs import load_toml  # data package; no code dependency beyond reading TOML

    return load_toml(_OPTIONS_FILE)


def attn_options() -> list[dict[str, QParams]]:
    """The 19 attention candidates of exllamav2 0.3.2 (``qparams_attn``), in measurement
    order: each a dict {"q_proj", "k_proj", "v_proj", "o_proj"} -> QParams."""
    return [{name: _qp_of(e) for name, e in opt.items()} for opt in _load_options()["attn"]]


def mlp_options() -> list[dict[str, QParams]]:
    """The 17 MLP candidates of exllamav2 0.3.2 (``qparams_mlp``), in measurement order: each a
    dict {"gate_proj", "up_proj", "down_proj"} -> QParams (MoE experts map w1/w3/w2 onto
    gate/up/down)."""
    return [{name: _qp_of(e) for name, e in opt.items()} for opt in _load_options()["mlp"]]


def head_options(head_bits: int) -> QParams:
    """QParams of the output head for ``--head-bits`` in {2, 3, 4, 5, 6, 8} (exllamav2 0.3.2
    ``qparams_headoptions``; the head is never measured)."""
    table = _load_options()["head"]
    key = str(int(head_bits))
    if key not in table:
        raise ValueError(f"head bits {head_bits} not supported; choose one of "
                         f"{sorted(int(k) for k in table)}")
    return _qp_of(table[key])


# ---------------------------------------------------------------------------------------------
# Packing (exllamav2 0.3.2 `exllamav2_ext/cuda/pack_tensor.cu`)
# ---------------------------------------------------------------------------------------------

def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 holding uint32 bit patterns -> int32 with the same bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _as_uint32(x: torch.Tensor) -> torch.Tensor:
    """int32 (any signed int) bit patterns -> int64 in [0, 2^32)."""
    return x.to(torch.int64) & _U32


def pack(qweight: torch.Tensor, qscale: torch.Tensor, qscale_max: torch.Tensor,
         invperm: torch.Tensor, qp: QParams, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Pack one quantized linear into EXL2 tensors (exllamav2 0.3.2 ``AdaptiveGPTQ.pack`` with
    ``pack_rows_4`` and ``pack_columns`` of ``cuda/pack_tensor.cu``).

    Inputs (any device; outputs stay there):
      ``qweight``   integer [K, N]: stored codes 0..2^b-1 of the act-order rows;
      ``qscale``    integer [G, N]: square-law scale codes 1..16 (stored as qs - 1);
      ``qscale_max`` float [G]: stored as fp16;
      ``invperm``   integer [K]: argsort of the act-order permutation;
      ``qp``        the QParams the codes were made with (gives the groups);
      ``bias``      optional [N], stored as fp16.

    Returns {"q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm"[, "bias"]} with the
    dtypes and shapes of the module docstring. Columns are padded to N_pad = 32·ceil(N/32)
    with code 2^(b-1) and scale code 0 (weight 0). Each group's codes form one little-endian
    bitstream per column starting at a fresh int32 row; a group that is not the last must
    fill whole words (rows·b divisible by 32), else ValueError.
    """
    if qweight.dim() != 2:
        raise ValueError(f"pack: qweight must be 2-D [K, N], got shape {tuple(qweight.shape)}")
    K, N = qweight.shape
    dev = qweight.device
    groups = qp.groups(K)
    G = len(groups)
    if tuple(qscale.shape) != (G, N):
        raise ValueError(f"pack: qscale shape {tuple(qscale.shape)}, expected ({G}, {N}) for {qp} at K={K}")
    if tuple(qscale_max.shape) != (G,):
        raise ValueError(f"pack: qscale_max shape {tuple(qscale_max.shape)}, expected ({G},)")
    if tuple(invperm.shape) != (K,):
        raise ValueError(f"pack: invperm shape {tuple(invperm.shape)}, expected ({K},)")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"pack: bias shape {tuple(bias.shape)}, expected ({N},)")

    g_bits = torch.tensor([g.bits for g in groups], dtype=torch.int64, device=dev)
    g_start = torch.tensor([g.start for g in groups], dtype=torch.int64, device=dev)
    g_rows = torch.tensor([g.rows for g in groups], dtype=torch.int64, device=dev)
    g_words = (g_rows * g_bits + 31) // 32
    partial = (g_rows * g_bits) % 32 != 0
    if bool(partial[:-1].any()):
        g = int(torch.nonzero(partial[:-1])[0])
        raise ValueError(f"pack: group {g} ({groups[g].rows} rows at {groups[g].bits} bits) does "
                         f"not fill whole 32-bit words; only the last group may")
    g_off = torch.cumsum(g_words, 0) - g_words
    n_words = int(g_words.sum())
    if G and int(g_off[-1]) > MAX_GROUP_OFFSET:
        raise ValueError(f"pack: packed-row offset {int(g_off[-1])} does not fit int16 (K={K} too large)")

    # Per-row bit width and position of the code in the packed stream.
    row_group = torch.repeat_interleave(torch.arange(G, device=dev), g_rows)
    row_bits = g_bits[row_group]
    bitpos = (torch.arange(K, device=dev) - g_start[row_group]) * row_bits + g_off[row_group] * 32
    word, shift = bitpos // 32, bitpos % 32

    maxq = (1 << row_bits) - 1
    sc = qscale.to(torch.int64)
    if bool(((sc < 1) | (sc > 16)).any()):
        raise ValueError("pack: qscale codes must be in 1..16")

    n_pad = -N % COLUMN_PAD
    parts = []
    for c0 in range(0, N, PACK_COLUMNS):  # columns pack independently: bounded int64 temporaries
        c1 = min(N, c0 + PACK_COLUMNS)
        codes = qweight[:, c0:c1].to(torch.int64)
        if bool(((codes < 0) | (codes > maxq[:, None])).any()):
            raise ValueError("pack: qweight holds codes outside 0..2^b-1 for their group's bit width")
        if c1 == N and n_pad:
            fill = (1 << (row_bits - 1))[:, None].expand(K, n_pad)
            codes = torch.cat([codes, fill], dim=1)
        shifted = codes << shift[:, None]           # < 2^39: fits int64
        del codes
        acc = torch.zeros((n_words + 1, shifted.shape[1]), dtype=torch.int64, device=dev)
        acc.index_add_(0, word, shifted & _U32)     # disjoint bit fields: add == or
        acc.index_add_(0, word + 1, shifted >> 32)  # the part that crosses into the next word
        del shifted
        parts.append(_to_int32(acc[:n_words]))
        del acc
    q_weight = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    nib = torch.nn.functional.pad(sc - 1, (0, n_pad))             # padded columns: code 0
    nib = nib.view(G, (N + n_pad) // 8, 8) << (4 * torch.arange(8, device=dev))
    q_scale = _to_int32(nib.sum(-1))

    q_groups = torch.stack([g_bits, g_off], 1).reshape(-1).to(torch.int16)
    out = {"q_weight": q_weight, "q_scale": q_scale,
           "q_scale_max": qscale_max.to(torch.float16).contiguous(),
           "q_groups": q_groups, "q_invperm": invperm.to(torch.int32).contiguous()}
    if bias is not None:
        out["bias"] = bias.to(torch.float16).contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# Reconstruction: the round-trip reference, written from the file layout only (a pure-torch
# equivalent of exllamav2 0.3.2 `ExLlamaV2Linear.get_weight_tensor_dq`)
# ---------------------------------------------------------------------------------------------

def _fp16_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IEEE fp16 multiply of fp16-representable operands: the float32 product of two fp16
    numbers is exact (11+11 significant bits, exponents within float32's normal range), so
    one rounding to fp16 (round-to-nearest-even, subnormals included) is the fp16 result."""
    return (a.to(torch.float32) * b.to(torch.float32)).to(torch.float16)


#: Weights per column chunk of :func:`reconstruct` (its int64 temporaries: about 4 of this many
#: elements, 8 bytes each)
RECONSTRUCT_ELEMENTS = 1 << 21


def reconstruct(q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor,
                q_groups: torch.Tensor, q_invperm: torch.Tensor, out_features: int) -> torch.Tensor:
    """Dequantize EXL2 tensors to the fp16 weight [out_features, K] (K = len(q_invperm)).

    Pure torch, on the tensors' device, from the stored layout alone (equivalent to exllamav2
    0.3.2 ``ExLlamaV2Linear.get_weight_tensor_dq``; the arithmetic of its
    ``cuda/q_matrix.cu`` ``reconstruct_kernel`` with
    ``dq_scale`` and ``ExLlamaV2Linear``'s ``q_scale_max / 256``):

    * scale[g, n] = fp16((c+1)²) × fp16(q_scale_max[g] × 2⁻⁸), c = nibble n%8 of
      q_scale[g, n//8]; fp16 multiplies;
    * group g (b = q_groups[2g]) spans packed rows q_groups[2g+1] to the next offset (the last
      group to the end) and holds n_words·32/b rows (the last: the rows left of K); value j
      sits at bit j·b of the column's little-endian stream;
    * W'[row] = fp16(v - 2^(b-1)) × scale[g] (fp16 multiply); weight = W'[q_invperm].T[:N].

    Works through the columns in chunks of about :data:`RECONSTRUCT_ELEMENTS` weights, so its
    working memory is a few such chunks beside the fp16 result, whatever N. The bias is not
    added. Raises ValueError when the tensors are inconsistent.
    """
    dev = q_weight.device
    K = int(q_invperm.numel())
    if q_weight.dim() != 2 or q_scale.dim() != 2:
        raise ValueError("reconstruct: q_weight and q_scale must be 2-D")
    n_words, n_cols = q_weight.shape
    G = q_groups.numel() // 2
    if G < 1 or q_groups.numel() != 2 * G:
        raise ValueError(f"reconstruct: q_groups has {q_groups.numel()} entries; expected 2 per group")
    if q_scale.shape[0] != G or q_scale.shape[1] * 8 != n_cols or q_scale_max.numel() != G:
        raise ValueError(f"reconstruct: q_scale {tuple(q_scale.shape)} / q_scale_max "
                         f"{tuple(q_scale_max.shape)} do not match {G} groups of {n_cols} columns")
    if not 1 <= out_features <= n_cols:
        raise ValueError(f"reconstruct: out_features {out_features} not in 1..{n_cols}")

    qg = q_groups.to(torch.int64).view(G, 2) & 0xFFFF       # the loader reads them as uint16
    bits, off = qg[:, 0], qg[:, 1]
    words = torch.diff(off, append=torch.tensor([n_words], device=dev))
    rows = words * 32 // bits
    rows[-1] = K - rows[:-1].sum()
    if bool((rows <= 0).any()) or bool((words[:-1] * 32 % bits[:-1] != 0).any()):
        raise ValueError("reconstruct: q_groups offsets do not describe whole groups of K rows")

    # Per row: its group, bit width, first word and bit offset in the column's stream.
    row_group = torch.repeat_interleave(torch.arange(G, device=dev), rows)
    row_start = torch.cumsum(rows, 0) - rows
    b = bits[row_group]
    j = torch.arange(K, device=dev) - row_start[row_group]
    w = off[row_group] + (j * b) // 32
    o = (j * b) % 32
    mask = ((1 << b) - 1)[:, None]
    zero = (1 << (b - 1))[:, None]
    smax = (q_scale_max.to(torch.float32) * 2.0**-8).to(torch.float16)  # exact product, one rounding
    invperm = q_invperm.to(torch.int64)
    shifts = 4 * torch.arange(8, device=dev)
    pad = torch.zeros((1, 1), dtype=torch.int64, device=dev)

    # Columns a chunk at a time (a multiple of 8: one q_scale word holds 8 columns' scales),
    # so the int64 temporaries stay near RECONSTRUCT_ELEMENTS elements whatever the width
    # (a 49,152-column head at K = 576 would otherwise hold about 1 GB of them); only the
    # first out_features columns are made. Each column's arithmetic is the same either way.
    out = torch.empty((out_features, K), dtype=torch.float16, device=dev)
    step = max(8, RECONSTRUCT_ELEMENTS // max(1, K) // 8 * 8)
    for c0 in range(0, out_features, step):
        c1 = min(out_features, c0 + step)
        ce = min(n_cols, -(-c1 // 8) * 8)
        qw = _as_uint32(q_weight[:, c0:ce])
        qw = torch.cat([qw, pad.expand(1, ce - c0)])
        pair = qw[w] | (qw[w + 1] << 32)
        v = (pair >> o[:, None]) & mask                                   # [K, columns]
        nib = (_as_uint32(q_scale[:, c0 // 8:ce // 8])[:, :, None] >> shifts) & 15
        c = nib.reshape(G, ce - c0)
        scale = _fp16_mul(((c + 1) ** 2).to(torch.float16), smax[:, None])  # [G, columns] fp16
        wp = _fp16_mul((v - zero).to(torch.float16), scale[row_group])
        out[c0:c1] = wp[invperm].T[:c1 - c0]
    return out


# ---------------------------------------------------------------------------------------------
# Kernel constraints (exllamav2 0.3.2 `exllamav2_ext/cuda/q_matrix.cu`, `ExLlamaV2Linear.load`)
# ---------------------------------------------------------------------------------------------

def check_kernel_constraints(q_weight: torch.Tensor, q_scale: torch.Tensor, q_scale_max: torch.Tensor,
                             q_groups: torch.Tensor, q_invperm: torch.Tensor) -> None:
    """Raise ValueError naming the first problem that would stop exllamav2 0.3.2's CUDA kernel
    (``q_matrix.cu`` QMatrix / reconstruct_kernel, ``ExLlamaV2Linear.load``) from using these
    tensors; return None when they are usable.

    Checks: dtypes (int32, int32, float16, int16, int32); N_pad = q_weight.shape[1] a multiple
    of 32 and ``q_scale.shape[1]*8 == N_pad``; ``len(q_scale_max) == q_scale.shape[0] ==
    len(q_groups)/2``; bit widths in {8,6,5,4,3,2} and non-increasing along K; offsets start
    at 0, increase, fit int16 and end inside q_weight; every group but the last fills whole
    words; group boundaries at multiples of 32 rows (16 inside the 2-bit segment); K a multiple
    of 32 (16 when the last segment is 2-bit: the kernel walks K in those steps); K ≤ 65535;
    q_invperm a permutation of 0..K-1; the last group's packed rows equal ceil(rows·b/32).
    """
    expect = {"q_weight": (q_weight, torch.int32), "q_scale": (q_scale, torch.int32),
              "q_scale_max": (q_scale_max, torch.float16), "q_groups": (q_groups, torch.int16),
              "q_invperm": (q_invperm, torch.int32)}
    for name, (t, dt) in expect.items():
        if t.dtype != dt:
            raise ValueError(f"{name}: dtype {t.dtype}, the kernel needs {dt}")
    if q_weight.dim() != 2 or q_scale.dim() != 2:
        raise ValueError(f"q_weight / q_scale must be 2-D, got {tuple(q_weight.shape)} / {tuple(q_scale.shape)}")
    n_words, n_cols = q_weight.shape
    if n_cols % COLUMN_PAD:
        raise ValueError(f"q_weight: {n_cols} columns; N must be padded to a multiple of {COLUMN_PAD}")
    if q_scale.shape[1] * 8 != n_cols:
        raise ValueError(f"q_scale: {q_scale.shape[1]} words per group hold {q_scale.shape[1] * 8} "
                         f"columns, q_weight has {n_cols}")
    G = q_scale.shape[0]
    if q_scale_max.dim() != 1 or q_scale_max.numel() != G:
        raise ValueError(f"q_scale_max: shape {tuple(q_scale_max.shape)}, expected ({G},)")
    if q_groups.dim() != 1 or q_groups.numel() != 2 * G or G == 0:
        raise ValueError(f"q_groups: {q_groups.numel()} entries, expected 2 per group ({2 * G})")
    K = int(q_invperm.numel())
    if K > MAX_IN_FEATURES:
        raise ValueError(f"q_invperm: K={K} input rows; the kernel allows at most {MAX_IN_FEATURES}")
    if q_invperm.dim() != 1 or K == 0 or not torch.equal(
            torch.sort(q_invperm.to(torch.int64)).values, torch.arange(K, device=q_invperm.device)):
        raise ValueError(f"q_invperm: not a permutation of 0..{K - 1}")

    qg = q_groups.to(torch.int64).view(G, 2)
    bits, off = qg[:, 0], qg[:, 1]
    bad = ~torch.isin(bits, torch.tensor(KERNEL_BITS, device=bits.device))
    if bool(bad.any()):
        g = int(torch.nonzero(bad)[0])
        raise ValueError(f"q_groups: group {g} has {int(bits[g])} bits; the kernel has {sorted(KERNEL_BITS)}")
    inc = bits[1:] > bits[:-1]
    if bool(inc.any()):
        g = int(torch.nonzero(inc)[0]) + 1
        raise ValueError(f"q_groups: bit widths must be non-increasing along K; group {g} has "
                         f"{int(bits[g])} bits after {int(bits[g - 1])}")
    if int(off[0]) != 0:
        raise ValueError(f"q_groups: first offset is {int(off[0])}, must be 0")
    if bool((off < 0).any()) or bool((off > MAX_GROUP_OFFSET).any()):
        raise ValueError(f"q_groups: offsets must fit int16 (0..{MAX_GROUP_OFFSET})")
    words = torch.diff(off, append=torch.tensor([n_words], device=off.device))
    if bool((words <= 0).any()):
        g = int(torch.nonzero(words <= 0)[0])
        raise ValueError(f"q_groups: group {g} has {int(words[g])} packed rows (offsets must increase "
                         f"and stay below q_weight's {n_words} rows)")
    ragged = (words[:-1] * 32) % bits[:-1] != 0
    if bool(ragged.any()):
        g = int(torch.nonzero(ragged)[0])
        raise ValueError(f"q_groups: group {g} spans {int(words[g])} words, not a whole number of "
                         f"{int(bits[g])}-bit rows")
    rows = words * 32 // bits
    rows[-1] = K - int(rows[:-1].sum())
    if int(rows[-1]) <= 0:
        raise ValueError(f"q_groups: groups before the last already hold {int(rows[:-1].sum())} "
                         f"rows of K={K}")
    if int((rows[-1] * bits[-1] + 31) // 32) != int(words[-1]):
        raise ValueError(f"q_weight: last group of {int(rows[-1])} rows at {int(bits[-1])} bits needs "
                         f"{int((rows[-1] * bits[-1] + 31) // 32)} packed rows, has {int(words[-1])}")
    # Boundaries: a group that starts after a 2-bit group may start on 16 rows, else on 32.
    starts = torch.cumsum(rows, 0) - rows
    step = torch.where(bits == 2, 16, 32)
    need = torch.cat([torch.full((1,), 32, device=bits.device), step[:-1]])
    mis = starts % need != 0
    if bool(mis.any()):
        g = int(torch.nonzero(mis)[0])
        raise ValueError(f"q_groups: group {g} starts at row {int(starts[g])}; group boundaries "
                         f"must be multiples of {int(need[g])} rows")
    if K % int(step[-1]):
        raise ValueError(f"K={K} input rows; the kernel walks K in steps of {int(step[-1])} rows, "
                         f"K must be a multiple of that")
