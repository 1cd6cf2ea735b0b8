"""Calibration layer: the fixed wiki split, token windows, bad-input errors, the
layer-streaming engine (against a plain transformers forward) and the captured linear-input
statistics (against a direct computation from forward hooks on the plain model)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from quantpress import assets
import synth
from quantpress.calibration import data, engine, stats
from quantpress.errors import InputError

ARCHS = ("llama", "qwen2", "qwen3")
ROWS, SEQLEN = 3, 40


@pytest.fixture(scope="session")
def cal_dir() -> Path:
    """exllamav2 0.3.2's standard_cal_data (fetched once into the cache)."""
    return assets.standard_cal_data()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_dir):
    """3-layer models (fp16 on disk) for each arch, a sharded llama, and a qwen2 with
    sliding-window layers (layer_types: full, sliding, sliding)."""
    root = tmp_path_factory.mktemp("calib_models")
    out = {a: synth.make_model(root / a, a, smollm2_dir, num_hidden_layers=3) for a in ARCHS}
    # smaller vocab (random tokens below 8192) to keep these two cheap
    out["llama_sharded"] = synth.make_model(root / "llama_sharded", "llama", smollm2_dir,
                                            num_hidden_layers=3, seed=1, vocab_size=8192,
                                            max_shard_size="3MB")
    out["qwen2_sliding"] = synth.make_model(root / "qwen2_sliding", "qwen2", smollm2_dir,
                                            num_hidden_layers=3, seed=2, vocab_size=8192,
                                            use_sliding_window=True, sliding_window=16,
                                            max_window_layers=1)
    return out


def _tokens(rows=ROWS, seqlen=SEQLEN, seed=0, vocab=8192):
    return torch.randint(0, vocab, (rows, seqlen), generator=torch.Generator().manual_seed(seed))


def _reference(model_dir, tokens, attn="sdpa", capture_linears=False):
    """Plain transformers forward in float32: per-layer outputs, final normed hidden, logits,
    and (optionally) the float64 inputs of every decoder-layer linear, [tokens, K]."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    layer_out, lin_in, handles = [], {}, []
    for layer in ref.model.layers:
        handles.append(layer.register_forward_hook(lambda m, a, o: layer_out.append(o[0] if isinstance(o, tuple) else o)))
    if capture_linears:
        for name, m in ref.named_modules():
            if isinstance(m, torch.nn.Linear) and ".layers." in name:
                handles.append(m.register_forward_hook(
                    lambda mod, a, o, name=name: lin_in.setdefault(name, []).append(
                        a[0].detach().reshape(-1, a[0].shape[-1]).double())))
    with torch.no_grad():
        r = ref(tokens, output_hidden_states=True)
    for h in handles:
        h.remove()
    return dict(layers=layer_out, normed=r.hidden_states[-1], logits=r.logits,
                lin_in={k: torch.cat(v) for k, v in lin_in.items()})


def _close(actual, expected, rtol=1e-5):
    """|a − e| ≤ rtol·max|e| elementwise (relative to the tensor's scale)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected.double(), rtol=0, atol=rtol * scale)


# --------------------------------------------------------------------------------------------
# Streaming equals the whole model

@pytest.mark.parametrize("name", ARCHS + ("llama_sharded", "qwen2_sliding"))
def test_streaming_equals_transformers(tiny, name):
    toks = _tokens()
    ref = _reference(tiny[name], toks)
    sm = engine.StreamingModel(tiny[name], "cpu", torch.float32)
    seen = []
    h = engine.run(sm, toks, batch_size=2, hidden_device="cpu", progress=False,
                   on_layer=lambda i, layer, x, y, ctx: seen.append(y.clone()))
    assert len(seen) == sm.num_layers == 3
    for i, (y, y_ref) in enumerate(zip(seen, ref["layers"])):
        _close(y, y_ref)
    _close(h, ref["layers"][-1])
    _close(sm.final_norm(h), ref["normed"])
    _close(sm.final_logits(h), ref["logits"])


def test_streaming_eager_mask_and_tied_head(tiny):
    """Eager attention materializes transformers' 4D causal mask (sdpa passes None); qwen2
    has tied embeddings (no lm_head.weight in the file)."""
    toks = _tokens(seed=3)
    ref = _reference(tiny["qwen2"], toks, attn="eager")
    sm = engine.StreamingModel(tiny["qwen2"], "cpu", torch.float32, attn_implementation="eager")
    assert sm.attention_mask(0, 2, SEQLEN) is not None
    from safetensors import safe_open
    with safe_open(str(tiny["qwen2"] / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    h = engine.run(sm, toks, batch_size=1, progress=False)
    _close(sm.final_logits(h), ref["logits"])


def test_streaming_smollm2_real(smollm2_dir, cal_dir):
    """The real SmolLM2-135M (fp16 on disk, tied, 30 layers, 576 wide) on wiki tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    toks = data.token_rows(tok, data.calibration_articles(cal_dir)[:20], 2, 32, seed=0)
    ref = _reference(smollm2_dir, toks, capture_linears=True)
    sm = engine.StreamingModel(smollm2_dir, "cpu", torch.float32)
    col = stats.StatsCollector(kinds={"abs", "sq"}, include=("down_proj", "q_proj"))
    h = engine.run(sm, toks, hooks_factory=col, progress=False)
    _close(sm.final_logits(h), ref["logits"])
    assert len(col.stats) == 2 * 30
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.mlp.down_proj"):
        x = ref["lin_in"][name]
        _close(col[name].abs_mean(), x.abs().mean(0))
        _close(col[name].imatrix()[0], x.square().sum(0))
        assert col[name].imatrix()[1] == x.shape[0] == 2 * 32


def test_embed_reads_row_blocks(tiny, monkeypatch):
    """embed() reads the embedding matrix by vocabulary blocks (never whole, never in
    float32): same values as transformers' nn.Embedding over the float32 weights."""
    sm = engine.StreamingModel(tiny["llama"])
    toks = _tokens(seed=3)
    toks[0, :3] = torch.tensor([0, 49151, 1000])  # first row, last row, a block edge
    expected = sm.embedding()(toks)
    calls = []
    get_rows = sm.weights.get_rows

    def spy(name, lo, hi, *a, **k):
        calls.append((lo, hi))
        return get_rows(name, lo, hi, *a, **k)

    monkeypatch.setattr(engine, "EMBED_BLOCK_ROWS", 1000)
    monkeypatch.setattr(sm.weights, "get_rows", spy)
    got = sm.embed(toks, batch_size=1)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    used = {int(t) // 1000 for t in toks.reshape(-1)}
    assert calls == [(b * 1000, min(49152, b * 1000 + 1000)) for b in sorted(used)]
    assert (49000, 49152) in calls and len(calls) < 50


def test_on_layer_output_feeds_next_layer(tiny):
    """What on_layer returns is the next layer's input; ctx.forward reruns the layer."""
    toks = _tokens(seed=4)
    sm = engine.StreamingModel(tiny["llama"], "cpu", torch.float32)
    inputs, replaced = [], []

    def on_layer(i, layer, x, y, ctx):
        inputs.append(x.clone())
        torch.testing.assert_close(ctx.forward(layer, x), y, rtol=0, atol=0)
        attn = ctx.forward(layer.self_attn, layer.input_layernorm(x), what="self_attn")
        assert attn.shape == x.shape
        # out=: an earlier output of the same shape is written over, one of another is not
        buf = torch.full_like(y, float("nan"))
        again = ctx.forward(layer, x, out=buf)
        assert again.data_ptr() == buf.data_ptr() and torch.equal(again, y)
        other = torch.empty(y.shape[0] + 1, *y.shape[1:])
        assert ctx.forward(layer, x, out=other).data_ptr() != other.data_ptr()
        new = 0.5 * y
        replaced.append(new)
        return new

    h = engine.run(sm, toks, on_layer=on_layer, batch_size=2, progress=False)
    for i in range(1, 3):
        torch.testing.assert_close(inputs[i], replaced[i - 1], rtol=0, atol=0)
    torch.testing.assert_close(h, replaced[-1], rtol=0, atol=0)


def test_hidden_states_held_once_without_inputs(tiny):
    """keep_inputs=False: every layer's outputs are written over its inputs (one buffer for
    the whole pass, on_layer given None for the inputs), with the same values as the pass
    that keeps both copies, in batches of 2 rows of 3 and with the capture hooks' statistics
    unchanged; a FanOut keeps the inputs only for a consumer whose on_layer may read them."""
    toks = _tokens(seed=9)
    sm = engine.StreamingModel(tiny["llama"], "cpu", torch.float32)
    kept, col_kept = [], stats.StatsCollector(kinds={"sq"}, prefix=sm.layer_prefix)
    h_kept = engine.run(sm, toks, hooks_factory=col_kept, batch_size=2, progress=False,
                        on_layer=lambda i, layer, x, y, ctx: kept.append((x.data_ptr(), y.data_ptr())))
    once, col_once = [], stats.StatsCollector(kinds={"sq"}, prefix=sm.layer_prefix)

    def on_layer(i, layer, x, y, ctx):
        assert x is None
        once.append(y.data_ptr())

    h_once = engine.run(sm, toks, hooks_factory=col_once, batch_size=2, progress=False,
                        on_layer=on_layer, keep_inputs=False)
    assert torch.equal(h_once, h_kept)
    assert len(once) == 3 and len(set(once)) == 1 and h_once.data_ptr() == once[0]
    assert all(x != y for x, y in kept)     # (the default pass: a new output buffer per layer)
    for name, st in col_kept.stats.items():
        assert torch.equal(st.imatrix()[0], col_once[name].imatrix()[0])

    class Reads:
        def on_layer(self, *a):
            pass

    class Unused(Reads):
        inputs_unused = True

    class HooksOnly:
        def hooks(self, index, layer):
            return None

    assert not engine.FanOut([HooksOnly(), Unused()]).keep_inputs
    assert engine.FanOut([HooksOnly(), Unused(), Reads()]).keep_inputs


def test_fanout_side_by_side_consumers_see_their_own_parameters(tiny):
    """Consumers of a shared pass run side by side (threads=2): one swaps a weight of its copy
    of the layer while the other, at the same moment (both inside on_layer, held by a
    barrier), reruns the layer and gets the reference output; the layer keeps its own
    parameters; an ``after_all`` consumer runs alone after both."""
    import threading

    toks = _tokens(seed=6)
    sm = engine.StreamingModel(tiny["llama"], "cpu", torch.float32)
    meet = threading.Barrier(2, timeout=60)   # broken (test fails) unless both run at once
    seen, order = [], []

    class Swapper:
        def on_layer(self, i, layer, x, y, ctx):
            q = layer.self_attn.q_proj
            w = q.weight.data
            q.weight.data = torch.zeros_like(w)
            meet.wait()          # the reader starts now
            meet.wait()          # the reader is done
            q.weight.data = w
            order.append(("swap", i))

    class Reader:
        def on_layer(self, i, layer, x, y, ctx):
            meet.wait()
            seen.append(torch.equal(ctx.forward(layer, x), y))
            meet.wait()
            order.append(("read", i))

    class Last:
        after_all = True

        def on_layer(self, i, layer, x, y, ctx):
            order.append(("last", i))

    originals = {}

    def hooks(i, layer):
        originals[i] = {k: p.data_ptr() for k, p in layer.named_parameters()}

    fan = engine.FanOut([Swapper(), Reader(), Last()], threads=2)

    def on_layer(i, layer, x, y, ctx):
        fan.on_layer(i, layer, x, y, ctx)
        assert {k: p.data_ptr() for k, p in layer.named_parameters()} == originals[i]
        assert torch.equal(ctx.forward(layer, x), y)

    engine.run(sm, toks, hooks_factory=hooks, on_layer=on_layer, batch_size=2, progress=False)
    assert seen == [True] * 3
    for i in range(3):
        assert order[3 * i + 2] == ("last", i)
        assert sorted(order[3 * i:3 * i + 2]) == [("read", i), ("swap", i)]


def test_side_by_side_threads_rule(monkeypatch):
    """Side by side only on CPU with one intra-op thread, at most one consumer per core."""
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert engine.side_by_side_threads("cpu", 2) == 2
        assert engine.side_by_side_threads("cpu", 5) == 3
        assert engine.side_by_side_threads("cpu", 1) == 1
        assert engine.side_by_side_threads("meta", 2) == 1
        torch.set_num_threads(2)
        assert engine.side_by_side_threads("cpu", 2) == 1
    finally:
        torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------
# Captured statistics equal a direct computation

@pytest.mark.parametrize("name", ("llama", "qwen3"))
def test_stats_equal_direct(tiny, name):
    toks = _tokens(rows=4, seed=5)
    ref = _reference(tiny[name], toks, capture_linears=True)
    sm = engine.StreamingModel(tiny[name], "cpu", torch.float32)
    col = stats.StatsCollector()
    engine.run(sm, toks, hooks_factory=col, batch_size=3, progress=False)  # batches of 3 + 1
    assert set(col.stats) == set(ref["lin_in"])
    n = 4 * SEQLEN
    for lin, x in ref["lin_in"].items():
        st = col[lin]
        assert st.count == x.shape[0] == n
        _close(st.abs_mean(), x.abs().mean(0))
        _close(st.sq_mean(), x.square().mean(0))
        in_sum2, counts = st.imatrix()
        _close(in_sum2, x.square().sum(0))
        assert counts == n
        _close(st.hessian(), 2.0 / n * (x.T @ x))
        assert st.xtx.device.type == "cpu"


def test_stats_accumulate_over_updates():
    """Two updates equal one update of the concatenation; float64 Hessian option."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 5, 16, generator=g), torch.randn(3, 16, generator=g) * 10
    st = stats.LinearStats("x", 16, hessian_dtype=torch.float64)
    st.update(a)
    st.update(b)
    x = torch.cat([a.reshape(-1, 16), b]).double()
    assert st.count == 38
    _close(st.abs_mean(), x.abs().mean(0))
    _close(st.hessian(), 2 / 38 * x.T @ x, rtol=1e-6)
    only = stats.LinearStats("y", 16, kinds={"abs"})
    only.update(a)
    assert only.xtx is None and only.sq_sum is None
    with pytest.raises(ValueError, match="not captured"):
        only.hessian()


def test_stats_nonfinite_names_the_linear():
    st = stats.LinearStats("model.layers.7.mlp.down_proj", 4)
    x = torch.ones(2, 3, 4)
    x[1, 2, 0] = float("nan")
    with pytest.raises(InputError, match=r"model\.layers\.7\.mlp\.down_proj.*1 of 24"):
        st.update(x)


def _patched_copy(src: Path, dst: Path, edit) -> Path:
    """Copy a model dir and rewrite its model.safetensors through ``edit(dict) -> dict``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    sd = edit(load_file(str(dst / "model.safetensors")))
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_engine_bad_checkpoints(tiny, tmp_path):
    toks = _tokens(rows=2, seqlen=8)

    def inf_norm(sd):
        sd["model.layers.1.input_layernorm.weight"][3] = float("inf")
        return sd

    d = _patched_copy(tiny["llama"], tmp_path / "inf", inf_norm)
    with pytest.raises(InputError, match=r"model\.layers\.1\.self_attn\.q_proj"):
        engine.run(engine.StreamingModel(d), toks, hooks_factory=stats.StatsCollector(), progress=False)
    with pytest.raises(InputError, match="decoder layer 1"):  # no hooks: the layer output check
        engine.run(engine.StreamingModel(d), toks, progress=False)

    def drop(sd):
        del sd["model.layers.2.mlp.up_proj.weight"]
        return sd

    d = _patched_copy(tiny["llama"], tmp_path / "missing", drop)
    with pytest.raises(InputError, match=r"'model\.layers\.2\.mlp\.up_proj\.weight' not found"):
        engine.run(engine.StreamingModel(d), toks, progress=False)

    def shrink(sd):
        sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:-1]
        return sd

    d = _patched_copy(tiny["llama"], tmp_path / "shape", shrink)
    with pytest.raises(InputError, match=r"up_proj\.weight' has shape \(767, 256\)"):
        engine.StreamingModel(d).load_layer(0)

    with pytest.raises(InputError, match=r"token ids must lie in \[0, 49152\)"):
        engine.run(engine.StreamingModel(tiny["llama"]), toks + 49152, progress=False)
    with pytest.raises(InputError, match="no config.json"):
        engine.StreamingModel(tmp_path)


def test_sharded_index_is_used(tiny):
    idx = json.loads((tiny["llama_sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1
    w = engine.SafetensorsDir(tiny["llama_sharded"])
    assert set(w.keys()) == set(idx["weight_map"])


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads /proc/self/maps (Linux)")
def test_pass_keeps_no_checkpoint_mapped(tiny):
    """A streamed pass leaves no safetensors file of the model mapped into the process after
    any layer (a kept handle's map would hold every page read: RSS growing by the checkpoint
    over the pass), and the reads give the same tensors as safetensors' own load of the
    files' bytes."""
    from safetensors.torch import load

    model = tiny["llama_sharded"]
    files = [str(f) for f in sorted(model.glob("*.safetensors"))]
    assert len(files) > 1

    def mapped() -> list[str]:
        text = Path("/proc/self/maps").read_text()
        return [f for f in files if f in text]

    sm = engine.StreamingModel(model, "cpu", torch.float32)
    seen = []
    engine.run(sm, _tokens(seed=5), batch_size=2, progress=False,
               on_layer=lambda i, *a: seen.append(mapped()))
    assert seen == [[], [], []] and mapped() == []
    w = engine.SafetensorsDir(model)
    whole = {k: v for f in files for k, v in load(Path(f).read_bytes()).items()}
    for name in ("model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(w.get(name), whole[name])
    assert torch.equal(w.get_rows("model.embed_tokens.weight", 5, 9), whole["model.embed_tokens.weight"][5:9])
    assert w.shape("model.norm.weight") == tuple(whole["model.norm.weight"].shape)
    assert mapped() == []


# --------------------------------------------------------------------------------------------
# Fixed split, token windows, file loading

def test_wiki_fixed_split(cal_dir):
    arts = data.wiki_articles(cal_dir)
    cal, held = data.calibration_articles(cal_dir), data.heldout_articles(cal_dir)
    assert (len(arts), len(cal), len(held)) == (2349, 1800, 549)
    assert cal + held == arts
    assert not set(cal) & set(held)
    assert arts[0].startswith("2007 European Parliament election in Romania\n")
    assert not any(a.startswith("<doc") or "</doc>" in a for a in arts)
    text = data.heldout_text(cal_dir)
    assert text == "\n\n".join(a.strip() for a in held)
    assert 0.2e6 < len(text.encode()) < 0.26e6


def test_token_rows_deterministic(smollm2_dir, cal_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = data.calibration_articles(cal_dir)[:30]
    a = data.token_rows(tok, texts, 6, 128, seed=7)
    b = data.token_rows(tok, texts, 6, 128, seed=7)
    c = data.token_rows(tok, texts, 6, 128, seed=8)
    assert a.dtype == torch.long and a.shape == (6, 128)
    assert torch.equal(a, b) and not torch.equal(a, c)
    stream = data.tokenize_concat(tok, texts)
    assert int((stream == tok.eos_token_id).sum()) == 30  # one EOS after each document
    windows = stream[: stream.numel() // 128 * 128].view(-1, 128)
    for row in a:  # every row is one aligned window of the stream, and all differ
        assert int((windows == row).all(1).sum()) == 1
    assert len({tuple(r.tolist()) for r in a}) == 6


def test_token_rows_too_short(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    n = data.tokenize_concat(tok, ["Hello world.", "Short."]).numel()
    with pytest.raises(InputError, match=rf"{n} tokens, 1024 needed \(8 samples x 128 tokens\)"):
        data.token_rows(tok, ["Hello world.", "Short."], 8, 128)
    with pytest.raises(InputError, match="0 documents"):
        data.token_rows(tok, [], 1, 8)


def test_load_texts_formats_and_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = tmp_path / "c.jsonl"
    j.write_text('{"content": "first doc"}\n{"content": "  "}\n{"content": "second doc"}\n')
    assert data.load_texts(j, field="content", cache_dir=tmp_path / "hf") == ["first doc", "second doc"]
    with pytest.raises(InputError, match=r"c\.jsonl: no column 'text'; available columns: content"):
        data.load_texts(j, cache_dir=tmp_path / "hf")

    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["a b c", "d e"], "n": [1, 2]}), p)
    assert data.load_texts(p, field="body", cache_dir=tmp_path / "hf") == ["a b c", "d e"]
    with pytest.raises(InputError, match="available columns: body, n"):
        data.load_texts(p, field="text", cache_dir=tmp_path / "hf")
    with pytest.raises(InputError, match="'n' holds int values"):
        data.load_texts(p, field="n", cache_dir=tmp_path / "hf")

    t = tmp_path / "c.txt"
    t.write_text("para one\nline\n\npara two\n")
    assert data.load_texts(t, cache_dir=tmp_path / "hf") == ["para one\nline\n\npara two\n"]
    assert data.load_texts(t, sample_by="paragraph", cache_dir=tmp_path / "hf") == ["para one\nline", "para two\n"]

    e = tmp_path / "empty.txt"
    e.write_text("")
    with pytest.raises(InputError, match=r"empty\.txt: calibration file is empty"):
        data.load_texts(e)
    w = tmp_path / "blank.txt"
    w.write_text("\n \n")
    with pytest.raises(InputError, match=r"blank\.txt: column 'text' has no non-empty text"):
        data.load_texts(w, cache_dir=tmp_path / "hf")
    b = tmp_path / "bad.jsonl"
    b.write_text("{not json\n")
    with pytest.raises(InputError, match=r"bad\.jsonl: cannot read as json"):
        data.load_texts(b, cache_dir=tmp_path / "hf")
    with pytest.raises(InputError, match="not found"):
        data.load_texts(tmp_path / "nope.jsonl")
    with pytest.raises(InputError, match="not found"):
        data.wiki_articles(tmp_path)


def test_tokenizer_without_special_tokens(smollm2_dir, tiny, tmp_path):
    """No pad token is ever needed (rows are not padded); documents are separated by EOS, else
    BOS; a tokenizer with neither is refused for several documents, and one that claims to add
    a BOS it does not define is refused, naming the model."""
    from transformers import AutoTokenizer

    from quantpress.targets import CalibOptions, calibration_rows

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    docs = ["Hello world.", "Short text."]
    with_eos = data.tokenize_concat(tok, docs)
    tok.eos_token = None
    with_bos = data.tokenize_concat(tok, docs)
    sep = (with_eos == with_eos[len(tok(docs[0], add_special_tokens=False)["input_ids"])]).nonzero()
    assert with_bos.numel() == with_eos.numel() and sep.numel() >= 1
    assert int(with_bos[sep[0, 0]]) == tok.bos_token_id
    tok.bos_token = None
    with pytest.raises(InputError, match="no EOS or BOS token to separate the 2 calibration documents"):
        data.tokenize_concat(tok, docs)
    assert data.tokenize_concat(tok, docs[:1]).numel() == with_eos.numel() - 1 - len(
        tok(docs[1], add_special_tokens=False)["input_ids"]) - 1

    model = tmp_path / "nobos"
    shutil.copytree(tiny["llama"], model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(bos_token=None, eos_token=None, add_bos_token=True)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"nobos: the tokenizer adds a BOS token \(add_bos_token\) but defines none"):
        calibration_rows(model, CalibOptions(samples=2, seqlen=16), progress=False)
    cfg.update(add_bos_token=False)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"nobos: the tokenizer has no EOS or BOS token to separate"):
        calibration_rows(model, CalibOptions(samples=2, seqlen=16), progress=False)


def test_dataset_folder_and_name(tmp_path, monkeypatch):
    """--calib also takes a datasets folder (data files datasets recognizes) or a hub name;
    offline, a name gives one clear error naming it."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text('{"body": "doc one"}\n{"body": "doc two"}\n')
    (folder / "part-1.jsonl").write_text('{"body": "doc three"}\n')
    assert sorted(data.load_texts(folder, field="body", cache_dir=tmp_path / "hf")) == [
        "doc one", "doc three", "doc two"]
    with pytest.raises(InputError, match=r"ds: no column 'text'; available columns: body"):
        data.load_texts(folder, cache_dir=tmp_path / "hf")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network wait in CI
    with pytest.raises(InputError, match=r"no-such-owner/no-such-set:cfg@validation: not a local file, "
                                         r"and datasets cannot load it"):
        data.load_texts("no-such-owner/no-such-set:cfg@validation", cache_dir=tmp_path / "hf")
    with pytest.raises(InputError, match=r"nope\.jsonl: calibration file not found"):
        data.load_texts(tmp_path / "nope.jsonl")


def heap_check() -> None:
    """The body of the test below, run in a fresh interpreter (exit 0, 3: not applicable)."""
    from quantpress.memory import MMAP_THRESHOLD, TRIM_KEEP, anon_rss, bound_heap, trim_heap

    if not bound_heap() or anon_rss() is None:
        raise SystemExit(3)
    anon = anon_rss
    trim_heap(force=True)  # the reference point of the next trims
    before = anon()
    for _ in range(4):
        t = torch.ones(3 << 20)  # 12 MiB, touched
        del t
    kept = anon() - before
    trim_heap()  # 12 MiB free: below TRIM_KEEP, kept for the next layer
    assert kept >= 10 << 20 and anon() - before >= 10 << 20, (kept, anon() - before)
    big = torch.ones(MMAP_THRESHOLD // 4 + (1 << 20))  # no free chunk that large: mapped
    del big
    assert anon() - before - kept < 4 << 20, (anon() - before, kept)
    block = MMAP_THRESHOLD // 2
    many = [torch.ones(block // 4) for _ in range(TRIM_KEEP // block + 2)]  # > TRIM_KEEP in all
    del many
    assert anon() - before > TRIM_KEEP, anon() - before
    trim_heap()
    assert anon() - before < 4 << 20, anon() - before


def test_bound_heap_keeps_step_temporaries_until_the_layer_ends():
    """After bound_heap(), freed tensors below the mmap threshold stay on the heap for the
    next step (or layer) to reuse instead of being unmapped and faulted in again; trim_heap()
    at a layer's end returns them once the RSS grew by more than TRIM_KEEP since the last
    trim, and leaves a smaller amount in place. A tensor above the mmap threshold that no free
    heap chunk holds is its own mapping, returned when freed. Run in a fresh interpreter: the
    heap of the long test process (free chunks of earlier tests) makes the RSS steps
    unpredictable."""
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    p = subprocess.run([sys.executable, "-c", "import test_calibration as t; t.heap_check()"],
                       cwd=here, env={**os.environ, "PYTHONPATH": str(here)},
                       capture_output=True, text=True, timeout=300)
    if p.returncode == 3:
        pytest.skip("not glibc on Linux, or MALLOC_*_THRESHOLD_ set: mallopt not applied")
    assert p.returncode == 0, p.stderr[-3000:]


def test_estimate_line_scales_the_first_layer():
    """The estimate after a pass's first layer: rows x seqlen tokens at the first layer's
    rate, times the layers left."""
    from quantpress.calibration.engine import estimate_line

    line = estimate_line(128, 512, 30, 250.3)
    assert line == ("estimate: 128 rows x 512 tokens x 30 layers: the first took 250.3 s "
                    "(262 tokens/s), about 2 h 05 min for the pass")
    assert estimate_line(4, 64, 3, 2.0).endswith("(128 tokens/s), about 6 s for the pass")
    assert estimate_line(16, 256, 30, 10.0).endswith("about 5 min 00 s for the pass")


def test_model_skeletons_are_built_one_at_a_time(tiny_llama_dir, monkeypatch):
    """transformers sets torch's default dtype, process-wide, to the config's while it builds a
    model: two StreamingModels made at once in two threads build their skeletons one after the
    other (otherwise the second could restore the first's dtype and leave it behind), and the
    default dtype is float32 afterwards."""
    import threading
    import time

    import transformers

    real = transformers.AutoModelForCausalLM.from_config
    lock, active, most = threading.Lock(), [0], [0]

    def slow(*a, **kw):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.3)
        try:
            return real(*a, **kw)
        finally:
            with lock:
                active[0] -= 1
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", slow)
    made, errors = [], []

    def build():
        try:
            made.append(engine.StreamingModel(tiny_llama_dir))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(made) == 2
    assert most[0] == 1 and torch.get_default_dtype() == torch.float32
