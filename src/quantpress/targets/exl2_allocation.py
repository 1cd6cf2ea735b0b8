"""EXL2's bit allocation at the target level: the budget of a target bpw and the range this
model can reach (:func:`cost_slots`, :func:`check_target`, before anything is measured), and
one option per module chosen from a measurement (:func:`allocate_options`) under the
objective :attr:`~quantpress.targets.exl2_options.EXL2Options.objective` names, with the
content shares ρ of the ``"content"`` objective (:func:`content_shares` when the measurement
lacks them). The knapsack itself is :func:`quantpress.calibration.exl2_alloc.allocate`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from quantpress.calibration import engine
from quantpress.calibration import exl2_alloc as alloc
from quantpress.calibration import exl2_measure as cm
from quantpress.calibration import exl2_measurement as mfile
from quantpress.errors import InputError
from quantpress.quantize import exl2 as qexl2
from quantpress.targets.exl2_model import EXL2Model

#: the achieved decoder bpw lies in [target − BPW_WINDOW, target] (dearer options are taken
#: when the optimum of the objective spends less)
BPW_WINDOW = 0.05


def cost_slots(shapes: dict, num_layers: int) -> list[list[tuple[int, float]]]:
    """Per slot (attn, mlp per layer), the costs of the candidate options for these shapes
    (err 0): the reachable bpw range before anything is measured."""
    cost = mfile.module_cost_fn(shapes)
    a = [(cost({n: qp.as_dict() for n, qp in o.items()}, "attn"), 0.0) for o in qexl2.attn_options()]
    m = [(cost({n: qp.as_dict() for n, qp in o.items()}, "mlp"), 0.0) for o in qexl2.mlp_options()]
    return [a, m] * num_layers


def check_target(bpw: float, slots, numel: int) -> int:
    """The budget in bits for ``bpw``; InputError stating the reachable range when ``bpw`` is
    outside it (rounded inwards to 2 decimals, so every printed value is reachable)."""
    budget = alloc.budget_bits(bpw, numel)
    lo, hi = alloc.reachable_bits(slots)
    if not lo <= budget <= hi:
        rlo, rhi = math.ceil(lo / numel * 100) / 100, math.floor(hi / numel * 100) / 100
        raise InputError(f"--bpw {bpw}: outside the reachable range [{rlo:.2f}, {rhi:.2f}] bpw "
                         f"of this model's decoder layers (all cheapest / all most expensive options)")
    return budget


def content_shares(sm: engine.StreamingModel, rows: torch.Tensor, batch_size: int,
                   progress: bool = True) -> dict[str, float]:
    """Each decoder module output's content share ρ (measurement key → ρ, dimensionless;
    :func:`quantpress.calibration.exl2_measure.content_share`) from one unquantized forward
    pass over the calibration ``rows`` (int64 [rows, seqlen]): what the ``"content"`` objective
    needs when a measurement is reused."""
    p = cm.ContentProbe()
    engine.run(sm, rows, on_layer=p.on_layer, batch_size=batch_size, progress=progress)
    return p.results


@dataclass
class Allocated:
    """What :func:`allocate_options` chose: ``allocation`` (the knapsack's
    :class:`~quantpress.calibration.exl2_alloc.Allocation`, one option index per slot: attn,
    mlp per layer), ``measurement`` (the measurement it was chosen from, with the content
    shares it used), ``strategy`` (measurement key → the chosen option, as exllamav2's
    quantizer takes it), ``errs`` (each slot's measured error, in slot order),
    ``objective_value`` (the sum or the maximum the objective minimized), ``content`` (per
    layer the (attn, mlp) content shares; empty for an objective without them) and
    ``forward_seconds`` (the forward pass that computed missing shares; None when none ran)."""

    allocation: alloc.Allocation
    measurement: mfile.Measurement
    strategy: dict
    errs: list[float]
    objective_value: float
    content: list[tuple[float, float]]
    forward_seconds: float | None = None


def allocate_options(meas: mfile.Measurement, m: EXL2Model, objective: str, bpw: float, budget: int,
                     progress: bool = True) -> Allocated:
    """One option per decoder module of the model ``m`` (calibrated) from the measurement
    ``meas`` under ``budget`` bits (:func:`check_target` of ``bpw``), spending at least
    ``bpw`` − :data:`BPW_WINDOW` per weight, minimizing ``objective`` (a key of
    :data:`quantpress.calibration.exl2_alloc.OBJECTIVE_MODES`). The ``"content"`` objective
    weighs each module's error by its content share; a measurement written without them
    (exllamav2's) gets them from one unquantized forward pass (:func:`content_shares`).
    InputError (from the knapsack) when ``budget`` lies outside the measurement's reachable
    range."""
    by_content, aggregate, power = alloc.OBJECTIVE_MODES[objective]
    shares = meas.content_share
    slots = meas.slots()
    content: list[tuple[float, float]] = []
    forward = None
    if by_content:
        if shares is None:  # a measurement written without them (exllamav2's)
            t0 = time.perf_counter()
            shares = content_shares(m.sm, m.rows, m.batch, progress)
            forward = time.perf_counter() - t0
            meas = mfile.Measurement(meas.modules, meas.last_module_idx, meas.num_layers, shares)
        rho = [shares[k] for k in meas.slot_keys()]
        content = [(rho[2 * i], rho[2 * i + 1]) for i in range(m.L)]
        slots = alloc.content_slots(slots, rho)
    a = alloc.allocate(slots, budget, numel=m.numel, objective=aggregate, power=power,
                       min_bits=alloc.budget_bits(float(bpw) - BPW_WINDOW, m.numel))
    errs = [s[j][1] for s, j in zip(meas.slots(), a.choice)]
    return Allocated(a, meas, meas.strategy(a.choice), errs,
                     a.objective_value if aggregate == "sum" else a.err_max, content, forward)
