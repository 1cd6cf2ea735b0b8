"""``OUT_ROOT/<name>/manifest.json`` and the model card (``README.md``) made from it.

The manifest records every output of one model as the batch finished it (relative path, each
file's SHA-256, bytes, bits per weight, round trip, seconds, evaluation) plus the calibration,
the job's options and the versions of the software that made it. A re-run trusts an output
only when its manifest entry says ``"roundtrip": "ok"``, its options are those of the job and
every file still has the recorded checksum, in place or still among the verified outputs
waiting to be installed (:func:`staged_dir`): the entry is written before the output is
renamed into place.
"""
from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path

from quantpress.errors import InputError

MANIFEST = "manifest.json"
CARD = "README.md"
CHUNK = 1 << 22
#: a model's work in progress, ``OUT_ROOT/<name>/.work/``: temporary outputs, the checkpoints
#: of the layer-streamed passes, and (:data:`VERIFIED`) the outputs waiting for their entry
WORK = ".work"
#: under :data:`WORK`, the verified outputs whose manifest entry is not written yet: an output
#: is renamed from here into place only after its entry is in the manifest, so that every
#: output the model's directory holds is one the manifest records
VERIFIED = "verified"


def sha256_file(path: Path) -> str:
    """SHA-256 (hex) of a file, read 4 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def file_digests(path: Path) -> dict[str, str]:
    """``{file: sha256}`` of an output: a file → its name; a directory → every regular file
    below it by relative path, sorted."""
    path = Path(path)
    if path.is_file():
        return {path.name: sha256_file(path)}
    return {str(f.relative_to(path)): sha256_file(f) for f in sorted(path.rglob("*")) if f.is_file()}


def intact(model_dir: Path, entry: dict) -> bool:
    """Whether a finished output of the manifest is still on disk with the recorded
    checksums (``entry["files"]``, relative to the output)."""
    p = model_dir / entry["path"]
    files = entry.get("files") or {}
    if not p.exists() or not files:
        return False
    try:
        return file_digests(p) == files
    except OSError:
        return False


def staged_dir(model_dir: Path) -> Path:
    """The directory of a model's verified outputs waiting for their manifest entry
    (``<model_dir>/.work/verified``, :data:`VERIFIED`)."""
    return Path(model_dir) / WORK / VERIFIED


def staged_path(model_dir: Path, path: str) -> Path:
    """Where the output ``path`` (relative to ``model_dir``) lies from its verification until
    its manifest entry is written (:func:`staged_dir`)."""
    return staged_dir(model_dir) / path


def runtimes(kind: str) -> str:
    """Which runtimes load an output of ``kind`` (its target's ``runtimes``; "" for a kind
    no target registers)."""
    from quantpress.targets.registry import registered

    return next((c.runtimes for c in registered() if c.kind == kind), "")


def versions() -> dict[str, str]:
    """Versions of quantpress and the libraries whose code decides the output bytes."""
    from quantpress.targets.registry import registered

    out = {}
    extra = [p for c in registered() for p in c.packages]
    for pkg in dict.fromkeys(["quantpress", "torch", "transformers", "safetensors", *extra, "numpy"]):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def read_manifest(model_dir: Path) -> dict | None:
    """The manifest of ``model_dir`` (None when there is none). InputError naming the file when
    it is not a manifest."""
    p = Path(model_dir) / MANIFEST
    if not p.exists():
        return None
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{p}: not a readable manifest ({e}); move it away to start over") from None
    if not isinstance(m, dict) or not isinstance(m.get("outputs"), list):
        raise InputError(f"{p}: not a quantpress manifest (no outputs list)")
    return m


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as indented JSON through a temporary sibling renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _size(n: int | None) -> str:
    if not n:
        return ""
    for unit, div in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def model_card(manifest: dict) -> str:
    """The model card (Markdown) of a manifest: one table row per output (file, size, bpw,
    PPL, KLD, round trip, which runtime loads it) and how it was made."""
    m = manifest
    origin = m['source']
    if m.get("repo_id"):
        origin = f"{m['repo_id']}@{m.get('revision') or 'main'}"
    lines = [f"# {m['model']}: quantized outputs", "",
             f"Made by quantpress {m.get('versions', {}).get('quantpress', '?')} from "
             f"`{origin}`; every output passed its round trip before it was kept.", ""]
    cal = m.get("calibration") or {}
    if cal:
        lines += [f"Calibration: {cal.get('samples')} rows × {cal.get('seqlen')} tokens of "
                  f"{cal.get('text') or 'the default text'} (seed {cal.get('seed')}), "
                  f"{cal.get('device', '')} {cal.get('dtype', '')}.".replace(" ,", ","), ""]
    base = m.get("eval_base")
    if base:
        lines += [f"Evaluation: {base['text']}, {base['n_chunks']} chunks of {base['n_ctx']} tokens; "
                  f"PPL of the source {base['ppl']:.4f}; KLD = mean KL divergence of each output's "
                  f"next-token distribution from the source's.", ""]
    lines += ["| file | size | bpw | PPL | KLD | round trip | loads in |",
              "|---|---|---|---|---|---|---|"]
    for o in m["outputs"]:
        ev = o.get("eval") or {}
        ppl = f"{ev['ppl']:.4f}" if "ppl" in ev else ""
        kld = f"{ev['kld']:.5f}" if "kld" in ev else ""
        bpw = f"{o['bpw']:.3f}" if o.get("bpw") else ""
        rt = o.get("roundtrip", "")
        rt = "ok" if rt == "ok" else f"**{rt}**"
        name = o["path"] + ("/" if o.get("is_dir") else "")
        lines.append(f"| `{name}` | {_size(o.get('bytes'))} | {bpw} | {ppl} | {kld} | {rt} | "
                     f"{runtimes(o['kind'])} |")
    return "\n".join(lines) + "\n"
