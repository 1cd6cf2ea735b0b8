"""Reference side of the side-by-side speed benches: llm-compressor 0.14.0.1 (AWQ, GPTQ).

llm-compressor runs in its own cached virtual environment (:func:`ensure_env`: torch 2.13.0,
the CPU wheel here, plus ``llmcompressor==0.14.0.1``, which pins transformers <= 5.17 and
compressed-tensors 0.19.0, so it cannot share the project's environment). :func:`run` hands
it the exact token rows we calibrate on and the held-out chunks we evaluate on, in a child
process started with that environment's python; the child times ``oneshot`` alone and scores
the model before and after it with the project's own perplexity / KL code
(:mod:`quantpress.calibration.eval`, imported from ``<repo>/src``), so both sides of a bench
use identical formulas.

How llm-compressor 0.14 is driven (read from its installed source):

- AWQ is a transform in 0.14 (``llmcompressor.modifiers.transform.awq.AWQModifier``: it only
  searches and applies the per-channel scales); the 4-bit weights come from a
  ``QuantizationModifier`` after it. The recipe is ``[AWQModifier(), QuantizationModifier(
  config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
  num_bits=4, type="int", symmetric=False, strategy="group", group_size=G))}, ignore=["lm_head"])]``
  (``W4A16_ASYM`` with the group size replaced). Default llama mappings, ``duo_scaling=True``,
  ``n_grid=20``; there is no clipping search (AutoAWQ's ``auto_clip``): the weight observer is
  plain min/max.
- GPTQ: ``GPTQModifier`` with the same kind of config group, symmetric; ``block_size``,
  ``dampening_frac`` and ``actorder`` from ``options`` (llm-compressor's defaults otherwise:
  128, 0.01, "static"). "group" activation ordering was removed in 0.14 (it raises).
- Calibration data: a pre-tokenized ``datasets.Dataset`` (``input_ids``, ``attention_mask`` of
  ones), ``shuffle_calibration_samples=False``, ``batch_size=1``, ``max_seq_length=seqlen``
  (the truncation collator then keeps every row whole), ``pipeline="sequential"``. A forward
  pre-hook on the input embedding checks that the model saw exactly the given rows.
- After ``oneshot`` the model stays in memory with compressed-tensors' fake-quantizing forward
  (status "frozen": every targeted Linear runs ``F.linear(x, qdq(W))``); the child checks this
  on one layer and reports it.

CPU: llm-compressor's AWQ pins its cached activations (``IntermediatesCache.pin_memory``), which
a CPU-only torch refuses ("Cannot access accelerator device when none is available"); when no
accelerator is present the child turns that method into a no-op and says so in ``patched``.

Layers the group size does not fit: llm-compressor refuses a Linear whose input width is not
a multiple of the group size; like quantpress (which leaves such layers in float), the child
adds them to ``ignore`` and lists them in ``float_linears`` (SmolLM2-135M at group 128: only
the 30 ``down_proj``, 1536 wide, are quantized; its other Linears are 576 wide).

Memory: the child resets its VmHWM (``/proc/self/clear_refs``) just before ``oneshot``, so
``oneshot_vmhwm_bytes`` is the peak RSS during ``oneshot`` (the loaded model included).
``peak_rss_bytes`` is ``ru_maxrss`` after ``oneshot``: the kernel reports the larger of the
reset high-water mark and the RSS that the *parent* had when it started the child (Linux
carries it over at exec; ``ru_maxrss_at_start_bytes`` shows it), so in a bench process that
already holds a model it can be the parent's figure. ``vmhwm_bytes``: the child's own peak
from its start to the end of ``oneshot`` (model load and base evaluation included).

Threads: on a shared 2-core machine torch's two OpenMP threads spin-wait whenever the other
core is busy; the AWQ smoke run took 353 s with 2 threads under load and 54 s with
``threads=1`` (same result). Give both sides of a bench the same explicit ``threads``.

Manual smoke run (builds the rows and chunks exactly as the project does)::

    .venv/bin/python scripts/llmcompressor_ref.py --method awq --samples 4 --seqlen 128 \\
        --group-size 64 --chunks 2 --ctx 256
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLMC_VERSION = "0.14.0.1"
TORCH_PIN = "torch==2.13.0"
ENV_NAME = f"llmcompressor-{LLMC_VERSION}"
MARKER = ".quantpress-complete"
REPO = Path(__file__).resolve().parent.parent
METHODS = ("awq", "gptq")
#: options each method accepts (anything else is a ValueError)
OPTION_KEYS = {
    "awq": {"duo_scaling", "n_grid", "batch_size"},
    "gptq": {"actorder", "dampening_frac", "block_size", "batch_size"},
}
RESULT_PREFIX = "RESULT "


# --------------------------------------------------------------------------------------------
# The environment

def _cache_root() -> Path:
    """:func:`quantpress.assets.cache_root`, or the same rule when quantpress is not importable."""
    try:
        from quantpress.assets import cache_root
    except ImportError:
        xdg = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        root = Path(os.environ.get("QUANTPRESS_CACHE", xdg / "quantpress"))
        root.mkdir(parents=True, exist_ok=True)
        return root
    return cache_root()


def ensure_env(verbose: bool = True) -> Path:
    """The python executable of a cached virtual environment holding llm-compressor.

    The environment lives in ``<cache>/envs/llmcompressor-0.14.0.1/`` (``<cache>``:
    :func:`quantpress.assets.cache_root`). It is made once with ``python -m venv``, then
    ``pip install torch==2.13.0`` (the CPU wheel here; pinned again on the next pip command
    so that pip never swaps in another, CUDA, build), then ``llmcompressor==0.14.0.1``
    (about 50 s and 1.5 GB). A marker file is written last: a second call only checks it and
    returns at once; a directory without the marker (an interrupted build) is deleted and
    built again.

    Args:
        verbose: print what is being done and let pip print its progress (else pip runs
            with ``-q``).

    Returns:
        Path of ``bin/python`` inside the environment.

    Raises:
        SystemExit: with a one-line message when ``venv`` or a pip command fails.
    """
    env = _cache_root() / "envs" / ENV_NAME
    py = env / "bin" / "python"
    if (env / MARKER).is_file() and py.exists():
        return py
    if env.exists():
        if verbose:
            print(f"[llmcompressor_ref] removing half-made environment {env}", flush=True)
        shutil.rmtree(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if verbose:
        print(f"[llmcompressor_ref] creating {env}", flush=True)
    quiet = [] if verbose else ["-q"]
    steps = [
        ("venv", [sys.executable, "-m", "venv", str(env)]),
        (f"pip install {TORCH_PIN}", [str(py), "-m", "pip", "install", *quiet, TORCH_PIN]),
        (f"pip install llmcompressor=={LLMC_VERSION}",
         [str(py), "-m", "pip", "install", *quiet, TORCH_PIN, f"llmcompressor=={LLMC_VERSION}"]),
    ]
    for what, cmd in steps:
        if verbose:
            print(f"[llmcompressor_ref] {what}", flush=True)
        try:
            r = subprocess.run(cmd)
        except OSError as e:
            raise SystemExit(f"llmcompressor_ref: {what} could not start ({e})") from None
        if r.returncode != 0:
            raise SystemExit(f"llmcompressor_ref: '{what}' failed (exit {r.returncode}) while "
                             f"building {env}; see the pip output above")
    (env / MARKER).write_text(f"{TORCH_PIN} llmcompressor=={LLMC_VERSION}\n"
                              f"built in {time.perf_counter() - t0:.0f} s\n")
    if verbose:
        print(f"[llmcompressor_ref] environment ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return py


# --------------------------------------------------------------------------------------------
# The parent side

def _check_options(method: str, options: dict | None) -> dict:
    options = dict(options or {})
    unknown = set(options) - OPTION_KEYS[method]
    if unknown:
        raise ValueError(f"{method}: unknown option(s) {sorted(unknown)}; accepted: "
                         f"{sorted(OPTION_KEYS[method])}")
    act = options.get("actorder")
    if act is not None and act not in ("static", "weight"):
        raise ValueError(f"gptq: actorder {act!r} is not supported by llm-compressor "
                         f"{LLMC_VERSION} (only 'static'/'weight' or None; 'group' was removed)")
    return options


def run(method: str, model_dir, calib_rows, heldout_chunks, *, group_size: int,
        dtype: str = "float32", options: dict | None = None, threads: int | None = None) -> dict:
    """Quantize ``model_dir`` with llm-compressor on the given rows, in a child process, and
    score it on the held-out chunks.

    The tensors are saved (``torch.save``) in a temporary directory; the child, started with
    :func:`ensure_env`'s python, loads the model on CPU (``AutoModelForCausalLM.from_pretrained(
    model_dir, dtype=dtype)``), scores it, runs ``oneshot`` (the only step timed), scores the
    quantized model and prints one ``RESULT {json}`` line.

    Args:
        method: "awq" (4-bit asymmetric, zero point) or "gptq" (4-bit symmetric).
        model_dir: Hugging Face model directory (with its tokenizer).
        calib_rows: int64 tensor [n, seqlen], the calibration rows, used as they are.
        heldout_chunks: int64 tensor [chunks, ctx], evaluation chunks; llama-perplexity's
            convention: positions ``ctx // 2 … ctx − 2`` are scored.
        group_size: weights per quantization group along the input dimension.
        dtype: "float32", "float16" or "bfloat16" (model load dtype).
        options: AWQ: ``duo_scaling`` (True/False/"both"), ``n_grid``; GPTQ: ``actorder``
            ("static"/"weight"/None; absent: llm-compressor's default "static"),
            ``dampening_frac`` (0.01), ``block_size`` (128); both: ``batch_size`` (1).
        threads: ``torch.set_num_threads`` in the child (None: torch's default).

    Returns:
        dict with ``method``; ``wall_s``, ``user_s``, ``sys_s`` (``oneshot`` only; CPU
        seconds of the child plus any process it started); memory in bytes (see the module
        docstring): ``peak_rss_bytes`` (``ru_maxrss`` after oneshot), ``vmhwm_bytes``,
        ``oneshot_vmhwm_bytes``, ``rss_before_oneshot_bytes``, ``ru_maxrss_at_start_bytes``;
        quality on the held-out chunks: ``ppl``, ``kld`` (mean KL(base ‖ quantized), nats),
        ``ppl_base``, ``kld_p99``, ``same_top``, ``tokens`` (scored); ``patched`` (what was
        disabled for CPU, one sentence); ``quantized_forward`` (how the quantized model was
        evaluated, as checked); ``rows_seen_match`` (the model saw exactly ``calib_rows``);
        ``quantized_linears`` / ``float_linears`` (layers left in float because the group
        size does not divide their input width); ``recipe`` (the modifiers' repr);
        ``calibration``, ``eval``, ``versions`` (llmcompressor, torch, transformers,
        compressed_tensors), ``threads`` (torch threads in the child), ``dtype``, ``load_s``,
        ``eval_s`` (not timed into ``wall_s``).

    Raises:
        ValueError: unknown method, option or dtype, or tensors of the wrong shape or type.
        FileNotFoundError: ``model_dir`` has no config.json.
        SystemExit: the environment cannot be built (:func:`ensure_env`).
        RuntimeError: the child failed or printed no result (its stderr went to ours), e.g.
            when the group size divides no Linear layer's input width.
    """
    import torch

    if method not in METHODS:
        raise ValueError(f"method {method!r}: expected one of {METHODS}")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype {dtype!r}: expected float32, float16 or bfloat16")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size {group_size!r}: expected a positive integer")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads {threads!r}: expected a positive integer or None")
    opts = _check_options(method, options)
    for name, t in (("calib_rows", calib_rows), ("heldout_chunks", heldout_chunks)):
        if not isinstance(t, torch.Tensor) or t.ndim != 2 or t.dtype != torch.int64 or t.numel() == 0:
            raise ValueError(f"{name}: expected a non-empty int64 tensor [rows, length], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if heldout_chunks.shape[1] < 4:
        raise ValueError(f"heldout_chunks: ctx {heldout_chunks.shape[1]} is too short (need >= 4)")
    model_dir = Path(model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")

    py = ensure_env(verbose=True)
    with tempfile.TemporaryDirectory(prefix="llmc-ref-") as tmp:
        rows_p, chunks_p = Path(tmp, "rows.pt"), Path(tmp, "chunks.pt")
        torch.save(calib_rows.detach().cpu().contiguous(), rows_p)
        torch.save(heldout_chunks.detach().cpu().contiguous(), chunks_p)
        spec = {"method": method, "model_dir": str(model_dir), "rows": str(rows_p),
                "chunks": str(chunks_p), "group_size": group_size, "dtype": dtype,
                "options": opts, "threads": threads, "repo_src": str(REPO / "src")}
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONNOUSERSITE="1")
        env.pop("PYTHONPATH", None)  # the child must see only its own site-packages
        cmd = [str(py), "-u", str(Path(__file__).resolve()), "--child", json.dumps(spec)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
        elif line.strip():
            print(line, file=sys.stderr)
    if proc.returncode != 0 or result is None:
        tail = "\n".join(proc.stdout.splitlines()[-5:])
        raise RuntimeError(f"llm-compressor {method} child failed (exit {proc.returncode}); "
                           f"see its stderr above{': ' + tail if tail else ''}")
    return result


# --------------------------------------------------------------------------------------------
# Rows and chunks as the project builds them (CLI; importable by the benches)

def project_rows(model_dir, samples: int, seqlen: int, seed: int = 0):
    """The calibration rows quantpress uses for ``model_dir`` by default: ``samples`` windows
    of ``seqlen`` tokens of wiki.utf8 articles 0-1799 drawn with ``seed``, BOS first when the
    model adds one (:func:`quantpress.targets.base.calibration_rows`). Returns int64
    [samples, seqlen]. Raises quantpress.errors.InputError for too little text or a model that
    cannot be read."""
    sys.path.insert(0, str(REPO / "src"))
    from quantpress.targets.base import CalibOptions, calibration_rows

    rows, _ = calibration_rows(model_dir, CalibOptions(samples=samples, seqlen=seqlen, seed=seed),
                               progress=False)
    return rows


def project_chunks(model_dir, ctx: int, chunks: int | None):
    """The held-out evaluation chunks quantpress uses (``quantpress.targets.eval.evaluate``'s
    default text): wiki.utf8 articles 1800-2348 tokenized once, cut into ``chunks`` chunks of
    ``ctx`` tokens, BOS first in every chunk when the model adds one. Returns int64
    [chunks, ctx]. Raises quantpress.errors.InputError when the text is too short."""
    sys.path.insert(0, str(REPO / "src"))
    from quantpress.calibration import data as cdata
    from quantpress.calibration import eval as ceval
    from quantpress.convert import loaders
    from quantpress.targets.base import default_cal_dir
    from quantpress.targets.eval import tokenize_stream

    p = Path(model_dir)
    ld = loaders.find_loader(p)
    tok = ld.tokenizer(p)
    bos = tok.bos_token_id if ld.add_bos(p, tok) else None
    text = cdata.heldout_text(default_cal_dir())
    return ceval.make_chunks(tokenize_stream(tok, text, bos), ctx, chunks, bos)


# --------------------------------------------------------------------------------------------
# The child (runs under the llm-compressor environment's python)

def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _cpu_patches(torch) -> tuple[str, dict]:
    """Disable what a CPU-only torch cannot do; returns (sentence, call counter)."""
    calls = {"pin_memory": 0}
    if torch.accelerator.is_available():
        return "nothing (an accelerator is present)", calls
    from llmcompressor.pipelines.cache import IntermediatesCache

    def no_pin(self, batch_index, input_names=None):
        calls["pin_memory"] += 1  # pinning only speeds host-to-device copies; there are none

    IntermediatesCache.pin_memory = no_pin
    return ("llmcompressor.pipelines.cache.IntermediatesCache.pin_memory was made a no-op "
            "(AWQ pins its cached activations before each grid search, and a CPU-only torch "
            "raises 'Cannot access accelerator device when none is available'; pinning only "
            "speeds host-to-GPU copies)"), calls


def _recipe(method: str, group_size: int, opts: dict, ignore: list[str]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size,
                               symmetric=(method == "gptq"), dynamic=False)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}
    if method == "awq":
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform.awq import AWQModifier

        awq_kw = {k: opts[k] for k in ("duo_scaling", "n_grid") if k in opts}
        return [AWQModifier(**awq_kw),
                QuantizationModifier(config_groups=groups, ignore=ignore)]
    from llmcompressor.modifiers.gptq import GPTQModifier

    kw = {"block_size": opts.get("block_size", 128),
          "dampening_frac": opts.get("dampening_frac", 0.01)}
    if "actorder" in opts:
        kw["actorder"] = opts["actorder"]
    return [GPTQModifier(config_groups=groups, ignore=ignore, **kw)]


def _scored_logits(model, chunk, sl, out_emb):
    """Logits at the scored positions of one chunk: [n_scored, vocab] (float32)."""
    h = model.base_model(input_ids=chunk[None]).last_hidden_state[0, sl]
    return out_emb(h).float()


def _compact_names(names: list[str]) -> list[str]:
    """``model.layers.N.x.y`` names grouped by their part after the layer number:
    ``["self_attn.q_proj x30", ...]`` (other names as they are)."""
    import re

    counts: dict[str, int] = {}
    for n in names:
        key = re.sub(r"^.*?\.layers\.\d+\.", "", n)
        counts[key] = counts.get(key, 0) + 1
    return [f"{k} x{v}" if v > 1 else k for k, v in counts.items()]


def _weight_fingerprint(t) -> tuple[float, float]:
    d = t.detach().double()
    return float(d.sum()), float(d.square().sum())


def _check_fake_quant(torch, model) -> str:
    """Describe (and check on the first quantized Linear) how the quantized model runs."""
    from compressed_tensors.quantization import forward_quantize

    mods = [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and getattr(m, "quantization_scheme", None) is not None]
    if not mods:
        raise RuntimeError("no Linear module carries a quantization scheme after oneshot")
    statuses = sorted({str(getattr(m, "quantization_status", None)) for _, m in mods})
    name, m = mods[0]
    args = m.quantization_scheme.weights
    with torch.no_grad():
        wq = forward_quantize(m, m.weight.data.clone(), "weight", args)
        x = torch.randn(3, m.in_features, dtype=m.weight.dtype)
        diff_q = float((m(x) - torch.nn.functional.linear(x, wq, m.bias)).abs().max())
        on_grid = bool(torch.equal(wq, m.weight.data))
        g = args.group_size or m.in_features
        levels = int(wq[0, :g].unique().numel())
    if diff_q > 1e-4 * max(1.0, float(x.abs().max())):
        raise RuntimeError(f"{name}: forward after oneshot is not F.linear(x, qdq(W)) "
                           f"(max diff {diff_q:.3g}); the model is not fake-quantized")
    return (f"in-memory model after oneshot: {len(mods)} Linear layers with compressed-tensors' "
            f"fake-quantizing forward (status {'/'.join(statuses)}); checked on {name}: "
            f"forward == F.linear(x, qdq(W)) (max diff {diff_q:.1e}), {levels} distinct values "
            f"in its first group, stored weight {'already' if on_grid else 'not'} on the grid")


def _child(spec: dict) -> dict:
    import resource
    from importlib import metadata

    maxrss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sys.path.insert(0, spec["repo_src"])
    import torch

    from quantpress.calibration import eval as ceval

    if spec["threads"]:
        torch.set_num_threads(int(spec["threads"]))
    patched, pin_calls = _cpu_patches(torch)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmcompressor import oneshot

    rows = torch.load(spec["rows"], weights_only=True)
    chunks = torch.load(spec["chunks"], weights_only=True)
    n, seqlen = rows.shape
    ctx = chunks.shape[1]
    sl = ceval.scored_slice(ctx)
    targets = ceval.scored_targets(chunks)

    t0 = time.perf_counter()
    dt = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=dt)
    model.eval()
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    load_s = time.perf_counter() - t0

    # base model: keep only the final hidden states at the scored positions (tiny); the
    # output embedding is left alone by both recipes (lm_head ignored), checked below
    t0 = time.perf_counter()
    out_emb = model.get_output_embeddings()
    fp_before = _weight_fingerprint(out_emb.weight)
    h_base = []
    ppl_base = ceval.PerplexityStats()
    with torch.no_grad():
        full = model(input_ids=chunks[:1]).logits[0, sl].float()
        part = _scored_logits(model, chunks[0], sl, out_emb)
        if not torch.allclose(full, part, rtol=1e-4, atol=1e-4):
            raise RuntimeError("lm_head(base_model(x)) differs from model(x).logits: this "
                               "architecture post-processes its logits; not supported here")
        del full, part
        for i in range(chunks.shape[0]):
            h = model.base_model(input_ids=chunks[i:i + 1]).last_hidden_state[0, sl].clone()
            ppl_base.update(out_emb(h).float(), targets[i], what="base model")
            h_base.append(h)
    eval_s = time.perf_counter() - t0

    seen: list[tuple[int, ...]] = []

    def record(_mod, args, kwargs):
        ids = args[0] if args else kwargs.get("input")
        if ids is not None:
            seen.extend(tuple(r) for r in ids.reshape(-1, ids.shape[-1]).tolist())

    hook = model.get_input_embeddings().register_forward_pre_hook(record, with_kwargs=True)
    ds = Dataset.from_dict({"input_ids": rows.tolist(), "attention_mask": [[1] * seqlen] * n})
    # like quantpress, Linears whose input width the group size does not divide stay float
    # (llm-compressor refuses them: "columns % group_size == 0" is required)
    gs = spec["group_size"]
    linears = [(name, m) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    skipped = [name for name, m in linears if m.in_features % gs]
    if len(skipped) == len(linears):
        raise ValueError(f"group size {gs} divides no Linear layer's input width "
                         f"({sorted({m.in_features for _, m in linears})})")
    recipe = _recipe(spec["method"], gs, spec["options"], ["lm_head", *skipped])
    bs = int(spec["options"].get("batch_size", 1))

    rss_before = (_status_kib("VmRSS") or 0) * 1024
    hwm_before = (_status_kib("VmHWM") or 0) * 1024
    hwm_reset = _reset_hwm()
    r0s = resource.getrusage(resource.RUSAGE_SELF)
    r0c = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    oneshot(model=model, processor=tok, dataset=ds, recipe=recipe, num_calibration_samples=n,
            max_seq_length=seqlen, shuffle_calibration_samples=False, batch_size=bs,
            pipeline="sequential")
    wall = time.perf_counter() - t0
    r1s = resource.getrusage(resource.RUSAGE_SELF)
    r1c = resource.getrusage(resource.RUSAGE_CHILDREN)
    hwm_after = (_status_kib("VmHWM") or 0) * 1024
    oneshot_hwm = hwm_after if hwm_reset else None
    hook.remove()

    want = sorted(set(tuple(r) for r in rows.tolist()))
    rows_match = sorted(set(seen)) == want

    quantized_forward = _check_fake_quant(torch, model)
    if _weight_fingerprint(out_emb.weight) != fp_before:
        raise RuntimeError("the output embedding changed during oneshot; the base logits "
                           "cannot be rebuilt from the stored hidden states")
    t1 = time.perf_counter()
    kl = ceval.KLStats()
    with torch.no_grad():
        for i in range(chunks.shape[0]):
            lq = _scored_logits(model, chunks[i], sl, out_emb)
            lb = out_emb(h_base[i]).float()
            kl.update(lb, lq, targets[i], what=f"llm-compressor {spec['method']}")
            del lq, lb
    eval_s += time.perf_counter() - t1
    klr = kl.result()
    pin_note = f" (called {pin_calls['pin_memory']} times in this run)" if pin_calls["pin_memory"] else \
        (" (not reached in this run)" if "no-op" in patched else "")

    def ver(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    return {
        "method": spec["method"],
        "wall_s": wall,
        "user_s": (r1s.ru_utime - r0s.ru_utime) + (r1c.ru_utime - r0c.ru_utime),
        "sys_s": (r1s.ru_stime - r0s.ru_stime) + (r1c.ru_stime - r0c.ru_stime),
        "peak_rss_bytes": r1s.ru_maxrss * 1024,
        "vmhwm_bytes": max(hwm_before, hwm_after),
        "oneshot_vmhwm_bytes": oneshot_hwm,
        "rss_before_oneshot_bytes": rss_before,
        "ru_maxrss_at_start_bytes": maxrss_start,
        "ppl": kl.perplexity()["ppl"],
        "kld": klr["kld_mean"],
        "ppl_base": ppl_base.result()["ppl"],
        "kld_p99": klr["kld_p99"],
        "same_top": klr["same_top"],
        "tokens": klr["tokens"],
        "patched": patched + pin_note,
        "quantized_forward": quantized_forward,
        "rows_seen_match": rows_match,
        "quantized_linears": len(linears) - len(skipped),
        "float_linears": _compact_names(skipped),
        "recipe": [repr(m) for m in recipe],
        "calibration": {"rows": n, "seqlen": seqlen, "batch_size": bs},
        "eval": {"chunks": int(chunks.shape[0]), "ctx": ctx, "first_scored": ceval.first_scored(ctx)},
        "versions": {"llmcompressor": ver("llmcompressor"), "torch": torch.__version__,
                     "transformers": ver("transformers"),
                     "compressed_tensors": ver("compressed-tensors")},
        "threads": torch.get_num_threads(),
        "dtype": spec["dtype"],
        "load_s": load_s,
        "eval_s": eval_s,
    }


# --------------------------------------------------------------------------------------------
# CLI

def main(argv: list[str] | None = None) -> None:
    """``--child JSON``: the child side of :func:`run` (prints ``RESULT {json}``); otherwise a
    manual smoke run on the project's own rows and held-out chunks, printing the result."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        res = _child(json.loads(argv[1]))
        print(RESULT_PREFIX + json.dumps(res), flush=True)
        return
    sys.path.insert(0, str(REPO / "src"))
    from bench_common import add_model_arg, model_dir

    ap = argparse.ArgumentParser(description="llm-compressor 0.14.0.1 reference run (smoke test)")
    ap.add_argument("--method", choices=METHODS, default="awq")
    add_model_arg(ap)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--actorder", choices=["static", "none"], help="GPTQ activation ordering")
    args = ap.parse_args(argv)
    model = model_dir(args.model)
    rows = project_rows(model, args.samples, args.seqlen)
    chunks = project_chunks(model, args.ctx, args.chunks)
    opts = {}
    if args.actorder and args.method == "gptq":
        opts["actorder"] = None if args.actorder == "none" else args.actorder
    res = run(args.method, model, rows, chunks, group_size=args.group_size, dtype=args.dtype,
              options=opts, threads=args.threads)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
