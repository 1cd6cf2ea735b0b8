"""The parts the quantized-directory readers share: finding and reading their config.json's
``quantization_config`` (AWQ, GPTQ, EXL2, FP8), and (AWQ, EXL2) an index of the stored tensors
under HF names, each quantized linear ``<m>`` appearing as ``<m>.weight`` and dequantized on
demand by the subclass's :meth:`QuantizedWeights.dequantized`. This is the weights protocol of
:class:`calibration.engine.StreamingModel` (``keys()``, ``in``, ``get(name, device, dtype)``)."""
from __future__ import annotations

import abc
import json
from pathlib import Path

import torch

from quantpress.errors import InputError


def quantized_as(path: str | Path, method: str) -> bool:
    """Whether ``path`` is a directory whose config.json has a ``quantization_config`` with
    ``quant_method`` ``method`` (case-insensitive); False when config.json is missing or not
    JSON (the loader registry's ``detect``)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(q, dict) and str(q.get("quant_method", "")).lower() == method


def quantized_config(path: str | Path, method: str, label: str) -> tuple[dict, dict]:
    """(config.json as a dict, its ``quantization_config``) of a directory quantized with
    ``quant_method`` ``method`` (case-insensitive). Raises InputError naming config.json when
    it is missing or not JSON, and naming the directory ("config.json has no ``label``
    quantization_config") when the block is missing or of another method."""
    p = Path(path)
    try:
        cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{p / 'config.json'}: not readable JSON ({e})") from None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if not isinstance(q, dict) or str(q.get("quant_method", "")).lower() != method:
        raise InputError(f"{p}: config.json has no {label} quantization_config")
    return cfg, q


class QuantizedWeights(abc.ABC):
    """Base of :class:`convert.awq_dir.AWQWeights` and :class:`convert.exl2_dir.EXL2Weights`.

    Subclasses set ``path`` and ``raw`` (a reader with ``keys()``, ``in`` and
    ``get(name, device)``), call :meth:`_index` and implement :meth:`dequantized`."""

    path = None
    raw = None

    def _index(self, marker: str, companions: tuple[str, ...]) -> None:
        """Find the quantized linears (``<m>.<marker>``), check that each has its
        ``<m>.<companion>`` tensors (InputError naming the first missing one) and build the
        HF-name index (the quantized tensors hidden behind ``<m>.weight``)."""
        names = set(self.raw.keys())
        self.quantized = sorted(k[: -len(marker) - 1] for k in names if k.endswith("." + marker))
        for m in self.quantized:
            for c in companions:
                if f"{m}.{c}" not in names:
                    raise InputError(f"{self.path}: '{m}.{marker}' without '{m}.{c}'")
        stored = {marker, *companions}
        self._qset = set(self.quantized)
        self._keys = [k for k in self.raw.keys()
                      if not (k.rsplit(".", 1)[-1] in stored and k.rsplit(".", 1)[0] in self._qset)]
        self._keys += [m + ".weight" for m in self.quantized]

    def keys(self):
        """HF names (quantized linears appear as ``<module>.weight``)."""
        return list(self._keys)

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def is_quantized(self, name: str) -> bool:
        """Whether ``name`` (``<module>.weight``) is stored quantized."""
        return name.endswith(".weight") and name[: -len(".weight")] in self._qset

    @abc.abstractmethod
    def dequantized(self, module: str, device="cpu") -> torch.Tensor:
        """float16 [out, in] of quantized linear ``module`` (each format's reader)."""

    def get(self, name: str, device="cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` (dequantized when quantized) on ``device``; floating tensors in
        ``dtype`` when given."""
        t = self.dequantized(name[: -len(".weight")], device) if self.is_quantized(name) \
            else self.raw.get(name, device)
        return t if dtype is None or not t.is_floating_point() else t.to(dtype)

    def streaming_model(self, device="cpu", dtype: torch.dtype | None = None,
                        attn_implementation: str = "sdpa", config: dict | None = None):
        """A :class:`calibration.engine.StreamingModel` over these weights: transformers'
        decoder layers built from ``config`` (default: the directory's config.json without its
        quantization block, ``self.config``), quantized linears dequantized layer by layer."""
        from quantpress.calibration.engine import StreamingModel

        cfg = config if config is not None else \
            {k: v for k, v in self.config.items() if k != "quantization_config"}
        return StreamingModel.over_weights(cfg, self, self.path, device, dtype, attn_implementation)
