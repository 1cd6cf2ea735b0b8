"""The options of the two EXL2 outputs and the steps of ``quantize exl2``:
:class:`EXL2Options` (a directory at a target bpw, exllamav2 0.3.2 ``convert.py``'s ``-b`` /
``-hb`` / ``-m`` / ``-ss``), :class:`EXL2MeasurementOptions` (measurement.json alone, ``-om``)
and :func:`exl2_steps` (which of them one command makes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from quantpress.calibration import exl2_alloc as alloc
from quantpress.convert import exl2_dir
from quantpress.errors import InputError
from quantpress.quantize import exl2 as qexl2
from quantpress.targets.options import option
from quantpress.targets.registry import Step

#: the kind of the EXL2 directory target (a batch's table names its measurement by it too)
KIND = "exl2"
#: the head bits exllamav2 offers (``-hb``; :func:`quantpress.quantize.exl2.head_options`)
HEAD_BITS = (2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class EXL2Options:
    """``bpw``: target bits per weight of the decoder layers (exllamav2 ``-b``); ``head_bits``:
    lm_head bits (2, 3, 4, 5, 6 or 8; ``-hb``); ``measurement``: reuse this measurement.json
    (``-m``; None: measure); ``objective``: what the allocation minimizes (``content``,
    ``sum`` or ``max``, :data:`quantpress.calibration.exl2_alloc.OBJECTIVE_MODES`);
    ``max_shard_size``: MB per output file (``-ss``; 0 = one file)."""

    bpw: float = option(flag="--bpw", help="target bits per weight of the decoder layers "
                                           "(exllamav2 -b; required unless --measure-only)")
    head_bits: int = option(6, flag="--head-bits", help="lm_head bits: 2, 3, 4, 5, 6 or 8 (default {default})")
    # job files share one measurement per model (exl2_measurement), not one per table
    measurement: str | None = option(None, flag="--measurement", job=False,
                                     help="reuse this measurement.json (skips the measurement pass)")
    objective: str = option(alloc.DEFAULT_OBJECTIVE, flag="--objective", choices=tuple(alloc.OBJECTIVE_MODES),
                            help="bit allocation: minimize the sum of squared module errors relative "
                                 "to the norm of the non-sink tokens (content, default), the sum of "
                                 "exllamav2's module errors (sum) or their maximum (max, exllamav2's intent)")
    max_shard_size: float = option(exl2_dir.DEFAULT_SHARD_MB, flag="--max-shard-size",
                                   help="MB per output file (exllamav2 -ss; default {default}, 0 = one file)")

    def validate(self) -> None:
        """InputError naming the option: bpw not a positive number, head bits not in
        {2,3,4,5,6,8}, an unknown objective, a negative shard size."""
        if isinstance(self.bpw, bool) or not isinstance(self.bpw, (int, float)) \
                or not math.isfinite(self.bpw) or self.bpw <= 0:
            raise InputError(f"--bpw {self.bpw!r}: expected a positive number of bits per weight")
        head_qparams(self.head_bits)
        if self.objective not in alloc.OBJECTIVE_MODES:
            raise InputError(f"--objective {self.objective!r}: choose one of "
                             f"{', '.join(alloc.OBJECTIVE_MODES)}")
        exl2_dir.shard_bytes(self.max_shard_size)

    @property
    def label(self) -> str:
        """The target bpw as given ("4.0", "4.25")."""
        return f"{float(self.bpw)}"


@dataclass(frozen=True)
class EXL2MeasurementOptions:
    """``quantize exl2 --measure-only FILE``: the measurement pass alone, written as
    measurement.json (exllamav2 ``-om``). No options of its own: calibration and compute are
    the source's."""

    def validate(self) -> None:
        """Nothing to check."""


def head_qparams(head_bits) -> qexl2.QParams:
    """The head's setting for ``head_bits`` (:func:`quantpress.quantize.exl2.head_options`).
    InputError unless it is one of :data:`HEAD_BITS`."""
    try:
        hb = int(head_bits)
        if hb != head_bits or hb not in HEAD_BITS:
            raise ValueError
        return qexl2.head_options(hb)
    except (ValueError, TypeError):
        raise InputError(f"--head-bits {head_bits}: choose one of "
                         f"{', '.join(map(str, HEAD_BITS))}") from None


def exl2_steps(args, options: EXL2Options) -> list[Step]:
    """The steps of ``quantize exl2``: with ``--measure-only FILE`` the measurement alone at
    FILE, else the EXL2 directory at ``-o``. InputError for --measure-only with
    --measurement, and for a missing -o or --bpw without --measure-only."""
    if args.measure_only is not None:
        if args.measurement is not None:
            raise InputError("--measure-only and --measurement exclude each other (one writes a "
                             "measurement, the other reuses one)")
        return [Step(EXL2MeasurementOptions(), args.measure_only)]
    if args.output is None:
        raise InputError("-o/--output is required (or --measure-only FILE)")
    if args.bpw is None:
        raise InputError("--bpw is required (or --measure-only FILE)")
    return [Step(options, args.output)]
