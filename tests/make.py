"""Outputs made through the runner, as the CLI verbs make them, with the tests' defaults: CPU,
no progress bars, and (for calibrated targets) 4 rows of 64 tokens."""
from __future__ import annotations

from pathlib import Path

from quantpress.targets import (AWQOptions, CalibOptions, ComputeOptions, EXL2MeasurementOptions,
                                EXL2Options, GGUFOptions, ImatrixOptions, Source, Summary, produce)


def source(path, samples: int = 4, seqlen: int = 64, device: str = "cpu", dtype: str | None = None,
           batch_tokens: int = 4096, cal_dir=None, **calib) -> Source:
    """A :class:`Source` for tests: CPU, 4 × 64 calibration tokens unless told otherwise."""
    return Source(path, ComputeOptions(device=device, dtype=dtype, batch_tokens=batch_tokens),
                  CalibOptions(samples=samples, seqlen=seqlen, **calib), progress=False, cal_dir=cal_dir)


def _make(options, src, out, force: bool, **kw) -> Summary:
    s = src if isinstance(src, Source) else source(src, **kw)
    return produce(options, s, Path(out), force=force, progress=False)


def gguf(src, out, policy: str = "F16", force: bool = False, imatrix=None, **kw) -> Summary:
    """``convert hf-to-gguf`` / ``quantize gguf`` (``imatrix``: ``--imatrix FILE``)."""
    return _make(GGUFOptions(policy, imatrix=None if imatrix is None else str(imatrix)), src, out, force, **kw)


def awq(src, out, force: bool = False, samples: int = 4, seqlen: int = 64, device: str = "cpu",
        **opts) -> Summary:
    """``quantize awq`` with :class:`AWQOptions` ``opts``."""
    return _make(AWQOptions(**opts), src, out, force, samples=samples, seqlen=seqlen, device=device)


def exl2(src, out, force: bool = False, samples: int = 4, seqlen: int = 64, device: str = "cpu",
         **opts) -> Summary:
    """``quantize exl2`` with :class:`EXL2Options` ``opts``."""
    return _make(EXL2Options(**opts), src, out, force, samples=samples, seqlen=seqlen, device=device)


def measurement(src, out, force: bool = False, **kw) -> Summary:
    """``quantize exl2 --measure-only``."""
    return _make(EXL2MeasurementOptions(), src, out, force, **kw)


def imatrix(src, out, force: bool = False, **kw) -> Summary:
    """``quantize imatrix``."""
    return _make(ImatrixOptions(), src, out, force, **kw)


def evaluate(base, outputs=(), text=None, ctx: int = 512, chunks: int | None = None,
             device: str = "cpu", progress: bool = False, cal_dir=None):
    """``quantize eval`` (:func:`quantpress.targets.eval.evaluate`)."""
    from quantpress.targets.eval import EvalOptions, evaluate as run

    return run(base, list(outputs), EvalOptions(None if text is None else str(text), ctx, chunks),
               ComputeOptions(device=device), progress=progress, cal_dir=cal_dir)


def digests(p) -> dict[str, str]:
    """SHA-256 of an output: a file → {its name: digest}; a directory → every file below it by
    relative path."""
    import hashlib

    p = Path(p)
    if p.is_file():
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()}
    return {str(f.relative_to(p)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(p.rglob("*")) if f.is_file()}


def logits_both(model, ours_sm, ids):
    """(theirs, ours): float32 logits of ``ids`` [rows, seq] from a transformers ``model`` and
    from quantpress's streaming model ``ours_sm`` (dequantized by our reader) of the same
    output directory."""
    import torch

    from quantpress.calibration import engine

    with torch.no_grad():
        theirs = model(ids).logits
    return theirs, ours_sm.final_logits(engine.run(ours_sm, ids, progress=False))
