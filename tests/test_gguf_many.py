"""convert/gguf_file.py ``write_gguf_many`` and targets/gguf.py ``GGUFTarget.write_together``:
several policies of one source written from one read of each source tensor.

* the files equal, byte for byte, those of one ``produce`` per policy (Q4_K_M, Q8_0, Q6_K in
  llama-quantize's tensor order; F16 in the converter's order: two order groups);
* each source tensor is loaded exactly once per order group, and only through the first
  target of its group, and encoded once per distinct ggml type within its group;
* a NaN in a source tensor raises InputError naming the tensor, with every writer closed;
* plans of one order that differ in shapes, or targets of different sources, are refused;
* on the CPU with codec processes, windows of tensors with the next read meanwhile (at most one
  window ahead; a failed load raised here, nothing left running), the same bytes as one
  tensor at a time; which plans' codecs keep every core (``codecs_leave_a_core``).

Tiny 2-layer llama (``tiny_llama_dir``), CPU.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import make
import procs
from quantpress.convert import gguf_checkers, gguf_checks, gguf_file, gguf_reading, gguf_roundtrip
from quantpress.convert.gguf_checks import SourceTensor
from quantpress.errors import InputError
from quantpress.quantize.ggml import common
from quantpress.targets import GGUFOptions, Run, produce
from quantpress.targets.gguf import GGUFTarget

POLICIES = ["Q4_K_M", "Q8_0", "Q6_K", "F16"]


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def prepared(tiny_llama_dir) -> list[GGUFTarget]:
    """Prepared GGUF targets of the tiny llama, one per policy of POLICIES, sharing one CPU
    Source (use :func:`_fresh` copies: tests replace plan tensors)."""
    src = make.source(tiny_llama_dir)
    run = Run(progress=False)
    out = []
    for p in POLICIES:
        t = GGUFTarget(src, GGUFOptions(p))
        t.prepare(run)
        out.append(t)
    return out


def _fresh(prepared: list[GGUFTarget], policies=POLICIES) -> list[GGUFTarget]:
    """Copies of the prepared targets of ``policies`` whose plans own their tensor lists."""
    by_policy = {t.options.policy: t for t in prepared}
    out = []
    for p in policies:
        t = copy.copy(by_policy[p])
        t.plan = dataclasses.replace(t.plan, tensors=list(t.plan.tensors))
        out.append(t)
    return out


def _count_loads(targets: list[GGUFTarget]) -> Counter:
    """Wrap every SourceTensor loader of every plan; the Counter counts loads by
    (target index, tensor name)."""
    calls: Counter = Counter()
    for i, t in enumerate(targets):
        def wrap(st: SourceTensor, i=i) -> SourceTensor:
            def load(inner=st.load, name=st.name):
                calls[i, name] += 1
                return inner()
            return SourceTensor(st.name, st.shape, load)
        t.plan.tensors = [wrap(st) for st in t.plan.tensors]
    return calls


@pytest.fixture(scope="module")
def singles(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """sha256 of the file of one ``produce`` run per policy."""
    d = tmp_path_factory.mktemp("singles")
    out = {}
    for p in POLICIES:
        f = d / f"{p}.gguf"
        summary = produce(GGUFOptions(p), make.source(tiny_llama_dir), f, progress=False)
        # the round trip ran beside the writing: one verify figure, no empty "verify" stage
        assert list(summary.stages)[-2:] == ["quantize+write", "verify (beside writing)"]
        out[p] = _sha(f)
    return out


def test_together_is_byte_identical_and_reads_once_per_order(prepared, tmp_path, singles,
                                                             monkeypatch):
    targets = _fresh(prepared)
    orders = [tuple(st.name for st in t.plan.tensors) for t in targets]
    groups: dict[tuple, list[int]] = {}
    for i, o in enumerate(orders):
        groups.setdefault(o, []).append(i)
    # the quantized policies share llama-quantize's order, F16 keeps the converter's
    assert len(groups) == 2 and sorted(map(len, groups.values())) == [1, 3]
    calls = _count_loads(targets)
    encoded: Counter = Counter()
    real_encode = gguf_file.encode_many

    def counting_encode(items, device):
        for _, type_name, _ in items:
            encoded[type_name] += 1
        return real_encode(items, device)
    monkeypatch.setattr(gguf_file, "encode_many", counting_encode)
    run = Run(progress=False)
    tmps = [tmp_path / f"{p}.gguf" for p in POLICIES]
    GGUFTarget.write_together(targets, tmps, [run] * len(targets))
    assert list(run.stages) == ["quantize+write", "verify (beside writing)"]
    for p, f in zip(POLICIES, tmps):
        assert _sha(f) == singles[p], f"{p}: differs from a single produce()"
    # each file's round trip ran beside the writing, on the tensors as read for it (the
    # counts below: no second read of the source)
    for t in targets:
        assert t.roundtrip.ok and [r.name for r in t.roundtrip.tensors] == [st.name for st in t.plan.tensors]
    for idx in groups.values():
        names = targets[idx[0]].plan.tensors
        assert all(calls[idx[0], st.name] == 1 for st in names)  # once per group ...
        assert not any(calls[i, st.name] for i in idx[1:] for st in names)  # ... by its first
    per_name = Counter()
    for (_, name), n in calls.items():
        per_name[name] += n
    assert set(per_name.values()) == {len(groups)}  # every name: once per group in all
    # one encode per tensor and distinct ggml type among the files of its group (the F32
    # norms once for Q4_K_M, Q8_0 and Q6_K)
    expected: Counter = Counter()
    for idx in groups.values():
        for st in targets[idx[0]].plan.tensors:
            for ty in {targets[i].plan.types[st.name] for i in idx}:
                expected[ty] += 1
    assert encoded == expected
    assert sum(encoded.values()) < sum(len(t.plan.tensors) for t in targets)


class _TrackedWriter(gguf_file.GGUFWriter):
    """GGUFWriter that remembers its instances (to check that every one was closed)."""

    made: list = []

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        _TrackedWriter.made.append(self)


def test_nan_names_tensor_and_closes_every_writer(prepared, tmp_path, monkeypatch):
    targets = _fresh(prepared)
    _TrackedWriter.made = []
    monkeypatch.setattr(gguf_file, "GGUFWriter", _TrackedWriter)
    quant = targets[0].plan.tensors  # llama-quantize's order: the group written first
    # the second tensor of that order: output.weight is already in all three files
    k = next(i for i, st in enumerate(quant) if st.name == "output_norm.weight")
    assert k > 0

    def bad(inner=quant[k].load):
        t = inner().clone()
        t[7] = float("nan")
        return t
    quant[k] = SourceTensor(quant[k].name, quant[k].shape, bad)
    tmps = [tmp_path / f"{p}.gguf" for p in POLICIES]
    with pytest.raises(InputError, match=r"'output_norm\.weight'.*NaN"):
        GGUFTarget.write_together(targets, tmps, [Run(progress=False)] * len(targets))
    # the quantized group's three writers were opened (the F16 group never started), all closed
    assert len(_TrackedWriter.made) == 3
    assert all(w.fout is None for w in _TrackedWriter.made)
    assert not tmps[3].exists()
    # and the round trips that ran beside them have ended
    import threading
    assert not [t for t in threading.enumerate() if t.name == "quantpress-roundtrip"]


def test_round_trip_beside_writing_equals_one_after_it(prepared, tmp_path):
    """The round trip run beside the writing (each tensor checked against the source tensor
    the writer read) reports exactly what verify_gguf reports re-reading the finished file
    and the source afterwards, tensor for tensor (both on one torch thread, as the checking
    thread runs: the error sums' rounding depends on the thread count)."""
    from quantpress.quantize.ggml.common import single_threaded_ops

    targets = _fresh(prepared, ["Q4_K_M", "Q8_0"])
    tmps = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    GGUFTarget.write_together(targets, tmps, [Run(progress=False)] * 2)
    for t, f in zip(targets, tmps):
        with single_threaded_ops():
            after = gguf_roundtrip.verify_gguf(f, t.plan.tensors, t.plan.types, torch.device("cpu"))
        assert t.roundtrip.ok and after.ok
        assert t.roundtrip.tensors == after.tensors


def test_tensors_reader_finds_what_gguf_py_finds(prepared, tmp_path):
    """The checkers' reader (arrays' extents only) and gguf-py's whole parse agree on every
    tensor (name, type, shape, offset, bytes), on the data offset, on every metadata key and
    type and on every value that is no array; an array's field keeps its bytes as one part."""
    from gguf import GGUFValueType

    (t,) = _fresh(prepared, ["Q8_0"])
    f = tmp_path / "q8.gguf"
    GGUFTarget.write_together([t], [f], [Run(progress=False)])
    full, fast = gguf_reading.GGUFFileReader(str(f)), gguf_reading.GGUFTensorsReader(str(f))
    info = [[(x.name, int(x.tensor_type), x.shape.tolist(), int(x.data_offset), int(x.n_bytes))
             for x in r.tensors] for r in (full, fast)]
    assert info[0] == info[1] and len(info[0]) == len(t.plan.tensors)
    assert fast.data_offset == full.data_offset
    assert all(np.array_equal(a.data, b.data) for a, b in zip(full.tensors, fast.tensors))
    assert list(full.fields) == list(fast.fields)
    arrays = 0
    for key, a in full.fields.items():
        b = fast.fields[key]
        assert a.types == b.types and a.offset == b.offset, key
        assert sum(int(p.nbytes) for p in a.parts) == sum(int(p.nbytes) for p in b.parts), key
        if a.types[0] == GGUFValueType.ARRAY:
            arrays += 1
            assert b.data == [] and len(b.parts) == 6, key     # key length, key, type, item type, count, items
        else:
            assert a.contents() == b.contents(), key
    assert arrays >= 3      # the vocabulary, its token types, the merges


def test_a_string_length_off_by_one_fails_the_round_trip(prepared, tmp_path):
    """A vocabulary string's length one byte too long: the checkers' walk over the lengths,
    as gguf-py's own parse, reads everything after it shifted, and the round trip fails."""
    (t,) = _fresh(prepared, ["Q8_0"])
    f = tmp_path / "q8.gguf"
    GGUFTarget.write_together([t], [f], [Run(progress=False)])
    field = gguf_reading.GGUFFileReader(str(f)).fields["tokenizer.ggml.tokens"]
    at = field.offset + sum(int(p.nbytes) for p in field.parts[:5])   # the first string's length
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[at:at + 8], "little")
    raw[at:at + 8] = (n + 1).to_bytes(8, "little")
    f.write_bytes(bytes(raw))
    rep = gguf_roundtrip.verify_gguf(f, t.plan.tensors, t.plan.types, torch.device("cpu"))
    assert not rep.ok and rep.mismatches


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # gguf-py decoding the shifted bytes
def test_a_file_longer_than_its_tensor_infos_fails_the_round_trip(tiny_llama_dir, tmp_path, monkeypatch):
    """Bytes the tensor infos do not account for (64 after the third tensor: every later
    tensor's data is shifted, which both dequantizers decode alike) fail the round trip on the
    file's size: exit 3, nothing left."""
    from quantpress.cli.convert_main import main as convert_main

    real = gguf_file.GGUFWriter.write_tensor_data
    calls = []

    def longer(self, tensor, *a, **kw):
        real(self, tensor, *a, **kw)
        calls.append(1)
        if len(calls) == 3:
            self.fout[0].write(b"\0" * 64)
    monkeypatch.setattr(gguf_file.GGUFWriter, "write_tensor_data", longer)
    out = tmp_path / "o.gguf"
    code = convert_main(["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q8_0", "-o", str(out), "--quiet"])
    assert code == 3 and not list(tmp_path.iterdir())


def test_mismatched_plans_are_refused(prepared, tmp_path):
    targets = _fresh(prepared, ["Q4_K_M", "Q8_0"])
    st = targets[1].plan.tensors[-1]
    targets[1].plan.tensors[-1] = SourceTensor(st.name, (*st.shape[:-1], st.shape[-1] * 2), st.load)
    with pytest.raises(ValueError, match=st.name):
        GGUFTarget.write_together(targets, [tmp_path / "a.gguf", tmp_path / "b.gguf"], [Run(progress=False)] * 2)
    with pytest.raises(ValueError):
        GGUFTarget.write_together(targets, [tmp_path / "a.gguf"], [Run(progress=False)])
    other = GGUFTarget(make.source(tmp_path), GGUFOptions("Q8_0"))
    other.plan = targets[0].plan
    with pytest.raises(ValueError, match="different sources"):
        GGUFTarget.write_together([targets[0], other], [tmp_path / "a.gguf", tmp_path / "b.gguf"],
                                  [Run(progress=False)] * 2)
    assert not list(tmp_path.glob("*.gguf"))


def test_write_gguf_many_needs_a_file():
    with pytest.raises(ValueError):
        gguf_file.write_gguf_many([], "llama", [], torch.device("cpu"))


@pytest.mark.parametrize("workers,processes,part,writer", [(1, True, None, False), (3, True, None, False),
                                                          (1, False, None, False), (3, False, None, False),
                                                          (3, True, 1 << 14, False), (3, True, 1 << 14, True)])
def test_another_tensors_data_fails_the_round_trip(tiny_llama_dir, tmp_path, monkeypatch, capsys, request,
                                                   workers, processes, part, writer):
    """Every later tensor of a shape written with the data of the first tensor of that shape
    and type: sizes and both dequantizers agree, only the error against the source tells: exit
    3, the tensors named, nothing left; with the round trip in one or three checker
    processes (three: as off the CPU; also with every tensor over 2^14 values in parts, and
    with the error computed by the writer, as off the CPU), and in threads (where no process
    can be started)."""
    from quantpress.cli.convert_main import main as convert_main

    monkeypatch.setattr(gguf_roundtrip, "checkers_for", lambda device: workers)
    monkeypatch.setattr(gguf_roundtrip, "FIGURES_ON_WRITER", writer)
    if part:
        monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 12)
        monkeypatch.setattr(gguf_checks, "CHECK_PART_ELEMENTS", part)
        gguf_roundtrip.close_checkers()     # (new ones fork with these sizes)
        request.addfinalizer(gguf_roundtrip.close_checkers)
    monkeypatch.setattr(gguf_roundtrip, "USE_PROCESSES", processes)
    real = gguf_file.encode_many
    first: dict = {}

    def same_data(items, device):
        return real([(first.setdefault((tuple(t.shape), ty), t), ty, w) for t, ty, w in items], device)
    monkeypatch.setattr(gguf_file, "encode_many", same_data)
    out = tmp_path / "o.gguf"
    code = convert_main(["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q4_K_M", "-o", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and not list(tmp_path.iterdir()), err
    assert "blk.1." in err and "dB SNR against the source tensor" in err, err


def test_round_trip_in_processes_reports_what_threads_report(prepared, tmp_path, monkeypatch):
    """Four files written together, their round trips in checker processes (by default, one
    per file on the CPU) and then in threads: the same per-tensor reports, value for
    value (the same float32 checks on the CPU), and the same bytes."""
    reports, shas = {}, {}
    for processes in (True, False):
        monkeypatch.setattr(gguf_roundtrip, "USE_PROCESSES", processes)
        targets = _fresh(prepared)
        tmps = [tmp_path / f"{p}-{processes}.gguf" for p in POLICIES]
        GGUFTarget.write_together(targets, tmps, [Run(progress=False)] * len(targets))
        for t in targets:
            assert t.roundtrip.ok, t.roundtrip.mismatches
            assert t.roundtrip.checker_processes == (1 if processes else 0), t.roundtrip.checker_processes
        reports[processes] = [t.roundtrip.tensors for t in targets]
        shas[processes] = [_sha(f) for f in tmps]
    assert reports[True] == reports[False] and shas[True] == shas[False]
    assert sum(len(r) for r in reports[True]) == sum(len(t.plan.tensors) for t in _fresh(prepared))


def test_large_tensors_checked_in_parts_by_several_checkers(prepared, tmp_path, monkeypatch, request):
    """Tensors handed to three checker processes in parts of at most sixteen chunks of 2^12
    values (the embedding, 12.6M values, in 192 parts): the parts of one tensor go to several
    checkers, and the reports are the check's in threads of the same chunks, value for value
    (the parts' figures summed in row order), the bytes the same. (Checkers forked for the
    test: they keep the chunk size they were forked with.)"""
    monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(gguf_checks, "CHECK_PART_ELEMENTS", 1 << 16)
    gguf_roundtrip.close_checkers()
    request.addfinalizer(gguf_roundtrip.close_checkers)
    monkeypatch.setattr(gguf_roundtrip, "checkers_for", lambda device: 3)
    sent: dict = {}
    real_send = gguf_checkers.CheckerProcesses._send

    def spy(self, c, request):
        if request[0] == "check":
            sent.setdefault(request[2], []).append((id(c), request[3]))
        return real_send(self, c, request)
    monkeypatch.setattr(gguf_checkers.CheckerProcesses, "_send", spy)
    reports = {}
    for processes in (True, False):
        monkeypatch.setattr(gguf_roundtrip, "USE_PROCESSES", processes)
        t = _fresh(prepared, ["Q4_K_M"])[0]
        out = tmp_path / f"{processes}.gguf"
        GGUFTarget.write_together([t], [out], [Run(progress=False)])
        assert t.roundtrip.ok, t.roundtrip.mismatches
        reports[processes] = (t.roundtrip.tensors, _sha(out))
    assert reports[True] == reports[False]
    for index, st in enumerate(t.plan.tensors):
        rows, cols = math.prod(st.shape[:-1]), st.shape[-1]
        parts = [r for _, r in sent[index]]
        assert sorted(parts) == list(gguf_checks.check_parts(rows, cols)), st.name
        assert (len(parts) > 1) == (st.numel > 1 << 16), (st.name, len(parts))
    # the embedding and the output head (49,152 x 256: 192 parts of 256 rows) each on all three
    big = [i for i, st in enumerate(t.plan.tensors) if st.numel == 49152 * 256]
    assert len(big) == 2 and all(len(sent[i]) == 192 and len({c for c, _ in sent[i]}) == 3 for i in big)


@pytest.fixture
def figures_on_writer(monkeypatch, request):
    """The writer computing our half of the round trip (as off the CPU: FIGURES_ON_WRITER) on
    the CPU, three checkers, tensors over 2^16 values in parts (chunks of 2^12); checkers
    forked for the test."""
    monkeypatch.setattr(gguf_roundtrip, "FIGURES_ON_WRITER", True)
    monkeypatch.setattr(gguf_roundtrip, "checkers_for", lambda device: 3)
    monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(gguf_checks, "CHECK_PART_ELEMENTS", 1 << 16)
    gguf_roundtrip.close_checkers()
    request.addfinalizer(gguf_roundtrip.close_checkers)


def test_writer_figures_report_what_the_checkers_report(prepared, tmp_path, monkeypatch, figures_on_writer):
    """The writer's own error sums with checksums to the checkers: the same bytes, every
    tensor checked, the same maximum errors as the checks in threads and RMSE and SNR within
    float32's rounding of other sums (the writer sums whole chunks, the threads pieces of
    2^18 values); no source copied into a staging area."""
    copies = []
    real = gguf_checkers.StagingArea.take
    monkeypatch.setattr(gguf_checkers.StagingArea, "take", lambda self, n: copies.append(n) or real(self, n))
    written = _processes_then_threads(prepared, tmp_path, monkeypatch, ["Q4_K_M", "Q6_K"])
    for processes, (targets, _) in written.items():
        assert [t.roundtrip.checker_processes for t in targets] == ([3, 3] if processes else [0, 0])
    reports = {k: ([t.roundtrip.tensors for t in targets], shas) for k, (targets, shas) in written.items()}
    assert not copies
    assert reports[True][1] == reports[False][1]
    for ours, theirs in zip(*(reports[k][0] for k in (True, False))):
        assert len(ours) == len(theirs) == len(targets[0].plan.tensors)
        for a, b in zip(ours, theirs):
            assert (a.name, a.type, a.shape, a.n_bytes, a.max_abs_err) == (b.name, b.type, b.shape, b.n_bytes,
                                                                           b.max_abs_err)
            assert a.rmse == pytest.approx(b.rmse, rel=1e-5) and a.snr_db == pytest.approx(b.snr_db, rel=1e-6)


def test_writer_figures_catch_a_file_that_is_not_what_was_written(prepared, tmp_path, monkeypatch,
                                                                  figures_on_writer):
    """The writer computing the error sums: the bytes of every Q4_K tensor changed on their
    way to the file (one byte in every 40th block), after the writer's figures were taken from
    the bytes it meant to write: the checkers' checksums of gguf-py's values find exactly
    those rows, tensor by tensor, and only those tensors fail."""
    from gguf import GGUFWriter

    t = _fresh(prepared, ["Q4_K_M"])[0]
    size = {st.name: st.numel // 256 * 144 for st in t.plan.tensors if t.plan.types[st.name] == "Q4_K"}
    others = {math.prod(st.shape[:-1]) * gguf_file.ggml.get(t.plan.types[st.name]).row_bytes(st.shape[-1])
              for st in t.plan.tensors if st.name not in size}
    # the rows holding a changed block (every 40th of the tensor's blocks, cols / 256 a row)
    expected = {st.name: len({b // (st.shape[-1] // 256) for b in range(0, st.numel // 256, 40)})
                for st in t.plan.tensors if st.name in size and size[st.name] not in others}
    assert len(expected) > 10 and {st.shape[-1] for st in t.plan.tensors if st.name in expected} == {256, 768}
    real = GGUFWriter.write_tensor_data

    def corrupt(self, data, *args, **kwargs):
        if data.nbytes in set(size.values()) - others:          # (a Q4_K block: 144 bytes)
            rows = data.copy().reshape(-1, 144)
            rows[::40, 20] ^= 0x11                                # two levels of the block's first sub-blocks
            data = rows.reshape(-1)
        return real(self, data, *args, **kwargs)
    monkeypatch.setattr(GGUFWriter, "write_tensor_data", corrupt)
    GGUFTarget.write_together([t], [tmp_path / "o.gguf"], [Run(progress=False)])
    got = {m.split(":")[0]: m for m in t.roundtrip.mismatches}
    assert got == {name: f"{name}: gguf-py and quantpress dequantize differ in {n} rows (Q4_K)"
                   for name, n in expected.items()}, t.roundtrip.mismatches


def test_figures_on_the_writer_only_off_the_cpu(monkeypatch):
    """By default the writer computes our half of the round trip off the CPU only (the CPU's
    cores are the codecs'); FIGURES_ON_WRITER True / False forces it on every device / none."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert gguf_roundtrip.figures_on_writer(cpu) is None and gguf_roundtrip.figures_on_writer(cuda) == cuda
    monkeypatch.setattr(gguf_roundtrip, "FIGURES_ON_WRITER", True)
    assert gguf_roundtrip.figures_on_writer(cpu) == cpu
    monkeypatch.setattr(gguf_roundtrip, "FIGURES_ON_WRITER", False)
    assert gguf_roundtrip.figures_on_writer(cuda) is None


def test_row_checksums_in_torch_and_numpy_agree_and_tell_rows_apart():
    """row_checksums (the writer's, torch) and the checker's NumPy version give the same int64
    pairs on every kind of float32 (signed zeros, infinities, NaN, subnormals, extremes); one
    value changed changes the first checksum of its row only, two values of a row exchanged
    the second only; on rows of 300,000 values with the largest bit patterns, too."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1536, generator=g) * torch.logspace(-40, 38, 64).unsqueeze(1)
    x.view(-1)[:8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -3.4e38, 3.4e38])
    x[5] = -0.0
    ours = gguf_checks.row_checksums(x)
    assert ours.dtype == torch.int64 and ours.shape == (64, 2)
    assert np.array_equal(ours.numpy(), gguf_checks.row_checksums_np(x.numpy()))
    y = x.clone()
    y[7, 100] = torch.nextafter(y[7, 100], torch.tensor(math.inf))
    y[9, [3, 1000]] = y[9, [1000, 3]]
    differ = (gguf_checks.row_checksums(y) != ours).numpy()
    assert differ[7].tolist() == [True, True] and differ[9].tolist() == [False, True]
    assert not np.delete(differ, [7, 9], axis=0).any()
    # rows of 300,000 values (a weight period of 13), every bit pattern near ±2^31:
    # NumPy's float64 sums stay exact
    u = torch.rand(3, 300_000, generator=g) * 0.5 + 0.5
    wide = torch.stack([u[0] * 3.4e38, -u[1] * 1e-38, u[2] * 3e38])    # bits near 2^31, and near -2^31
    wide[2, ::3] = -0.0
    assert np.array_equal(gguf_checks.row_checksums(wide).numpy(),
                          gguf_checks.row_checksums_np(wide.numpy()))


def test_check_parts_cover_every_row_once_on_chunk_boundaries(monkeypatch):
    """check_parts: consecutive ranges of whole rows from 0 to the last row, each starting on a
    chunk boundary of chunk_rows, none above the part size unless it is one chunk."""
    monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 12)
    monkeypatch.setattr(gguf_checks, "CHECK_PART_ELEMENTS", 3 << 12)
    for rows, cols in [(1, 64), (7, 64), (1000, 64), (192, 64), (193, 64), (3, 1 << 15), (1000, 576), (9, 1)]:
        parts = list(gguf_checks.check_parts(rows, cols))
        starts = {r0 for r0, _ in gguf_checks.chunk_rows(rows, cols)}
        assert parts[0][0] == 0 and parts[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        for r0, r1 in parts:
            assert r0 in starts and (r1 in starts or r1 == rows), (rows, cols, r0, r1)
            one_chunk = [(r0, r1)] == [c for c in gguf_checks.chunk_rows(rows, cols) if c[0] == r0]
            assert (r1 - r0) * cols <= gguf_checks.CHECK_PART_ELEMENTS or one_chunk, (rows, cols, r0, r1)
            assert (r1 - r0) * cols > gguf_checks.CHECK_PART_ELEMENTS - gguf_checks.VERIFY_CHUNK_ELEMENTS \
                or r1 == rows or one_chunk


def _processes_then_threads(prepared, tmp_path, monkeypatch, policies) -> dict:
    """``policies`` written together with their round trips in checker processes, then in
    threads (``USE_PROCESSES``), every round trip ok: {processes: (targets, sha256 of each
    file)}."""
    out = {}
    for processes in (True, False):
        monkeypatch.setattr(gguf_roundtrip, "USE_PROCESSES", processes)
        targets = _fresh(prepared, policies)
        tmps = [tmp_path / f"{t.options.policy}-{processes}.gguf" for t in targets]
        GGUFTarget.write_together(targets, tmps, [Run(progress=False)] * len(targets))
        assert all(t.roundtrip.ok for t in targets), [t.roundtrip.mismatches for t in targets]
        out[processes] = (targets, [_sha(f) for f in tmps])
    return out


@pytest.fixture
def small_staging(monkeypatch):
    """Checker processes whose staging areas are 420,000 bytes together (140,000 each when
    three start together; the checkers of the test are ended before and after it)."""
    monkeypatch.setattr(gguf_checkers, "STAGING_BYTES", 420_000)
    gguf_roundtrip.close_checkers()
    yield
    gguf_roundtrip.close_checkers()


def test_round_trip_through_a_small_staging_area(prepared, tmp_path, monkeypatch, small_staging):
    """Sources handed over through staging areas smaller than some of them (those go alone,
    in shared memory of their own) and than the others together (the areas wrap around
    several times; three checkers per file): the same reports and bytes as in threads."""
    monkeypatch.setattr(gguf_roundtrip, "checkers_for", lambda device: 3)
    sizes = [(x := st.load()).numel() * x.element_size() for st in _fresh(prepared, ["Q4_K_M"])[0].plan.tensors]
    assert max(sizes) > 140_000 and sum(s for s in sizes if s <= 140_000) > 5 * 140_000, sizes
    written = _processes_then_threads(prepared, tmp_path, monkeypatch, ["Q4_K_M", "Q8_0"])
    for processes, (targets, _) in written.items():
        n = [t.roundtrip.checker_processes for t in targets]
        assert all(1 <= k <= 3 for k in n) if processes else n == [0, 0], n
    reports = {k: ([t.roundtrip.tensors for t in targets], shas) for k, (targets, shas) in written.items()}
    assert reports[True] == reports[False]


def test_checkers_slow_to_start(prepared, tmp_path, monkeypatch):
    """Checkers forked right before a file is written and slow to start (one second before
    they touch their staging areas, as a process left unscheduled on a busy machine): the
    writer's first copies wait until a checker has touched its area (touching it afterwards
    would zero them, and the checks would fail on zeros)."""
    import time

    real = gguf_checkers.serve_checks

    def slow(*args):
        time.sleep(1.0)
        real(*args)
    monkeypatch.setattr(gguf_checkers, "serve_checks", slow)
    gguf_roundtrip.close_checkers()
    try:
        targets = _fresh(prepared, ["Q8_0"])
        GGUFTarget.write_together(targets, [tmp_path / "o.gguf"], [Run(progress=False)])
        assert targets[0].roundtrip.ok, targets[0].roundtrip.mismatches
        assert targets[0].roundtrip.checker_processes == 1
    finally:
        gguf_roundtrip.close_checkers()


def test_checkers_end_with_a_killed_writer(tmp_path):
    """A writer killed (SIGKILL, no exit handlers) leaves no checker process behind: each
    checker holds only its own end of its pipe, which the writer's death closes."""
    code = ("import os, signal\n"
            "from quantpress.convert import gguf_roundtrip as r\n"
            "print(*r.checker_processes(3).pids(), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert not procs.left_by_killed_writer(code, 3)


def test_checkers_started_in_a_thread_that_ended(prepared, tmp_path):
    """Checkers forked from a thread that has since ended still check (they do not die with
    the thread that started them)."""
    import threading
    import time

    gguf_roundtrip.close_checkers()
    pids = []

    def start():
        gguf_roundtrip.start_checkers(torch.device("cpu"))
        pids.extend(gguf_roundtrip.checker_processes(1).pids())
    t = threading.Thread(target=start)
    t.start()
    t.join()
    time.sleep(0.5)
    assert pids and all(os.path.exists(f"/proc/{p}") for p in pids), pids
    targets = _fresh(prepared, ["Q8_0"])
    GGUFTarget.write_together(targets, [tmp_path / "o.gguf"], [Run(progress=False)])
    assert targets[0].roundtrip.ok and targets[0].roundtrip.checker_processes == 1
    assert gguf_roundtrip.checker_processes(1).pids()[:len(pids)] == pids


def test_a_checker_process_that_dies_fails_the_command(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """The checker process killed while the file is written: exit 1, the checker named,
    nothing left; the next command starts a new checker and succeeds."""
    from quantpress.cli.convert_main import main as convert_main

    real = gguf_file.encode_many
    calls = []

    def killing(items, device):
        calls.append(len(items))
        if len(calls) == 2:     # (the tiny llama is written in three windows: codec processes)
            pids = gguf_roundtrip.checker_processes(1).pids()
            assert pids
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        return real(items, device)
    monkeypatch.setattr(gguf_file, "encode_many", killing)
    out = tmp_path / "o.gguf"
    code = convert_main(["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q4_K_M", "-o", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "checker process" in err and "died" in err, err
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(gguf_file, "encode_many", real)
    code = convert_main(["hf-to-gguf", str(tiny_llama_dir), "--policy", "Q4_K_M", "-o", str(out), "--quiet"])
    assert code == 0 and out.is_file(), capsys.readouterr().err


def test_every_ggml_type_clears_the_snr_floor_with_margin():
    """The round trip's SNR floor is far below what real quantization gives: every ggml type
    written, on Gaussian, heavy-tailed and outlier-column tensors, stays at least 4 dB above
    it, while another tensor's data falls below it."""
    import math

    from quantpress.quantize import ggml

    def snr(x, y):
        e = x - y
        return 10 * math.log10(float((x * x).sum()) / float((e * e).sum()))

    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(64, 1024, generator=g),
               torch.distributions.StudentT(2.0).sample((64, 1024)),
               torch.randn(64, 1024, generator=g) * torch.rand(1024, generator=g) ** 4]
    for name in ("Q2_K", "Q3_K", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q4_K", "Q5_0", "Q5_1", "Q5_K",
                 "Q6_K", "Q8_0"):
        for x in tensors:
            got = snr(x, ggml.dequantize(ggml.quantize(x, name), name).reshape(x.shape))
            assert got >= gguf_checks.MIN_SNR_DB + 4, f"{name}: {got:.1f} dB"
    x = tensors[0]
    assert snr(x, torch.randn(x.shape, generator=g)) < gguf_checks.MIN_SNR_DB


def test_encode_many_per_expert_importance_weights_equal_llamacpp():
    """encode_many with a 3-D tensor [n_mat, rows, n] and an imatrix [n_mat * n] (one slice per
    expert matrix, as llama_tensor_quantize_impl's imatrix_for_row), beside a 2-D tensor of
    the same type and one of another: each expert's rows are llama.cpp's with its own slice."""
    import ggml_ref

    g = torch.Generator().manual_seed(11)
    x3 = torch.randn(3, 4, 512, generator=g)
    w3 = torch.rand(3 * 512, generator=g) * torch.tensor([1.0, 100.0, 1e-3]).repeat_interleave(512)
    x2 = torch.randn(6, 256, generator=g)
    w2 = torch.rand(256, generator=g)
    raws = gguf_file.encode_many([(x3, "Q4_K", w3), (x2, "Q4_K", w2), (x2, "Q5_0", None)], torch.device("cpu"))
    want3 = np.concatenate([ggml_ref.ref_quantize(x3[e].numpy(), "Q4_K", imatrix=w3.view(3, 512)[e].numpy())
                            for e in range(3)])
    assert np.array_equal(raws[0], want3)
    assert np.array_equal(raws[1], ggml_ref.ref_quantize(x2.numpy(), "Q4_K", imatrix=w2.numpy()))
    assert np.array_equal(raws[2], ggml_ref.ref_quantize(x2.numpy(), "Q5_0"))
    assert np.array_equal(raws[0], gguf_file.encode(x3, "Q4_K", torch.device("cpu"), w3))
    with pytest.raises(ValueError, match="imatrix of 100 values"):
        gguf_file.encode_many([(x3, "Q4_K", torch.ones(100))], torch.device("cpu"))


# ------------------------------------------------------------ windows and read-ahead on the CPU

@pytest.fixture
def one_codec_worker(monkeypatch):
    """Two codec lanes (this thread and one codec process), windows of 2^20 elements (as many
    rounds of slices as that takes); the worker is ended afterwards."""
    from quantpress.quantize.ggml import processes

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    assert processes.start_codec_processes(1) == 1
    monkeypatch.setattr(gguf_file, "CPU_WINDOW_ROUNDS", max(1, (1 << 20) // (2 * common.CPU_SLICE_ELEMENTS)))
    yield
    torch.set_num_threads(before)
    processes.close_codec_processes()


def _eight_slices(seed: int = 0) -> list[SourceTensor]:
    # eight tensors of 256 x 2048 (2^19 elements each: a window of 2^20 elements holds two)
    g = torch.Generator().manual_seed(seed)
    data = [torch.randn(256, 2048, generator=g) for _ in range(8)]
    return [SourceTensor(f"blk.{i}.ffn_up.weight", (256, 2048), lambda x=x: x.clone()) for i, x in enumerate(data)]


def _write(path: Path, tensors: list[SourceTensor], type_name: str = "Q8_0", verify: bool = False):
    files = [(path, [], {st.name: type_name for st in tensors})]
    return gguf_file.write_gguf_many(files, "llama", tensors, torch.device("cpu"), verify=verify)


def test_cpu_windows_read_ahead_within_a_window(one_codec_worker, tmp_path, monkeypatch):
    """With codec processes the CPU writer encodes windows (here two tensors each) and a
    background thread reads the next window while one is encoded: the encoding of the first
    window waits here until the third tensor's load has begun (without the read-ahead it would
    never begin). The reader keeps at most one window ahead: tensor i is not loaded before
    window i // 2 - 1 is being encoded. The file is the one written one tensor at a time."""
    import threading

    tensors = _eight_slices()
    started = {i: threading.Event() for i in range(8)}
    encodes: list[int] = []          # tensors per encode_many call, as called
    at_load: dict[int, int] = {}     # tensor → encode_many calls begun when its load began

    def watched(i: int, st: SourceTensor) -> SourceTensor:
        def load(inner=st.load):
            at_load[i] = len(encodes)
            started[i].set()
            return inner()
        return SourceTensor(st.name, st.shape, load)
    real = gguf_file.encode_many

    def encode(items, device):
        encodes.append(len(items))
        if len(encodes) == 1:
            assert started[2].wait(20), "the next window was not read during the encoding"
        return real(items, device)
    monkeypatch.setattr(gguf_file, "encode_many", encode)
    _write(tmp_path / "w.gguf", [watched(i, st) for i, st in enumerate(tensors)])
    assert encodes == [2, 2, 2, 2], encodes     # (no call for an empty last window)
    assert all(at_load[i] >= i // 2 - 1 for i in range(8)), at_load
    monkeypatch.setattr(gguf_file, "CPU_WINDOW_ROUNDS", 0)      # one tensor at a time, no reader
    monkeypatch.setattr(gguf_file, "encode_many", real)
    _write(tmp_path / "one.gguf", _eight_slices())
    assert _sha(tmp_path / "w.gguf") == _sha(tmp_path / "one.gguf")


def test_a_load_that_fails_in_the_reader_is_raised_here(one_codec_worker, tmp_path, monkeypatch):
    """A source tensor whose load fails in the read-ahead thread fails the write with that
    error; the reader thread ends and every file is closed (its round trip too)."""
    import threading

    tensors = _eight_slices()

    def broken():
        raise OSError("shard 2: read error")
    tensors[5] = SourceTensor(tensors[5].name, tensors[5].shape, broken)
    _TrackedWriter.made = []
    monkeypatch.setattr(gguf_file, "GGUFWriter", _TrackedWriter)
    with pytest.raises(OSError, match="shard 2: read error"):
        _write(tmp_path / "w.gguf", tensors, verify=True)
    assert len(_TrackedWriter.made) == 1 and _TrackedWriter.made[0].fout is None
    assert not [t for t in threading.enumerate() if t.name.startswith("quantpress-read")]
    assert not [t for t in threading.enumerate() if t.name == "quantpress-roundtrip"]


def test_cpu_windows_with_the_round_trip_and_search_codecs(one_codec_worker, tmp_path, monkeypatch):
    """Q4_K (a search codec, through the codec process) in windows, with the round trip beside
    the writing: it passes and the file is the one written one tensor at a time."""
    trip = _write(tmp_path / "w.gguf", _eight_slices(1), "Q4_K", verify=True)[0]
    assert trip.ok and len(trip.tensors) == 8
    monkeypatch.setattr(gguf_file, "CPU_WINDOW_ROUNDS", 0)
    _write(tmp_path / "one.gguf", _eight_slices(1), "Q4_K")
    assert _sha(tmp_path / "w.gguf") == _sha(tmp_path / "one.gguf")


def test_which_plans_leave_the_checker_a_core():
    """gguf_file.codecs_leave_a_core: the codecs keep every core when more than half of the
    weights go to a search codec or to a type given importance weights that it uses, whatever
    the tensors' sizes (windows pool small tensors); Q8_0 ignores importance weights."""
    def st(name, n):
        return SourceTensor(name, (n // 256, 256), None)
    tensors = [st("a", 1 << 16), st("b", 1 << 16), st("c", 1 << 16), st("d", 1 << 16)]
    def leaves(types, imatrix=None):
        return gguf_file.codecs_leave_a_core([(None, [], dict(zip("abcd", types)), imatrix or {})], tensors)
    assert leaves(["Q5_0", "Q8_0", "Q4_K", "Q6_K"])              # half heavy: the core is left
    assert not leaves(["Q5_0", "Q4_K", "Q4_K", "Q6_K"])          # three quarters heavy
    w = torch.ones(256)
    assert not leaves(["Q5_0", "Q5_0", "Q8_0", "Q4_K"], {"a": w, "b": w})   # weighted Q5_0: heavy
    assert leaves(["Q8_0", "Q8_0", "Q5_0", "Q4_K"], {"a": w, "b": w})      # weighted Q8_0: not
    # of two files written together, a tensor is heavy when it is in either
    files = [(None, [], dict(zip("abcd", ["Q8_0"] * 4)), {}), (None, [], dict(zip("abcd", ["Q4_K"] * 4)), {})]
    assert not gguf_file.codecs_leave_a_core(files, tensors)


def test_round_trip_chunks_cover_every_row_once(monkeypatch):
    """chunk_rows: consecutive ranges of whole rows from 0 to the last row, none above the
    chunk size (or one row wider than it)."""
    monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 12)
    for rows, cols in [(1, 64), (7, 64), (100, 64), (64, 64), (65, 64), (3, 1 << 15), (1000, 576), (9, 1)]:
        ranges = list(gguf_checks.chunk_rows(rows, cols))
        assert ranges[0][0] == 0 and ranges[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        for r0, r1 in ranges:
            assert r1 > r0 and (r1 - r0) * cols <= max(gguf_checks.VERIFY_CHUNK_ELEMENTS, cols)
            assert (r1 - r0) * cols > gguf_checks.VERIFY_CHUNK_ELEMENTS - cols or r1 == rows


def test_gguf_py_decoder_is_gguf_py_dequantize():
    """The round trip's gguf-py values (each type's dequantize_blocks on a piece's blocks at
    once) are gguf.quants.dequantize's of the same rows, bit for bit, for every type we write."""
    from gguf import GGMLQuantizationType
    from gguf import quants as gguf_quants

    from quantpress.quantize import ggml as ggml_codecs

    g = torch.Generator().manual_seed(7)
    x = torch.randn(7, 512, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[3, :40] = 0.0
    for name in ggml_codecs.names():
        raw = ggml_codecs.quantize(x, name).numpy()
        expected = np.asarray(gguf_quants.dequantize(raw, GGMLQuantizationType[name]), dtype=np.float32).reshape(-1)
        got = gguf_reading.gguf_py_decoder(name)(raw)
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        assert np.array_equal(got.view(np.int32), expected.view(np.int32)), name


def test_round_trip_reports_the_same_in_any_chunking(prepared, tmp_path, monkeypatch):
    """A file's round trip with small chunks (16 rows of 256) and pieces of 5 rows of 256 (a
    remainder in every whole chunk) finds what it finds with the defaults: every tensor ok,
    the same errors."""
    from quantpress.quantize.ggml.common import single_threaded_ops

    t = _fresh(prepared, ["Q4_K_M"])[0]
    out = tmp_path / "a.gguf"
    GGUFTarget.write_together([t], [out], [Run(progress=False)])
    with single_threaded_ops():
        base = gguf_roundtrip.verify_gguf(out, t.plan.tensors, t.plan.types, torch.device("cpu"))
        monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 12)
        monkeypatch.setattr(gguf_checks, "CHECK_PIECE_ELEMENTS", 5 * 256)
        small = gguf_roundtrip.verify_gguf(out, t.plan.tensors, t.plan.types, torch.device("cpu"))
    assert base.ok and small.ok and not small.mismatches
    assert [(r.name, r.type) for r in small.tensors] == [(r.name, r.type) for r in base.tensors]
    rows = [(math.prod(r.shape[:-1]), r.shape[-1]) for r in small.tensors]
    assert any(n > 16 and cols == 256 for n, cols in rows), rows      # several chunks, each with a remainder
    # (the error sums are float32 dots per chunk, which other chunks round otherwise: the
    # 12.6M-value embedding and output head differ by up to 2.6e-5 relative, the rest less)
    for a, b in zip(base.tensors, small.tensors):
        assert a.max_abs_err == b.max_abs_err and a.rmse == pytest.approx(b.rmse, rel=1e-4)


def test_round_trip_counts_values_the_dequantizers_disagree_on(prepared, tmp_path, monkeypatch):
    """Our dequantization made to differ from gguf-py's in the last value of every piece it
    is given (pieces of 4 rows of 256, chunks of 2^14 values): the round trip fails and
    names every tensor with the number of its pieces as the count of values that differ, so
    each piece of each chunk is compared once."""
    from quantpress.quantize import ggml as ggml_codecs
    from quantpress.quantize.ggml.common import single_threaded_ops

    t = _fresh(prepared, ["Q4_K_M"])[0]
    out = tmp_path / "a.gguf"
    GGUFTarget.write_together([t], [out], [Run(progress=False)])

    class OffByOne:
        def __getattr__(self, name):
            return getattr(ggml_codecs, name)

        @staticmethod
        def dequantize(b, tname):
            v = ggml_codecs.dequantize(b, tname)
            v.view(-1)[-1] += 1.0
            return v

    monkeypatch.setattr(gguf_checks, "CHECK_PIECE_ELEMENTS", 4 * 256)
    monkeypatch.setattr(gguf_checks, "VERIFY_CHUNK_ELEMENTS", 1 << 14)
    monkeypatch.setattr(gguf_checks, "ggml", OffByOne())
    with single_threaded_ops():
        rep = gguf_roundtrip.verify_gguf(out, t.plan.tensors, t.plan.types, torch.device("cpu"))
    differ = {m.split(":")[0]: m for m in rep.mismatches if "dequantize differ" in m}
    assert not rep.ok and len(differ) == len(t.plan.tensors)
    many = 0
    for st in t.plan.tensors:
        rows, cols = math.prod(st.shape[:-1]), st.shape[-1]
        piece = max(1, 4 * 256 // cols)
        n = sum(-(-(r1 - r0) // piece) for r0, r1 in gguf_checks.chunk_rows(rows, cols))
        many += n > 2
        assert differ[st.name] == (f"{st.name}: gguf-py and quantpress dequantize differ in {n} values "
                                   f"({t.plan.types[st.name]})"), differ[st.name]
    assert many > 10, many
