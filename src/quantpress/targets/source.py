"""What all the outputs of one model share: the compute and calibration options and the
:class:`Source` (the loader, the config, the calibration rows computed once)."""
from __future__ import annotations

from pathlib import Path
from dataclasses import dataclass
from typing import Any

import torch

from quantpress import assets
from quantpress.calibration import data as cdata
from quantpress.calibration import engine
from quantpress.convert import loaders
from quantpress.errors import InputError
from quantpress.devices import (DEFAULT_BATCH_TOKENS, check_device, pick_device, pick_dtype,
                                rows_per_batch)


# --------------------------------------------------------------------------------------------
# Options shared by the outputs of one model

def _need_int(option: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{option} {value!r}: expected an integer >= {low}")


@dataclass(frozen=True)
class CalibOptions:
    """Calibration text and rows (``--calib``, ``--calib-field``, ``--samples``, ``--seqlen``,
    ``--seed``): ``samples`` windows of ``seqlen`` tokens drawn with ``seed`` from ``calib`` (a
    .txt/.utf8/.md file, .json/.jsonl/.parquet with the text in column ``calib_field``, a
    folder of such files, or a ``datasets`` name; None: the calibration split of exllamav2's
    wiki.utf8, :func:`quantpress.calibration.data.calibration_articles`)."""

    calib: str | None = None
    calib_field: str = "text"
    samples: int = 128
    seqlen: int = 512
    seed: int = 0

    def validate(self) -> None:
        """InputError naming the option when a count is not a positive integer."""
        _need_int("--samples", self.samples)
        _need_int("--seqlen", self.seqlen)
        _need_int("--seed", self.seed, 0)
        if not isinstance(self.calib_field, str) or not self.calib_field:
            raise InputError(f"--calib-field {self.calib_field!r}: expected a column name")


@dataclass(frozen=True)
class ComputeOptions:
    """Where and how forward passes run (``--device``, ``--dtype``, ``--batch-tokens``):
    ``device`` auto (CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N; ``dtype``
    float32 (None: float32), float16 or bfloat16; ``batch_tokens`` tokens per forward batch."""

    device: str = "auto"
    dtype: str | None = None
    batch_tokens: int = DEFAULT_BATCH_TOKENS

    def validate(self) -> None:
        """InputError naming the option for a bad device (or CUDA on a machine without it), an
        unknown dtype or a non-positive batch size."""
        check_device(self.device)
        pick_dtype(self.dtype)
        rows_per_batch(self.batch_tokens, 1)


# --------------------------------------------------------------------------------------------
# The source model

class Source:
    """One input model and what all of its outputs share: the loader chosen by what the path
    is (:mod:`quantpress.convert.loaders`), its config, the compute device and dtype, and the
    calibration rows (tokenized once, whatever number of targets use them).

    ``path``: HF directory or GGUF file. ``compute`` / ``calib``: :class:`ComputeOptions` /
    :class:`CalibOptions` (validated here: InputError naming the option). ``cal_dir``:
    exllamav2's ``standard_cal_data`` directory for the default text (None: fetched into the
    cache by :func:`quantpress.assets.standard_cal_data` when first needed). ``repo_id``: the
    Hugging Face repo id ``path`` is the cached snapshot of (None: a plain path), for what
    names the model (GGUF ``general.name``, as ``convert_hf_to_gguf.py --remote`` sets it)."""

    def __init__(self, path: str | Path, compute: ComputeOptions | None = None,
                 calib: CalibOptions | None = None, progress: bool = True,
                 cal_dir: str | Path | None = None, repo_id: str | None = None):
        self.path = Path(path)
        self.repo_id = repo_id
        self.compute = compute or ComputeOptions()
        self.calib = calib or CalibOptions()
        self.compute.validate()
        self.calib.validate()
        self.progress = progress
        self._cal_dir = None if cal_dir is None else Path(cal_dir)
        self._loader: loaders.Loader | None = None
        self._config: dict | None = None
        self._rows: tuple[torch.Tensor, str] | None = None

    # ---- what the path is ------------------------------------------------------------------

    @property
    def loader(self) -> loaders.Loader:
        """The loader for the path (InputError when none applies)."""
        if self._loader is None:
            self._loader = loaders.find_loader(self.path)
        return self._loader

    @property
    def kind(self) -> str:
        """``hf``, ``gguf``, ``awq`` or ``exl2``."""
        return self.loader.kind

    def require_hf(self, what: str) -> None:
        """InputError unless the source is an unquantized Hugging Face directory; ``what``
        names the output kind that needs it."""
        if self.kind != "hf":
            raise InputError(f"{self.path}: {what} needs a Hugging Face model directory "
                             f"(FP16/BF16/F32 safetensors), not a {self.kind} input")

    @property
    def config(self) -> dict:
        """The HF config dict (config.json, without a quantization block)."""
        if self._config is None:
            self._config = self.loader.hf_config(self.path)
        return self._config

    # ---- compute ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return pick_device(self.compute.device)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return pick_dtype(self.compute.dtype)

    def streaming_model(self, base_config: dict | None = None) -> engine.StreamingModel:
        """A new :class:`~quantpress.calibration.engine.StreamingModel` over the source on the
        compute device and dtype (skeleton only; layers are read when the engine reaches them)."""
        return self.loader.open(self.path, self.device, self.dtype, base_config)

    def batch_rows(self, seqlen: int) -> int:
        """Rows of ``seqlen`` tokens per forward batch (``--batch-tokens``)."""
        return rows_per_batch(self.compute.batch_tokens, seqlen)

    def parameter_count(self) -> int:
        """Elements over every tensor of an HF source checkpoint (headers only)."""
        self.require_hf("counting parameters")
        return engine.SafetensorsDir(self.path).parameter_count()

    # ---- calibration -----------------------------------------------------------------------

    def cal_dir(self) -> Path:
        """exllamav2's ``standard_cal_data`` directory (the default text), fetched into the
        cache the first time. InputError when it cannot be fetched (offline)."""
        if self._cal_dir is None:
            self._cal_dir = default_cal_dir()
        return self._cal_dir

    def calibration_rows(self) -> tuple[torch.Tensor, str]:
        """Calibration token rows int64 [samples, seqlen] and a description of the text,
        computed once (:func:`calibration_rows`)."""
        if self._rows is None:
            self._rows = calibration_rows(self.path, self.calib, self.progress, self._cal_dir)
        return self._rows


def default_cal_dir() -> Path:
    """exllamav2 0.3.2's ``standard_cal_data`` directory (:func:`quantpress.assets.standard_cal_data`),
    fetched with pip into the cache the first time. Raises InputError when that fails
    (offline and not cached), suggesting ``--calib`` / ``--text``."""
    try:
        return assets.standard_cal_data()
    except Exception as e:  # pip unavailable, offline, no such version
        raise InputError(f"cannot fetch exllamav2's calibration data into {assets.cache_root()} "
                         f"({type(e).__name__}); pass --calib FILE (or --text FILE)") from None


def calibration_rows(model: str | Path, calib: CalibOptions | None = None, progress: bool = True,
                     cal_dir: str | Path | None = None) -> tuple[torch.Tensor, str]:
    """Calibration token rows for ``model``: int64 [samples, seqlen] and a description of the
    text. ``calib.calib``: a text/JSON(L)/Parquet file or folder or dataset name
    (:func:`quantpress.calibration.data.load_texts`; ``calib_field`` its text column); None:
    the calibration split of exllamav2's wiki.utf8 (articles 0–1799) from ``cal_dir`` (None:
    :func:`default_cal_dir`). Rows are fixed-seed windows
    (:func:`quantpress.calibration.data.token_rows`); when the model adds a BOS (llama.cpp
    ``add_bos``), the first token of each row is BOS, as llama-imatrix does for each chunk.
    Raises InputError for bad files, unknown columns and too little text."""
    calib = calib or CalibOptions()
    calib.validate()
    p = Path(model)
    ld = loaders.find_loader(p)
    if calib.calib is None:
        texts = cdata.calibration_articles(cal_dir or default_cal_dir())
        source = "exllamav2-0.3.2 standard_cal_data/wiki.utf8 (articles 0-1799)"
    else:
        texts = cdata.load_texts_quietly(calib.calib, field=calib.calib_field, progress=progress)
        source = str(calib.calib)
    tok = ld.tokenizer(p)
    add_bos = ld.add_bos(p, tok)
    try:
        rows = cdata.token_rows(tok, texts, calib.samples, calib.seqlen, seed=calib.seed)
    except InputError as e:
        if "no EOS or BOS" in str(e):
            raise InputError(f"{p}: {e}") from None
        raise
    if add_bos:
        rows[:, 0] = tok.bos_token_id
    return rows, source
