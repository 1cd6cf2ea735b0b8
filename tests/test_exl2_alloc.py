"""EXL2 measurement.json (calibration/exl2_measurement.py) and bpw allocation
(calibration/exl2_alloc.py).

References: the option tables are exllamav2 0.3.2's ``qparams_attn`` / ``qparams_mlp``
(``conversion/qparams.py``), with the bits per weight its ``QParams.total_bits`` gives for
Llama-3-8B shapes; the per-linear cost is re-implemented here from ``QParams.total_bits``;
optimal allocations come from ``scipy.optimize.milp`` (HiGHS) and, for tiny instances,
exhaustive enumeration.
"""
from __future__ import annotations

import copy
import itertools
import json
import math
import re

import numpy as np
import pytest
from scipy.optimize import Bounds, LinearConstraint, milp

from quantpress.calibration.exl2_alloc import (OBJECTIVE_MODES, allocate, budget_bits, content_slots,
                                    decoder_numel, reachable_bits, reachable_bpw)
from quantpress.calibration.exl2_measurement import (QSetting, module_cost_fn, read_measurement,
                                          slot_keys, validate_schema, write_measurement)
from quantpress.errors import InputError

# --------------------------------------------------------------------------------------------
# Option tables of exllamav2 0.3.2 `conversion/qparams.py`, noted "4/3 (.1/.9) g128" = 10% of
# the rows at 4 bits, 90% at 3, group 128; "g32/64/64" = group size per bit width.

ATTN = [  # (q = k = o, v[, o])
    ("3/2 (.05/.95) g64", "3/2 (.05/.95) g64"),
    ("3/2 (.1/.9) g64", "3/2 (.25/.75) g64"),
    ("3/2 (.1/.9) g64", "4/3 (.1/.9) g128"),
    ("3/2 (.1/.9) g64", "4/3 (.1/.9) g128", "4/3 (.1/.9) g128"),
    ("4/3 (.1/.9) g128", "4/3 (.1/.9) g128"),
    ("4/3 (.1/.9) g128", "4/3 (.1/.9) g64"),
    ("4 g128", "4 g128"),
    ("4 g128", "4 g64"),
    ("4 g64", "4 g32"),
    ("4 g32", "4 g32"),
    ("5/4 (.1/.9) g128", "5/4 (.1/.9) g64"),
    ("5/4 (.1/.9) g64", "5/4 (.1/.9) g32"),
    ("5/4 (.1/.9) g64", "5 g64"),
    ("5/4 (.1/.9) g32", "5 g32"),
    ("6/5 (.1/.9) g128", "6 g128"),
    ("6/5 (.1/.9) g32", "6 g32"),
    ("6 g128", "6 g128"),
    ("6 g32", "8 g32"),
    ("8 g128", "8 g128"),
]
MLP = [  # (gate, up, down)
    ("3/2 (.05/.95) g64", "3/2 (.05/.95) g64", "6/3/2 (.05/.2/.75) g32/64/64"),
    ("3/2 (.1/.9) g64", "3/2 (.25/.75) g64", "6/3/2 (.05/.2/.75) g32/64/64"),
    ("3/2 (.1/.9) g64", "3/2 (.3/.7) g64", "5/3 (.05/.95) g32"),
    ("3/2 (.1/.9) g64", "3/2 (.3/.7) g64", "5/4 (.05/.95) g32"),
    ("4/3 (.1/.9) g128", "4/3 (.25/.75) g128", "8/4/3 (.05/.1/.85) g32/128/128"),
    ("4/3 (.1/.9) g32", "4/3 (.25/.75) g32", "8/4/3 (.05/.1/.85) g32"),
    ("4/3 (.1/.9) g32", "4/3 (.25/.75) g32", "8/4 (.05/.95) g32/128"),
    ("4 g128", "4 g32", "8/4 (.05/.95) g32/128"),
    ("4 g32", "4 g32", "8/4 (.05/.95) g32"),
    ("5/4 (.1/.9) g128", "5/4 (.25/.75) g128", "8/5/4 (.05/.1/.85) g32/128/128"),
    ("5/4 (.1/.9) g32", "5/4 (.25/.75) g32", "8/5/4 (.05/.1/.85) g32"),
    ("6/5 (.1/.9) g128", "6/5 (.25/.75) g128", "8/6/5 (.05/.1/.85) g32/128/128"),
    ("6/5 (.1/.9) g32", "6/5 (.25/.75) g32", "8/6/5 (.05/.1/.85) g32"),
    ("6 g128", "6 g128", "8/6 (.05/.95) g32/128"),
    ("8/6 (.1/.9) g128", "8/6 (.1/.9) g128", "8/6 (.15/.85) g128"),
    ("8/6 (.1/.9) g128", "8/6 (.1/.9) g128", "8 g128"),
    ("8 g128", "8 g128", "8 g128"),
]
# bits per weight of every option, as exllamav2 0.3.2's `QParams.total_bits` gives them for
# Llama-3-8B shapes (hidden 4096, kv 1024, ffn 14336)
LLAMA3_ATTN_BPW = [2.138, 2.199, 2.283, 2.677, 3.169, 3.170, 4.044, 4.047, 4.082, 4.138, 4.170,
                   4.190, 4.274, 4.329, 5.256, 5.329, 6.044, 6.338, 8.044]
LLAMA3_MLP_BPW = [2.245, 2.323, 2.596, 2.912, 3.283, 3.366, 3.619, 4.137, 4.198, 4.266, 4.348,
                  5.249, 5.331, 6.071, 6.303, 6.869, 8.035]

_NOTATION = re.compile(r"^([\d/]+)(?: \(([.\d/]+)\))? g([\d/]+)$")


def setting(s: str) -> dict:
    m = _NOTATION.match(s)
    bits = [int(b) for b in m.group(1).split("/")]
    prop = [float(p) for p in m.group(2).split("/")] if m.group(2) else [1.0]
    gs = [int(g) for g in m.group(3).split("/")]
    gs = gs * len(bits) if len(gs) == 1 else gs
    return {"group_size": {str(b): g for b, g in zip(bits, gs)}, "bits": bits,
            "bits_prop": prop, "scale_bits": 4}


def attn_options() -> list[dict]:
    out = []
    for row in ATTN:
        qko, v, o = row[0], row[1], row[2] if len(row) > 2 else row[0]
        out.append({"q_proj": setting(qko), "k_proj": setting(qko), "v_proj": setting(v),
                    "o_proj": setting(o)})
    return out


def mlp_options() -> list[dict]:
    return [{"gate_proj": setting(g), "up_proj": setting(u), "down_proj": setting(d)}
            for g, u, d in MLP]


def shapes(h: int, kv: int, ffn: int) -> dict:
    """linear name -> (in_features, out_features)"""
    return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}


SMOL = shapes(576, 192, 1536)
LLAMA3 = shapes(4096, 1024, 14336)
SMOL_LAYERS = 30


def ref_linear_bits(st: dict, k: int, n: int, bias: bool = False) -> int:
    """exllamav2 0.3.2 ``QParams.total_bits`` (``conversion/qparams.py``), written
    independently: rows per bit width, then weights + 16·G + 32·G + 4·G·N + 32·K (+ 16·N),
    N padded to 32."""
    n = n + (-n % 32)
    gsz = {int(b): g for b, g in st["group_size"].items()}
    rem, left, groups, total = k, k, 0, 0
    for b, p in zip(st["bits"], st["bits_prop"]):
        g = math.ceil(min(k * p, rem) / gsz[b])
        rem -= g * gsz[b]
        groups += g
        rows = min(g * gsz[b], left)
        left -= rows
        total += rows * n * b
    assert rem <= 0
    return total + 16 * groups + 32 * groups + 4 * groups * n + 32 * k + (16 * n if bias else 0)


def option_bits(opt: dict, shp: dict) -> int:
    return sum(ref_linear_bits(v, *shp[name]) for name, v in opt.items()
               if name not in ("accuracy", "total_bits"))


def numel_of(shp: dict, names) -> int:
    return sum(shp[n][0] * shp[n][1] for n in names)


ATTN_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def make_measurement(seed: int, n_layers: int = SMOL_LAYERS, shp: dict = SMOL) -> dict:
    """A plausible measurement: err = a_s · 2^(−1.1·bpw) · lognormal noise per option (so
    cost and err are not monotone in the option index), total_bits from the formula of
    exllamav2 0.3.2's ``QParams.total_bits``."""
    rng = np.random.default_rng(seed)
    meas = {}
    for i in range(n_layers):
        for mode, opts, names in (("self_attn", attn_options(), ATTN_NAMES),
                                  ("mlp", mlp_options(), MLP_NAMES)):
            scale = rng.uniform(0.5, 2.0) * 0.05
            n = numel_of(shp, names)
            out = []
            for opt in opts:
                tb = option_bits(opt, shp)
                err = scale * 2.0 ** (-1.1 * tb / n) * rng.lognormal(0.0, 0.15)
                out.append({"accuracy": 1.0 - err, "total_bits": tb, **opt})
            meas[f"model.layers.{i}.{mode}"] = out
    meas["model.norm.norm"] = None
    meas["lm_head.linear"] = None
    return meas


def smol_slots(seed: int, random_err: bool = False) -> list[list[tuple[int, float]]]:
    """SmolLM2-shaped slots (30 layers × attn 19 / mlp 17 options, real option costs); errs
    either the plausible model above or uniform random (a harder knapsack)."""
    rng = np.random.default_rng(seed)
    ac = [option_bits(o, SMOL) for o in attn_options()]
    mc = [option_bits(o, SMOL) for o in mlp_options()]
    slots = []
    for _ in range(SMOL_LAYERS):
        for costs, n in ((ac, numel_of(SMOL, ATTN_NAMES)), (mc, numel_of(SMOL, MLP_NAMES))):
            if random_err:
                err = rng.uniform(1e-4, 1e-1, len(costs))
            else:
                bpw = np.array(costs) / n
                err = (rng.uniform(0.5, 2.0) * 0.05 * 2.0 ** (-1.1 * bpw)
                       * rng.lognormal(0.0, 0.15, len(costs)))
            slots.append(list(zip(costs, err.tolist())))
    return slots


SMOL_NUMEL = SMOL_LAYERS * numel_of(SMOL, ATTN_NAMES + MLP_NAMES)


# --------------------------------------------------------------------------------------------
# Exact references


def milp_reference(slots, budget: int, objective: str = "sum", power: float = 1.0):
    """Optimal choice by scipy.optimize.milp: binaries x[s, j], one per slot, Σ c·x ≤ budget;
    minimize Σ err^power·x, or t ≥ Σ_j err·x per slot for the minimax. Returns (choice, cost)."""
    sizes = [len(s) for s in slots]
    N, S = sum(sizes), len(slots)
    c = np.array([o[0] for s in slots for o in s], dtype=np.float64)
    e = np.array([o[1] for s in slots for o in s], dtype=np.float64)
    base = np.array([min(o[0] for o in s) for s in slots], dtype=np.float64)
    slot_of = np.repeat(np.arange(S), sizes)
    extra = budget - base.sum()
    one = np.zeros((S, N))
    one[slot_of, np.arange(N)] = 1.0
    scale = 1e6 / e.max() ** power                       # HiGHS's absolute gap is 1e-6
    cost_row = ((c - base[slot_of]) / extra)[None, :]    # ≤ 1, well conditioned
    if objective == "sum":
        res = milp((e ** power) * scale, integrality=np.ones(N), bounds=Bounds(0, 1),
                   constraints=[LinearConstraint(one, 1, 1),
                                LinearConstraint(cost_row, -np.inf, 1.0)],
                   options={"mip_rel_gap": 0})
        x = res.x
    else:
        obj = np.zeros(N + 1)
        obj[N] = 1.0
        tie = np.hstack([one * (e * scale)[None, :], -np.ones((S, 1))])
        res = milp(obj, integrality=np.append(np.ones(N), 0),
                   bounds=Bounds(0, np.append(np.ones(N), np.inf)),
                   constraints=[LinearConstraint(np.hstack([one, np.zeros((S, 1))]), 1, 1),
                                LinearConstraint(np.append(cost_row, 0)[None, :], -np.inf, 1.0),
                                LinearConstraint(tie, -np.inf, 0.0)],
                   options={"mip_rel_gap": 0})
        x = res.x[:N]
    assert res.status == 0, res.message
    xi = np.round(x).astype(int)
    offsets = np.cumsum([0] + sizes[:-1])
    choice = [int(np.flatnonzero(xi[o:o + m])[0]) for o, m in zip(offsets, sizes)]
    return choice, int(sum(slots[s][j][0] for s, j in enumerate(choice)))


def cost_err(slots, choice):
    return (sum(slots[s][j][0] for s, j in enumerate(choice)),
            [slots[s][j][1] for s, j in enumerate(choice)])


# --------------------------------------------------------------------------------------------
# Costs


def test_option_costs_match_spec_tables():
    # independent formula vs the Llama-3-8B bpw of exllamav2 0.3.2's `QParams.total_bits`
    na, nm = numel_of(LLAMA3, ATTN_NAMES), numel_of(LLAMA3, MLP_NAMES)
    assert [round(option_bits(o, LLAMA3) / na, 3) for o in attn_options()] == LLAMA3_ATTN_BPW
    assert [round(option_bits(o, LLAMA3) / nm, 3) for o in mlp_options()] == LLAMA3_MLP_BPW
    # the module's cost equals the formula for every linear, incl. padding and bias
    for opt in attn_options() + mlp_options():
        for st in opt.values():
            q = QSetting.from_json(st)
            assert q.to_json() == st
            for k, n, bias in ((576, 192, False), (1536, 576, True), (4096, 100, True)):
                assert q.total_bits(k, n, bias) == ref_linear_bits(st, k, n, bias)
    # SmolLM2 shapes cost 2.26–8.12 (attn) and 2.32–8.07 (mlp), not monotone in index
    cost = module_cost_fn(SMOL)
    sa = [cost(o, "model.layers.0.self_attn") / numel_of(SMOL, ATTN_NAMES) for o in attn_options()]
    sm = [cost(o, "model.layers.0.mlp") / numel_of(SMOL, MLP_NAMES) for o in mlp_options()]
    assert (round(min(sa), 2), round(max(sa), 2)) == (2.26, 8.12)
    assert (round(min(sm), 2), round(max(sm), 2)) == (2.32, 8.07)
    assert sa[5] < sa[4] and sa[11] < sa[10]


def test_budget_helpers():
    per_layer = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
    assert decoder_numel(30, SMOL) == 30 * per_layer
    assert decoder_numel(30, SMOL, norm_numel_per_layer=2 * 576) == 30 * (per_layer + 1152)
    assert decoder_numel(2, {"x": (64, 100)}) == 2 * 64 * 128           # out padded to 32
    assert decoder_numel(2, {"x": (64, 100)}, pad32=False) == 2 * 64 * 100
    assert budget_bits(4.125, 1000) == 4125
    assert budget_bits(4.125, 30 * per_layer) == int(30 * per_layer * 4.125)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InputError, match="bpw"):
            budget_bits(bad, 1000)


# --------------------------------------------------------------------------------------------
# measurement.json


def test_roundtrip(tmp_path):
    meas = make_measurement(0)
    path = tmp_path / "measurement.json"
    write_measurement(path, meas, 2 * SMOL_LAYERS + 2)
    assert [p.name for p in tmp_path.iterdir()] == ["measurement.json"]   # no temp file left
    raw = json.loads(path.read_text())
    assert list(raw) == ["measurement", "last_module_idx"]
    assert raw["last_module_idx"] == 62
    assert raw["measurement"] == meas and list(raw["measurement"]) == list(meas)

    m = read_measurement(path, expect_layers=SMOL_LAYERS, expect_shapes=SMOL)
    assert (m.num_layers, m.last_module_idx) == (SMOL_LAYERS, 62)
    assert m.modules == meas
    keys = slot_keys(SMOL_LAYERS)
    assert keys[:3] == ["model.layers.0.self_attn", "model.layers.0.mlp",
                        "model.layers.1.self_attn"] and len(keys) == 60
    slots = m.slots()
    assert len(slots) == 60 and [len(s) for s in slots[:2]] == [19, 17]
    for key, slot in zip(keys, slots):
        assert slot == [(o["total_bits"], 1.0 - o["accuracy"]) for o in meas[key]]
    choice = [i % 7 for i in range(60)]
    strat = m.strategy(choice)
    assert list(strat) == keys
    assert strat["model.layers.3.mlp"] is m.modules["model.layers.3.mlp"][choice[7]]
    assert strat["model.layers.3.mlp"] == meas["model.layers.3.mlp"][choice[7]]
    # an explicit cost function is accepted too
    read_measurement(path, cost=module_cost_fn(SMOL))
    # overwriting an existing file is atomic and leaves only the new content
    write_measurement(path, make_measurement(1, n_layers=2), 6)
    assert read_measurement(path).num_layers == 2
    assert [p.name for p in tmp_path.iterdir()] == ["measurement.json"]


def test_reads_exllamav2_text():
    """The layout exllamav2 0.3.2 ``measure_quant`` writes (json.dumps(indent=4), options
    shaped as in its measurement.json) is accepted."""
    q = {"group_size": {"3": 64, "2": 64}, "bits": [3, 2], "bits_prop": [0.05, 0.95],
         "scale_bits": 4}
    attn = {"accuracy": 0.99871, "total_bits": 123456789, "q_proj": q, "k_proj": q,
            "v_proj": q, "o_proj": q}
    mlp = {"accuracy": 0.998, "total_bits": 223456789, "gate_proj": q, "up_proj": q,
           "down_proj": q}
    text = json.dumps({"measurement": {"model.layers.0.self_attn": [attn],
                                       "model.layers.0.mlp": [mlp], "model.norm.norm": None,
                                       "lm_head.linear": None}, "last_module_idx": 4}, indent=4)
    assert validate_schema(json.loads(text)) == 1


@pytest.fixture
def written(tmp_path):
    meas = make_measurement(2, n_layers=4)
    path = tmp_path / "measurement.json"
    write_measurement(path, meas, 10)
    return path, meas


def test_truncated_or_not_json(written, tmp_path):
    path, _ = written
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match=r"measurement\.json: truncated or not JSON"):
        read_measurement(path)
    for content in (b"", b"\xff\xfe\x00garbage", b"{\"measurement\": "):
        path.write_bytes(content)
        with pytest.raises(InputError, match="truncated or not JSON") as ei:
            read_measurement(path)
        assert str(path) in str(ei.value)
    with pytest.raises(InputError, match="not found"):
        read_measurement(tmp_path / "absent.json")


def test_missing_last_module_idx(written):
    path, meas = written
    path.write_text(json.dumps({"measurement": meas}))
    with pytest.raises(InputError, match=r'measurement\.json: missing key "last_module_idx"'):
        read_measurement(path)


def test_wrong_layer_count(written):
    path, _ = written
    with pytest.raises(InputError) as ei:
        read_measurement(path, expect_layers=30)
    msg = str(ei.value)
    assert str(path) in msg and "has 4 decoder layers" in msg and "model has 30" in msg


def test_bad_bits_order(written):
    path, meas = written
    bad = copy.deepcopy(meas)
    d = bad["model.layers.2.mlp"][5]["down_proj"]
    d["bits"] = d["bits"][::-1]
    d["bits_prop"] = d["bits_prop"][::-1]
    path.write_text(json.dumps({"measurement": bad, "last_module_idx": 10}))
    with pytest.raises(InputError) as ei:
        read_measurement(path)
    msg = str(ei.value)
    assert 'measurement["model.layers.2.mlp"][5]["down_proj"]["bits"]' in msg
    assert "descending" in msg and str(path) in msg


def test_total_bits_inconsistent_with_model(written):
    path, meas = written
    # a measurement of SmolLM2 read against another model's shapes
    with pytest.raises(InputError) as ei:
        read_measurement(path, expect_shapes=shapes(640, 128, 1792))
    msg = str(ei.value)
    assert 'measurement["model.layers.0.self_attn"][0]["total_bits"]' in msg
    assert str(meas["model.layers.0.self_attn"][0]["total_bits"]) in msg
    # a given cost function that disagrees on one module only
    ref = module_cost_fn(SMOL)

    def cost(opt, key):
        return ref(opt, key) + (32 if key == "model.layers.3.mlp" else 0)

    with pytest.raises(InputError, match=r'model\.layers\.3\.mlp"\]\[0\]\["total_bits"\]'):
        read_measurement(path, cost=cost)
    read_measurement(path, cost=ref)                     # consistent: accepted


def _mutations():
    """(name, mutate(obj), expected message fragment) for validate_schema."""
    L = "model.layers.1.self_attn"

    def drop(*keys):
        def f(o):
            d = o
            for k in keys[:-1]:
                d = d[k]
            del d[keys[-1]]
        return f

    def put(value, *keys):
        def f(o):
            d = o
            for k in keys[:-1]:
                d = d[k]
            d[keys[-1]] = value
        return f

    M = "measurement"
    return [
        ("no measurement", drop(M), 'missing key "measurement"'),
        ("missing mlp", drop(M, "model.layers.2.mlp"), 'missing key "model.layers.2.mlp"'),
        ("missing attn", drop(M, "model.layers.0.self_attn"),
         'missing key "model.layers.0.self_attn"'),
        ("layer gap", lambda o: [drop(M, f"model.layers.1.{m}")(o) for m in ("self_attn", "mlp")],
         'layer indices are not 0..2: missing key "model.layers.1.self_attn"'),
        ("missing accuracy", drop(M, L, 3, "accuracy"),
         f'measurement["{L}"][3]: missing key "accuracy"'),
        ("missing linear", drop(M, L, 3, "v_proj"), f'measurement["{L}"][3]: missing key "v_proj"'),
        ("missing bits_prop", drop(M, L, 0, "q_proj", "bits_prop"),
         f'measurement["{L}"][0]["q_proj"]: missing key "bits_prop"'),
        ("moe key", put([{}], M, "model.layers.0.block_sparse_moe"), "not supported"),
        ("non-null other", put([], M, "model.norm.norm"), 'measurement["model.norm.norm"]'),
        ("empty options", put([], M, L), f'measurement["{L}"]: expected a non-empty list'),
        ("accuracy > 1", put(1.5, M, L, 2, "accuracy"), '["accuracy"]: 1.5'),
        ("accuracy str", put("0.99", M, L, 2, "accuracy"), '["accuracy"]'),
        ("total_bits float", put(1.5e6, M, L, 2, "total_bits"), '["total_bits"]: 1500000.0'),
        ("bits_prop sum", put([0.5, 0.4], M, L, 1, "o_proj", "bits_prop"), "summing to 1"),
        ("bits 7", put([7], M, L, 1, "o_proj", "bits"), "[7]"),
        ("group keys", put({"4": 64}, M, L, 1, "o_proj", "group_size"), "do not match bits"),
        ("group 48", put({"3": 48, "2": 64}, M, L, 0, "k_proj", "group_size"), "multiple of 32"),
        ("scale bits", put(8, M, L, 0, "k_proj", "scale_bits"), '["scale_bits"]: 8'),
        ("extra key", put(1, M, L, 0, "k_proj", "foo"), "unexpected key(s) ['foo']"),
        ("idx small", put(3, "last_module_idx"), '"last_module_idx": 3'),
        ("idx str", put("10", "last_module_idx"), '"last_module_idx"'),
        ("top list", None, "top level is list"),
    ]


@pytest.mark.parametrize("name,mutate,fragment", _mutations(), ids=[m[0] for m in _mutations()])
def test_validation_errors(name, mutate, fragment):
    obj = {"measurement": make_measurement(3, n_layers=4), "last_module_idx": 10}
    validate_schema(copy.deepcopy(obj), expect_layers=4, cost=module_cost_fn(SMOL))
    if mutate is None:
        obj = [obj]
    else:
        mutate(obj)
    with pytest.raises(InputError) as ei:
        validate_schema(obj, source="m.json")
    assert str(ei.value).startswith("m.json: ")
    assert fragment in str(ei.value)


def test_write_refuses_invalid(tmp_path):
    meas = make_measurement(4, n_layers=2)
    meas["model.layers.1.mlp"][0]["up_proj"]["bits"] = [2, 4]
    with pytest.raises(InputError, match=r'model\.layers\.1\.mlp"\]\[0\]\["up_proj"\]\["bits"\]'):
        write_measurement(tmp_path / "m.json", meas, 6)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InputError, match="cannot write"):
        write_measurement(tmp_path / "absent" / "m.json", make_measurement(4, n_layers=2), 6)


def test_write_numpy_scalars(tmp_path):
    meas = make_measurement(5, n_layers=2)
    opt = meas["model.layers.0.mlp"][3]
    opt["accuracy"], opt["total_bits"] = np.float64(opt["accuracy"]), np.int64(opt["total_bits"])
    path = write_measurement(tmp_path / "m.json", meas, 6)
    back = read_measurement(path, expect_shapes=SMOL).modules["model.layers.0.mlp"][3]
    assert back["accuracy"] == float(opt["accuracy"]) and back["total_bits"] == int(opt["total_bits"])


# --------------------------------------------------------------------------------------------
# Allocation


@pytest.mark.parametrize("seed,random_err,target", [
    (0, False, 2.6), (1, False, 4.125), (2, False, 5.5), (3, False, 7.2),
    (4, True, 2.5), (5, True, 3.1),
])
def test_sum_optimum_equals_milp(seed, random_err, target):
    slots = smol_slots(seed, random_err)
    budget = budget_bits(target, SMOL_NUMEL)
    a = allocate(slots, budget, numel=SMOL_NUMEL)
    ref_choice, ref_cost = milp_reference(slots, budget)
    assert ref_cost <= budget
    ref = sum(cost_err(slots, ref_choice)[1])
    cost, errs = cost_err(slots, a.choice)
    assert cost == a.total_bits <= budget
    assert a.err_sum == pytest.approx(sum(errs), rel=1e-12)
    assert abs(a.err_sum - ref) <= 1e-9 * ref
    assert a.lower_bound <= ref * (1 + 1e-9)             # a proven bound really is one
    assert a.err_max == pytest.approx(max(errs), rel=1e-12)


def test_power_objective_equals_milp():
    slots = smol_slots(6)
    budget = budget_bits(3.7, SMOL_NUMEL)
    a = allocate(slots, budget, power=2.5)
    ref_choice, ref_cost = milp_reference(slots, budget, power=2.5)
    ref = sum(e ** 2.5 for e in cost_err(slots, ref_choice)[1])
    assert a.total_bits <= budget and ref_cost <= budget
    assert abs(a.objective_value - ref) <= 1e-9 * ref


@pytest.mark.parametrize("seed,random_err,target", [(7, False, 3.0), (8, True, 2.7)])
def test_minimax_equals_milp(seed, random_err, target):
    slots = smol_slots(seed, random_err)
    budget = budget_bits(target, SMOL_NUMEL)
    a = allocate(slots, budget, objective="max")
    ref_choice, ref_cost = milp_reference(slots, budget, objective="max")
    ref = max(cost_err(slots, ref_choice)[1])
    assert a.total_bits <= budget and ref_cost <= budget
    assert a.err_max == ref == a.max_allowed
    # secondary objective: the least Σ err among choices whose max err is ≤ the optimum
    allowed = [[(c, e) if e <= ref else (c, 1e3) for c, e in s] for s in slots]
    sec_choice, _ = milp_reference(allowed, budget)
    sec = sum(cost_err(slots, sec_choice)[1])
    assert abs(a.err_sum - sec) <= 1e-9 * sec
    assert a.err_sum >= allocate(slots, budget).err_sum * (1 - 1e-12)   # sum optimum ≤ it


def test_small_instances_exhaustive():
    """Tiny instances, every choice enumerated; a grid of 4 cells forces rounded DPs and
    several rounds of option removal."""
    rng = np.random.default_rng(9)
    for trial in range(40):
        S, M = 4, int(rng.integers(2, 6))
        slots = [[(int(rng.integers(1, 1000)), float(rng.uniform(0, 1))) for _ in range(M)]
                 for _ in range(S)]
        lo, hi = reachable_bits(slots)
        budget = int(rng.integers(lo, hi + 1))
        best = min(sum(slots[s][j][1] for s, j in enumerate(ch))
                   for ch in itertools.product(range(M), repeat=S)
                   if sum(slots[s][j][0] for s, j in enumerate(ch)) <= budget)
        for grid in (4, 1 << 16):
            a = allocate(slots, budget, grid=grid)
            assert a.total_bits <= budget
            assert a.lower_bound <= best + 1e-12
            if a.lower_bound >= a.objective_value - 1e-12:      # certified → must be optimal
                assert a.err_sum == pytest.approx(best, abs=1e-12)
            if grid > 1000:                                       # exact DP on these costs
                assert a.err_sum == pytest.approx(best, abs=1e-12)


def test_fill_up_uses_slack_without_worse_error():
    # slot 0: the 12-bit option errs as little as the 10-bit one; after the optimum (err 0.8
    # either way) 2 bits are left, so the fill-up moves slot 0 to it
    slots = [[(10, 0.5), (12, 0.5), (40, 0.4)], [(10, 0.3), (30, 0.1)]]
    a = allocate(slots, 23)
    assert a.choice == [1, 0] and a.total_bits == 22 and a.err_sum == pytest.approx(0.8)
    # no slack: stays on the cheaper option
    assert allocate(slots, 20).choice == [0, 0]


def test_min_bits_spends_the_window():
    # the optimum (err 0.2 + 0.1) costs 20 of 40 bits; dearer options only err more (noisy
    # measurements of a tiny model), so neither the optimum nor the fill-up spends more
    slots = [[(10, 0.2), (18, 0.25), (30, 0.6)], [(10, 0.1), (15, 0.3), (26, 0.35)]]
    a = allocate(slots, 40)
    assert a.choice == [0, 0] and a.total_bits == 20
    # asked to spend at least 33 bits: one move reaches it; the one that adds least error
    # (slot 1 → 26 bits, +0.25; the best choice in [33, 40] errs 0.55 too, e.g. [1, 1])
    b = allocate(slots, 40, min_bits=33)
    assert 33 <= b.total_bits <= 40 and b.err_sum == pytest.approx(0.55)
    # only slot 0 → 30 bits reaches 38 (error 0.7, the one choice in [38, 40])
    c = allocate(slots, 40, min_bits=38)
    assert c.choice == [2, 0] and c.total_bits == 40
    # never past the budget, and no move when the window is already met
    assert allocate(slots, 40, min_bits=39).total_bits <= 40
    assert allocate(slots, 40, min_bits=20).choice == [0, 0]


def test_measurement_drives_several_targets(tmp_path):
    path = tmp_path / "measurement.json"
    write_measurement(path, make_measurement(10), 2 * SMOL_LAYERS + 2)
    m = read_measurement(path, expect_layers=SMOL_LAYERS, expect_shapes=SMOL)
    slots = m.slots()
    numel = decoder_numel(SMOL_LAYERS, SMOL)
    lo, hi = reachable_bpw(slots, numel)
    prev = math.inf
    for target in (2.4, 2.75, 3.0, 3.5, 4.0, 4.125, 4.65, 5.0, 6.0, 7.0, 8.0, hi):
        a = allocate(slots, budget_bits(target, numel), numel=numel)
        bpw = a.bpw(numel)
        assert target - 0.05 <= bpw <= target
        strat = m.strategy(a.choice)
        assert sum(o["total_bits"] for o in strat.values()) == a.total_bits
        assert a.err_sum == pytest.approx(sum(1 - o["accuracy"] for o in strat.values()))
        assert a.err_sum <= prev * (1 + 1e-12)          # more bits never err more
        assert a.lower_bound >= a.objective_value * (1 - 1e-9)   # certified optimal
        prev = a.err_sum


def _parse_range(msg: str) -> tuple[float, float]:
    m = re.search(r"\[(\d+\.\d\d), (\d+\.\d\d)\] bpw", msg)
    assert m, msg
    return float(m.group(1)), float(m.group(2))


def test_out_of_range_target_refused_with_range():
    slots = smol_slots(11)
    numel = SMOL_NUMEL
    true_lo = sum(min(c for c, _ in s) for s in slots) / numel
    true_hi = sum(max(c for c, _ in s) for s in slots) / numel
    assert reachable_bpw(slots, numel) == pytest.approx((true_lo, true_hi))
    for target, side in ((2.0, "below"), (true_lo - 1e-4, "below"), (8.5, "above")):
        with pytest.raises(InputError) as ei:
            allocate(slots, budget_bits(target, numel), numel=numel)
        msg = str(ei.value)
        assert side in msg
        lo, hi = _parse_range(msg)
        # 2 decimals, rounded inwards: every printed target is reachable
        assert true_lo <= lo < true_lo + 0.01 and true_hi - 0.01 < hi <= true_hi
    for target in (lo, hi):
        a = allocate(slots, budget_bits(target, numel), numel=numel)
        assert a.total_bits <= budget_bits(target, numel)
    with pytest.raises(InputError, match=r"budget 5 bits is below the reachable range \["):
        allocate(slots, 5)


def test_bad_arguments():
    slots = [[(10, 0.1), (20, 0.05)]]
    for kw in ({"objective": "median"}, {"power": 0.0}, {"grid": 0}):
        with pytest.raises(ValueError):
            allocate(slots, 15, **kw)
    for bad in ([], [[]], [[(10, float("nan"))]], [[(-1, 0.1)]]):
        with pytest.raises(ValueError):
            allocate(bad, 15)


# --------------------------------------------------------------------------------------------
# The "content" objective: err / q, q the non-sink share of a module output's norm


def test_content_share_excludes_sink_tokens():
    """q = mean over rows of ‖ordinary tokens‖ / ‖all tokens‖, a token being an outlier when
    its norm exceeds 4x the row's median token norm; checked against a per-row loop."""
    import torch

    from quantpress.calibration.exl2_measure import OUTLIER_TOKEN_FACTOR, content_share, module_accuracy

    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 40, 16, generator=g)
    y[:, 0] *= 150.0                                   # an attention sink at position 0
    y[1, 7] *= 3.0                                     # a large but ordinary token
    ref = []
    for row in y:
        tn = row.norm(dim=-1)
        med = tn.median()
        keep = [float(t) ** 2 for t in tn if t <= OUTLIER_TOKEN_FACTOR * med]
        ref.append(math.sqrt(sum(keep)) / float(tn.norm()))
    q = content_share(y)
    assert q == pytest.approx(sum(ref) / len(ref), rel=1e-5)
    assert q < 0.1                                      # the sink dominates ‖y‖
    assert content_share(y[:, 1:]) == pytest.approx(1.0)   # no sink: every token counts
    # err / q is the error relative to the ordinary tokens' norm: perturb only those tokens
    d = torch.randn(3, 40, 16, generator=g) * 0.01
    d[:, 0] = 0
    err = 1 - module_accuracy(y + d, y)
    # the measurement's scorer (one scratch for every candidate) gives the same values
    from quantpress.calibration.exl2_measure import AccuracyScorer
    scorer = AccuracyScorer(y)
    for cand in (y + d, y - 2 * d, y + d):
        assert scorer.score(cand) == module_accuracy(cand, y)
    rel_content = float((d.flatten(1).norm(dim=1) / y[:, 1:].flatten(1).norm(dim=1)).mean())
    assert err / q == pytest.approx(rel_content, rel=0.05)
    assert err < 0.2 * rel_content                     # what the plain err hides


def test_content_slots_divide_errors():
    slots = [[(10, 0.1), (20, 0.05)], [(10, 0.02), (30, 0.01)]]
    out = content_slots(slots, [0.5, 0.1])
    assert out == [[(10, 0.2), (20, 0.1)], [(10, pytest.approx(0.2)), (30, pytest.approx(0.1))]]
    assert content_slots(slots, [1.0, 0.0])[1][0][1] == pytest.approx(0.02 / 1e-6)  # floored q
    for bad, frag in (([0.5], "1 module content shares for 2 slots"),
                      ([0.5, float("nan")], "content share of slot 1 is nan"),
                      ([-0.1, 0.5], "content share of slot 0")):
        with pytest.raises(InputError, match=re.escape(frag)):
            content_slots(slots, bad)


def test_content_objective_moves_bits_to_sink_dominated_slots():
    """The same measured errs, but the second half of the slots has q = 0.1 (their outputs'
    norm is 90% one sink token, as in SmolLM2 layers 11-27): the "content" objective gives
    them more bits than the plain sum, and its choice is the MILP optimum of Σ (err / q)²."""
    normalize, aggregate, power = OBJECTIVE_MODES["content"]
    assert normalize and aggregate == "sum" and power == 2.0
    slots = smol_slots(12)
    q = [1.0] * SMOL_LAYERS + [0.1] * SMOL_LAYERS
    budget = budget_bits(4.0, SMOL_NUMEL)
    scaled = content_slots(slots, q)
    a = allocate(scaled, budget, power=power)
    plain = allocate(slots, budget)
    half = len(slots) // 2
    bits = lambda ch: sum(slots[s][j][0] for s, j in enumerate(ch) if s >= half)
    assert bits(a.choice) > bits(plain.choice)
    ref_choice, _ = milp_reference(scaled, budget, power=power)
    ref = sum(e ** 2 for e in cost_err(scaled, ref_choice)[1])
    assert abs(a.objective_value - ref) <= 1e-9 * ref and a.total_bits <= budget


def test_content_probe_matches_a_transformers_forward(tiny_llama_dir, tmp_path):
    """ContentProbe on the streaming engine against transformers' own forward of the same
    model, whose first token carries a massive embedding (an artificial sink, so that ρ is far
    from 1): the attention block's output (layer input + self_attn output) and the layer's
    output, taken by hooks, give the same ρ per module key; the measurement pass
    (``Measurer.content``) records the same values."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantpress.calibration import engine
    from quantpress.calibration.exl2_measure import ContentProbe, content_share

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    sink = 7
    with torch.no_grad():
        model.model.embed_tokens.weight[sink] *= 300.0
    model.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(100, 49152, (2, 48), generator=g)
    tokens[:, 0] = sink
    sm = engine.StreamingModel(tmp_path, "cpu", torch.float32)
    probe = ContentProbe()
    engine.run(sm, tokens, on_layer=probe.on_layer, progress=False)
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen.__setitem__(("in", i), a[0] if a else kw["hidden_states"]),
            with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(("attn", i), out[0])))
        hooks.append(layer.register_forward_hook(
            lambda m, a, out, i=i: seen.__setitem__(("out", i), out[0] if isinstance(out, tuple) else out)))
    with torch.no_grad():
        model(tokens)
    for h in hooks:
        h.remove()
    assert len(probe.results) == 2 * len(model.model.layers)
    # the measurement pass records the same shares (one option per module keeps it fast)
    from quantpress.calibration.exl2_measure import Measurer
    from quantpress.quantize import exl2 as qexl2

    m = Measurer(int(tokens.shape[0]), attn_opts=qexl2.attn_options()[:1],
                 mlp_opts=qexl2.mlp_options()[:1])
    engine.run(sm, tokens, hooks_factory=m.hooks, on_layer=m.on_layer, progress=False)
    assert m.content.keys() == probe.results.keys()
    for k, v in m.content.items():
        assert v == pytest.approx(probe.results[k], rel=1e-5), k
    for i in range(len(model.model.layers)):
        y_attn = seen[("in", i)] + seen[("attn", i)]
        ref_attn, ref_mlp = content_share(y_attn), content_share(seen[("out", i)])
        assert ref_attn < 0.5 and ref_mlp < 0.5                 # the sink dominates the norm
        assert probe.results[f"model.layers.{i}.self_attn"] == pytest.approx(ref_attn, rel=1e-4)
        assert probe.results[f"model.layers.{i}.mlp"] == pytest.approx(ref_mlp, rel=1e-4)
