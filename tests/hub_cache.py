"""A Hugging Face hub cache written offline, laid out as huggingface_hub lays out its downloads
(``models--ORG--NAME/{blobs,snapshots,refs}``: each file a blob named by its git or LFS hash,
the snapshot's entries relative symlinks to the blobs, ``refs/<branch>`` the commit), checked
with huggingface_hub's own ``scan_cache_dir``. huggingface_hub has no public call that fills
the cache without a Hub to download from, so the layout is written here."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def _blob_id(data: bytes, lfs: bool) -> str:
    """The blob's name: the LFS object's SHA-256, else the git blob's SHA-1 (the ETag the Hub
    sends for each kind)."""
    if lfs:
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, model_dir: Path, refs: tuple[str, ...] = ("main",),
                 commit: str | None = None) -> Path:
    """Put the files of ``model_dir`` (top level) into ``cache`` as the snapshot of ``repo_id``
    at ``commit`` (None: a hash of the files), each of ``refs`` pointing at it. Returns the
    snapshot directory."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    if commit is None:
        h = hashlib.sha1(repo_id.encode())
        for p in files:
            h.update(p.name.encode() + hashlib.sha256(p.read_bytes()).digest())
        commit = h.hexdigest()
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        data = p.read_bytes()
        blob = repo / "blobs" / _blob_id(data, lfs=p.suffix == ".safetensors")
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / p.name
        if not link.is_symlink():
            os.symlink(os.path.relpath(blob, snap), link)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


def check_layout(cache: Path, repo_id: str) -> dict[str, set[str]]:
    """huggingface_hub's view of the cache (``scan_cache_dir``): asserts it found no problem,
    returns ``{commit: refs}`` of ``repo_id``."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    repo = next(r for r in info.repos if r.repo_id == repo_id)
    assert repo.repo_type == "model"
    return {r.commit_hash: set(r.refs) for r in repo.revisions}
