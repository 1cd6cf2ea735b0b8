"""Nothing read from a resume directory runs code (issue 56, item 5): the layer-streamed passes'
checkpoints are JSON plus safetensors (calibration/statefiles.py), a planted pickle in place of
a layer state is refused with exit 2 naming the file and never unpickled, and the states every
consumer kind saves come back equal in type and value."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import batches
import numpy as np
import pytest
import make
import torch
from quantpress.calibration import checkpoint as ckpt_mod
from quantpress.calibration.checkpoint import LayerCheckpoint
from quantpress.calibration.stats import LinearStats
from quantpress.calibration.statefiles import load_state, load_tensor, save_state, save_tensor
from quantpress.cli.quantize_main import main as quantize_main
from quantpress.errors import InputError
from quantpress.quantize.exl2 import QParams


class _Planted:
    """Unpickling it opens ``path`` for writing: the file appears iff a reader unpickled it."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(path: Path, marker: Path) -> None:
    """A ``torch.save`` pickle at ``path`` that creates ``marker`` when loaded with
    ``weights_only=False`` (what the resume code did before)."""
    torch.save({"records": [_Planted(marker)]}, path)


def test_the_planted_pickle_is_live(tmp_path):
    """The plant used below really runs code when unpickled the old way (so that the tests
    that refuse it can fail)."""
    marker = tmp_path / "ran"
    _plant(tmp_path / "p.pt", marker)
    assert not marker.exists()
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert marker.exists()


def same(a, b, where: str = "state") -> None:
    """Assert ``a`` and ``b`` equal in type and value, all the way down (tensors: dtype,
    device, shape and bits; NaN equals NaN)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.device, a.shape, a.requires_grad) == (b.dtype, b.device, b.shape, b.requires_grad), where
        def bits(t):
            t = t.detach().cpu().contiguous()
            return t.view(torch.uint8) if t.numel() else t

        assert torch.equal(bits(a), bits(b)), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif dataclasses.is_dataclass(a):
        same(vars(a), vars(b), f"{where}.")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, where


def test_every_node_kind_round_trips(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    st = LinearStats("model.layers.0.mlp.up_proj", 4, kinds={"sq", "amax"})
    st.update(torch.randn(5, 4))
    value = {
        "none": None, "flags": [True, False], "int": 2 ** 70, "float": 0.1, "neg0": -0.0,
        "nonfinite": (float("nan"), float("inf"), float("-inf")),
        "text": "é\n\"", "set": {3, 1, 2}, "frozen": frozenset({"a", "b"}),
        "int keys": {1: "a", (2, "x"): None},
        "tensors": [base, base, base[1:], base.t(), torch.zeros(0, 3, dtype=torch.int64)],
        "dtypes": [torch.tensor([1.5, -2], dtype=torch.bfloat16),
                   torch.tensor([0.5, 448.0]).to(torch.float8_e4m3fn), torch.float64, torch.device("cpu")],
        "numpy": [np.arange(6, dtype=np.int16).reshape(2, 3), np.float64(0.25), np.int32(-7)],
        "records": [st, QParams(64, [4], [1.0])],
    }
    save_state(value, tmp_path / "s.json", tmp_path / "s.safetensors")
    back = load_state(tmp_path / "s.json", tmp_path / "s.safetensors")
    same(value, back)
    t = back["tensors"]
    assert t[0] is t[1] and t[2].data_ptr() != t[0].data_ptr()       # one object stays one
    assert back["records"][1] == value["records"][1] and hash(back["records"][1]) == hash(value["records"][1])
    json.loads((tmp_path / "s.json").read_text())                    # strict JSON (no NaN token)

    h = torch.randn(2, 3, 8, dtype=torch.float16)
    save_tensor(h, tmp_path / "h.safetensors")
    same(h, load_tensor(tmp_path / "h.safetensors"))
    with pytest.raises(TypeError, match=r"state\['x'\]: builtins.object cannot be saved"):
        save_state({"x": object()}, tmp_path / "o.json", tmp_path / "o.safetensors")


def test_files_not_written_here_are_refused(tmp_path):
    """Every way a saved state can be something else: InputError naming the file, and the
    planted pickle never runs."""
    marker = tmp_path / "ran"
    save_state({"a": torch.ones(2)}, tmp_path / "s.json", tmp_path / "s.safetensors")
    good_json = (tmp_path / "s.json").read_text()

    _plant(tmp_path / "s.safetensors", marker)
    with pytest.raises(InputError, match=r"s\.safetensors: not a safetensors file"):
        load_state(tmp_path / "s.json")
    _plant(tmp_path / "h.safetensors", marker)
    with pytest.raises(InputError, match=r"h\.safetensors: not a safetensors file"):
        load_tensor(tmp_path / "h.safetensors")
    _plant(tmp_path / "s.json", marker)
    with pytest.raises(InputError, match=r"s\.json: not a JSON saved state"):
        load_state(tmp_path / "s.json")
    assert not marker.exists()

    save_state({"a": torch.ones(2)}, tmp_path / "s.json", tmp_path / "s.safetensors")
    doc = json.loads(good_json)

    def refused(state, match: str, **top) -> None:
        (tmp_path / "s.json").write_text(json.dumps({**doc, "state": state, **top}))
        with pytest.raises(InputError, match=match):
            load_state(tmp_path / "s.json")

    refused({"dataclass": "subprocess:Popen", "fields": {"args": "touch x"}}, r"s\.json: class subprocess:Popen is not a dataclass")
    refused({"dataclass": "quantpress.not_imported:X", "fields": {}}, "is not a dataclass of a loaded module")
    refused({"pickle": "gASV"}, r"s\.json: unknown node")
    refused({"tensor": "t9", "device": "cpu", "grad": False}, r"tensor 't9' is not in")
    refused(None, r"s\.safetensors: holds tensors its state s\.json does not name")
    refused(None, "not a saved state of format", version=2)
    refused(None, "is not a sibling file name", tensors="../s.safetensors")
    # safetensors of another format (a model file, say)
    from safetensors.torch import save_file

    save_file({"t0": torch.ones(2)}, str(tmp_path / "s.safetensors"))
    (tmp_path / "s.json").write_text(good_json)
    with pytest.raises(InputError, match=r"s\.safetensors: not a quantpress.saved-state safetensors file"):
        load_state(tmp_path / "s.json")


def test_checkpoint_refuses_a_planted_file_and_keeps_the_directory(tmp_path):
    d = tmp_path / "p.ckpt"
    marker = tmp_path / "ran"
    c = LayerCheckpoint(d, "p", {"job": 1})
    assert c.start() == (0, None, [])
    states = [{"records": [QParams(32, [4], [1.0])], "x": torch.randn(4)}, {"records": []}]
    hiddens = [torch.randn(2, 3, 8), torch.randn(2, 3, 8)]
    for i in range(2):
        c.commit(i, hiddens[i], states[i])
    assert sorted(p.name for p in d.iterdir()) == ["done.json", "hidden-1.safetensors", "key.json",
                                                   "layer-0.json", "layer-0.safetensors",
                                                   "layer-1.json", "layer-1.safetensors"]
    first, hidden, back = LayerCheckpoint(d, "p", {"job": 1}).start()
    assert first == 2
    same(hiddens[1], hidden)
    same(states, back)

    def files() -> dict:
        return make.digests(d)

    for name in ("layer-0.pt", "hidden-1.pt", "layer-9.json", "notes.txt"):
        _plant(d / name, marker)
        before = files()
        with pytest.raises(InputError, match=rf"{name}: not a file this checkpoint writes"):
            LayerCheckpoint(d, "p", {"job": 1}).start()
        assert files() == before
        (d / name).unlink()
    for name in ("layer-1.safetensors", "layer-0.json", "hidden-1.safetensors"):
        keep = (d / name).read_bytes()
        _plant(d / name, marker)
        before = files()
        with pytest.raises(InputError, match=rf"{name}: not a"):
            LayerCheckpoint(d, "p", {"job": 1}).start()
        assert files() == before
        (d / name).write_bytes(keep)
    (d / "layer-0.json").unlink()
    with pytest.raises(InputError, match=r"layer-0\.json: missing"):
        LayerCheckpoint(d, "p", {"job": 1}).start()
    (d / "done.json").write_text("garbage")
    with pytest.raises(InputError, match=r"done\.json: not the JSON a checkpoint writes"):
        LayerCheckpoint(d, "p", {"job": 1}).start()
    assert not marker.exists()
    # another key: discarded as before, whatever it holds (nothing is read)
    _plant(d / "layer-0.pt", marker)
    msgs = []
    assert LayerCheckpoint(d, "p", {"job": 2}, msgs.append).start() == (0, None, [])
    assert "another job or code version; discarded" in msgs[0]
    assert sorted(p.name for p in d.iterdir()) == ["key.json"] and not marker.exists()


def _files(d: Path) -> dict[str, str]:
    return {k: v for k, v in make.digests(d).items() if k not in ("manifest.json", "README.md")}


def test_planted_pickle_in_an_interrupted_job_is_refused(tmp_path, three_layer_dir):
    """A batch killed in its reference pass (the GGUF output finished before it) and in a GPTQ
    pass of its own; a pickle that creates a file when unpickled is planted in place of a layer
    state (as ``layer-0.safetensors``, and under the old name ``layer-0.pt``); the re-run exits
    2 naming the file, the file is never created, the finished output and the saved work stay
    byte for byte. With the real layer state put back, the run resumes where it stopped."""
    out = tmp_path / "out"
    marker = tmp_path / "planted-ran"
    # the GGUF output first, in a run of its own: in one run it is written in a second lane,
    # which a kill of the first lane may stop between installing it and recording it
    p = batches.batch_process(batches.one_model_job(tmp_path / "g.toml", three_layer_dir, 'gguf = ["Q8_0"]'), out)
    assert p.returncode == 0, p.stderr[-2000:]
    job = batches.one_model_job(tmp_path / "j.toml", three_layer_dir, 'gguf = ["Q8_0"]\nimatrix = true')
    p = batches.batch_process(job, out, "reference:1")
    assert p.returncode == -9, p.stderr[-2000:]
    m = out / "m"
    ckpt = m / ".work" / "reference.ckpt"
    gguf = make.digests(m / "m-Q8_0.gguf")
    real = (ckpt / "layer-0.safetensors").read_bytes()

    for name in ("layer-0.safetensors", "layer-0.pt"):
        _plant(ckpt / name, marker)
        before = _files(m)
        p = batches.batch_process(job, out)
        assert p.returncode == 2, p.stderr[-2000:]
        row = {r["path"]: r for r in json.loads(p.stdout)}["m.imatrix.gguf"]
        assert (row["status"], row["code"]) == ("failed", 2) and f"{ckpt / name}: not a" in row["error"], row
        assert not marker.exists()
        # the manifest and model card record the failure; nothing else changes
        assert _files(m) == before and make.digests(m / "m-Q8_0.gguf") == gguf
        if name.endswith(".pt"):
            (ckpt / name).unlink()
        else:
            (ckpt / name).write_bytes(real)

    p = batches.batch_process(job, out)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "reference: resuming at layer 2 (layers 0-1 kept" in p.stderr
    rows = {r["path"]: (r["status"], r["resumed_at"]) for r in json.loads(p.stdout)}
    assert rows == {"m-Q8_0.gguf": ("kept", 0), "m.imatrix.gguf": ("made", 2)}
    single = tmp_path / "single.imatrix.gguf"
    make.imatrix(make.source(three_layer_dir, samples=2, seqlen=32), single)
    assert (m / "m.imatrix.gguf").read_bytes() == single.read_bytes()

    # a pass of the output's own (GPTQ): refused the same way, and that output alone fails
    job = batches.one_model_job(tmp_path / "q.toml", three_layer_dir, "gptq = [{ group_size = 64 }]")
    out = tmp_path / "gout"
    p = batches.batch_process(job, out, "m-GPTQ-w4g64:0")
    assert p.returncode == -9, p.stderr[-2000:]
    gck = out / "m" / ".work" / "m-GPTQ-w4g64.ckpt"
    _plant(gck / "layer-0.safetensors", marker)
    p = batches.batch_process(job, out)
    assert p.returncode == 2, p.stderr[-2000:]
    (row,) = json.loads(p.stdout)
    assert (row["status"], row["code"]) == ("failed", 2), row
    assert f"{gck / 'layer-0.safetensors'}: not a safetensors file" in row["error"], row
    assert not marker.exists() and not (out / "m" / "m-GPTQ-w4g64").exists()


def _classes(x) -> set[str]:
    """The dataclasses in a saved state (qualified names), all the way down."""
    if dataclasses.is_dataclass(x):
        return {type(x).__qualname__} | _classes(vars(x))
    if isinstance(x, dict):
        return set().union(*map(_classes, x.values()))
    if isinstance(x, (list, tuple)):
        return set().union(*map(_classes, x))
    return set()


def test_every_consumer_state_round_trips(tmp_path, three_layer_dir, monkeypatch):
    """A batch with every checkpointed consumer kind (imatrix statistics, AWQ, FP8 static,
    EXL2 measurement in the reference pass; GPTQ and EXL2 quantization in passes of their
    own): each committed layer state, read back from its files, equals what was saved in type
    and value (the dataclass records of every kind among them)."""
    seen = tmp_path / "seen"
    seen.mkdir()
    commit = LayerCheckpoint.commit

    def checked(self, index, hidden, state):
        commit(self, index, hidden, state)
        back = load_state(self.dir / f"layer-{index}.json", self.dir / f"layer-{index}.safetensors")
        same(state, back)
        same(hidden.detach().cpu(), load_tensor(self.dir / f"hidden-{index}.safetensors"))
        (seen / f"{self.name}-{index}").write_text(json.dumps(sorted(_classes(state))))

    monkeypatch.setattr(ckpt_mod.LayerCheckpoint, "commit", checked)
    job = batches.one_model_job(tmp_path / "j.toml", three_layer_dir,
               'imatrix = true\nawq = [{ group_size = 64 }]\nfp8 = [{ scheme = "static" }]\n'
               'gptq = [{ group_size = 64 }]\nexl2 = [{ bpw = 4.0 }]')
    assert quantize_main(["batch", str(job), "-o", str(tmp_path / "out"), "--quiet"]) == 0
    names = sorted(p.name for p in seen.iterdir())
    assert names == sorted(f"{n}-{i}" for n in ("reference", "m-GPTQ-w4g64", "m-EXL2-4.0bpw")
                           for i in range(3)), names
    kinds = {n: set(json.loads((seen / f"{n}-1").read_text())) for n in ("reference", "m-GPTQ-w4g64", "m-EXL2-4.0bpw")}
    want = {"reference": {"LinearStats", "LinearResult", "FP8Linear"},
            "m-GPTQ-w4g64": {"LinearResult"}, "m-EXL2-4.0bpw": {"LinearRecord", "QParams"}}
    assert all(kinds[n] >= want[n] for n in want), kinds
