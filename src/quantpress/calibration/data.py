"""Calibration and evaluation text: the fixed split of exllamav2's ``wiki.utf8``, local
text/JSONL/Parquet files through ``datasets``, and fixed-seed token windows.

The calibration layer does no downloading: callers pass the directory of exllamav2 0.3.2's
``standard_cal_data`` (:func:`quantpress.assets.standard_cal_data` fetches it) or the path of a
local file.

Fixed split of exllamav2 0.3.2's ``conversion/standard_cal_data/wiki.utf8``, used everywhere:

- records are split on ``</doc>\\n``; each record's first line (the ``<doc id=… url=… title=…>``
  tag) is dropped, exactly as exllamav2 ``conversion/tokenize.py`` does; empty records are
  dropped; file order is kept. The article text is otherwise untouched (it starts with the
  title line and ends with newlines);
- calibration = articles 0–1799, held-out evaluation = articles 1800–2348 (549 articles).
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch

from quantpress.errors import InputError

WIKI_FILE = "wiki.utf8"
WIKI_ARTICLES = 2349
CALIBRATION_ARTICLES = 1800  # articles [0, 1800) calibrate; [1800, 2349) are held out

_FORMATS = {".txt": "text", ".text": "text", ".utf8": "text", ".md": "text",
            ".json": "json", ".jsonl": "json", ".ndjson": "json",
            ".parquet": "parquet", ".pq": "parquet"}


# --------------------------------------------------------------------------------------------
# The fixed wiki split

def _wiki_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / WIKI_FILE
    if not p.is_file():
        raise InputError(f"{p}: not found (expected exllamav2's standard_cal_data/{WIKI_FILE}; "
                         f"'python -m quantpress.assets cal-data' fetches it)")
    return p


def wiki_articles(path: str | Path) -> list[str]:
    """All articles of exllamav2's ``wiki.utf8``, in file order (2,349 for exllamav2 0.3.2).

    ``path``: the ``standard_cal_data`` directory or the ``wiki.utf8`` file itself.
    Reproduces exllamav2 ``conversion/tokenize.py``: ``text.split("</doc>\\n")`` and
    ``a[a.find("\\n") + 1:]`` (drops the ``<doc …>`` tag line); empty records are dropped.
    Raises InputError if the file is missing, unreadable or holds no ``</doc>`` records."""
    p = _wiki_path(path)
    try:
        text = p.read_text(encoding="utf8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{p}: cannot read as UTF-8 text ({e})") from e
    if "</doc>\n" not in text:
        raise InputError(f"{p}: no '</doc>' records; not exllamav2's wiki.utf8")
    articles = [a[a.find("\n") + 1:] for a in text.split("</doc>\n")]
    return [a for a in articles if a]


def _checked_split(path: str | Path) -> list[str]:
    arts = wiki_articles(path)
    if len(arts) != WIKI_ARTICLES:
        raise InputError(f"{_wiki_path(path)}: {len(arts)} articles, expected {WIKI_ARTICLES} "
                         f"(exllamav2 0.3.2's wiki.utf8); the fixed split would not be the same")
    return arts


def calibration_articles(path: str | Path) -> list[str]:
    """Articles 0–1799 of ``wiki.utf8`` (the calibration part of the fixed split, ≈398k
    SmolLM2 tokens). Raises InputError unless the file has exactly 2,349 articles."""
    return _checked_split(path)[:CALIBRATION_ARTICLES]


def heldout_articles(path: str | Path) -> list[str]:
    """Articles 1800–2348 of ``wiki.utf8`` (549 articles, the held-out evaluation part,
    disjoint from every calibration set). Raises InputError unless there are 2,349 articles."""
    return _checked_split(path)[CALIBRATION_ARTICLES:]


def heldout_text(path: str | Path) -> str:
    """The held-out articles as one plain text (≈0.23 MB), each ``strip()``ped and joined by
    blank lines (``"\\n\\n"``), for llama-perplexity and the transformers harness."""
    return "\n\n".join(a.strip() for a in heldout_articles(path))


# --------------------------------------------------------------------------------------------
# Local files through `datasets`

def load_texts(path: str | Path, field: str = "text", fmt: str | None = None,
               sample_by: str = "document", cache_dir: str | Path | None = None) -> list[str]:
    """Documents of a local text, JSON/JSONL or Parquet file, as a list of strings. A folder,
    or a name that is no existing file (``owner/name[:config][@split]``), goes to
    :func:`load_dataset_texts` instead.

    Uses ``datasets.load_dataset(fmt, data_files=path, split="train")`` with ``fmt`` in
    {"text", "json", "parquet"} (default: from the extension: .txt/.utf8/.md → text,
    .json/.jsonl → json, .parquet → parquet). ``field`` is the column holding the text
    ("text" for plain text files). ``sample_by`` applies to plain text only: "document" (the
    whole file is one document), "paragraph" (blank-line separated) or "line".
    Empty and whitespace-only documents are dropped.

    Raises InputError naming the file (and column) when the file is missing, unreadable in
    that format, has no rows or no non-empty text, the column is unknown (the message lists the
    available ones) or its values are not strings."""
    import datasets

    p = Path(path)
    if p.is_dir() or (not p.exists() and _looks_like_dataset_name(str(path))):
        return load_dataset_texts(str(path), field=field, cache_dir=cache_dir)
    if not p.is_file():
        raise InputError(f"{p}: calibration file not found")
    if fmt is None:
        fmt = _FORMATS.get(p.suffix.lower())
        if fmt is None:
            raise InputError(f"{p}: unknown calibration file type '{p.suffix}' "
                             f"(expected one of {sorted(_FORMATS)}, or pass the format)")
    if fmt not in ("text", "json", "parquet"):
        raise InputError(f"{p}: format '{fmt}' is not one of text, json, parquet")
    if p.stat().st_size == 0:
        raise InputError(f"{p}: calibration file is empty")
    kw = {"sample_by": sample_by} if fmt == "text" else {}
    try:
        ds = datasets.load_dataset(fmt, data_files=str(p), split="train",
                                   cache_dir=None if cache_dir is None else str(cache_dir), **kw)
    except Exception as e:  # datasets wraps parse errors in several exception types
        root = e
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        msg = str(root).splitlines()[0] if str(root) else ""
        raise InputError(f"{p}: cannot read as {fmt} ({type(root).__name__}: {msg})") from e
    return _texts_of(ds, field, str(p))


def load_texts_quietly(path: str | Path, field: str = "text", progress: bool = True) -> list[str]:
    """:func:`load_texts` with ``datasets``' own logging silenced (it logs parse failures that
    the InputError already states once) and, unless ``progress``, its progress bars off."""
    import logging

    import datasets

    was = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bars()
    log = logging.getLogger("datasets")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        return load_texts(path, field=field)
    finally:
        log.setLevel(level)
        if was:
            datasets.enable_progress_bars()


def _looks_like_dataset_name(name: str) -> bool:
    """``owner/name`` or ``name``, optionally ``:config`` / ``@split``, with no file suffix."""
    import re

    return (Path(name.split(":")[0].split("@")[0]).suffix.lower() not in _FORMATS
            and re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?(@[\w.\[\]:%-]+)?", name) is not None)


def load_dataset_texts(name: str, field: str = "text", cache_dir: str | Path | None = None
                       ) -> list[str]:
    """Documents of a ``datasets`` dataset: a local dataset folder (data files that
    ``datasets.load_dataset(folder)`` recognizes) or a hub name ``owner/name[:config][@split]``
    (default split "train"; needs the network, or the dataset in the ``datasets`` cache).

    Raises InputError naming the dataset when it cannot be loaded (offline, unknown name,
    unknown split), the column is unknown (listing the available ones) or holds no text."""
    import datasets

    spec, split = (name.split("@", 1) + ["train"])[:2]
    repo, config = (spec.split(":", 1) + [None])[:2]
    try:
        ds = datasets.load_dataset(repo, config, split=split,
                                   cache_dir=None if cache_dir is None else str(cache_dir))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise InputError(f"{name}: not a local file, and datasets cannot load it as a dataset "
                         f"(offline or unknown name/config/split?): {type(e).__name__}: {msg}") from None
    return _texts_of(ds, field, name)


def _texts_of(ds, field: str, where: str) -> list[str]:
    if field not in ds.column_names:
        raise InputError(f"{where}: no column '{field}'; available columns: "
                         f"{', '.join(ds.column_names) or '(none)'}")
    if ds.num_rows == 0:
        raise InputError(f"{where}: no rows")
    values = ds[field]
    bad = next((v for v in values if not isinstance(v, str) and v is not None), None)
    if bad is not None:
        raise InputError(f"{where}: column '{field}' holds {type(bad).__name__} values, not text")
    texts = [v for v in values if v is not None and v.strip()]
    if not texts:
        raise InputError(f"{where}: column '{field}' has no non-empty text")
    return texts


# --------------------------------------------------------------------------------------------
# Token windows

def tokenize_concat(tokenizer, texts: Sequence[str] | Iterable[str], add_eos: bool = True
                    ) -> torch.Tensor:
    """Token ids of ``texts`` concatenated into one stream, int64 [total].

    Each document is encoded without special tokens (``add_special_tokens=False``) and, if
    ``add_eos``, **followed by EOS** (the document separator GPT-style training uses; no BOS is
    inserted, so no per-document BOS rows as in exllamav2). A tokenizer without EOS separates
    documents with its BOS. Rows are never padded, so no pad token is needed.
    Raises InputError if there are no documents, or several documents and the tokenizer has
    neither an EOS nor a BOS token to separate them."""
    texts = list(texts)
    if not texts:
        raise InputError("no calibration text (0 documents)")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "bos_token_id", None)
    if add_eos and eos is None and len(texts) > 1:
        raise InputError(f"the tokenizer has no EOS or BOS token to separate the {len(texts)} "
                         f"calibration documents (set eos_token in tokenizer_config.json, or "
                         f"give one plain-text file)")
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    parts = []
    for seq in ids:  # one tensor per document (a loop over documents, not tokens)
        t = torch.as_tensor(seq, dtype=torch.long)
        if add_eos and eos is not None:
            t = torch.cat([t, t.new_tensor([eos])])
        parts.append(t)
    return torch.cat(parts)


def token_rows(tokenizer, texts: Sequence[str] | Iterable[str], n_samples: int, seqlen: int,
               seed: int = 0, add_eos: bool = True) -> torch.Tensor:
    """``n_samples`` calibration rows of ``seqlen`` tokens, int64 [n_samples, seqlen] (CPU).

    The documents are tokenized and concatenated by :func:`tokenize_concat` (EOS after each
    document). The stream is cut into ⌊total/seqlen⌋ non-overlapping windows (the tail is
    dropped, as AutoAWQ's ``get_calib_dataset`` does) and ``n_samples`` of them are drawn
    without replacement by ``torch.randperm`` with a ``torch.Generator`` seeded with ``seed``,
    then sorted in stream order. The same text, tokenizer and seed give the same rows.

    Raises InputError if there are fewer than ``n_samples * seqlen`` tokens (the message says
    how many there are and how many are needed) or if n_samples/seqlen are not positive."""
    if n_samples < 1 or seqlen < 1:
        raise InputError(f"n_samples ({n_samples}) and seqlen ({seqlen}) must be positive")
    stream = tokenize_concat(tokenizer, texts, add_eos=add_eos)
    need = n_samples * seqlen
    if stream.numel() < need:
        raise InputError(f"calibration text too short: {stream.numel()} tokens, "
                         f"{need} needed ({n_samples} samples x {seqlen} tokens)")
    n_windows = stream.numel() // seqlen
    windows = stream[: n_windows * seqlen].view(n_windows, seqlen)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n_windows, generator=g)[:n_samples].sort().values
    return windows[pick].clone()
