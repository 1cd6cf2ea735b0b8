"""The source model as both EXL2 targets check and read it (:class:`EXL2Model`): the
llama-like decoder layout EXL2 needs (:func:`linear_shapes`), the kernel's limits on
in_features (:func:`check_in_features`), the decoder numel the bpw budget counts, and the
calibration rows; :func:`layer_seconds` reports a finished measurement pass per layer.
"""
from __future__ import annotations

from pathlib import Path

from quantpress.calibration import engine
from quantpress.calibration import exl2_alloc as alloc
from quantpress.calibration import exl2_measure as cm
from quantpress.calibration import exl2_measurement as mfile
from quantpress.errors import InputError
from quantpress.memory import bound_heap
from quantpress.quantize import exl2 as qexl2
from quantpress.targets.base import Run, Source


def linear_shapes(sm: engine.StreamingModel) -> dict[str, tuple[int, int, bool]]:
    """``{linear name: (in_features, out_features, has_bias)}`` of the decoder layers (read from
    the meta skeleton, no weights). InputError when a layer lacks a linear or the layers differ
    (EXL2 needs the llama-like q/k/v/o + gate/up/down layout)."""
    shapes = None
    for i in range(sm.num_layers):
        layer = sm.layer_skeleton(i)
        s = {}
        for mode, names in cm.MODULES.items():
            for n in names:
                lin = cm.linear_of(layer, mode, n, i)
                s[n] = (int(lin.in_features), int(lin.out_features), lin.bias is not None)
        if shapes is None:
            shapes = s
        elif s != shapes:
            raise InputError(f"{sm.dir}: decoder layer {i} has linear shapes {s}, layer 0 has "
                             f"{shapes}; EXL2 measurement needs identical layers")
    if shapes is None:
        raise InputError(f"{sm.dir}: the model has no decoder layers")
    return shapes


def check_in_features(shapes: dict, head_in: int, model_dir: Path) -> None:
    """Every quantized linear's in_features must be a multiple of 32 (group and bit-segment
    boundaries) and at most 65535 (the loader's int16 permutation). InputError naming it."""
    for name, k in [(n, s[0]) for n, s in shapes.items()] + [("lm_head", head_in)]:
        if k > qexl2.MAX_IN_FEATURES:
            raise InputError(f"{model_dir}: {name} has in_features {k} > {qexl2.MAX_IN_FEATURES}; "
                             f"exllamav2's kernel cannot load it")
        if k % 32:
            raise InputError(f"{model_dir}: {name} has in_features {k}, not a multiple of 32; "
                             f"EXL2 groups need multiples of 32 input rows")


class EXL2Model:
    """What both EXL2 targets check and keep about the source: the streaming model, the
    linear shapes and the decoder numel (checked on the meta skeleton, nothing read), then
    (:meth:`calibrate`) the calibration rows. InputError on creation: non-HF input, layers
    whose linears differ or are missing, an in_features the kernel cannot take."""

    def __init__(self, source: Source):
        bound_heap()
        source.require_hf("EXL2")
        self.source = source
        self.sm = source.streaming_model()
        self.L = self.sm.num_layers
        self.shapes = linear_shapes(self.sm)
        check_in_features(self.shapes, int(self.sm.head_skeleton().in_features), source.path)
        self.numel = alloc.decoder_numel(self.L, {n: s[:2] for n, s in self.shapes.items()})

    def calibrate(self, run: Run) -> None:
        """The calibration rows (stage "tokenize") and the rows per forward batch."""
        with run.stage("tokenize"):
            self.rows, self.text = self.source.calibration_rows()
        self.batch = self.source.batch_rows(self.rows.shape[1])

    def measurer(self) -> cm.Measurer:
        """A measurement pass consumer (:class:`quantpress.calibration.exl2_measure.Measurer`)
        for the reference hidden states of the calibration rows."""
        return cm.Measurer(int(self.rows.shape[0]), prefix=self.sm.layer_prefix)

    def measured(self, m: cm.Measurer) -> tuple[dict, int, dict]:
        """``(measurement dict, last_module_idx, content shares)`` of a finished measurement
        pass, as measurement.json holds them, validated against the model (InputError when
        the pass's result does not fit it)."""
        modules, last = cm.measurement_dict(m.results, self.sm.num_layers, self.sm.norm_name,
                                            self.sm.lm_head_name)
        mfile.validate_schema({"measurement": modules, "last_module_idx": last},
                              source="measurement pass", expect_layers=self.L,
                              cost=mfile.module_cost_fn(self.shapes))
        return modules, last, dict(m.content)


def layer_seconds(measurer: cm.Measurer) -> list[dict]:
    """The measurement pass's wall seconds per decoder layer, in layer order:
    ``[{"gptq": s, "forward": s, "hessian": s, "search": s}, ...]`` (GPTQ of the candidate
    settings, module forwards, XᵀX accumulation, and the scale searches inside GPTQ;
    :class:`calibration.exl2_measure.Timings`)."""
    return [{k: round(v, 3) for k, v in vars(t).items()} for t in measurer.per_layer]
