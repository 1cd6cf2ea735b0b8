"""Output targets (one per output kind) and the runner they share.

Importing this package registers every target; :func:`produce` makes one verified output::

    from quantpress.targets import AWQOptions, CalibOptions, Source, produce

    src = Source("models/SmolLM2-135M-Instruct", calib=CalibOptions(samples=16, seqlen=256))
    summary = produce(AWQOptions(group_size=64), src, "smollm2-awq-w4g64")
    print(summary.text())

A new output kind is an options dataclass whose fields declare their flags, help, defaults
and job-file keys (:func:`quantpress.targets.options.option`) and a
:class:`~quantpress.targets.target.Target` subclass declared for it (``class MyTarget(Target,
kind="my", options=MyOptions)``) with its verbs, job-file key, stream, needs and estimate
(:mod:`quantpress.targets.registry`); the CLI and ``quantize batch`` take everything from
those declarations (example: tests/int8_target.py). Installed packages can add targets through
the ``quantpress.targets`` entry-point group.
"""
from quantpress.targets.awq import AWQOptions
from quantpress.targets.base import (CalibOptions, ComputeOptions, Run, Source, Summary, Target,
                                     calibration_rows, check_output, produce)
from quantpress.targets.exl2 import EXL2MeasurementOptions, EXL2Options
from quantpress.targets.fp8 import FP8Options
from quantpress.targets.gguf import GGUFOptions
from quantpress.targets.gptq import GPTQOptions
from quantpress.targets.imatrix import ImatrixOptions

__all__ = ["AWQOptions", "CalibOptions", "ComputeOptions", "EXL2MeasurementOptions", "EXL2Options",
           "FP8Options", "GGUFOptions", "GPTQOptions", "ImatrixOptions", "Run", "Source", "Summary",
           "Target", "calibration_rows", "check_output", "produce"]
