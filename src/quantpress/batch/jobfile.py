"""Batch job files (``quantize batch JOBS.toml``): TOML in, a validated plan out.

::

    [defaults]                 # for every model below; any key of a [[model]] but source/name
    device = "auto"
    calib = { samples = 128, seqlen = 2048 }

    [[model]]
    source = "models/Llama-3.1-8B-Instruct"    # Hugging Face directory (relative: to the job file)
    name = "Llama-3.1-8B-Instruct"             # output prefix; default: the directory's name
    gguf = ["Q4_K_M", "Q6_K", "Q8_0"]          # policies, as convert hf-to-gguf --policy, or
                                               # tables of its options: { policy = "IQ4_XS",
                                               # imatrix = true } (true: this model's imatrix)
    imatrix = true                             # also <name>.imatrix.gguf (quantize imatrix)
    awq = [{ group_size = 128 }]               # each table: the options of quantize awq
    gptq = [{ group_size = 128 }]              # each table: the options of quantize gptq
    fp8 = [{ scheme = "dynamic" }]             # each table: the options of quantize fp8
    exl2 = [{ bpw = 4.0 }, { bpw = 6.0, head_bits = 8 }]   # the options of quantize exl2
    exl2_measurement = "m.json"                # optional: reuse it (quantize exl2 --measurement)
    eval = true                                # or { ctx = 512, chunks = 20, text = "FILE" }

Keys are the single verbs' option names with ``_`` for ``-`` (``group_size``, ``head_bits``,
``max_shard_size``; ``calib`` holds ``calib``, ``calib_field``, ``samples``, ``seqlen``,
``seed``). Every table becomes the options dataclass the single verb builds
(:class:`~quantpress.targets.GGUFOptions`, :class:`~quantpress.targets.AWQOptions`, ...), so a
value the verb refuses is refused here with the verb's message, prefixed with the job file and
the model entry. Everything is checked before any work starts: :func:`read_jobs` raises
InputError naming the file, the entry and the key.
"""
from __future__ import annotations

import math
import tomllib
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from quantpress.errors import InputError
from quantpress.targets import (AWQOptions, CalibOptions, ComputeOptions, EXL2MeasurementOptions,
                                EXL2Options, FP8Options, GGUFOptions, GPTQOptions, ImatrixOptions)
from quantpress.targets.eval import EvalOptions

#: keys of a [[model]] entry (and of [defaults], but for source and name)
MODEL_KEYS = ("source", "name", "gguf", "imatrix", "awq", "gptq", "fp8", "exl2", "exl2_measurement",
              "eval", "device", "dtype", "batch_tokens", "calib")
#: keys of the calib table → CalibOptions fields
CALIB_KEYS = ("calib", "calib_field", "samples", "seqlen", "seed")
#: file name of the EXL2 measurement shared by a model's EXL2 outputs
MEASUREMENT_FILE = "measurement.json"
#: ``GGUFOptions.imatrix`` of a GGUF table with ``imatrix = true``: the model's own imatrix
#: output, put in when it is finished (as ``--imatrix auto`` of the single verbs)
BATCH_IMATRIX = "auto"


@dataclass(frozen=True)
class OutputJob:
    """One output of a model: ``kind`` (gguf, imatrix, measurement, awq, exl2), ``target``
    (Q4_K_M, w4g128, 4.0, ...), ``path`` relative to the model's output directory and the
    single verb's ``options`` dataclass."""

    kind: str
    target: str
    path: str
    options: Any

    @property
    def after_imatrix(self) -> bool:
        """A GGUF output quantized with the model's own imatrix (``imatrix = true`` in its
        table): made once the imatrix output is finished."""
        return self.kind == "gguf" and self.options.imatrix == BATCH_IMATRIX


@dataclass
class ModelJob:
    """One [[model]] entry: ``index`` in the file, output prefix ``name``, ``source`` HF
    directory, compute and calibration options, the ``outputs`` in the order they are made,
    and ``eval`` (None: no evaluation)."""

    index: int
    name: str
    source: Path
    compute: ComputeOptions
    calib: CalibOptions
    outputs: list[OutputJob] = field(default_factory=list)
    eval: EvalOptions | None = None

    @property
    def where(self) -> str:
        """``model[i] (name)``, for messages."""
        return f"model[{self.index}] ({self.name})"


# --------------------------------------------------------------------------------------------
# Typed tables → options dataclasses

_TYPES = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,), "None": (type(None),),
          "tuple[str, ...]": (list, tuple)}


def _check_type(where: str, key: str, value: Any, annotation: str) -> None:
    names = [a.strip() for a in str(annotation).split("|")]
    for n in names:
        allowed = _TYPES.get(n)
        if allowed is None:
            continue
        if n in ("int", "float") and isinstance(value, bool):
            continue
        if isinstance(value, allowed):
            return
    want = " or ".join({"int": "an integer", "float": "a number", "bool": "true/false",
                        "str": "a string", "None": "absent",
                        "tuple[str, ...]": "a list of strings"}.get(n, n) for n in names)
    raise InputError(f"{where}: {key} = {value!r}: expected {want}")


def build_options(options_type: type, table: Any, where: str, exclude: tuple[str, ...] = ()) -> Any:
    """``options_type`` (a dataclass) from a TOML table: unknown keys refused (listing the
    known ones), values type-checked against the fields' annotations, required fields
    demanded (a TOML array becomes the tuple a ``tuple[...]`` field holds), then ``validate()``;
    every InputError is prefixed with ``where``."""
    if not isinstance(table, dict):
        raise InputError(f"{where}: expected a table {{ key = value, ... }}, got {table!r}")
    known = [f for f in fields(options_type) if f.name not in exclude]
    names = [f.name for f in known]
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r}; known keys: {', '.join(names)}")
    table = dict(table)
    for f in known:
        if f.name in table:
            _check_type(where, f.name, table[f.name], f.type)
            if str(f.type).startswith("tuple[") and isinstance(table[f.name], list):
                table[f.name] = tuple(table[f.name])
        elif f.default is MISSING and f.default_factory is MISSING:
            raise InputError(f"{where}: missing key {f.name!r}")
    opts = options_type(**table)
    try:
        opts.validate()
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return opts


# --------------------------------------------------------------------------------------------
# The job file

def _load(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: job file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the job file ({e})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:  # the message carries "(at line L, column C)"
        raise InputError(f"{path}: not valid TOML: {e}") from None


def _list_of(where: str, key: str, value: Any, kind: type | tuple[type, ...], what: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
        raise InputError(f"{where}: {key} = {value!r}: expected a list of {what}")
    return value


def _bool(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where}: {key} = {value!r}: expected true or false")
    return value


def _exl2_label(bpw: float) -> str:
    return f"{float(bpw)}"


def _model(entry: Any, index: int, defaults: dict, base: Path, file: Path,
           device: str | None) -> ModelJob:
    where0 = f"{file}: model[{index}]"
    if not isinstance(entry, dict):
        raise InputError(f"{where0}: expected a table ([[model]])")
    unknown = sorted(set(entry) - set(MODEL_KEYS))
    if unknown:
        raise InputError(f"{where0}: unknown key {unknown[0]!r}; known keys: {', '.join(MODEL_KEYS)}")
    if "source" not in entry:
        raise InputError(f"{where0}: missing key 'source' (the Hugging Face model directory)")
    e = {**defaults, **entry}
    if "calib" in defaults and "calib" in entry and isinstance(entry["calib"], dict) \
            and isinstance(defaults["calib"], dict):
        e["calib"] = {**defaults["calib"], **entry["calib"]}
    src = e["source"]
    if not isinstance(src, str) or not src:
        raise InputError(f"{where0}: source = {src!r}: expected a path")
    source = Path(src).expanduser()
    if not source.is_absolute():
        source = (base / source).resolve()
    if not source.is_dir() or not (source / "config.json").is_file():
        raise InputError(f"{where0}: source {source}: not a Hugging Face model directory "
                         f"(no config.json)")
    name = e.get("name", source.name)
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise InputError(f"{where0}: name = {name!r}: expected a file-name prefix without '/'")
    where = f"{file}: model[{index}] ({name})"

    comp = {k: e[k] for k in ("device", "dtype", "batch_tokens") if k in e}
    if device is not None:
        comp["device"] = device
    compute = build_options(ComputeOptions, comp, where)
    calib_t = e.get("calib", {})
    if not isinstance(calib_t, dict):
        raise InputError(f"{where}: calib = {calib_t!r}: expected a table such as "
                         f"{{ samples = 128, seqlen = 512 }}")
    calib = build_options(CalibOptions, calib_t, f"{where}: calib")
    if calib.calib is not None and not Path(calib.calib).is_absolute() and (base / calib.calib).exists():
        calib = replace(calib, calib=str((base / calib.calib).resolve()))

    job = ModelJob(index, name, source, compute, calib)
    out = job.outputs
    gguf = [_gguf_options(t, f"{where}: gguf[{i}]", base)
            for i, t in enumerate(_list_of(where, "gguf", e.get("gguf", []), (str, dict),
                                           "policy names or tables of hf-to-gguf options"))]
    for o in gguf:
        out.append(OutputJob("gguf", o.policy, f"{name}-{o.policy}.gguf", o))
    weighted = any(o.imatrix == BATCH_IMATRIX for o in gguf)
    if _bool(where, "imatrix", e.get("imatrix", weighted)) or weighted:
        out.append(OutputJob("imatrix", "imatrix", f"{name}.imatrix.gguf", ImatrixOptions()))
    for i, t in enumerate(_list_of(where, "awq", e.get("awq", []), dict, "tables")):
        o = build_options(AWQOptions, t, f"{where}: awq[{i}]")
        label = o.label + ("-rtn" if o.rtn else "")
        out.append(OutputJob("awq", label, f"{name}-AWQ-{label}", o))
    for i, t in enumerate(_list_of(where, "gptq", e.get("gptq", []), dict, "tables")):
        o = build_options(GPTQOptions, t, f"{where}: gptq[{i}]")
        label = o.label + ("-rtn" if o.rtn else "")
        out.append(OutputJob("gptq", label, f"{name}-GPTQ-{label}", o))
    for i, t in enumerate(_list_of(where, "fp8", e.get("fp8", []), dict, "tables")):
        o = build_options(FP8Options, t, f"{where}: fp8[{i}]")
        out.append(OutputJob("fp8", o.scheme, f"{name}-{o.label}", o))
    exl2 = _list_of(where, "exl2", e.get("exl2", []), dict, "tables")
    reuse = e.get("exl2_measurement")
    if reuse is not None:
        if not isinstance(reuse, str) or not exl2:
            raise InputError(f"{where}: exl2_measurement = {reuse!r}: expected the path of a "
                             f"measurement.json, with exl2 targets to use it")
        reuse = Path(reuse).expanduser()
        reuse = str(reuse if reuse.is_absolute() else (base / reuse).resolve())
        if not Path(reuse).is_file():
            raise InputError(f"{where}: exl2_measurement {reuse}: no such file")
    elif exl2:
        out.append(OutputJob("measurement", "exl2", MEASUREMENT_FILE, EXL2MeasurementOptions()))
    for i, t in enumerate(exl2):
        o = build_options(EXL2Options, t, f"{where}: exl2[{i}]", exclude=("measurement",))
        if reuse is not None:
            o = replace(o, measurement=reuse)
        label = _exl2_label(o.bpw)
        out.append(OutputJob("exl2", label, f"{name}-EXL2-{label}bpw", o))
    ev = e.get("eval", False)
    if isinstance(ev, dict):
        job.eval = build_options(EvalOptions, ev, f"{where}: eval")
        if job.eval.text is not None and not Path(job.eval.text).is_absolute():
            job.eval = replace(job.eval, text=str((base / job.eval.text).resolve()))
    elif _bool(where, "eval", ev):
        job.eval = EvalOptions()
    if not out:
        raise InputError(f"{where}: no outputs (give gguf, imatrix, awq, gptq, fp8 or exl2)")
    seen: dict[str, int] = {}
    for o in out:
        if o.path in seen:
            raise InputError(f"{where}: two entries write the same output {name}/{o.path}")
        seen[o.path] = 1
    return job


def _gguf_options(item: str | dict, where: str, base: Path) -> GGUFOptions:
    """One entry of ``gguf``: a policy name, or a table of ``convert hf-to-gguf``'s options
    where ``imatrix`` is true (the model's own imatrix, :data:`BATCH_IMATRIX`), false, or the
    path of an imatrix file (relative: to the job file)."""
    table = {"policy": item} if isinstance(item, str) else dict(item)
    im = table.get("imatrix")
    if isinstance(im, bool):
        if im:
            table["imatrix"] = BATCH_IMATRIX
        else:
            del table["imatrix"]
    elif isinstance(im, str):
        f = Path(im).expanduser()
        f = f if f.is_absolute() else (base / f).resolve()
        if im == BATCH_IMATRIX or not f.is_file():
            raise InputError(f"{where}: imatrix = {im!r}: expected true (this model's imatrix) or "
                             f"the path of an imatrix file")
        table["imatrix"] = str(f)
    return build_options(GGUFOptions, table, where)


def read_jobs(path: str | Path, out_root: str | Path, device: str | None = None) -> list[ModelJob]:
    """Read and check a job file: the :class:`ModelJob` list, nothing written.

    ``out_root``: where outputs go (``OUT_ROOT/<name>/``); it must be a directory or not exist
    yet. ``device``: overrides every entry's ``device`` (``--device``). Raises InputError
    naming the file, the model entry and the key for: a file that is not TOML (line and
    column), an unknown or missing key (listing the known ones), a wrong type, a source that is
    no model directory, an option the single verb refuses (its message), two entries writing
    the same output path, an OUT_ROOT that is a file."""
    path = Path(path)
    out_root = Path(out_root)
    if out_root.exists() and not out_root.is_dir():
        raise InputError(f"{out_root}: OUT_ROOT is a file, expected a directory")
    doc = _load(path)
    unknown = sorted(set(doc) - {"defaults", "model"})
    if unknown:
        raise InputError(f"{path}: unknown top-level key {unknown[0]!r}; known: defaults, model")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise InputError(f"{path}: defaults must be a table ([defaults])")
    bad = sorted(set(defaults) - set(MODEL_KEYS) | set(defaults) & {"source", "name"})
    if bad:
        raise InputError(f"{path}: [defaults]: key {bad[0]!r} not allowed; known keys: "
                         f"{', '.join(k for k in MODEL_KEYS if k not in ('source', 'name'))}")
    models = doc.get("model")
    if not isinstance(models, list) or not models:
        raise InputError(f"{path}: no [[model]] entries")
    base = path.resolve().parent
    jobs = [_model(m, i, defaults, base, path, device) for i, m in enumerate(models)]
    names: dict[str, int] = {}
    for j in jobs:
        if j.name in names:
            raise InputError(f"{path}: model[{names[j.name]}] and model[{j.index}] both write "
                             f"{out_root / j.name} (give one of them another name)")
        names[j.name] = j.index
    return jobs


def estimate(job: ModelJob) -> dict:
    """Rough figures for ``--dry-run``, from the safetensors headers and config.json (no
    weight is read): ``bytes`` on disk per output path, ``disk`` their sum, and the working
    memory of each stage the batch will run (``stages``, bytes above what the libraries
    themselves take), with ``peak_memory`` and ``peak_stage`` its largest. In bytes, float32
    (the compute dtype on CPU), with E = vocab × hidden × 4 (the embedding / head), W = one
    decoder layer, X = calibration tokens × hidden × 4, f the MLP width:

    * ``gguf``: the largest tensor in float32, its quantized bytes per policy, and the round
      trip's float32 chunks (``convert.gguf_roundtrip.VERIFY_CHUNK_ELEMENTS``, four copies);
    * ``calibration pass``: the streaming engine, max(E + X, W + 2X + A) with A one forward
      batch's temporaries, plus its consumers' working sets, added when
      :func:`~quantpress.calibration.engine.side_by_side_threads` runs them side by side (this
      process's threads decide, as they will for the run), else the largest: an AWQ
      search holds a fake-quantized copy of the layer and its linears' inputs (W + 4X); the
      EXL2 measurement the layer's four Hessians, and per module (two side by side) one
      candidate's forward and one batched GPTQ call
      (``calibration.exl2_measure.GPTQ_BATCH_BYTES``);
    * ``EXL2 passes`` and ``EXL2 head``: :func:`quantpress.targets.exl2.pass_memory` (6X + 3W
      per pass; 3.75E per head), times the passes run side by side; ``GPTQ pass``: its layer
      part, one pass at a time;
    * ``evaluation``: the larger of its two phases: the forward over all chunks (one layer,
      the chunks' hidden states twice, one batch's temporaries, the base's kept last hidden
      states and cached head) and the logits (both heads, about ten float32 arrays of one
      logits batch, ``targets.eval.LOGITS_BUDGET``, counting its float64 copy as two, and
      both models' kept hidden states)."""
    from quantpress.calibration.engine import SafetensorsDir, side_by_side_threads
    from quantpress.calibration.exl2_measure import GPTQ_BATCH_BYTES
    from quantpress.convert import gguf_arch, gguf_policy
    from quantpress.convert.gguf_roundtrip import VERIFY_CHUNK_ELEMENTS
    from quantpress.quantize import ggml
    from quantpress.devices import pick_device, rows_per_batch
    from quantpress.targets.eval import LOGITS_BUDGET
    from quantpress.targets.exl2 import pass_memory

    st = SafetensorsDir(job.source)
    shapes = {k: tuple(st.shape(k)) for k in st.keys()}
    st.close()
    cfg = gguf_arch.load_hf_config(job.source)
    L = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    ffn = int(cfg.get("intermediate_size") or 4 * hidden)
    vocab = int(cfg.get("vocab_size") or 0)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    numel = {k: math.prod(s) for k, s in shapes.items()}
    total = sum(numel.values())
    layer = 4 * sum(numel[k] for k in shapes if ".layers.0." in k)
    linear = sum(numel[k] for k in shapes if ".layers." in k and k.endswith("proj.weight"))
    emb = 4 * vocab * hidden
    rows, seqlen = job.calib.samples, job.calib.seqlen
    tokens = rows * seqlen
    batch = min(rows, rows_per_batch(job.compute.batch_tokens, seqlen)) * seqlen
    acts = 4 * batch * (3 * ffn + 4 * hidden)

    sizes: dict[str, int] = {}
    stages: dict[str, int] = {}
    consumers: list[int] = []
    exl2 = 0
    gguf_out = 0
    for o in job.outputs:
        if o.kind == "gguf":
            try:
                arch = gguf_arch.gguf_arch(cfg)
                names = [(gguf_arch.gguf_tensor_name(k, arch, n_layers=L), s) for k, s in shapes.items()
                         if not gguf_arch.is_skipped_tensor(k)]
                params = gguf_policy.ModelParams(
                    arch=arch, n_layer=L, n_head=heads,
                    n_head_kv=int(cfg.get("num_key_value_heads") or heads),
                    n_expert=0, has_output=any(n == "output.weight" for n, _ in names))
                types = gguf_policy.plan_types(o.options.policy, names, params)
                row_bytes = {n: math.prod(s[:-1]) * ggml.get(types[n]).row_bytes(s[-1]) for n, s in names}
                sizes[o.path] = sum(row_bytes.values())
                gguf_out += max(row_bytes.values())
            except Exception:  # an estimate only: fall back to F16 size
                sizes[o.path] = 2 * total
                gguf_out += 2 * max(numel.values())
        elif o.kind in ("awq", "gptq"):   # packed codes + a scale and zero point per group
            g = o.options.group_size if o.options.group_size > 0 else 1 << 30  # -1: per column
            sizes[o.path] = int(linear * (o.options.bits / 8 + 2.5 / g) + 2 * (total - linear))
            if o.kind == "gptq":          # its own pass over its quantized stream, like EXL2's
                stages["GPTQ pass"] = pass_memory(tokens, hidden, layer // 4, 0)[0]
            elif not o.options.rtn:
                consumers.append(layer + 16 * tokens * hidden)
        elif o.kind == "fp8":
            sizes[o.path] = int(linear + 2 * (total - linear))
            if o.options.scheme == "static":
                consumers.append(16 * tokens * hidden)
        elif o.kind == "exl2":
            sizes[o.path] = int(linear * o.options.bpw / 8 + 2 * (total - linear))
            exl2 += 1
        elif o.kind in ("imatrix", "measurement"):
            sizes[o.path] = 8 * 7 * hidden * L if o.kind == "imatrix" else 40_000 * L
            if o.kind == "imatrix":
                consumers.append(0)
            else:
                hess = 4 * (2 * hidden * hidden + (heads * head_dim) ** 2 + ffn * ffn)
                module = 4 * min(tokens, 4096) * (4 * ffn + 4 * hidden) + GPTQ_BATCH_BYTES
                consumers.append(layer + hess + 2 * module)
    device = pick_device(job.compute.device)
    if gguf_out:
        stages["gguf"] = 4 * max(numel.values()) + gguf_out + 4 * 4 * VERIFY_CHUNK_ELEMENTS
    if consumers:
        together = side_by_side_threads(device, len(consumers)) > 1
        stream = max(emb + 4 * tokens * hidden, layer + 8 * tokens * hidden + acts)
        stages["calibration pass"] = stream + (sum(consumers) if together else max(consumers))
    if exl2:
        n = side_by_side_threads(device, exl2)
        layers, head = pass_memory(tokens, hidden, layer // 4, vocab * hidden)
        stages["EXL2 passes"], stages["EXL2 head"] = n * layers, n * head
    if job.eval is not None:
        ctx = job.eval.ctx
        scored = ctx // 2
        # all chunks of the text: the held-out split is 58,368 tokens (114 chunks of 512);
        # another text about one token per 4 bytes
        try:
            text_tokens = 58_368 if job.eval.text is None else Path(job.eval.text).stat().st_size // 4
        except OSError:
            text_tokens = 58_368
        n_chunks = job.eval.chunks or max(1, text_tokens // ctx)
        logit_rows = max(1, LOGITS_BUDGET // max(1, 4 * scored * vocab))
        logits = 4 * logit_rows * scored * vocab
        kept = 4 * n_chunks * scored * hidden      # one model's last hidden states, scored half
        eval_acts = 4 * min(n_chunks, rows_per_batch(job.compute.batch_tokens, ctx)) * ctx * (3 * ffn + 4 * hidden)
        forward = layer + 8 * n_chunks * ctx * hidden + eval_acts + kept + emb
        stages["evaluation"] = max(forward, 2 * emb + 10 * logits + 2 * kept)
    peak_stage = max(stages, key=stages.get) if stages else None
    return {"bytes": sizes, "disk": sum(sizes.values()), "stages": stages,
            "peak_memory": stages.get(peak_stage, 0), "peak_stage": peak_stage}
