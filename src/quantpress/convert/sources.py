"""Where a model argument points: a local path, or a Hugging Face repo id read from the hub cache.

Every verb's MODEL argument and a job file's ``source`` go through :func:`resolve_model`:

- an existing path (a directory or a file; relative to ``base`` when given, else to the
  working directory) is used as it is;
- otherwise a string of the form ``org/name`` is a Hugging Face repo id, resolved with
  ``huggingface_hub.snapshot_download(..., local_files_only=True)`` at ``revision`` (a
  branch, tag or commit; None: ``main``) in the hub cache (``HF_HUB_CACHE``, else
  ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``, as huggingface_hub reads them). Nothing
  touches the network unless ``allow_download`` (``--allow-download``) is set and the
  revision is not cached; then the files quantpress reads (:data:`DOWNLOAD_PATTERNS`, top
  level only) are downloaded into that cache with ``snapshot_download`` (``HF_HUB_OFFLINE=1``
  still forbids it);
- anything else is returned as it is, for the verb's own message about the missing path.

A repo id not in the cache is an InputError (exit 2) naming the id, the revision and the
cache directory searched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from quantpress.errors import InputError

#: ``org/name`` (huggingface_hub's own check, ``validate_repo_id``, runs on it too)
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+")
#: what ``--allow-download`` fetches of a repo: the configs, tokenizer files and safetensors
#: shards (README.md too: its model card feeds GGUF metadata), top level only, so that
#: ``pytorch_model.bin`` copies, ``original/``, ``onnx/`` or GGUF files are left on the Hub
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja", "*.tiktoken",
                     "README.md")
DOWNLOAD_IGNORE = ("*/*",)
#: the argument help the verbs append to their MODEL argument's
REPO_HELP = "; or a repo id org/name from the local Hugging Face cache (--revision, --allow-download)"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model argument: ``path`` (local directory or file), and for a repo id the
    ``repo_id`` and the ``revision`` asked for (None: the default branch)."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None

    @property
    def name(self) -> str:
        """A name for outputs: the repo's name (``org/name`` → ``name``), else the path's."""
        return self.repo_id.rsplit("/", 1)[1] if self.repo_id else self.path.name


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub reads (``huggingface_hub.constants.HF_HUB_CACHE``)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def is_repo_id(text: str) -> bool:
    """Whether ``text`` has the form of a Hugging Face repo id ``org/name`` (huggingface_hub's
    ``validate_repo_id`` rules)."""
    if not REPO_ID.fullmatch(text):
        return False
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except ValueError:
        return False
    return True


def resolve_model(spec: str | Path, revision: str | None = None, allow_download: bool = False,
                  base: Path | None = None) -> ModelSource:
    """The :class:`ModelSource` of a model argument (see the module docstring).

    ``base``: the directory relative paths are read from (a job file's); None: the working
    directory. Raises InputError for a ``revision`` with a local path or a non-repo-id, for a
    repo id whose revision is not in the cache (naming the id, the revision and the cache
    directory), and for a failed download (``allow_download``)."""
    text = str(spec)
    path = Path(text).expanduser()
    if base is not None and not path.is_absolute():
        path = (base / path).resolve()
    if path.exists() or not is_repo_id(text):
        if revision is not None:
            what = "a local path" if path.exists() else "not a Hugging Face repo id (org/name)"
            raise InputError(f"{text}: {what}; --revision {revision} applies to repo ids only")
        return ModelSource(path)
    return ModelSource(Path(snapshot_path(text, revision, allow_download)), text, revision)


def snapshot_path(repo_id: str, revision: str | None = None, allow_download: bool = False) -> str:
    """The snapshot directory of ``repo_id`` at ``revision`` in the hub cache
    (``snapshot_download(local_files_only=True)``); with ``allow_download``, downloaded first
    when the cache lacks it. InputError when it is not there (or the download fails)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rev = revision or constants.DEFAULT_REVISION
    cache = hub_cache_dir()
    patterns = dict(allow_patterns=list(DOWNLOAD_PATTERNS), ignore_patterns=list(DOWNLOAD_IGNORE))
    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True, **patterns)
    except LocalEntryNotFoundError as e:
        incomplete = type(e).__name__ == "IncompleteSnapshotError"
    state = "incomplete" if incomplete else "not"
    where = f"{repo_id} (revision {rev}): {state} in the Hugging Face cache {cache}"
    if not allow_download:
        raise InputError(f"{where}; not a local path either (pass --allow-download to fetch it)")
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"{where}; HF_HUB_OFFLINE is set, so --allow-download cannot fetch it")
    try:
        return snapshot_download(repo_id, revision=revision, **patterns)
    except (OSError, ValueError) as e:  # huggingface_hub's HTTP and cache errors are OSErrors
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise InputError(f"{where}; download failed ({type(e).__name__}: {first})") from None
