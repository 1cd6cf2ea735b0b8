"""Batch job files (``quantize batch JOBS.toml``): TOML in, a validated plan out.

::

    [defaults]                 # for every model below; any key of a [[model]] but source/name
    device = "auto"
    calib = { samples = 128, seqlen = 2048 }

    [[model]]
    source = "models/Llama-3.1-8B-Instruct"    # Hugging Face directory (relative: to the job
                                               # file), or a repo id org/name read from the
                                               # local hub cache (--allow-download: fetched)
    revision = "main"                          # a repo id's branch, tag or commit (default main)
    name = "Llama-3.1-8B-Instruct"             # output prefix; default: the directory's (the
                                               # repo's) name
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from quantpress.convert.sources import resolve_model
from quantpress.errors import InputError
from quantpress.targets import CalibOptions, ComputeOptions
from quantpress.targets import registry
from quantpress.targets.base import target_for
from quantpress.targets.eval import EvalOptions
from quantpress.targets.options import from_table

#: keys of a [[model]] entry besides the output kinds' (not in [defaults])
COMMON_KEYS = ("source", "name", "revision")
TAIL_KEYS = ("eval", "device", "dtype", "batch_tokens", "calib")
#: keys of the calib table → CalibOptions fields
CALIB_KEYS = ("calib", "calib_field", "samples", "seqlen", "seed")


def output_kinds() -> list[type]:
    """The target classes a job file may name (a ``job_key``), in job-file order."""
    return [c for c in registry.registered() if c.job_key]


def model_keys() -> tuple[str, ...]:
    """Every key of a [[model]] entry (and of [defaults], but for source, name and revision):
    source, name, revision, each output kind's key (and the key naming a file it may reuse),
    then the evaluation, compute and calibration keys."""
    kinds = []
    for c in output_kinds():
        kinds.append(c.job_key)
        if c.needs is not None and c.needs.reuse_key:
            kinds.append(c.needs.reuse_key)
    return (*COMMON_KEYS, *kinds, *TAIL_KEYS)


@dataclass(frozen=True)
class OutputJob:
    """One output of a model: ``kind`` (its target's, :attr:`Target.kind`), ``target``
    (Q4_K_M, w4g128, 4.0, ...), ``path`` relative to the model's output directory and the
    single verb's ``options`` dataclass."""

    kind: str
    target: str
    path: str
    options: Any

    @property
    def maker(self) -> type:
        """The target class that makes it."""
        return target_for(self.options)

    @property
    def needs(self):
        """The :class:`~quantpress.targets.registry.Needs` of another output of the model that
        this output waits for (None: it waits for none)."""
        n = self.maker.needs
        return n if n is not None and n.when(self.options) else None


@dataclass
class ModelJob:
    """One [[model]] entry: ``index`` in the file, output prefix ``name``, ``source`` HF
    directory (for a repo id its cached snapshot), compute and calibration options, the
    ``outputs`` in the order they are made, ``eval`` (None: no evaluation), and for a repo-id
    source its ``repo_id`` and the ``revision`` asked for (None: the default branch)."""

    index: int
    name: str
    source: Path
    compute: ComputeOptions
    calib: CalibOptions
    outputs: list[OutputJob] = field(default_factory=list)
    eval: EvalOptions | None = None
    repo_id: str | None = None
    revision: str | None = None

    @property
    def where(self) -> str:
        """``model[i] (name)``, for messages."""
        return f"model[{self.index}] ({self.name})"


# --------------------------------------------------------------------------------------------
# Typed tables → options dataclasses

def build_options(options_type: type, table: Any, where: str, exclude: tuple[str, ...] = ()) -> Any:
    """``options_type`` from a TOML table (:func:`quantpress.targets.options.from_table`:
    unknown keys refused listing the declared ones, types checked, ``validate()``), every
    InputError prefixed with ``where``."""
    return from_table(options_type, table, where, exclude)


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


def _bool(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{where}: {key} = {value!r}: expected true or false")
    return value


def _output(cls: type, name: str, options: Any) -> OutputJob:
    return OutputJob(cls.kind, cls.job_target(options), cls.job_path(name, options), options)


def _outputs(e: dict, name: str, where: str, base: Path) -> list[OutputJob]:
    """The outputs of one entry, from each output kind's key (:meth:`Target.job_entries`),
    with the outputs they need (:class:`~quantpress.targets.registry.Needs`): the provider's
    output added when the entry does not ask for it, or the file the entry's reuse key names
    set to them instead; in job-file order."""
    chosen: list[tuple[type, Any]] = []
    for cls in output_kinds():
        if cls.job_key in e:
            chosen += [(cls, o) for o in cls.job_entries(e[cls.job_key], where, base)]
    for cls in output_kinds() + [c for c in registry.registered() if not c.job_key]:
        n = cls.needs
        if n is None:
            continue
        mine = [(i, o) for i, (c, o) in enumerate(chosen) if c is cls]
        reuse = e.get(n.reuse_key) if n.reuse_key else None
        if reuse is not None:
            if not isinstance(reuse, str) or not mine:
                raise InputError(f"{where}: {n.reuse_key} = {reuse!r}: expected the path of "
                                 f"{n.reuse_what}, with {cls.job_key} targets to use it")
            f = Path(reuse).expanduser()
            f = f if f.is_absolute() else (base / f).resolve()
            if not f.is_file():
                raise InputError(f"{where}: {n.reuse_key} {f}: no such file")
            for i, o in mine:
                chosen[i] = (cls, replace(o, **{n.option: str(f)}))
        elif any(n.when(o) for _, o in mine) and not any(type(o) is n.provider for _, o in chosen):
            chosen.append((target_for_type(n.provider), n.provider()))
    chosen.sort(key=lambda co: co[0].job_order)
    return [_output(c, name, o) for c, o in chosen]


def target_for_type(options_type: type) -> type:
    """The target class registered for ``options_type``."""
    from quantpress.targets.target import TARGETS

    return TARGETS[options_type]


def _model(entry: Any, index: int, defaults: dict, base: Path, file: Path,
           device: str | None, allow_download: bool = False) -> ModelJob:
    where0 = f"{file}: model[{index}]"
    keys = model_keys()
    if not isinstance(entry, dict):
        raise InputError(f"{where0}: expected a table ([[model]])")
    unknown = sorted(set(entry) - set(keys))
    if unknown:
        raise InputError(f"{where0}: unknown key {unknown[0]!r}; known keys: {', '.join(keys)}")
    if "source" not in entry:
        raise InputError(f"{where0}: missing key 'source' (the Hugging Face model directory "
                         f"or repo id)")
    e = {**defaults, **entry}
    if "calib" in defaults and "calib" in entry and isinstance(entry["calib"], dict) \
            and isinstance(defaults["calib"], dict):
        e["calib"] = {**defaults["calib"], **entry["calib"]}
    src = e["source"]
    if not isinstance(src, str) or not src:
        raise InputError(f"{where0}: source = {src!r}: expected a path or a repo id")
    revision = e.get("revision")
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise InputError(f"{where0}: revision = {revision!r}: expected a branch, tag or commit")
    try:
        resolved = resolve_model(src, revision, allow_download=allow_download, base=base)
    except InputError as err:
        raise InputError(f"{where0}: source {err}") from None
    source = resolved.path
    if not source.is_dir() or not (source / "config.json").is_file():
        raise InputError(f"{where0}: source {source}: not a Hugging Face model directory "
                         f"(no config.json)")
    name = e.get("name", resolved.name)
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

    job = ModelJob(index, name, source, compute, calib, _outputs(e, name, where, base),
                   repo_id=resolved.repo_id, revision=resolved.revision)
    ev = e.get("eval", False)
    if isinstance(ev, dict):
        job.eval = build_options(EvalOptions, ev, f"{where}: eval")
        if job.eval.text is not None and not Path(job.eval.text).is_absolute():
            job.eval = replace(job.eval, text=str((base / job.eval.text).resolve()))
    elif _bool(where, "eval", ev):
        job.eval = EvalOptions()
    if not job.outputs:
        kinds = [c.job_key for c in output_kinds()]
        raise InputError(f"{where}: no outputs (give {', '.join(kinds[:-1])} or {kinds[-1]})")
    seen: dict[str, int] = {}
    for o in job.outputs:
        if o.path in seen:
            raise InputError(f"{where}: two entries write the same output {name}/{o.path}")
        seen[o.path] = 1
    return job


def read_jobs(path: str | Path, out_root: str | Path, device: str | None = None,
              allow_download: bool = False) -> list[ModelJob]:
    """Read and check a job file: the :class:`ModelJob` list, nothing written.

    ``out_root``: where outputs go (``OUT_ROOT/<name>/``); it must be a directory or not exist
    yet. ``device``: overrides every entry's ``device`` (``--device``). ``allow_download``: a
    repo-id source missing from the hub cache is downloaded (``--allow-download``;
    :func:`quantpress.convert.sources.resolve_model`). Raises InputError
    naming the file, the model entry and the key for: a file that is not TOML (line and
    column), an unknown or missing key (listing the known ones), a wrong type, a source that is
    no model directory (or a repo id not in the cache), an option the single verb refuses (its
    message), two entries writing the same output path, an OUT_ROOT that is a file."""
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
    keys = model_keys()
    bad = sorted(set(defaults) - set(keys) | set(defaults) & set(COMMON_KEYS))
    if bad:
        raise InputError(f"{path}: [defaults]: key {bad[0]!r} not allowed; known keys: "
                         f"{', '.join(k for k in keys if k not in COMMON_KEYS)}")
    models = doc.get("model")
    if not isinstance(models, list) or not models:
        raise InputError(f"{path}: no [[model]] entries")
    base = path.resolve().parent
    jobs = [_model(m, i, defaults, base, path, device, allow_download) for i, m in enumerate(models)]
    names: dict[str, int] = {}
    for j in jobs:
        if j.name in names:
            raise InputError(f"{path}: model[{names[j.name]}] and model[{j.index}] both write "
                             f"{out_root / j.name} (give one of them another name)")
        names[j.name] = j.index
    return jobs


def model_info(job: ModelJob) -> registry.ModelInfo:
    """The :class:`~quantpress.targets.registry.ModelInfo` of ``job``'s source, from the
    safetensors headers and config.json (no weight is read)."""
    from quantpress.calibration.engine import SafetensorsDir
    from quantpress.convert.gguf_arch import load_hf_config
    from quantpress.devices import pick_device

    st = SafetensorsDir(job.source)
    shapes = {k: tuple(st.shape(k)) for k in st.keys()}
    st.close()
    cfg = load_hf_config(job.source)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    numel = {k: math.prod(s) for k, s in shapes.items()}
    vocab = int(cfg.get("vocab_size") or 0)
    return registry.ModelInfo(
        shapes=shapes, numel=numel, cfg=cfg, layers=int(cfg["num_hidden_layers"]), hidden=hidden,
        ffn=int(cfg.get("intermediate_size") or 4 * hidden), vocab=vocab, heads=heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        layer=4 * sum(numel[k] for k in shapes if ".layers.0." in k),
        emb=4 * vocab * hidden,
        linear=sum(numel[k] for k in shapes if ".layers." in k and k.endswith("proj.weight")),
        total=sum(numel.values()), tokens=job.calib.samples * job.calib.seqlen,
        device=pick_device(job.compute.device))


def estimate(job: ModelJob) -> dict:
    """Rough figures for ``--dry-run``, from the safetensors headers and config.json (no
    weight is read): ``bytes`` on disk per output path, ``disk`` their sum, and the working
    memory of each stage the batch will run (``stages``, bytes above what the libraries
    themselves take), with ``peak_memory`` and ``peak_stage`` its largest. In bytes, float32
    (the compute dtype on CPU), with E = vocab × hidden × 4 (the embedding / head), W = one
    decoder layer, X = calibration tokens × hidden × 4, f the MLP width:

    * each output kind's own sizes and stages: :meth:`Target.estimate` (the per-kind figures
      are documented there);
    * ``calibration pass``: the streaming engine, max(E + X, W + 2X + A) with A one forward
      batch's temporaries, plus the working sets of the consumers the kinds put on it, added
      when :func:`~quantpress.calibration.engine.side_by_side_threads` runs them side by side
      (this process's threads decide, as they will for the run), else the largest;
    * ``evaluation``: the larger of its two phases: the forward over all chunks (one layer,
      the chunks' hidden states twice, one batch's temporaries, the base's kept last hidden
      states and cached head) and the logits (both heads, about ten float32 arrays of one
      logits batch, ``targets.eval.LOGITS_BUDGET``, counting its float64 copy as two, and
      both models' kept hidden states)."""
    from quantpress.calibration.engine import side_by_side_threads
    from quantpress.devices import rows_per_batch
    from quantpress.targets.eval import LOGITS_BUDGET

    info = model_info(job)
    hidden, ffn, vocab, layer, emb = info.hidden, info.ffn, info.vocab, info.layer, info.emb
    rows, seqlen = job.calib.samples, job.calib.seqlen
    tokens = info.tokens
    batch = min(rows, rows_per_batch(job.compute.batch_tokens, seqlen)) * seqlen
    acts = 4 * batch * (3 * ffn + 4 * hidden)

    sizes: dict[str, int] = {}
    stages: dict[str, int] = {}
    consumers: list[int] = []
    by_kind: dict[type, list[OutputJob]] = {}
    for o in job.outputs:
        by_kind.setdefault(o.maker, []).append(o)
    for cls, outs in by_kind.items():
        est = cls.estimate(info, [o.options for o in outs])
        sizes.update({o.path: n for o, n in zip(outs, est.sizes)})
        for k, v in est.stages.items():
            stages[k] = max(stages.get(k, 0), v)
        consumers += est.consumers
    sizes = {o.path: sizes[o.path] for o in job.outputs}
    if consumers:
        together = side_by_side_threads(info.device, len(consumers)) > 1
        stream = max(emb + 4 * tokens * hidden, layer + 8 * tokens * hidden + acts)
        stages["calibration pass"] = stream + (sum(consumers) if together else max(consumers))
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
