"""EXL2 ``measurement.json``: schema, validation, atomic writer and reader.

Reproduces the file that exllamav2 0.3.2 writes after its measurement pass
(``conversion/measure.py``, export at the end of ``measure_quant``) and reads back with
``convert.py -m`` (``conversion/convert_exl2.py``)::

    {"measurement": {
        "model.layers.0.self_attn": [option, ...],      # 19 options (attention)
        "model.layers.0.mlp":       [option, ...],      # 17 options (MLP)
        ...,
        "model.norm.norm": null, "lm_head.linear": null},
     "last_module_idx": 2 * num_layers + 2}

Keys are exllamav2's ``module.key + "." + mode``. Only llama / qwen2 / qwen3 layouts are
accepted here (no MoE ``block_sparse_moe``, no ``parallel_decoder``): an attention option holds
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``; an MLP option ``gate_proj``, ``up_proj``,
``down_proj``. Every option is::

    {"accuracy": float in [0, 1],            # 1 - mean relative output error of the module
     "total_bits": int > 0,                  # cost in bits of the module's linears (see below)
     "<linear>": {"group_size": {"<bits>": int, ...},   # keys: the bit widths, as strings
                  "bits": [int, ...],                   # strictly descending, each in 2..8
                  "bits_prop": [float, ...],            # fractions of the input rows, sum 1
                  "scale_bits": 4}, ...}

Modules that are not measured (the final norm, the head) have the value ``null``.
``last_module_idx`` is required on import (exllamav2 reads it unconditionally); for a complete
measurement it is ``len(modules) - 1 = 2 * num_layers + 2`` (embedding, 2 modules per layer,
final norm, head).

Every validation failure raises :class:`~quantize.errors.InputError` whose message names the
file and the JSON location at fault, e.g.
``measurement.json: measurement["model.layers.3.mlp"][5]["down_proj"]["bits"]: [4, 8] is not
in descending order``.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from quantpress.errors import InputError
from quantpress.quantize.exl2 import QParams, bits_cost

ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
MODE_LINEARS = {"self_attn": ATTN_LINEARS, "mlp": MLP_LINEARS}
LINEAR_FIELDS = ("group_size", "bits", "bits_prop", "scale_bits")
VALID_BITS = frozenset({2, 3, 4, 5, 6, 8})
SCALE_BITS = 4
BITS_PROP_TOL = 1e-4

#: measurement.json key (ignored by exllamav2, which reads only "measurement" and
#: "last_module_idx") holding each module output's content share ρ, the weights of the
#: "content" allocation objective, so that reusing the file allocates exactly as measuring did
CONTENT_KEY = "quantpress_content_share"

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.([A-Za-z_]+)$")

CostFn = Callable[[Mapping[str, Any], str], int]
"""``cost(option_dict, layer_key) -> int``: the bits an option of module ``layer_key`` costs."""


def layer_key(layer: int, mode: str) -> str:
    """exllamav2's measurement key of decoder layer ``layer``'s ``mode`` ("self_attn" / "mlp")."""
    return f"model.layers.{layer}.{mode}"


def slot_keys(num_layers: int) -> list[str]:
    """The 2 * ``num_layers`` slot keys in optimizer order: layer 0 attn, layer 0 mlp, layer 1 …
    (the order of ``slots`` in exllamav2 0.3.2 ``conversion/optimize.py``)."""
    return [layer_key(i, m) for i in range(num_layers) for m in ("self_attn", "mlp")]


# --------------------------------------------------------------------------------------------
# One linear's quantization setting (exllamav2 QParams) and its cost in bits


@dataclass(frozen=True)
class QSetting:
    """One linear's EXL2 setting, the JSON dict ``{group_size, bits, bits_prop, scale_bits}``.

    ``bits`` are strictly descending; ``bits_prop[i]`` is the fraction of the input rows K at
    ``bits[i]``; ``group_size[b]`` is the group size (rows) of bit width b. Mirrors exllamav2
    0.3.2 ``conversion/qparams.py`` ``QParams`` (with the group sizes always per bit width).
    """

    group_size: Mapping[int, int]
    bits: tuple[int, ...]
    bits_prop: tuple[float, ...]
    scale_bits: int = SCALE_BITS

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> "QSetting":
        """From a (validated) JSON dict; ``group_size`` keys may be strings or ints."""
        return QSetting({int(b): int(g) for b, g in d["group_size"].items()},
                        tuple(int(b) for b in d["bits"]),
                        tuple(float(p) for p in d["bits_prop"]), int(d["scale_bits"]))

    def to_json(self) -> dict:
        """The JSON dict (``group_size`` keys as strings, as ``json`` writes them)."""
        return {"group_size": {str(b): int(self.group_size[b]) for b in self.bits},
                "bits": list(self.bits), "bits_prop": list(self.bits_prop),
                "scale_bits": self.scale_bits}

    def qparams(self):
        """This setting as :class:`quantize.exl2.QParams` (the codec's one definition of the
        row allocation and the bit cost). Raises InputError for a setting QParams rejects."""
        try:
            return QParams(self.group_size, self.bits, self.bits_prop, self.scale_bits)
        except ValueError as e:
            raise InputError(f"EXL2 setting {self.to_json()}: {e}") from None

    def group_rows(self, in_features: int) -> list[tuple[int, int]]:
        """Per bit width, ``(bits, n_groups)``: exllamav2's row allocation
        (:meth:`quantize.exl2.QParams.group_counts`: with rem = K, for each (b, p):
        n_b = ceil(min(K·p, rem) / gs_b), rem -= n_b·gs_b; rem ≤ 0 at the end, the last group
        may be partial). Raises InputError when the proportions do not cover K."""
        qp = self.qparams()
        try:
            counts = qp.group_counts(in_features)
        except ValueError as e:
            raise InputError(f"EXL2 setting {self.to_json()}: {e}") from None
        return list(zip(qp.bits, counts))

    def total_bits(self, in_features: int, out_features: int, bias: bool = False,
                   pad32: bool = True) -> int:
        """Cost in bits of one ``in_features`` (K) × ``out_features`` (N) linear, exllamav2 0.3.2
        ``QParams.total_bits``, computed by :func:`quantize.exl2.bits_cost`:
        Σ_g rows_g·N·b_g + 16·G (q_scale_max) + 32·G (q_groups) + scale_bits·G·N (q_scale)
        + 32·K (q_invperm) [+ 16·N bias]. With ``pad32`` N is first padded to a multiple of 32,
        as ``ExLlamaV2Linear(pad32=True)`` does before measuring (upstream measures the padded
        fake-quantized weight's shape). Raises InputError when the setting does not cover K."""
        n = out_features + (-out_features % 32 if pad32 else 0)
        qp = self.qparams()
        try:
            return int(bits_cost(qp, in_features, n, bias))
        except ValueError as e:
            raise InputError(f"EXL2 setting {self.to_json()}: {e}") from None


def module_cost_fn(shapes: Mapping[str, Sequence]) -> CostFn:
    """A ``cost(option, layer_key)`` from the model's linear shapes: ``shapes[name]`` =
    ``(in_features, out_features)`` or ``(in_features, out_features, has_bias)`` for every
    linear name of the option (q_proj … down_proj; the same in every layer for llama/qwen).
    The cost is Σ :meth:`QSetting.total_bits` over the option's linears, which is how
    exllamav2 0.3.2 ``measure_attn`` / ``measure_mlp`` compute ``total_bits``."""

    def cost(option: Mapping[str, Any], key: str) -> int:
        total = 0
        for name, value in option.items():
            if name in ("accuracy", "total_bits"):
                continue
            if name not in shapes:
                raise ValueError(f"module_cost_fn: no shape given for linear {name!r} of {key}")
            k, n, *rest = shapes[name]
            total += QSetting.from_json(value).total_bits(int(k), int(n), bool(rest and rest[0]))
        return total

    return cost


# --------------------------------------------------------------------------------------------
# Validation


def _loc(*parts) -> str:
    s = "measurement"
    for p in parts:
        s += f"[{p}]" if isinstance(p, int) else f'["{p}"]'
    return s


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return (_is_int(x) or isinstance(x, (float, np.floating))) and math.isfinite(float(x))


def _check_linear(src: str, d, loc: str) -> None:
    if not isinstance(d, dict):
        raise InputError(f"{src}: {loc}: expected an object, got {type(d).__name__}")
    for f in LINEAR_FIELDS:
        if f not in d:
            raise InputError(f'{src}: {loc}: missing key "{f}"')
    extra = sorted(set(d) - set(LINEAR_FIELDS))
    if extra:
        raise InputError(f"{src}: {loc}: unexpected key(s) {extra}")
    bits, prop, gs, sb = d["bits"], d["bits_prop"], d["group_size"], d["scale_bits"]
    if not isinstance(bits, list) or not bits or not all(_is_int(b) for b in bits):
        raise InputError(f'{src}: {loc}["bits"]: expected a non-empty list of ints, got {bits!r}')
    bad = [b for b in bits if b not in VALID_BITS]
    if bad:
        raise InputError(f'{src}: {loc}["bits"]: bit width(s) {bad} not in {sorted(VALID_BITS)}')
    if any(a <= b for a, b in zip(bits, bits[1:])):
        raise InputError(f'{src}: {loc}["bits"]: {bits} is not in descending order')
    if (not isinstance(prop, list) or len(prop) != len(bits)
            or not all(_is_num(p) for p in prop)):
        raise InputError(f'{src}: {loc}["bits_prop"]: expected {len(bits)} numbers (one per '
                         f'bit width), got {prop!r}')
    if any(p <= 0 or p > 1 for p in prop) or abs(sum(prop) - 1.0) > BITS_PROP_TOL:
        raise InputError(f'{src}: {loc}["bits_prop"]: {prop} must be fractions in (0, 1] '
                         f"summing to 1 (sum {sum(prop):.6g})")
    if not isinstance(gs, dict):
        raise InputError(f'{src}: {loc}["group_size"]: expected an object bits -> group size, '
                         f"got {gs!r}")
    try:
        gsi = {int(k): v for k, v in gs.items()}
    except (TypeError, ValueError):
        raise InputError(f'{src}: {loc}["group_size"]: keys must be bit widths, got '
                         f"{list(gs)}") from None
    if len(gsi) != len(gs) or set(gsi) != set(bits):
        raise InputError(f'{src}: {loc}["group_size"]: keys {sorted(gs)} do not match bits '
                         f"{bits}")
    for b, g in gsi.items():
        if not _is_int(g) or g <= 0 or g % (16 if b == 2 else 32) != 0:
            raise InputError(f'{src}: {loc}["group_size"]["{b}"]: {g!r} is not a positive '
                             f"multiple of {16 if b == 2 else 32}")
    if sb != SCALE_BITS or not _is_int(sb):
        raise InputError(f'{src}: {loc}["scale_bits"]: {sb!r}, expected {SCALE_BITS}')


def _check_option(src: str, opt, key: str, i: int, linears: Sequence[str],
                  cost: CostFn | None) -> None:
    loc = _loc(key, i)
    if not isinstance(opt, dict):
        raise InputError(f"{src}: {loc}: expected an option object, got {type(opt).__name__}")
    for f in ("accuracy", "total_bits", *linears):
        if f not in opt:
            raise InputError(f'{src}: {loc}: missing key "{f}"')
    extra = sorted(set(opt) - {"accuracy", "total_bits", *linears})
    if extra:
        raise InputError(f"{src}: {loc}: unexpected key(s) {extra} (llama/qwen2/qwen3 "
                         f"options hold {list(linears)})")
    acc = opt["accuracy"]
    if not _is_num(acc) or not 0.0 <= float(acc) <= 1.0:
        raise InputError(f'{src}: {loc}["accuracy"]: {acc!r} is not a number in [0, 1]')
    tb = opt["total_bits"]
    if not _is_int(tb) or tb <= 0:
        raise InputError(f'{src}: {loc}["total_bits"]: {tb!r} is not a positive integer')
    for name in linears:
        _check_linear(src, opt[name], _loc(key, i, name))
    if cost is not None:
        try:
            want = int(cost(opt, key))
        except InputError as e:
            raise InputError(f"{src}: {loc}: {e}") from None
        if want != tb:
            raise InputError(f'{src}: {loc}["total_bits"]: {tb} bits, but the model\'s shapes '
                             f"give {want} for this setting (a measurement of another model?)")


def validate_schema(obj, *, source: str = "measurement.json", expect_layers: int | None = None,
                    cost: CostFn | None = None) -> int:
    """Check ``obj`` (the parsed JSON) against the measurement.json schema; return the number of
    decoder layers it measures.

    ``source`` names the file in messages. ``expect_layers``: the model's decoder layer count,
    which must equal the file's. ``cost(option, layer_key) -> int`` (e.g.
    :func:`module_cost_fn`): every option's ``total_bits`` must equal it.

    Raises InputError naming ``source`` and the JSON location for: a top level that is not an
    object, a missing ``measurement`` / ``last_module_idx`` / option / linear key, a layer key
    whose mode is not ``self_attn`` / ``mlp`` (MoE and parallel decoders are unsupported), a
    layer without both modules, non-contiguous layer indices, an empty option list, a wrong
    type or value (accuracy outside [0, 1], total_bits ≤ 0, bits not strictly descending or not
    in {2,3,4,5,6,8}, bits_prop not summing to 1, group_size keys ≠ bits, scale_bits ≠ 4),
    ``last_module_idx`` outside [2·L, 2·L + 2], a layer count ≠ ``expect_layers``, and a
    ``total_bits`` that disagrees with ``cost``.
    """
    src = source
    if not isinstance(obj, dict):
        raise InputError(f"{src}: top level is {type(obj).__name__}, expected an object with "
                         f'"measurement" and "last_module_idx"')
    for f in ("measurement", "last_module_idx"):
        if f not in obj:
            raise InputError(f'{src}: missing key "{f}"')
    meas = obj["measurement"]
    if not isinstance(meas, dict):
        raise InputError(f'{src}: "measurement" is {type(meas).__name__}, expected an object')

    modes: dict[int, set[str]] = {}
    for key, value in meas.items():
        if not isinstance(key, str):
            raise InputError(f"{src}: measurement key {key!r} is not a string")
        m = _LAYER_KEY.match(key)
        if m is None:
            if value is not None:
                raise InputError(f"{src}: {_loc(key)}: not a decoder-layer key "
                                 f'("model.layers.N.self_attn" / ".mlp"), so it must be null')
            continue
        layer, mode = int(m.group(1)), m.group(2)
        if mode not in MODE_LINEARS:
            raise InputError(f'{src}: {_loc(key)}: mode "{mode}" is not supported (llama, qwen2 '
                             f"and qwen3 have self_attn and mlp)")
        if not isinstance(value, list) or not value:
            raise InputError(f"{src}: {_loc(key)}: expected a non-empty list of options, got "
                             f"{'null' if value is None else type(value).__name__}")
        modes.setdefault(layer, set()).add(mode)

    n_layers = len(modes)
    if n_layers == 0:
        raise InputError(f"{src}: no decoder layer is measured (no key "
                         f'"model.layers.N.self_attn")')
    for i in range(n_layers):
        if i not in modes:
            raise InputError(f"{src}: layer indices are not 0..{n_layers - 1}: "
                             f'missing key "{layer_key(i, "self_attn")}"')
        for mode in MODE_LINEARS:
            if mode not in modes[i]:
                raise InputError(f'{src}: missing key "{layer_key(i, mode)}"')
    if expect_layers is not None and n_layers != expect_layers:
        raise InputError(f"{src}: the measurement has {n_layers} decoder layers, the model has "
                         f"{expect_layers} (a measurement of another model?)")

    idx = obj["last_module_idx"]
    if not _is_int(idx):
        raise InputError(f'{src}: "last_module_idx": {idx!r} is not an integer')
    if not 2 * n_layers <= idx <= 2 * n_layers + 2:
        raise InputError(f'{src}: "last_module_idx": {idx}, but a measurement of {n_layers} '
                         f"layers ends at module {2 * n_layers + 2} (it must be at least "
                         f"{2 * n_layers}, the last layer's MLP)")

    for key in slot_keys(n_layers):
        linears = MODE_LINEARS[key.rsplit(".", 1)[1]]
        for i, opt in enumerate(meas[key]):
            _check_option(src, opt, key, i, linears, cost)
    shares = obj.get(CONTENT_KEY)
    if shares is not None:
        if not isinstance(shares, dict) or set(shares) != set(slot_keys(n_layers)):
            raise InputError(f'{src}: "{CONTENT_KEY}": expected an object with a number for each '
                             f'of the {2 * n_layers} measured modules')
        for key, v in shares.items():
            if not _is_num(v) or not 0.0 < v <= 1.0:
                raise InputError(f'{src}: "{CONTENT_KEY}"["{key}"]: {v!r} is not a share in (0, 1]')
    return n_layers


# --------------------------------------------------------------------------------------------
# In-memory representation, writer and reader


@dataclass(frozen=True)
class Measurement:
    """A validated measurement: ``modules`` is the JSON ``measurement`` object (slot key → list
    of option dicts, or None for unmeasured modules), ``last_module_idx`` as in the file,
    ``num_layers`` the decoder layer count L and ``content_share`` the file's
    :data:`CONTENT_KEY` (slot key → ρ) when it has one."""

    modules: dict
    last_module_idx: int
    num_layers: int
    content_share: dict | None = None

    def slot_keys(self) -> list[str]:
        """The 2·L slot keys in optimizer order (layer 0 attn, layer 0 mlp, …)."""
        return slot_keys(self.num_layers)

    def slots(self) -> list[list[tuple[int, float]]]:
        """Per slot (2·L, layer order), the list of ``(total_bits, err)`` with err =
        1 − accuracy, in option order: the input of :func:`calibration.exl2_alloc.allocate`.
        exllamav2 0.3.2 ``optimize.py`` builds the same ``slots``."""
        return [[(int(o["total_bits"]), 1.0 - float(o["accuracy"])) for o in self.modules[k]]
                for k in self.slot_keys()]

    def strategy(self, choice: Sequence[int]) -> dict[str, dict]:
        """``{slot key: chosen option dict}`` for one option index per slot (exllamav2's
        ``job["strategy"]``)."""
        keys = self.slot_keys()
        if len(choice) != len(keys):
            raise ValueError(f"{len(choice)} choices for {len(keys)} slots")
        return {k: self.modules[k][int(c)] for k, c in zip(keys, choice)}

    def to_json(self) -> dict:
        """The file's top-level object."""
        obj = {"measurement": self.modules, "last_module_idx": self.last_module_idx}
        if self.content_share is not None:
            obj[CONTENT_KEY] = self.content_share
        return obj


def _json_default(x):
    """numpy scalars (e.g. an accuracy computed as np.float32) as Python numbers."""
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    raise TypeError(f"{type(x).__name__} is not JSON-serializable")


def measurement_text(measurement: Mapping[str, Any], last_module_idx: int,
                     source: str = "measurement", content_share: Mapping[str, float] | None = None) -> str:
    """The text of measurement.json as exllamav2 0.3.2 writes it (``json.dumps({"measurement":
    ..., "last_module_idx": ...}, indent=4)``; numpy scalars as numbers), with the content
    shares under :data:`CONTENT_KEY` last when given (slot key → ρ, in slot order), validated
    by :func:`validate_schema`. Raises InputError naming ``source`` when it does not validate."""
    obj = {"measurement": dict(measurement), "last_module_idx": last_module_idx}
    if content_share is not None:
        n = sum(1 for k in measurement if k.endswith(".self_attn"))
        obj[CONTENT_KEY] = {k: content_share[k] for k in slot_keys(n) if k in content_share}
    try:
        text = json.dumps(obj, indent=4, default=_json_default)
    except (TypeError, ValueError) as e:
        raise InputError(f"{source}: measurement is not JSON-serializable: {e}") from None
    validate_schema(json.loads(text), source=source)
    return text


def write_measurement(path: str | os.PathLike, measurement: Mapping[str, Any],
                      last_module_idx: int, content_share: Mapping[str, float] | None = None) -> Path:
    """Validate and write ``{"measurement": measurement, "last_module_idx": last_module_idx}``
    to ``path`` as exllamav2 0.3.2 does (``json.dumps(..., indent=4)``), through a temporary
    file in the same directory that is renamed over ``path`` (no partial file on failure).

    ``measurement``: slot key → list of option dicts (or None), see the module docstring; the
    ``group_size`` keys may be ints (JSON writes them as strings); numpy scalars are written as
    numbers. Raises InputError if it does not validate (nothing is written) or the directory is
    not writable. Returns ``path``.
    """
    path = Path(path)
    text = measurement_text(measurement, last_module_idx, source=str(path), content_share=content_share)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # mode as umask allows
    except OSError as e:
        raise InputError(f"{path}: cannot write: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def read_measurement(path: str | os.PathLike, expect_layers: int | None = None,
                     expect_shapes: Mapping[str, Sequence] | None = None,
                     cost: CostFn | None = None) -> Measurement:
    """Read and validate a measurement.json (exllamav2 0.3.2 ``convert.py -m``).

    ``expect_layers``: the model's decoder layer count. ``expect_shapes``: linear name →
    ``(in_features, out_features[, has_bias])``; every option's ``total_bits`` is then checked
    against :func:`module_cost_fn` of these shapes. ``cost(option, layer_key) -> int`` overrides
    that cost function. Raises InputError naming ``path``: unreadable file, "truncated or not
    JSON", and every schema error of :func:`validate_schema` (missing key, layer count of
    another model, total_bits inconsistent with the shapes, …).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: measurement file not found") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path}: truncated or not JSON ({e})") from None
    if cost is None and expect_shapes is not None:
        cost = module_cost_fn(expect_shapes)
    n = validate_schema(obj, source=str(path), expect_layers=expect_layers, cost=cost)
    return Measurement(obj["measurement"], int(obj["last_module_idx"]), n, obj.get(CONTENT_KEY))
