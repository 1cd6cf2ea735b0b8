"""The EXL2 measurement as an output of its own: measurement.json (``quantize exl2
--measure-only FILE``, exllamav2 ``-om``; the file a batch shares between a model's EXL2
targets), made by :class:`EXL2MeasurementTarget` from the measurement pass
(:class:`quantpress.calibration.exl2_measure.Measurer`, exllamav2 ``conversion/measure.py``)
over the reference hidden states, and its round trip (:func:`verify_measurement`).
"""
from __future__ import annotations

from pathlib import Path

from quantpress.calibration import exl2_measure as cm
from quantpress.calibration import exl2_measurement as mfile
from quantpress.errors import InputError, RoundTripError
from quantpress.targets.base import Run, Summary, Target, reference_pass
from quantpress.targets.exl2_model import EXL2Model, layer_seconds
from quantpress.targets.exl2_options import KIND, EXL2MeasurementOptions
from quantpress.targets.registry import Estimate

#: file name of the EXL2 measurement a batch shares between a model's EXL2 outputs
MEASUREMENT_FILE = "measurement.json"


def verify_measurement(path: Path, text: str, num_layers: int, shapes: dict) -> str:
    """Round trip of a written measurement.json: it must validate against the model
    (:func:`quantpress.calibration.exl2_measurement.read_measurement`: layer count, every
    option's total_bits for these shapes) and hold exactly ``text``. RoundTripError otherwise."""
    try:
        mfile.read_measurement(path, expect_layers=num_layers, expect_shapes=shapes)
    except InputError as e:
        raise RoundTripError(f"round trip: {e}") from None
    if path.read_text(encoding="utf-8") != text:
        raise RoundTripError(f"round trip: {path} differs from the measurement made")
    return f"ok (re-read and validated: {num_layers} layers, every option's total_bits)"


class EXL2MeasurementTarget(Target, kind="measurement", options=EXL2MeasurementOptions):
    """measurement.json of the source (:class:`EXL2MeasurementOptions`). Bad input
    (InputError, in :meth:`prepare`): what :class:`~quantpress.targets.exl2_model.EXL2Model`
    refuses, too little calibration text."""

    reference_stage = "measurement"
    measurer: cm.Measurer | None = None
    job_order = 60
    runtimes = "exllamav2 convert.py -m, quantize exl2 --measurement"
    stream = "reference"
    is_model = False

    @classmethod
    def job_target(cls, options: EXL2MeasurementOptions) -> str:
        return KIND

    @classmethod
    def job_path(cls, name: str, options: EXL2MeasurementOptions) -> str:
        return MEASUREMENT_FILE

    @classmethod
    def estimate(cls, info, options: list[EXL2MeasurementOptions]) -> Estimate:
        """The layer's four Hessians and, per module (two side by side), one candidate's
        forward and one batched GPTQ call (``calibration.exl2_measure.GPTQ_BATCH_BYTES``)."""
        h, f = info.hidden, info.ffn
        hess = 4 * (2 * h * h + (info.heads * info.head_dim) ** 2 + f * f)
        module = 4 * min(info.tokens, 4096) * (4 * f + 4 * h) + cm.GPTQ_BATCH_BYTES
        return Estimate([40_000 * info.layers for _ in options],
                        consumers=[info.layer + hess + 2 * module for _ in options])

    def prepare(self, run: Run) -> None:
        self.m = EXL2Model(self.source)
        self.m.calibrate(run)

    def wants_reference(self) -> bool:
        """exllamav2 measures every module on the reference hidden states."""
        return True

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> cm.Measurer:
        """The measurer (the file is written at the end: nothing to resume in ``tmp``)."""
        self.measurer = self.m.measurer()
        return self.measurer

    def write(self, tmp: Path, run: Run) -> None:
        if self.measurer is None:
            self.reference_consumer(tmp, run)
            with run.stage("measurement"):
                reference_pass(self.source, [self.measurer], run.progress)
        self.timings = self.measurer.timings
        modules, last, shares = self.m.measured(self.measurer)
        self.text = mfile.measurement_text(modules, last, source="measurement pass", content_share=shares)
        mfile.write_measurement(tmp, modules, last, content_share=shares)

    def verify(self, tmp: Path, run: Run) -> str:
        return verify_measurement(tmp, self.text, self.m.L, self.m.shapes)

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        rows, seqlen = tuple(self.m.rows.shape)
        return Summary(self.kind, "exl2", out, str(self.source.path), roundtrip=roundtrip,
                       lines=[f"layers     {self.m.L} (attention and MLP options of each)",
                              f"calibration {rows} rows x {seqlen} tokens of {self.m.text}",
                              f"detail     GPTQ {self.timings.gptq:.1f} s (scale search "
                              f"{self.timings.search:.1f} s), forwards "
                              f"{self.timings.forward:.1f} s, Hessians {self.timings.hessian:.1f} s"],
                       details={"num_layers": self.m.L, "calibration": {"rows": rows, "seqlen": seqlen},
                                "detail": {"measurement_gptq": self.timings.gptq,
                                           "measurement_forward": self.timings.forward,
                                           "measurement_hessian": self.timings.hessian,
                                           "measurement_search": self.timings.search},
                                "measurement_layers": layer_seconds(self.measurer)})
