"""The summary of a finished EXL2 directory (:func:`dir_summary`): the achieved decoder bpw
against the target, the head's setting, the allocation's objective and module errors, the
option chosen for every layer's attention and MLP, and the stage details; the JSON details
carry the same per layer (with the content shares the allocation weighed them by).
"""
from __future__ import annotations

from pathlib import Path

from quantpress.calibration import exl2_measure as cm
from quantpress.calibration import exl2_measurement as mfile
from quantpress.quantize import exl2 as qexl2
from quantpress.targets.base import Summary
from quantpress.targets.exl2_allocation import Allocated
from quantpress.targets.exl2_model import EXL2Model
from quantpress.targets.exl2_options import KIND, EXL2Options

#: what each objective minimizes, in words (summary text)
OBJECTIVE_TEXT = {"content": "sum of squared module errors relative to the non-sink tokens' norm",
                  "sum": "sum of module errors", "max": "maximum module error"}


def setting_text(option: dict, names) -> str:
    """One module option in words, ``"q 4/3 (.1/.9) g128, k ..."``: each linear of ``names``
    by the first part of its name and its :class:`quantpress.quantize.exl2.QParams`."""
    return ", ".join(f"{n.split('_')[0]} {qexl2.QParams.from_dict(option[n])}" for n in names)


def dir_summary(o: EXL2Options, m: EXL2Model, chosen: Allocated, rec: cm.LinearRecord,
                detail: dict[str, float], measurement_layers: list[dict], out: Path,
                roundtrip: str, tensor_bytes: int) -> Summary:
    """The :class:`~quantpress.targets.base.Summary` of the EXL2 directory at ``out`` made
    with options ``o`` from the calibrated model ``m``: ``chosen`` the allocation
    (:func:`~quantpress.targets.exl2_allocation.allocate_options`), ``rec`` the quantized
    lm_head's record, ``detail`` the seconds of the passes' parts (in the order they ran),
    ``measurement_layers`` the measurement pass per layer
    (:func:`~quantpress.targets.exl2_model.layer_seconds`; [] for a reused measurement),
    ``roundtrip`` the round trip's text, ``tensor_bytes`` the bytes the tensors take."""
    a = chosen.allocation
    L = m.L
    choices = [(a.choice[2 * i], a.choice[2 * i + 1]) for i in range(L)]
    options = [tuple(setting_text(chosen.strategy[mfile.layer_key(i, mode)], cm.MODULES[mode])
                     for mode in ("self_attn", "mlp")) for i in range(L)]
    head_rtn = rec.shape[0] * rec.shape[1] > cm.RTN_HEAD_NUMEL
    head = (f"{rec.name} {rec.qparams} ({'round-to-nearest' if head_rtn else 'GPTQ'}), "
            f"{rec.bits / (rec.shape[0] * rec.shape[1]):.3f} bpw")
    decoder_bpw = a.total_bits / max(1, m.numel)
    rows, seqlen = tuple(m.rows.shape)
    measurement = o.measurement if o.measurement is not None else "measured"
    errs = chosen.errs
    lines = [f"decoder    {decoder_bpw:.4f} bpw ({a.total_bits} bits / {m.numel} weights) "
             f"for a target of {o.bpw}; head {o.head_bits} bits: {head}",
             f"allocation objective '{o.objective}' ({OBJECTIVE_TEXT[o.objective]}) = "
             f"{chosen.objective_value:.5f}; module errors: sum {sum(errs):.5f}, "
             f"max {max(errs):.5f}; measurement {measurement}",
             f"calibration {rows} rows x {seqlen} tokens of {m.text}",
             "options per layer (attn / mlp):"]
    lines += [f"    {i:3d}: attn {ai:2d} [{sa}]  mlp {mi:2d} [{sm_}]"
              for i, ((ai, mi), (sa, sm_)) in enumerate(zip(choices, options))]
    if detail:
        lines.append("detail     " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                               for k, v in detail.items()))
    layers = [{"layer": i, "attn": ai, "mlp": mi, "attn_setting": sa, "mlp_setting": sm_,
               **({"share_attn": sc[0], "share_mlp": sc[1]} if sc else {})}
              for i, ((ai, mi), (sa, sm_), sc) in enumerate(
                  zip(choices, options, chosen.content or [None] * L))]
    details = {"target_bpw": o.bpw, "head_bits": o.head_bits, "measurement": measurement,
               "decoder_bpw": round(decoder_bpw, 4), "decoder_bits": a.total_bits,
               "decoder_numel": m.numel, "objective": o.objective,
               "objective_value": chosen.objective_value, "err_sum": sum(errs),
               "err_max": max(errs), "head": head,
               "calibration": {"rows": rows, "seqlen": seqlen}, "num_layers": L,
               "detail": {k: round(v, 2) for k, v in detail.items()}, "layers": layers,
               "measurement_layers": measurement_layers}
    return Summary(KIND, o.label, out, str(m.source.path),
                   tensor_bytes=tensor_bytes, parameters=m.source.parameter_count(),
                   roundtrip=roundtrip, details=details, lines=lines)
