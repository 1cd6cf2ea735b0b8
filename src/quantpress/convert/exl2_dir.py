"""EXL2 (exllamav2 0.3.2) model directories: the streaming writer and the reader with the
pure-torch reconstruction (the round trip and ``quantize eval``'s loader), equivalent to
exllamav2 0.3.2 ``ExLlamaV2Linear.get_weight_tensor_dq``.

Layout, as exllamav2 0.3.2 ``conversion/compile.py`` ``compile_model`` writes it:

* per quantized linear (``model.layers.N.self_attn.q_proj``, …, ``lm_head``):
  ``q_weight`` int32 (packed rows, N_pad), ``q_scale`` int32 (G, N_pad/8), ``q_scale_max``
  float16 (G,), ``q_groups`` int16 (2G,), ``q_invperm`` int32 (K,), ``bias`` float16 (N,) if
  present (:mod:`quantize.exl2`);
* float16 ``.weight`` of ``model.embed_tokens`` and of every norm (input / post-attention
  layernorms, q_norm / k_norm, ``model.norm``);
* tied embeddings: a separate quantized ``lm_head.*`` besides the FP16 embedding;
* ``output.safetensors``, or ``output-0000k-of-0000N.safetensors`` when the tensors exceed the
  shard size (``-ss`` MB, 1 MB = 1024² bytes; tensors in order, a new shard when the next one
  would not fit); **no index JSON and no safetensors metadata** (exllamav2 globs
  ``*.safetensors``);
* every regular file of the source directory except ``*.safetensors`` / ``*.bin`` copied (a
  stale ``model.safetensors.index.json`` included, as upstream does; harmless to exllamav2,
  and :class:`EXL2Weights` ignores it), subdirectories not;
* ``config.json``: the source's, plus ``quantization_config`` = {quant_method "exl2",
  version "0.3.2", bits, head_bits, calibration {rows, length, dataset}}, ``indent=4``.

The writer keeps nothing between layers: each layer's tensors go to a hidden part file as
soon as they exist; the finish step (:class:`quantpress.convert.shards.ModelDirWriter`) copies
them into the shards piece by piece. The runner renames the temporary directory into place after
the round trip.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from quantpress.quantize import exl2 as qexl2
from quantpress.convert.quant_weights import QuantizedWeights, quantized_as, quantized_config
from quantpress.convert.shards import DirLayout, ModelDirWriter
from quantpress.errors import InputError

EXL2_VERSION = "0.3.2"
Q_SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups", "q_invperm")
#: exllamav2's default shard size, MB (``-ss``)
DEFAULT_SHARD_MB = 8192
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin")


def shard_bytes(max_shard_mb: float) -> int:
    """``-ss`` megabytes → bytes (MB = 1024², as exllamav2 counts); 0 = unlimited. InputError
    for a negative or non-finite size."""
    try:
        mb = float(max_shard_mb)
    except (TypeError, ValueError):
        raise InputError(f"--max-shard-size {max_shard_mb!r}: expected a number of MB") from None
    if not math.isfinite(mb) or mb < 0:
        raise InputError(f"--max-shard-size {max_shard_mb}: must be a non-negative number of MB "
                         f"(0 = one file)")
    return 0 if mb == 0 else max(1, int(mb * 1024 ** 2))


# --------------------------------------------------------------------------------------------
# Writer

#: ``output.safetensors`` or ``output-0000k-of-0000N.safetensors``, no index, no safetensors
#: metadata; every regular file of the source but weights copied; config.json with indent 4
EXL2_LAYOUT = DirLayout("output", None, index=False, config_indent=4, config_newline=False,
                        copied=lambda f: not f.name.endswith(_NOT_COPIED_SUFFIXES))


def dir_writer(tmp_dir: Path, max_shard_bytes: int = DEFAULT_SHARD_MB * 1024 ** 2,
               resume: bool = False) -> ModelDirWriter:
    """The writer of an EXL2 directory in ``tmp_dir`` (created; with ``resume`` it may exist,
    see :meth:`ModelDirWriter.adopt`): :class:`ModelDirWriter` in :data:`EXL2_LAYOUT`;
    ``max_shard_bytes`` 0 = a single ``output.safetensors``."""
    return ModelDirWriter(tmp_dir, EXL2_LAYOUT, max_shard_bytes, resume)


def exl2_config(source_config: dict, bits: float, head_bits: int, rows: int, length: int,
                dataset: str | None) -> dict:
    """config.json of the output: the source's with ``quantization_config`` = {quant_method
    "exl2", version "0.3.2", bits (the decoder target bpw), head_bits, calibration {rows,
    length, dataset}}; ``dataset`` is the calibration file's basename or "(default)"
    (exllamav2 0.3.2 ``compile_model``)."""
    cfg = dict(source_config)
    cfg["quantization_config"] = {
        "quant_method": "exl2", "version": EXL2_VERSION, "bits": bits, "head_bits": head_bits,
        "calibration": {"rows": rows, "length": length,
                        "dataset": Path(str(dataset)).name if dataset else "(default)"}}
    return cfg


# --------------------------------------------------------------------------------------------
# Reader

def is_exl2_dir(path: str | Path) -> bool:
    """True when ``path`` is a directory whose config.json says ``quant_method: exl2``."""
    return quantized_as(path, "exl2")


def read_exl2_config(path: str | Path) -> dict:
    """config.json of an EXL2 directory; InputError naming it when unreadable or not EXL2."""
    return quantized_config(path, "exl2", "EXL2")[0]


class _GlobDir:
    """Tensors of every ``*.safetensors`` file in a directory (exllamav2 globs them; an index
    JSON, stale or not, is ignored), read one at a time with ``safe_open``."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.dir = path
        self._files: dict[str, Path] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InputError(f"{path}: no *.safetensors files")
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        if k in self._files:
                            raise InputError(f"{path}: tensor '{k}' is in both {self._files[k].name} "
                                             f"and {f.name}")
                        self._files[k] = f
            except InputError:
                raise
            except Exception as e:
                raise InputError(f"{f}: not a readable safetensors file ({e})") from e

    def keys(self):
        return self._files.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str, device="cpu") -> torch.Tensor:
        from safetensors import safe_open

        f = self._files.get(name)
        if f is None:
            raise InputError(f"{self.dir}: tensor '{name}' not found")
        with safe_open(str(f), framework="pt", device="cpu") as h:
            return h.get_tensor(name).to(device)

    def close(self) -> None:
        pass


class EXL2Weights(QuantizedWeights):
    """The tensors of an EXL2 directory under HF names: each quantized linear ``<m>`` appears
    as ``<m>.weight``, reconstructed by :func:`quantize.exl2.reconstruct` on demand (the
    weights protocol of :class:`calibration.engine.StreamingModel`: ``keys()``, ``in``,
    ``get(name, device, dtype)``).

    ``out_features``: module → N for the reconstruction (the stored width is N padded to 32);
    without an entry, the bias length, else the padded width is used. Raises InputError for
    a directory without an EXL2 config or a quantized linear missing one of its tensors."""

    def __init__(self, path: str | Path, out_features: dict[str, int] | None = None):
        self.path = Path(path)
        self.config = read_exl2_config(self.path)
        self.raw = _GlobDir(self.path)
        self.out_features = dict(out_features or {})
        self._index(Q_SUFFIXES[0], tuple(Q_SUFFIXES[1:]))

    def q_tensors(self, module: str, device="cpu") -> dict[str, torch.Tensor]:
        """The five stored tensors of quantized linear ``module``, by suffix."""
        return {s: self.raw.get(f"{module}.{s}", device) for s in Q_SUFFIXES}

    def n_out(self, module: str, q_weight_cols: int) -> int:
        """out_features of ``module``: given, else its bias length, else the padded width."""
        if module in self.out_features:
            return int(self.out_features[module])
        if f"{module}.bias" in self.raw:
            return int(self.raw.get(f"{module}.bias").numel())
        return int(q_weight_cols)

    def dequantized(self, module: str, device="cpu") -> torch.Tensor:
        """float16 [N, K] of quantized linear ``module`` (:func:`quantize.exl2.reconstruct`)."""
        t = self.q_tensors(module, device)
        try:
            return qexl2.reconstruct(t["q_weight"], t["q_scale"], t["q_scale_max"], t["q_groups"],
                                     t["q_invperm"], self.n_out(module, t["q_weight"].shape[1]))
        except ValueError as e:
            raise InputError(f"{self.path}: '{module}': {e}") from None

    def get(self, name: str, device="cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` (reconstructed when quantized) on ``device`` in ``dtype``."""
        t = self.dequantized(name[: -len(".weight")], device) if self.is_quantized(name) \
            else self.raw.get(name, device)
        return t if dtype is None or not t.is_floating_point() else t.to(dtype)

    def close(self) -> None:
        self.raw.close()


def streaming_model(path: str | Path, device="cpu", dtype: torch.dtype | None = None,
                    attn_implementation: str = "sdpa"):
    """A :class:`calibration.engine.StreamingModel` over an EXL2 directory: transformers'
    decoder layers built from its config.json (without the quantization block), weights
    reconstructed layer by layer. When the directory has a quantized ``lm_head`` (always, for
    quantpress output; also with tied embeddings), the model uses it, as exllamav2 does:
    ``tie_word_embeddings`` is turned off for the skeleton."""
    from quantpress.calibration.engine import StreamingModel

    w = EXL2Weights(path)
    cfg = {k: v for k, v in w.config.items() if k != "quantization_config"}
    if "lm_head.weight" in w and cfg.get("tie_word_embeddings"):
        cfg["tie_word_embeddings"] = False
    sm = StreamingModel.over_weights(cfg, w, w.path, device, dtype, attn_implementation)
    for n, shape in sm.skeleton_shapes().items():
        if len(shape) == 2 and n.endswith(".weight"):
            w.out_features.setdefault(n[: -len(".weight")], int(shape[0]))
    return sm
