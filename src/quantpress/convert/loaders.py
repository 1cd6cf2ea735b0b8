"""Models opened by what their path is: the loader registry of the calibration verbs and of
``quantize eval``.

===========  =============================================================================
kind         what
===========  =============================================================================
``hf``       Hugging Face directory (config.json + safetensors) without ``quantization_config``
``gguf``     GGUF model file (any type quantpress dequantizes: F32/F16/BF16, Q4_0…Q8_0, Q2_K…Q6_K),
             dequantized tensor by tensor into the transformers layers (:mod:`.gguf_load`)
``awq``      AutoAWQ GEMM directory, dequantized by the reference procedure (:mod:`.awq_dir`)
``exl2``     EXL2 directory, reconstructed in pure torch (:mod:`.exl2_dir`)
``gptq``     GPTQ checkpoint directory, dequantized by the reference procedure (:mod:`.gptq_dir`)
``fp8``      compressed-tensors FP8 directory, dequantized by the reference procedure (:mod:`.fp8_dir`)
===========  =============================================================================

Each loader opens a :class:`quantpress.calibration.engine.StreamingModel` (one decoder layer in
memory at a time, tensors dequantized on demand). Other formats plug in with
:func:`register_loader`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantpress.calibration import engine
from quantpress.convert import awq_dir, exl2_dir, fp8_dir, gguf_arch, gguf_load, gptq_dir
from quantpress.errors import InputError


@dataclass
class Loader:
    """How to open one kind of model.

    ``detect(path) -> bool``: whether ``path`` is this kind. ``open(path, device, dtype,
    config) -> StreamingModel``: the model, tensors dequantized on demand; ``config`` is the
    base model's HF config dict when there is one (a loader may use it for hyper-parameters
    its file lacks). ``tokenizer(path)``: a transformers tokenizer. ``add_bos(path, tok)``:
    whether llama.cpp would put a BOS first (``llama_vocab_get_add_bos``). ``hf_config(path)``:
    the HF config dict (without ``quantization_config``). ``gguf_arch(path)``: the GGUF
    architecture name (for GGUF tensor names). ``vocab_size(path)``: tokens in the vocabulary."""

    kind: str
    detect: Callable[[Path], bool]
    open: Callable[..., "engine.StreamingModel"]
    tokenizer: Callable[[Path], object]
    add_bos: Callable[[Path, object], bool]
    hf_config: Callable[[Path], dict]
    gguf_arch: Callable[[Path], str]
    vocab_size: Callable[[Path], int] | None = None

    def vocabulary(self, path: Path) -> int:
        """Tokens in the vocabulary of the model at ``path``. Raises InputError when the
        config does not tell."""
        if self.vocab_size is not None:
            return int(self.vocab_size(path))
        cfg = self.hf_config(path)
        v = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
        if v is None:
            raise InputError(f"{path}: cannot tell the vocabulary size (no vocab_size in config.json)")
        return int(v)


LOADERS: list[Loader] = []


def register_loader(loader: Loader, first: bool = False) -> Loader:
    """Add ``loader`` to the registry (tried in order; ``first`` puts it before the others)."""
    LOADERS.insert(0, loader) if first else LOADERS.append(loader)
    return loader


def find_loader(path: str | Path) -> Loader:
    """The registered loader for ``path``. Raises InputError naming the path when none
    applies (missing path, a quantized HF directory of a kind without a loader, other files)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file or directory")
    for ld in LOADERS:
        if ld.detect(p):
            return ld
    if p.is_dir() and (p / "config.json").is_file():
        q = quant_method(p)
        if q:
            raise InputError(f"{p}: a '{q}'-quantized directory; no loader for it yet "
                             f"(supported: {', '.join(l.kind for l in LOADERS)})")
    raise InputError(f"{p}: not a Hugging Face model directory or a GGUF file "
                     f"(supported: {', '.join(l.kind for l in LOADERS)})")


def quant_method(d: Path) -> str | None:
    """``quantization_config.quant_method`` of the directory's config.json (None when there is
    no quantization block). Raises InputError when config.json is not readable JSON."""
    try:
        cfg = json.loads((Path(d) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{Path(d) / 'config.json'}: not readable JSON ({e})") from None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q is None:
        return None
    return str(q.get("quant_method", "unknown")) if isinstance(q, dict) else "unknown"


# --------------------------------------------------------------------------------------------
# Hugging Face directories

def _hf_detect(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and quant_method(p) is None


def _hf_open(p: Path, device, dtype, config=None):
    return engine.StreamingModel(p, device=device, dtype=dtype)


def hf_tokenizer(p: Path):
    """transformers' AutoTokenizer of the directory ``p``. Raises InputError naming it when the
    tokenizer files are missing or unusable."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(p)
    except Exception as e:
        raise InputError(f"{p}: cannot load the tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def hf_add_bos(p: Path, tok) -> bool:
    """Whether the tokenizer of directory ``p`` puts a BOS first (llama.cpp's add_bos as
    ``convert_hf_to_gguf.py`` derives it). Raises InputError for a tokenizer that claims to
    add a BOS but defines none."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        try:
            tcfg = json.loads((p / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            tcfg = {}
        if getattr(tok, "add_bos_token", False) or tcfg.get("add_bos_token") is True:
            raise InputError(f"{p}: the tokenizer adds a BOS token (add_bos_token) but defines "
                             f"none (bos_token in tokenizer_config.json)")
        return False
    with_special = tok("a", add_special_tokens=True)["input_ids"]
    plain = tok("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[0] == bos


def read_config_json(p: Path) -> dict:
    """config.json of the directory ``p`` as a dict. Raises InputError naming the file when it
    is missing, not JSON or not an object."""
    try:
        cfg = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{p / 'config.json'}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise InputError(f"{p / 'config.json'}: expected a JSON object")
    return cfg


def _hf_gguf_arch(p: Path) -> str:
    try:
        return gguf_arch.gguf_arch(gguf_arch.load_hf_config(p))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise InputError(f"{p}: {e}") from None


register_loader(Loader("hf", _hf_detect, _hf_open, hf_tokenizer, hf_add_bos, read_config_json,
                       _hf_gguf_arch))


# --------------------------------------------------------------------------------------------
# GGUF files

def _gguf_open(p: Path, device, dtype, config=None):
    return gguf_load.streaming_model(p, device=device, dtype=dtype, config=config)


def _gguf_tokenizer(p: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as e:
        raise InputError(f"{p}: cannot build a tokenizer from the GGUF metadata "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


register_loader(Loader("gguf", gguf_load.is_gguf, _gguf_open, _gguf_tokenizer,
                       lambda p, tok: gguf_load.GGUFWeights(p).add_bos(),
                       lambda p: gguf_load.GGUFWeights(p).hf_config(),
                       lambda p: gguf_load.GGUFWeights(p).arch,
                       lambda p: gguf_load.GGUFWeights(p).hf_config_shapes()["vocab_size"]))


# --------------------------------------------------------------------------------------------
# Quantized HF directories

def _config_json(p: Path) -> dict:
    return json.loads((Path(p) / "config.json").read_text(encoding="utf-8"))


def _without_quantization(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


register_loader(Loader("awq", awq_dir.is_awq_dir,
                       lambda p, device, dtype, config=None: awq_dir.streaming_model(p, device=device, dtype=dtype),
                       hf_tokenizer, hf_add_bos,
                       lambda p: _without_quantization(awq_dir.read_awq_config(p)[0]), _hf_gguf_arch))
register_loader(Loader("exl2", exl2_dir.is_exl2_dir,
                       lambda p, device, dtype, config=None: exl2_dir.streaming_model(p, device=device, dtype=dtype),
                       hf_tokenizer, hf_add_bos,
                       lambda p: _without_quantization(exl2_dir.read_exl2_config(p)), _hf_gguf_arch))
register_loader(Loader("gptq", gptq_dir.is_gptq_dir,
                       lambda p, device, dtype, config=None: gptq_dir.streaming_model(p, device=device, dtype=dtype),
                       hf_tokenizer, hf_add_bos,
                       lambda p: _without_quantization(_config_json(p)), _hf_gguf_arch))
register_loader(Loader("fp8", fp8_dir.is_fp8_dir,
                       lambda p, device, dtype, config=None: fp8_dir.streaming_model(p, device=device, dtype=dtype),
                       hf_tokenizer, hf_add_bos,
                       lambda p: _without_quantization(_config_json(p)), _hf_gguf_arch))
