"""Read any GGUF file (ours or not) with gguf-py and describe it: metadata and tensors."""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from gguf import GGMLQuantizationType, GGUFValueType

from quantpress.convert.gguf_reading import open_reader

ARRAY_PREVIEW = 6


def _value_text(field) -> str:
    vtype = GGUFValueType(field.types[0])
    if vtype == GGUFValueType.ARRAY:
        items = field.contents()
        sub = GGUFValueType(field.types[1]).name if len(field.types) > 1 else "?"
        head = ", ".join(repr(v) for v in items[:ARRAY_PREVIEW])
        more = f", ... ({len(items)} items)" if len(items) > ARRAY_PREVIEW else ""
        return f"[{sub}] [{head}{more}]"
    value = field.contents()
    text = repr(value)
    if len(text) > 120:
        text = text[:117] + "..."
    return f"{vtype.name} {text}"


def inspect_gguf(path: Path) -> dict:
    """Describe ``path``: ``{"metadata": [(key, text)], "tensors": [{name, shape, type,
    bytes, bpw}], "file_bytes": int}``. ``shape`` is in ggml order (ne[0] first), as
    llama.cpp prints it. Raises InputError if the file cannot be parsed as GGUF."""
    path = Path(path)
    reader = open_reader(path)
    meta = [(k, _value_text(f)) for k, f in reader.fields.items() if not k.startswith("GGUF.")]
    tensors = []
    for t in reader.tensors:
        ne = [int(d) for d in t.shape.tolist()]
        n = math.prod(ne)
        tensors.append({"name": t.name, "shape": ne, "type": GGMLQuantizationType(t.tensor_type).name,
                        "bytes": int(t.n_bytes), "bpw": 8.0 * int(t.n_bytes) / n if n else 0.0})
    return {"path": str(path), "file_bytes": path.stat().st_size, "metadata": meta, "tensors": tensors}


def format_inspection(info: dict) -> str:
    """Human-readable text of :func:`inspect_gguf`'s result."""
    lines = [f"{info['path']}: {info['file_bytes']:,} bytes, {len(info['metadata'])} metadata keys, "
             f"{len(info['tensors'])} tensors", "", "metadata:"]
    width = max((len(k) for k, _ in info["metadata"]), default=0)
    lines += [f"  {k:<{width}}  {v}" for k, v in info["metadata"]]
    lines += ["", "tensors:"]
    nw = max((len(t["name"]) for t in info["tensors"]), default=4)
    lines.append(f"  {'name':<{nw}}  {'shape (ne)':<20} {'type':<6} {'bytes':>12} {'bpw':>7}")
    for t in info["tensors"]:
        shape = "x".join(str(d) for d in t["shape"])
        lines.append(f"  {t['name']:<{nw}}  {shape:<20} {t['type']:<6} {t['bytes']:>12,} {t['bpw']:>7.3f}")
    counts = Counter(t["type"] for t in info["tensors"])
    n = sum(math.prod(t["shape"]) for t in info["tensors"])
    b = sum(t["bytes"] for t in info["tensors"])
    lines += ["", "types: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())),
              f"total: {n:,} weights, {b:,} tensor bytes, {8.0 * b / max(1, n):.4f} bits per weight"]
    return "\n".join(lines)
