"""Calibration-driven pipelines: ``quantize imatrix`` (llama.cpp importance matrix) and
``quantize eval`` (perplexity and KL divergence of quantized models against their base).

Both run models through the calibration engine (:mod:`calibration.engine`): transformers'
own decoder layers, loaded one at a time, over the hidden states of all rows. A model is
opened by a **loader** from the registry below, chosen by what the path is:

===========  =============================================================================
kind         what
===========  =============================================================================
``hf``       Hugging Face directory (config.json + safetensors) without ``quantization_config``
``gguf``     GGUF model file (any type quantpress dequantizes: F32/F16/BF16, Q4_0…Q8_0, Q2_K…Q6_K),
             dequantized tensor by tensor into the transformers layers (:mod:`convert.gguf_load`)
===========  =============================================================================

AWQ and EXL2 directories plug in later with :func:`register_loader` (a ``detect`` predicate
and an ``open`` function returning a :class:`~calibration.engine.StreamingModel`-like
object whose ``weights`` yield dequantized HF-named tensors).
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from calibration import data as cdata
from calibration import engine
from calibration import eval as ceval
from calibration.stats import StatsCollector
from cli.common import check_output
from convert import awq_dir, exl2_dir, gguf_arch, gguf_load
from convert.gguf_file import temp_path_for
from convert.imatrix_file import from_stats, write_imatrix
from quantize.errors import InputError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BATCH_TOKENS = 4096
#: bytes of float32 logits computed at once from final hidden states (the KL step holds about
#: eight arrays of that size: two models' logits, log-probabilities and their products)
LOGITS_BUDGET = 1 << 26


# --------------------------------------------------------------------------------------------
# Loader registry

@dataclass
class Loader:
    """How to open one kind of model.

    ``detect(path) -> bool``: whether ``path`` is this kind. ``open(path, device, dtype,
    config) -> StreamingModel``: the model, tensors dequantized on demand; ``config`` is the
    base model's HF config dict when there is one (a loader may use it for hyper-parameters
    its file lacks). ``tokenizer(path)``: a transformers tokenizer. ``add_bos(path, tok)``:
    whether llama.cpp would put a BOS first (``llama_vocab_get_add_bos``)."""

    kind: str
    detect: Callable[[Path], bool]
    open: Callable[..., "engine.StreamingModel"]
    tokenizer: Callable[[Path], object]
    add_bos: Callable[[Path, object], bool]
    hf_config: Callable[[Path], dict]
    gguf_arch: Callable[[Path], str]


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
        q = _quant_method(p)
        if q:
            raise InputError(f"{p}: a '{q}'-quantized directory; no loader for it yet "
                             f"(supported: {', '.join(l.kind for l in LOADERS)})")
    raise InputError(f"{p}: not a Hugging Face model directory or a GGUF file "
                     f"(supported: {', '.join(l.kind for l in LOADERS)})")


def _quant_method(d: Path) -> str | None:
    try:
        cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{d / 'config.json'}: not readable JSON ({e})") from None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if q is None:
        return None
    return str(q.get("quant_method", "unknown")) if isinstance(q, dict) else "unknown"


def _hf_detect(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file() and _quant_method(p) is None


def _hf_open(p: Path, device, dtype, config=None):
    return engine.StreamingModel(p, device=device, dtype=dtype)


def _hf_tokenizer(p: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(p)
    except Exception as e:
        raise InputError(f"{p}: cannot load the tokenizer ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _hf_add_bos(p: Path, tok) -> bool:
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


def _hf_config(p: Path) -> dict:
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


def _gguf_open(p: Path, device, dtype, config=None):
    return gguf_load.streaming_model(p, device=device, dtype=dtype, config=config)


def _gguf_tokenizer(p: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as e:
        raise InputError(f"{p}: cannot build a tokenizer from the GGUF metadata "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _gguf_add_bos(p: Path, tok) -> bool:
    return gguf_load.GGUFWeights(p).add_bos()


def _gguf_config(p: Path) -> dict:
    return gguf_load.GGUFWeights(p).hf_config()


def _gguf_arch(p: Path) -> str:
    return gguf_load.GGUFWeights(p).arch


register_loader(Loader("hf", _hf_detect, _hf_open, _hf_tokenizer, _hf_add_bos, _hf_config, _hf_gguf_arch))
register_loader(Loader("gguf", gguf_load.is_gguf, _gguf_open, _gguf_tokenizer, _gguf_add_bos,
                       _gguf_config, _gguf_arch))


def _awq_open(p: Path, device, dtype, config=None):
    return awq_dir.streaming_model(p, device=device, dtype=dtype)


def _awq_config(p: Path) -> dict:
    cfg, _, _ = awq_dir.read_awq_config(p)
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


register_loader(Loader("awq", awq_dir.is_awq_dir, _awq_open, _hf_tokenizer, _hf_add_bos,
                       _awq_config, _hf_gguf_arch))


def _exl2_open(p: Path, device, dtype, config=None):
    return exl2_dir.streaming_model(p, device=device, dtype=dtype)


def _exl2_config(p: Path) -> dict:
    cfg = exl2_dir.read_exl2_config(p)
    return {k: v for k, v in cfg.items() if k != "quantization_config"}


register_loader(Loader("exl2", exl2_dir.is_exl2_dir, _exl2_open, _hf_tokenizer, _hf_add_bos,
                       _exl2_config, _hf_gguf_arch))


# --------------------------------------------------------------------------------------------
# Shared helpers

def pick_device(name: str = "auto") -> torch.device:
    """``auto`` → CUDA when available, else CPU; otherwise ``torch.device(name)`` (InputError
    for an unknown name or CUDA without a GPU)."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise InputError(f"--device {name}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {name}: CUDA is not available")
    return dev


DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_dtype(name: str | None) -> torch.dtype:
    """Compute dtype by name (default float32: statistics and KL want full precision)."""
    if name in (None, "auto"):
        return torch.float32
    if name not in DTYPES:
        raise InputError(f"--dtype {name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_cal_dir() -> Path:
    """exllamav2 0.3.2's ``standard_cal_data`` directory: fetched into the cache by the
    repository's ``scripts/assets.py`` when it is available, else looked up in the cache
    (``$QUANTPRESS_CACHE``, ``$XDG_CACHE_HOME/quantpress`` or ``~/.cache/quantpress``)."""
    script = REPO / "scripts" / "assets.py"
    if script.is_file():
        spec = importlib.util.spec_from_file_location("_quantpress_assets", script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        try:
            return mod.standard_cal_data()
        except Exception as e:  # pip unavailable / offline
            raise InputError(f"cannot fetch exllamav2's calibration data ({e}); pass --calib "
                             f"FILE or --text FILE") from None
    xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = Path(os.environ.get("QUANTPRESS_CACHE", xdg / "quantpress"))
    d = root / "ref" / "exllamav2-0.3.2" / "standard_cal_data"
    if not (d / cdata.WIKI_FILE).is_file():
        raise InputError(f"{d}: exllamav2's calibration data is not in the cache; run "
                         f"'python scripts/assets.py cal-data' or pass --calib/--text FILE")
    return d


_LIBC = []


def _libc():
    if not _LIBC:
        import ctypes
        import ctypes.util

        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.append(lib if hasattr(lib, "malloc_trim") and hasattr(lib, "mallopt") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


#: glibc mallopt parameter number of M_MMAP_THRESHOLD
_M_MMAP_THRESHOLD = -3
#: blocks from this size up are mmapped and returned to the system when freed (bytes)
MMAP_THRESHOLD = 8 << 20


def bound_heap() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD` (``mallopt(M_MMAP_THRESHOLD)``;
    a no-op elsewhere). Returns True when set.

    By default glibc raises the threshold each time a mapped block is freed, up to 32 MiB;
    after that, the temporaries of a quantization pass (a few MiB to tens of MiB each) live on
    the heap, and the heap keeps what they free: on the 554M llama of scripts/bench_awq.py
    the layer pass then added 866 MiB of anonymous RSS instead of 360 with a 1 MiB threshold
    (which costs ~30% more time in page faults; both reproduced by running the script with
    ``MALLOC_MMAP_THRESHOLD_=1048576``, which this function leaves alone). With a fixed threshold, every tensor from
    8 MiB up is its own mapping, returned when freed; smaller ones reuse the heap, which
    :func:`trim_heap` returns between steps (the environment variable
    ``MALLOC_MMAP_THRESHOLD_`` sets the same, and wins when given)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    lib = _libc()
    return bool(lib is not None and lib.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def trim_heap(*_args) -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``; a no-op elsewhere).

    Used as the engine's ``on_layer`` callback: the engine frees a layer's weights and
    temporaries at every step, but glibc keeps tensors of a few MiB on its heap once its
    dynamic mmap threshold has grown, and RSS then climbs layer after layer although the live
    memory does not (scripts/bench_calibration.py measures it). Trimming once per layer costs
    nothing measurable. Returns None (the engine keeps the layer's outputs)."""
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)
    return None


def _rows_per_batch(batch_tokens: int, seqlen: int) -> int:
    if batch_tokens < 1:
        raise InputError(f"--batch-tokens must be positive, got {batch_tokens}")
    return max(1, batch_tokens // seqlen)


def read_text_file(path: str | Path) -> str:
    """Whole file as UTF-8 text (what ``llama-perplexity -f`` reads). Raises InputError for a
    missing, unreadable, empty or non-UTF-8 file."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: text file not found")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected a text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None
    if not text.strip():
        raise InputError(f"{p}: text file is empty")
    return text


def _tokenize_stream(tok, text: str, bos_id: int | None) -> torch.Tensor:
    """``common_tokenize(text, add_special=true)``: the text as one sequence, BOS first when the
    model adds one."""
    tok.model_max_length = int(1e30)  # one long sequence on purpose: no length warning
    ids = tok(text, add_special_tokens=False)["input_ids"]
    t = torch.as_tensor(ids, dtype=torch.long)
    if bos_id is not None:
        t = torch.cat([t.new_tensor([bos_id]), t])
    return t


# --------------------------------------------------------------------------------------------
# quantize eval

@dataclass
class ModelEval:
    """Figures of one evaluated model (see :mod:`calibration.eval` for their definitions)."""

    path: str
    kind: str
    ppl: dict
    kl: dict | None = None
    seconds: float = 0.0


@dataclass
class EvalReport:
    """Result of :func:`evaluate`: the base model first, then each output."""

    models: list[ModelEval]
    n_ctx: int
    n_chunks: int
    text: str
    device: str
    dtype: str
    seconds: float = 0.0

    def text_table(self) -> str:
        """Side-by-side table: PPL ± uncertainty, ΔPPL, mean / 99th-percentile KLD, top-1
        agreement."""
        base = self.models[0].ppl["ppl"]
        tokens = self.models[0].ppl["tokens"]
        lines = [f"text      {self.text}: {self.n_chunks} chunks of {self.n_ctx} tokens, "
                 f"{tokens} scored tokens (second half of each chunk)",
                 f"compute   {self.device}, {self.dtype}, {self.seconds:.1f} s", ""]
        names = [Path(m.path).name or m.path for m in self.models]
        w = max(8, *(len(n) for n in names))
        head = (f"{'model':<{w}}  {'kind':<5}  {'PPL':>18}  {'ΔPPL':>9}  {'KLD mean':>10}  "
                f"{'KLD 99%':>9}  {'top-1':>8}")
        lines += [head, "-" * len(head)]
        for m, n in zip(self.models, names):
            ppl = f"{m.ppl['ppl']:.4f} ± {m.ppl['ppl_unc']:.4f}"
            if m.kl is None:
                lines.append(f"{n:<{w}}  {m.kind:<5}  {ppl:>18}  {'(base)':>9}  {'':>10}  {'':>9}  {'':>8}")
            else:
                lines.append(f"{n:<{w}}  {m.kind:<5}  {ppl:>18}  {m.ppl['ppl'] - base:>+9.4f}  "
                             f"{m.kl['kld_mean']:>10.6f}  {m.kl['kld_p99']:>9.5f}  "
                             f"{100 * m.kl['same_top']:>7.2f}%")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The report as JSON-able dict: run parameters and, per model, the perplexity figures
        and (outputs only) the ``kl`` dict of :meth:`calibration.eval.KLStats.result`."""
        return {"text": self.text, "n_ctx": self.n_ctx, "n_chunks": self.n_chunks,
                "device": self.device, "dtype": self.dtype, "seconds": self.seconds,
                "models": [{"path": m.path, "kind": m.kind, "seconds": m.seconds, **m.ppl,
                            **({"kl": m.kl} if m.kl is not None else {})} for m in self.models]}


def _final_scored_hidden(sm, chunks: torch.Tensor, batch_rows: int, progress: bool) -> torch.Tensor:
    """Last decoder layer's output at the scored positions: [n_chunk, n_ctx−first−1, hidden]."""
    h = engine.run(sm, chunks, batch_size=batch_rows, progress=progress, on_layer=trim_heap)
    sl = ceval.scored_slice(chunks.shape[1])
    out = h[:, sl].clone()
    del h
    return out


def _bar(it, progress: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="batch", disable=not progress, leave=False)


def _vocab_size(p: Path, ld: Loader) -> int:
    if ld.kind == "gguf":
        v = gguf_load.GGUFWeights(p).hf_config_shapes()["vocab_size"]
    else:
        cfg = ld.hf_config(p)
        v = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    if v is None:
        raise InputError(f"{p}: cannot tell the vocabulary size")
    return int(v)


def _logit_rows(n_scored: int, vocab: int) -> int:
    return max(1, LOGITS_BUDGET // max(1, 4 * n_scored * vocab))


def evaluate(base: str | Path, outputs: list[str | Path] = (), text: str | Path | None = None,
             ctx: int = 512, chunks: int | None = None, device: str = "auto",
             dtype: str | None = None, batch_tokens: int = DEFAULT_BATCH_TOKENS,
             progress: bool = True, cal_dir: str | Path | None = None) -> EvalReport:
    """Perplexity of ``base`` and of every model in ``outputs``, and each output's KL
    divergence from ``base``, with llama-perplexity's conventions (:mod:`calibration.eval`).

    ``text``: a UTF-8 text file; default the held-out split of exllamav2's wiki.utf8
    (articles 1800–2348, :func:`calibration.data.heldout_text`). The text is tokenized once
    with the base model's tokenizer (all models must share its vocabulary), cut into chunks
    of ``ctx`` tokens (``chunks``: only the first N). Each model runs through the streaming
    engine over all chunks (one decoder layer in memory at a time); the last layer's output
    at the scored positions is kept (``n_chunk · ctx/2 · hidden`` floats for the base, the
    same for the output being evaluated), and logits are computed from it a few chunks at a
    time, so neither the model nor the logits of the whole text are ever in memory.
    A GGUF output is built with the base's config.json when the base is an HF directory.

    Raises InputError for unknown or unreadable models, a text that is missing, empty, not
    UTF-8 or shorter than 2·ctx tokens, mismatched vocabularies, and NaN/Inf activations or
    logits (naming the layer / model)."""
    bound_heap()
    t0 = time.perf_counter()
    dev, dt = pick_device(device), pick_dtype(dtype)
    base_p = Path(base)
    base_ld = find_loader(base_p)
    out_lds = [(Path(o), find_loader(o)) for o in outputs]
    vocab = _vocab_size(base_p, base_ld)
    for out_p, ld in out_lds:  # before any computation
        v = _vocab_size(out_p, ld)
        if v != vocab:
            raise InputError(f"{out_p}: vocabulary of {v} tokens, the base model has {vocab}; "
                             f"KL divergence needs the same vocabulary")
    if text is None:
        text_str = cdata.heldout_text(cal_dir or default_cal_dir())
        text_name = "wiki.utf8 held-out split (articles 1800-2348)"
    else:
        text_str = read_text_file(text)
        text_name = str(text)
    tok = base_ld.tokenizer(base_p)
    add_bos = base_ld.add_bos(base_p, tok)
    bos = tok.bos_token_id if add_bos else None
    toks = ceval.make_chunks(_tokenize_stream(tok, text_str, bos), ctx, chunks, bos)
    targets = ceval.scored_targets(toks)
    n_chunk, n_scored = targets.shape
    rows = _rows_per_batch(batch_tokens, ctx)
    base_cfg = base_ld.hf_config(base_p) if base_ld.kind == "hf" else None

    results: list[ModelEval] = []
    t1 = time.perf_counter()
    base_sm = base_ld.open(base_p, dev, dt)
    h_base = _final_scored_hidden(base_sm, toks, rows, progress)
    lrows = _logit_rows(n_scored, vocab)
    ppl = ceval.PerplexityStats()
    for r in _bar(range(0, n_chunk, lrows), progress, f"logits {base_p.name}"):
        ppl.update(base_sm.final_logits(h_base[r:r + lrows]), targets[r:r + lrows], what=str(base_p))
    results.append(ModelEval(str(base_p), base_ld.kind, ppl.result(), None, time.perf_counter() - t1))

    for out_p, ld in out_lds:
        t1 = time.perf_counter()
        sm = ld.open(out_p, dev, dt, base_cfg if ld.kind != "hf" else None)
        h = _final_scored_hidden(sm, toks, rows, progress)
        kl = ceval.KLStats()
        for r in _bar(range(0, n_chunk, lrows), progress, f"logits {out_p.name}"):
            lb = base_sm.final_logits(h_base[r:r + lrows])
            lq = sm.final_logits(h[r:r + lrows])
            kl.update(lb, lq, targets[r:r + lrows], what=str(out_p))
            del lb, lq
        results.append(ModelEval(str(out_p), ld.kind, kl.perplexity(), kl.result(), time.perf_counter() - t1))
        sm.release()
        del sm, h
    base_sm.release()
    return EvalReport(results, ctx, n_chunk, text_name, str(dev), str(dt).replace("torch.", ""),
                      time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# quantize imatrix

@dataclass
class ImatrixSummary:
    """What :func:`compute_imatrix` wrote."""

    output: Path
    entries: int
    samples: int
    seqlen: int
    datasets: list[str]
    seconds: float
    timings: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        """Calibration tokens seen by every weight (samples × seqlen)."""
        return self.samples * self.seqlen

    def text(self) -> str:
        """Human-readable summary (output, entries, data, time and tokens/s)."""
        return "\n".join([
            f"output     {self.output}",
            f"entries    {self.entries} weights (in_sum2 + counts each)",
            f"data       {self.samples} samples x {self.seqlen} tokens = {self.tokens:,} tokens "
            f"from {', '.join(self.datasets)}",
            f"time       {self.seconds:.1f} s (" + ", ".join(f"{k} {v:.1f} s" for k, v in self.timings.items())
            + f"), {self.tokens / max(self.timings.get('forward', self.seconds), 1e-9):,.0f} tokens/s",
        ])

    def to_json(self) -> dict:
        """The summary as a JSON-able dict."""
        return {"output": str(self.output), "entries": self.entries, "samples": self.samples,
                "seqlen": self.seqlen, "tokens": self.tokens, "datasets": self.datasets,
                "seconds": self.seconds, "timings": self.timings}


def calibration_rows(model: str | Path, calib: str | Path | None = None, calib_field: str = "text",
                     samples: int = 128, seqlen: int = 512, seed: int = 0,
                     cal_dir: str | Path | None = None, progress: bool = True) -> tuple[torch.Tensor, str]:
    """Calibration token rows for ``model``: int64 [samples, seqlen] and a description of the
    source. ``calib``: a text/JSON(L)/Parquet file (``calib_field`` = its text column; plain
    text files are one document); default the calibration split of exllamav2's wiki.utf8
    (articles 0–1799). Rows are fixed-seed windows (:func:`calibration.data.token_rows`);
    when the model adds a BOS (llama.cpp ``add_bos``), the first token of each row is BOS, as
    llama-imatrix does for each chunk. Raises InputError for bad files, unknown columns and
    too little text."""
    p = Path(model)
    ld = find_loader(p)
    if calib is None:
        texts = cdata.calibration_articles(cal_dir or default_cal_dir())
        source = "exllamav2-0.3.2 standard_cal_data/wiki.utf8 (articles 0-1799)"
    else:
        import logging

        import datasets

        was = datasets.is_progress_bar_enabled()
        if not progress:
            datasets.disable_progress_bars()
        log = logging.getLogger("datasets")
        level = log.level
        log.setLevel(logging.CRITICAL)  # datasets logs parse failures itself; InputError says it once
        try:
            texts = cdata.load_texts(calib, field=calib_field)
        finally:
            log.setLevel(level)
            if was:
                datasets.enable_progress_bars()
        source = str(calib)
    tok = ld.tokenizer(p)
    add_bos = ld.add_bos(p, tok)
    try:
        rows = cdata.token_rows(tok, texts, samples, seqlen, seed=seed)
    except InputError as e:
        if "no EOS or BOS" in str(e):
            raise InputError(f"{p}: {e}") from None
        raise
    if add_bos:
        rows[:, 0] = tok.bos_token_id
    return rows, source


def imatrix_from_rows(model: str | Path, rows: torch.Tensor, device: str = "auto",
                      dtype: str | None = None, batch_tokens: int = DEFAULT_BATCH_TOKENS,
                      progress: bool = True) -> dict[str, tuple[torch.Tensor, int]]:
    """Σx² of the input of every decoder-layer linear over all tokens of ``rows`` (int64
    [n, seqlen]), keyed by GGUF weight name (``blk.0.attn_q.weight``): ``(in_sum2 float32 [K],
    token count)``, i.e. llama.cpp ``IMatrixCollector::collect_imatrix`` for dense weights
    (``output.weight`` is left out, as llama-imatrix does without ``--process-output``).
    The model runs through the streaming engine in float32 (``dtype``) one layer at a time.
    Raises InputError on NaN/Inf activations (naming the linear) and unsupported models."""
    p = Path(model)
    ld = find_loader(p)
    arch = ld.gguf_arch(p)
    sm = ld.open(p, pick_device(device), pick_dtype(dtype))
    col = StatsCollector(kinds={"sq"}, prefix=sm.layer_prefix)
    engine.run(sm, rows, hooks_factory=col, batch_size=_rows_per_batch(batch_tokens, rows.shape[1]),
               progress=progress, on_layer=trim_heap)
    n_layers = int(sm.config.num_hidden_layers)
    out = {}
    for hf_name, st in col.stats.items():
        try:
            g = gguf_arch.gguf_tensor_name(hf_name + ".weight", arch, n_layers=n_layers)
        except ValueError as e:
            raise InputError(f"{p}: {e}") from None
        out[g] = st.imatrix()
    return out


def compute_imatrix(model: str | Path, out: str | Path, calib: str | Path | None = None,
                    calib_field: str = "text", samples: int = 128, seqlen: int = 512, seed: int = 0,
                    device: str = "auto", dtype: str | None = None,
                    batch_tokens: int = DEFAULT_BATCH_TOKENS, force: bool = False,
                    progress: bool = True, cal_dir: str | Path | None = None) -> ImatrixSummary:
    """``quantize imatrix``: llama.cpp importance matrix of ``model`` (HF directory or GGUF)
    written to ``out`` in llama.cpp's GGUF imatrix format (:mod:`convert.imatrix_file`), which
    ``llama-quantize --imatrix`` reads.

    Calibration data: :func:`calibration_rows` (``samples`` windows of ``seqlen`` tokens,
    fixed ``seed``). The file's ``imatrix.chunk_count`` is ``samples`` and
    ``imatrix.chunk_size`` is ``seqlen``. The file is written to a temporary name and renamed
    when complete; an existing ``out`` needs ``force``. Raises InputError for bad input (no
    file is left behind)."""
    bound_heap()
    t0 = time.perf_counter()
    out = Path(out)
    check_output(out, force)
    rows, source = calibration_rows(model, calib, calib_field, samples, seqlen, seed, cal_dir, progress)
    t1 = time.perf_counter()
    entries = imatrix_from_rows(model, rows, device, dtype, batch_tokens, progress)
    t2 = time.perf_counter()
    im = from_stats(entries, [source], chunk_count=rows.shape[0], chunk_size=rows.shape[1])
    tmp = temp_path_for(out)
    try:
        write_imatrix(tmp, im)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return ImatrixSummary(out, len(entries), rows.shape[0], rows.shape[1], [source],
                          time.perf_counter() - t0,
                          {"tokenize": t1 - t0, "forward": t2 - t1, "write": time.perf_counter() - t2})
