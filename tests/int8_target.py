"""An output kind defined outside the package, for tests/test_extra_target.py: int8 weights,
one float32 scale per output row (symmetric, scale = max |w| / 127), in one safetensors file
beside the source's config.json. Importing this module registers it (verb ``quantize int8``,
job-file key ``int8``); nothing in ``cli/`` or ``batch/`` names it.

The round trip re-reads the written file: every quantized tensor must be int8 with its scale,
dequantize to within half a step of the source weight, and equal the codes this module computes
again from the source; every other tensor must equal the source's bit for bit.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantpress.errors import InputError, RoundTripError
from quantpress.targets.base import Run, Summary, Target
from quantpress.targets.options import option
from quantpress.targets.registry import Estimate, Verb

WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Int8Options:
    """``min_size``: quantize only 2-D weights with at least this many elements; ``skip``:
    substrings of tensor names kept as they are."""

    min_size: int = option(1024, flag="--min-size",
                           help="quantize only 2-D weights with at least this many elements (default {default})")
    skip: tuple[str, ...] = option((), flag="--skip", append=True, metavar="NAME",
                                   help="keep tensors whose name contains NAME as they are (repeatable)")

    def validate(self) -> None:
        """InputError naming the option for a size that is not a positive integer."""
        if isinstance(self.min_size, bool) or not isinstance(self.min_size, int) or self.min_size < 1:
            raise InputError(f"--min-size {self.min_size!r}: expected a positive integer")

    @property
    def label(self) -> str:
        return f"int8-m{self.min_size}"


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and float32 scales [N] of a float weight [N, K]: round(w / s) with
    s = max |w| / 127 per row (1 for an all-zero row)."""
    w = w.float()
    s = w.abs().amax(dim=1) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as r:
            for k in r.keys():
                out[k] = r.get_tensor(k)
    return out


class Int8Target(Target, kind="int8", options=Int8Options, output_is_dir=True):
    """int8 per-channel symmetric weights in safetensors (:class:`Int8Options`)."""

    verbs = (Verb("quantize", "int8", "int8 per-channel symmetric weights in safetensors "
                                      "(the tests' extra target)", calibrated=False, dtype=False),)
    job_key = "int8"
    job_order = 90
    memory_stages = ("int8 pass",)
    plan_words = "{n} int8 pass(es)"
    runtimes = "tests/int8_target.py"

    @classmethod
    def estimate(cls, info, options: list[Int8Options]) -> Estimate:
        big = max(info.numel.values())
        return Estimate([info.linear + 2 * (info.total - info.linear) for _ in options],
                        {"int8 pass": 4 * big})

    def _quantized(self, name: str, t: torch.Tensor) -> bool:
        o = self.options
        return (t.dim() == 2 and t.numel() >= o.min_size and t.is_floating_point()
                and not any(s in name for s in o.skip))

    def prepare(self, run: Run) -> None:
        self.source.require_hf("int8")
        self.names = sorted(_tensors(self.source.path))

    def write(self, tmp: Path, run: Run) -> None:
        tmp.mkdir()
        out = {}
        for name, t in _tensors(self.source.path).items():
            if self._quantized(name, t):
                out[name], out[name + ".scale"] = quantize_rows(t)
            else:
                out[name] = t.contiguous()
        save_file(out, str(tmp / WEIGHTS))
        shutil.copy(self.source.path / "config.json", tmp / "config.json")
        (tmp / "int8_config.json").write_text(json.dumps({"bits": 8, "scheme": "per-row symmetric"}))

    def verify(self, tmp: Path, run: Run) -> str:
        with safe_open(str(tmp / WEIGHTS), "pt") as r:
            got = {k: r.get_tensor(k) for k in r.keys()}
        n, worst = 0, 0.0
        for name, t in _tensors(self.source.path).items():
            if name not in got:
                raise RoundTripError(f"round trip: '{name}' is missing from {WEIGHTS}")
            q = got[name]
            if not self._quantized(name, t):
                if not torch.equal(q, t):
                    raise RoundTripError(f"round trip: '{name}' differs from the source")
                continue
            s = got.get(name + ".scale")
            if q.dtype != torch.int8 or s is None or s.shape != (t.shape[0],):
                raise RoundTripError(f"round trip: '{name}' is not int8 with a scale per row")
            err = (q.float() * s[:, None] - t.float()).abs()
            if bool((err > s[:, None] / 2 * (1 + 1e-5)).any()):
                raise RoundTripError(f"round trip: '{name}' is off by more than half a step")
            if not torch.equal(quantize_rows(t)[0], q):
                raise RoundTripError(f"round trip: '{name}' codes differ from the source's")
            n += 1
            worst = max(worst, float((err / s[:, None]).max()))
        return f"ok ({n} int8 tensors, largest error {worst:.3f} of a step)"

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        with safe_open(str(out / WEIGHTS), "pt") as r:
            shapes = {k: r.get_slice(k).get_shape() for k in r.keys()}
        params = sum(torch.Size(s).numel() for k, s in shapes.items() if not k.endswith(".scale"))
        return Summary(self.kind, self.options.label, out, str(self.source.path),
                       tensor_bytes=(out / WEIGHTS).stat().st_size, parameters=params,
                       roundtrip=roundtrip)
