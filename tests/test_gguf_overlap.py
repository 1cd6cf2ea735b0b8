"""`convert hf-to-gguf` with the metadata computed in a forked process while the first tensors
are quantized (plan_from_hf(overlap=True), PendingKVs in write_gguf_many): the same bytes as
planning everything first, a plan that transformers' config changes is made again, and the
metadata's errors reach the user as before."""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

import synth
from quantpress.cli.convert_main import main as convert_main
from quantpress.convert import gguf_ahead, gguf_arch, gguf_file
from quantpress.convert.gguf_ahead import PendingKVs
from quantpress.convert.gguf_file import write_gguf_many
from quantpress.convert.gguf_tokenizer import UnknownPreTokenizer
from quantpress.errors import EXIT_BAD_INPUT, InputError
from quantpress.workers import fork_call
from quantpress.targets import gguf as gguf_target
from quantpress.targets import gguf_plan


@pytest.fixture
def single_thread(monkeypatch):
    """plan_from_hf overlaps only in a process without other threads; the suite's process
    may hold idle codec-pool threads from earlier tests, which the forked process never uses."""
    monkeypatch.setattr(threading, "active_count", lambda: 1)


def _write(plan, path):
    write_gguf_many([(path, plan.kvs, plan.types, plan.imatrix)], plan.arch, plan.tensors,
                    torch.device("cpu"), verify=False)
    return path.read_bytes()


def test_overlapped_plan_writes_the_same_bytes(tiny_llama_dir, tmp_path, single_thread, monkeypatch):
    serial = gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M")
    assert isinstance(serial.kvs, list)
    # the writer quantizes ahead until the KVs are there or its budget is held: keep them
    # "not ready" and the budget at a few tensors so that both ends are exercised
    monkeypatch.setattr(PendingKVs, "ready", lambda self: False)
    monkeypatch.setattr(gguf_ahead, "AHEAD_OF_HEADER_BYTES", 300_000)
    encoded, at_header = [], []
    real_encode, real_get = gguf_file.encode_many, PendingKVs.get
    monkeypatch.setattr(gguf_file, "encode_many", lambda items, device: encoded.extend(items) or real_encode(items, device))
    monkeypatch.setattr(PendingKVs, "get", lambda self: at_header.append(len(encoded)) or real_get(self))
    plan = gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M", overlap=True)
    assert isinstance(plan.kvs, PendingKVs)
    assert plan.types == serial.types and [t.name for t in plan.tensors] == [t.name for t in serial.tensors]
    ours = _write(plan, tmp_path / "overlap.gguf")
    n_tensors = len(serial.tensors)
    assert at_header and 0 < at_header[0] < n_tensors      # some, not all, quantized ahead
    # and no row quantized twice (where the budget ends within a matrix, its rest is one item)
    assert sum(x.numel() for x, _, _ in encoded) == sum(t.numel for t in serial.tensors)
    assert ours == _write(serial, tmp_path / "serial.gguf")


def test_kvs_arriving_within_a_tensor_end_its_pieces(tiny_llama_dir, tmp_path, single_thread, monkeypatch):
    # a matrix is quantized ahead of the header in pieces of rows on one lane less; once the
    # KVs are there (here: after the third piece) the rest of it goes at once, on every lane
    serial = gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M")
    first = serial.tensors[0]
    rows, width = first.shape
    monkeypatch.setattr(gguf_ahead, "AHEAD_PIECE_ELEMENTS", 2 * width)
    calls = []
    real_encode = gguf_file.encode_many

    def encode(items, device):
        calls.append(([tuple(x.shape) for x, _, _ in items], torch.get_num_threads()))
        return real_encode(items, device)
    monkeypatch.setattr(gguf_file, "encode_many", encode)
    monkeypatch.setattr(PendingKVs, "ready", lambda self: len(calls) >= 3)
    plan = gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M", overlap=True)
    assert isinstance(plan.kvs, PendingKVs) and plan.tensors[0].name == first.name
    lanes = torch.get_num_threads()
    ours = _write(plan, tmp_path / "overlap.gguf")
    assert rows > 6 and calls[:4] == [([(2, width)], max(1, lanes - 1))] * 3 + [([(rows - 6, width)], lanes)]
    # the rest of the file is written as usual: no row is quantized twice
    assert sum(math.prod(s) for shapes, _ in calls for s in shapes) == sum(t.numel for t in serial.tensors)
    assert ours == _write(serial, tmp_path / "serial.gguf")


def test_tensors_before_the_kvs_are_written_before_the_rest(tiny_llama_dir, tmp_path, single_thread, monkeypatch):
    # the KVs come within the third tensor (token_embd, after two of its pieces): the two
    # tensors quantized whole ahead of the header are written (and would be handed to the
    # round trip) before the rest of the third is quantized, not after it
    serial = gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M")
    names = [t.name for t in serial.tensors]
    assert names[:3] == ["output.weight", "output_norm.weight", "token_embd.weight"]
    rows, width = serial.tensors[2].shape
    step = 4
    monkeypatch.setattr(gguf_ahead, "AHEAD_PIECE_ELEMENTS", step * width)
    out_pieces = math.ceil(serial.tensors[0].shape[0] / step)
    events = []
    real_encode, real_write = gguf_file.encode_many, gguf_file.GGUFWriter.write_tensor_data

    def encode(items, device):
        events.extend(("encode", tuple(x.shape)) for x, _, _ in items)
        return real_encode(items, device)

    def write(self, tensor, *a, **k):
        events.append(("write", tensor.nbytes))
        return real_write(self, tensor, *a, **k)
    monkeypatch.setattr(gguf_file, "encode_many", encode)
    monkeypatch.setattr(gguf_file.GGUFWriter, "write_tensor_data", write)
    ahead = out_pieces + 1 + 2        # output.weight's pieces, output_norm, two of token_embd's
    monkeypatch.setattr(PendingKVs, "ready", lambda self: len(events) >= ahead)
    plan = gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M", overlap=True)
    ours = _write(plan, tmp_path / "overlap.gguf")
    assert [e for e, _ in events[:ahead]] == ["encode"] * ahead
    assert events[ahead + 2] == ("encode", (rows - 2 * step, width))
    assert [e for e, _ in events[ahead:ahead + 2]] == ["write", "write"]
    assert events[ahead + 3][0] == "write"         # token_embd, its pieces joined
    assert ours == _write(serial, tmp_path / "serial.gguf")


def test_plan_changed_by_transformers_is_made_again(smollm2_dir, tmp_path, single_thread, monkeypatch):
    # a llama config.json without num_key_value_heads: transformers' LlamaConfig fills it in
    # (= num_attention_heads), config.json as it is has none, so the tensor sides differ
    d = synth.make_model(tmp_path / "mha", "llama", smollm2_dir, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (d / "config.json").write_text(json.dumps(cfg))
    plans = []
    real = gguf_target.plan_from_hf
    monkeypatch.setattr(gguf_target, "plan_from_hf", lambda *a, **k: plans.append(k.get("overlap", False)) or real(*a, **k))
    out = tmp_path / "o.gguf"
    assert convert_main(["hf-to-gguf", str(d), "--policy", "Q4_K_M", "-o", str(out), "--quiet"]) == 0
    assert plans == [True, False]        # overlapped, PlanChanged, planned again
    assert out.read_bytes() == _write(real(d, "Q4_K_M"), tmp_path / "serial.gguf")


def test_metadata_errors_are_bad_input_and_leave_nothing(tiny_llama_dir, tmp_path, single_thread, capsys):
    d = tmp_path / "m"
    d.mkdir()
    for f in tiny_llama_dir.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            os.symlink(f, d / f.name)
    out = tmp_path / "o.gguf"
    assert convert_main(["hf-to-gguf", str(d), "--policy", "Q4_K_M", "-o", str(out), "--quiet"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "tokenizer" in err[0] and str(d) in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_plan_error_ends_the_metadata_process(tiny_llama_dir, single_thread, monkeypatch):
    calls = []
    monkeypatch.setattr(gguf_plan, "fork_call", lambda *a, **k: calls.append(fork_call(*a, **k)) or calls[-1])

    def refuse(plan, params, options):
        raise InputError("an imatrix of another model")
    monkeypatch.setattr(gguf_plan, "finish_plan", refuse)
    # (the forked copy sleeps before it computes anything: only ending it answers now)
    slow = gguf_arch.load_hf_config
    monkeypatch.setattr(gguf_arch, "load_hf_config", lambda *a: time.sleep(60) or slow(*a))
    with pytest.raises(InputError, match="another model"):
        gguf_target.plan_from_hf(tiny_llama_dir, "Q4_K_M", overlap=True)
    assert len(calls) == 1 and calls[0].ready()
    with pytest.raises(ProcessLookupError):     # ended and reaped, not left behind
        os.kill(calls[0].pid, 0)


def _raise_unknown(path):
    raise UnknownPreTokenizer("0123abcd", path)


def _raise_value():
    raise ValueError("plain")


def _fork_from_daemon(conn):
    try:
        fork_call(sorted, [2, 1])
        conn.send("started")
    except OSError as e:
        conn.send(f"OSError: {e}")


def test_forked_call_answers_and_errors(tmp_path):
    call = fork_call(sorted, [3, 1, 2])
    assert call.result() == [1, 2, 3] and call.ready()
    # an exception that does not survive pickling as it is (UnknownPreTokenizer's __init__
    # takes the hash) comes back as InputError with its message: still bad input
    with pytest.raises(InputError) as e:
        fork_call(_raise_unknown, tmp_path).result()
    assert "0123abcd" in str(e.value) and str(tmp_path) in str(e.value)
    assert str(e.value) == str(UnknownPreTokenizer("0123abcd", tmp_path))
    with pytest.raises(ValueError, match="plain"):
        fork_call(_raise_value).result()
    # a daemonic process (the batch's side lane) may not have children: OSError, which
    # plan_from_hf takes as "plan without the overlap"
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_fork_from_daemon, args=(there,), daemon=True)
    p.start()
    assert here.recv().startswith("OSError")
    p.join()
    # a call whose answer is not wanted is ended
    call = fork_call(time.sleep, 30)
    call.close()
    with pytest.raises(RuntimeError, match="unanswered"):
        call.result()
    # a process that dies without answering
    call = fork_call(time.sleep, 30)
    assert not call.ready()
    os.kill(call.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="without an answer"):
        call.result()
