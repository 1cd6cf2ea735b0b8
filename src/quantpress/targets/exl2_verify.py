"""The round trip of an EXL2 directory (:func:`verify_exl2_dir`): the final files re-read,
every linear checked against the exllamav2 kernel's constraints and reconstructed in pure
torch (:func:`quantpress.quantize.exl2.reconstruct`, :data:`VERIFY_ROWS` output rows at a
time), its SHA-256 compared with the quantizer's fake-quantized float16 weight's.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from quantpress.calibration import exl2_measure as cm
from quantpress.convert import exl2_dir
from quantpress.errors import RoundTripError
from quantpress.quantize import exl2 as qexl2

#: output rows reconstructed at a time by the round trip (a multiple of 32)
VERIFY_ROWS = 4096



def reconstructed_digest(name: str, t: dict, shape: tuple[int, int]) -> str:
    """:func:`quantpress.calibration.awq.tensor_digest` of the float16 weight [N, K] that
    :func:`quantpress.quantize.exl2.reconstruct` makes of the stored tensors ``t`` (by suffix:
    q_weight, q_scale, q_scale_max, q_groups, q_invperm), computed :data:`VERIFY_ROWS` output
    rows (stored columns) at a time, so the head of a large vocabulary is never reconstructed
    whole. Raises RoundTripError on a shape mismatch."""
    N, K = shape
    h = hashlib.sha256(f"{torch.float16}{(N, K)}".encode())
    for n0 in range(0, N, VERIFY_ROWS):
        n1 = min(N, n0 + VERIFY_ROWS)
        last = n1 == N
        qw = t["q_weight"][:, n0:] if last else t["q_weight"][:, n0:n1]
        qs = t["q_scale"][:, n0 // 8:] if last else t["q_scale"][:, n0 // 8:n1 // 8]
        deq = qexl2.reconstruct(qw, qs, t["q_scale_max"], t["q_groups"], t["q_invperm"], n1 - n0)
        if tuple(deq.shape) != (n1 - n0, K):
            raise RoundTripError(f"round trip: '{name}' rows {n0}..{n1 - 1} reconstruct to "
                                 f"{tuple(deq.shape)}, expected {(n1 - n0, K)}")
        h.update(deq.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def verify_exl2_dir(path: Path, records: list[cm.LinearRecord], expected: set[str]) -> str:
    """Round trip of a written EXL2 directory: the final files must hold exactly the
    ``expected`` tensor names; every linear of ``records`` is read back, checked with
    :func:`quantpress.quantize.exl2.check_kernel_constraints` and reconstructed by
    :func:`quantpress.quantize.exl2.reconstruct`; the SHA-256 of the float16 result must equal
    the quantizer's (``record.digest``), and a linear with a bias must have it. Raises
    RoundTripError naming the first tensor that differs."""
    w = exl2_dir.EXL2Weights(path, {r.name: r.shape[0] for r in records})
    stored = set(w.raw.keys())
    if stored != expected:
        extra, missing = sorted(stored - expected), sorted(expected - stored)
        raise RoundTripError(f"round trip: {path} holds tensors {extra[:3]} not written and "
                             f"lacks {missing[:3]}")
    for r in records:
        if not w.is_quantized(r.name + ".weight"):
            raise RoundTripError(f"round trip: '{r.name}' has no q_weight in {path}")
        t = w.q_tensors(r.name)
        try:
            qexl2.check_kernel_constraints(t["q_weight"], t["q_scale"], t["q_scale_max"],
                                           t["q_groups"], t["q_invperm"])
        except ValueError as e:
            raise RoundTripError(f"round trip: '{r.name}' violates the EXL2 kernel's "
                                 f"constraints: {e}") from None
        if t["q_invperm"].numel() != r.shape[1]:
            raise RoundTripError(f"round trip: '{r.name}.q_invperm' has {t['q_invperm'].numel()} "
                                 f"rows, expected in_features {r.shape[1]}")
        if r.has_bias != (f"{r.name}.bias" in w.raw):
            raise RoundTripError(f"round trip: '{r.name}.bias' "
                                 f"{'missing' if r.has_bias else 'unexpected'}")
        if reconstructed_digest(r.name, t, tuple(r.shape)) != r.digest:
            raise RoundTripError(f"round trip failed: '{r.name}' reconstructed from {path} "
                                 f"differs from the quantizer's fake-quantized weights")
    w.close()
    return (f"ok ({len(records)} linears bit-identical to the fake-quantized weights, kernel "
            f"constraints met)")
