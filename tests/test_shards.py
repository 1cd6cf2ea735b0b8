"""convert/shards.py: safetensors files written tensor by tensor, shards assembled from part
files, float16 conversion by row blocks; every file is read back with the safetensors
library itself."""
from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantpress.convert import shards
from quantpress.errors import InputError


def _mixed(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.f16": torch.randn(5, 7, generator=g).half(),
        "b.i32": torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 4), generator=g, dtype=torch.int32),
        "c.bf16": torch.randn(9, generator=g).bfloat16(),
        "d.i16": torch.randint(-300, 300, (6,), generator=g, dtype=torch.int16),
        "e.f32": torch.randn(2, 3, 4, generator=g),
        "f.u8": torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
        "g.scalar": torch.tensor(3.5),
    }


def _same(a: dict, b: dict):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_write_reads_back_with_safetensors(tmp_path):
    t = _mixed()
    p = tmp_path / "x.safetensors"
    n = shards.write_safetensors(p, t, metadata={"format": "pt"})
    assert n == sum(v.numel() * v.element_size() for v in t.values())
    _same(load_file(str(p)), t)
    with safe_open(str(p), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    # header padded to 8 bytes, every tensor aligned to its element size
    head, start = shards.read_header(p)
    assert start % 8 == 0
    for k, e in head.items():
        assert e["data_offsets"][0] % t[k].element_size() == 0, k
    # the same bytes of data as the library writes, in some order
    q = tmp_path / "ref.safetensors"
    save_file(t, str(q))
    assert p.stat().st_size - start == q.stat().st_size - shards.read_header(q)[1]


def test_row_chunks_written_block_by_block(tmp_path):
    full = torch.randn(37, 6).half()
    asked = []

    def rows(lo, hi):
        asked.append((lo, hi))
        return full[lo:hi].clone()

    p = tmp_path / "r.safetensors"
    shards.write_safetensors(p, {"emb": shards.RowChunks((37, 6), torch.float16, rows, block=10),
                                 "n": torch.ones(6)})
    assert asked == [(0, 10), (10, 20), (20, 30), (30, 37)]
    back = load_file(str(p))
    assert torch.equal(back["emb"], full) and torch.equal(back["n"], torch.ones(6))
    bad = shards.RowChunks((4, 6), torch.float16, lambda lo, hi: torch.zeros(hi - lo, 5).half())
    with pytest.raises(ValueError, match=r"tensor 'bad': rows \[0, 4\) came as \(4, 5\)"):
        shards.write_safetensors(tmp_path / "b.safetensors", {"bad": bad})
    with pytest.raises(ValueError, match="complex"):
        shards.write_safetensors(tmp_path / "c.safetensors", {"z": torch.zeros(2, dtype=torch.complex64)})


def test_shard_set_splits_in_order_and_copies_bytes(tmp_path):
    parts = [{f"l{i}.w": torch.randn(16, 8).half(), f"l{i}.q": torch.randint(0, 9, (8, 4), dtype=torch.int32)}
             for i in range(5)]
    parts.append({"big": torch.randn(100, 10)})  # 4000 bytes: more than the limit, a shard of its own
    s = shards.ShardSet(tmp_path, max_shard_bytes=700)
    for p in parts:
        s.add(p)
    with pytest.raises(ValueError, match="written twice"):
        s.add({"l0.w": torch.zeros(1)})
    plan = s.plan()
    names = [k for p in parts for k in p]
    assert [k for sh in plan for k in sh] == names  # the order added
    assert plan[-1] == ["big"] and len(plan) > 2
    for sh in plan:
        assert len(sh) == 1 or sum(s.sizes[k] for k in sh) <= 700
    wm = s.finish(lambda n: [f"out-{k}-of-{n}.safetensors" for k in range(n)], metadata={"format": "pt"})
    assert not list(tmp_path.glob(".part-*"))
    files = sorted(set(wm.values()))
    assert len(files) == len(plan)
    back = {}
    for f in files:
        got = load_file(str(tmp_path / f))
        assert set(got) == {k for k, v in wm.items() if v == f}
        back.update(got)
    _same(back, {k: v for p in parts for k, v in p.items()})


def test_shard_set_single_file_and_truncated_part(tmp_path):
    s = shards.ShardSet(tmp_path / "", 0)
    t = _mixed(1)
    s.add(dict(list(t.items())[:3]))
    s.add(dict(list(t.items())[3:]))
    wm = s.finish(lambda n: ["model.safetensors"] * n)
    assert set(wm.values()) == {"model.safetensors"}
    _same(load_file(str(tmp_path / "model.safetensors")), t)
    # a part file cut short is reported, naming it
    d = tmp_path / "trunc"
    d.mkdir()
    s = shards.ShardSet(d, 0)
    s.add({"w": torch.randn(64, 64)})
    part = next(d.glob(".part-*"))
    part.write_bytes(part.read_bytes()[:-100])
    with pytest.raises(ValueError, match="truncated part file"):
        s.finish(lambda n: ["m.safetensors"])


def test_read_header_errors(tmp_path):
    p = tmp_path / "short"
    p.write_bytes(b"abc")
    with pytest.raises(ValueError, match="shorter than 8 bytes"):
        shards.read_header(p)
    p.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        shards.read_header(p)


class _Rows:
    """A weights object with row access (the SafetensorsDir protocol)."""

    def __init__(self, t):
        self.t, self.calls = t, []

    def shape(self, name):
        return tuple(self.t.shape)

    def get_rows(self, name, lo, hi):
        self.calls.append((lo, hi))
        return self.t[lo:hi]

    def get(self, name, device="cpu"):
        return self.t


def test_float16_rows_checks_values(tmp_path):
    t = torch.randn(50, 4, dtype=torch.bfloat16)
    w = _Rows(t)
    rc = shards.float16_rows(w, "model.embed_tokens.weight", block=16)
    assert isinstance(rc, shards.RowChunks)
    shards.write_safetensors(tmp_path / "e.safetensors", {"e": rc})
    assert w.calls == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert torch.equal(load_file(str(tmp_path / "e.safetensors"))["e"], t.half())
    t2 = t.clone()
    t2[37, 1] = 1e6
    rc = shards.float16_rows(_Rows(t2), "lm_head.weight", block=16)
    with pytest.raises(InputError, match=r"'lm_head\.weight' \(row 37\) has values outside the float16 range"):
        shards.write_safetensors(tmp_path / "f.safetensors", {"e": rc})
    t2[37, 1] = float("nan")
    with pytest.raises(InputError, match=r"\(row 37\) holds NaN or Inf"):
        shards.checked_float16(t2, "x")
    # 1-D tensors and readers without row access come whole
    assert torch.equal(shards.float16_rows(_Rows(torch.ones(3)), "n"), torch.ones(3).half())


def test_header_is_json_with_offsets(tmp_path):
    p = tmp_path / "h.safetensors"
    shards.write_safetensors(p, {"x": torch.zeros(3, dtype=torch.int32), "y": torch.zeros(2).half()})
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    assert head["x"] == {"dtype": "I32", "shape": [3], "data_offsets": [0, 12]}
    assert head["y"] == {"dtype": "F16", "shape": [2], "data_offsets": [12, 16]}
    assert len(raw) == 8 + n + 16
