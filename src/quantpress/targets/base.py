"""The output skeleton every format shares: options, the source model, stages, the summary,
and the runner that turns a declared target into a verified output.

An output kind is a :class:`Target` subclass declared for its options dataclass
(``class GGUFTarget(Target, kind="gguf", options=GGUFOptions)``), and the runner picks the
target by the options' type, as torchao's ``quantize_(model, config)`` dispatches on the
config's type:

- ``options_type``: a frozen dataclass of the kind's own options, with ``validate()`` raising
  InputError that names the option (the CLI verbs and, later, batch job files build it);
- :meth:`Target.prepare`: every check against the model, before anything is written;
- :meth:`Target.write`: produce the output at a temporary path;
- :meth:`Target.verify`: the round trip, re-reading what :meth:`write` left there (raises
  :class:`quantpress.errors.RoundTripError`);
- :meth:`Target.summary`: a :class:`Summary`, one shape for every kind (text and JSON).

:func:`produce` owns what no target repeats: refusing an existing output without ``force``
(and a missing or unwritable output directory), the temporary sibling path (a file, or a
directory), the round trip, the atomic rename, the timings per stage, progress bars, and
leaving nothing behind on any error. Options shared by every calibrated output of one model
(:class:`CalibOptions`, :class:`ComputeOptions`) belong to the :class:`Source`, which computes
the calibration rows once for all the targets that use it.
"""
from __future__ import annotations

import abc
import contextlib
import copy
import json
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator

import torch

from quantpress import assets
from quantpress.calibration import data as cdata
from quantpress.calibration import engine
from quantpress.calibration.checkpoint import LayerCheckpoint, code_digest
from quantpress.convert import loaders
from quantpress.errors import InputError
from quantpress.devices import DEFAULT_BATCH_TOKENS, check_device, pick_device, pick_dtype, rows_per_batch
from quantpress.memory import trim_heap


# --------------------------------------------------------------------------------------------
# Options shared by the outputs of one model

def _need_int(option: str, value: Any, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InputError(f"{option} {value!r}: expected an integer >= {low}")


@dataclass(frozen=True)
class CalibOptions:
    """Calibration text and rows (``--calib``, ``--calib-field``, ``--samples``, ``--seqlen``,
    ``--seed``): ``samples`` windows of ``seqlen`` tokens drawn with ``seed`` from ``calib`` (a
    .txt/.utf8/.md file, .json/.jsonl/.parquet with the text in column ``calib_field``, a
    folder of such files, or a ``datasets`` name; None: the calibration split of exllamav2's
    wiki.utf8, :func:`quantpress.calibration.data.calibration_articles`)."""

    calib: str | None = None
    calib_field: str = "text"
    samples: int = 128
    seqlen: int = 512
    seed: int = 0

    def validate(self) -> None:
        """InputError naming the option when a count is not a positive integer."""
        _need_int("--samples", self.samples)
        _need_int("--seqlen", self.seqlen)
        _need_int("--seed", self.seed, 0)
        if not isinstance(self.calib_field, str) or not self.calib_field:
            raise InputError(f"--calib-field {self.calib_field!r}: expected a column name")


@dataclass(frozen=True)
class ComputeOptions:
    """Where and how forward passes run (``--device``, ``--dtype``, ``--batch-tokens``):
    ``device`` auto (CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N; ``dtype``
    float32 (None: float32), float16 or bfloat16; ``batch_tokens`` tokens per forward batch."""

    device: str = "auto"
    dtype: str | None = None
    batch_tokens: int = DEFAULT_BATCH_TOKENS

    def validate(self) -> None:
        """InputError naming the option for a bad device (or CUDA on a machine without it), an
        unknown dtype or a non-positive batch size."""
        check_device(self.device)
        pick_dtype(self.dtype)
        rows_per_batch(self.batch_tokens, 1)


# --------------------------------------------------------------------------------------------
# The source model

class Source:
    """One input model and what all of its outputs share: the loader chosen by what the path
    is (:mod:`quantpress.convert.loaders`), its config, the compute device and dtype, and the
    calibration rows (tokenized once, whatever number of targets use them).

    ``path``: HF directory or GGUF file. ``compute`` / ``calib``: :class:`ComputeOptions` /
    :class:`CalibOptions` (validated here: InputError naming the option). ``cal_dir``:
    exllamav2's ``standard_cal_data`` directory for the default text (None: fetched into the
    cache by :func:`quantpress.assets.standard_cal_data` when first needed)."""

    def __init__(self, path: str | Path, compute: ComputeOptions | None = None,
                 calib: CalibOptions | None = None, progress: bool = True,
                 cal_dir: str | Path | None = None):
        self.path = Path(path)
        self.compute = compute or ComputeOptions()
        self.calib = calib or CalibOptions()
        self.compute.validate()
        self.calib.validate()
        self.progress = progress
        self._cal_dir = None if cal_dir is None else Path(cal_dir)
        self._loader: loaders.Loader | None = None
        self._config: dict | None = None
        self._rows: tuple[torch.Tensor, str] | None = None

    # ---- what the path is ------------------------------------------------------------------

    @property
    def loader(self) -> loaders.Loader:
        """The loader for the path (InputError when none applies)."""
        if self._loader is None:
            self._loader = loaders.find_loader(self.path)
        return self._loader

    @property
    def kind(self) -> str:
        """``hf``, ``gguf``, ``awq`` or ``exl2``."""
        return self.loader.kind

    def require_hf(self, what: str) -> None:
        """InputError unless the source is an unquantized Hugging Face directory; ``what``
        names the output kind that needs it."""
        if self.kind != "hf":
            raise InputError(f"{self.path}: {what} needs a Hugging Face model directory "
                             f"(FP16/BF16/F32 safetensors), not a {self.kind} input")

    @property
    def config(self) -> dict:
        """The HF config dict (config.json, without a quantization block)."""
        if self._config is None:
            self._config = self.loader.hf_config(self.path)
        return self._config

    # ---- compute ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """The compute device."""
        return pick_device(self.compute.device)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return pick_dtype(self.compute.dtype)

    def streaming_model(self, base_config: dict | None = None) -> engine.StreamingModel:
        """A new :class:`~quantpress.calibration.engine.StreamingModel` over the source on the
        compute device and dtype (skeleton only; layers are read when the engine reaches them)."""
        return self.loader.open(self.path, self.device, self.dtype, base_config)

    def batch_rows(self, seqlen: int) -> int:
        """Rows of ``seqlen`` tokens per forward batch (``--batch-tokens``)."""
        return rows_per_batch(self.compute.batch_tokens, seqlen)

    def parameter_count(self) -> int:
        """Elements over every tensor of an HF source checkpoint (headers only)."""
        self.require_hf("counting parameters")
        return engine.SafetensorsDir(self.path).parameter_count()

    # ---- calibration -----------------------------------------------------------------------

    def cal_dir(self) -> Path:
        """exllamav2's ``standard_cal_data`` directory (the default text), fetched into the
        cache the first time. InputError when it cannot be fetched (offline)."""
        if self._cal_dir is None:
            self._cal_dir = default_cal_dir()
        return self._cal_dir

    def calibration_rows(self) -> tuple[torch.Tensor, str]:
        """Calibration token rows int64 [samples, seqlen] and a description of the text,
        computed once (:func:`calibration_rows`)."""
        if self._rows is None:
            self._rows = calibration_rows(self.path, self.calib, self.progress, self._cal_dir)
        return self._rows


def default_cal_dir() -> Path:
    """exllamav2 0.3.2's ``standard_cal_data`` directory (:func:`quantpress.assets.standard_cal_data`),
    fetched with pip into the cache the first time. Raises InputError when that fails
    (offline and not cached), suggesting ``--calib`` / ``--text``."""
    try:
        return assets.standard_cal_data()
    except Exception as e:  # pip unavailable, offline, no such version
        raise InputError(f"cannot fetch exllamav2's calibration data into {assets.cache_root()} "
                         f"({type(e).__name__}); pass --calib FILE (or --text FILE)") from None


def calibration_rows(model: str | Path, calib: CalibOptions | None = None, progress: bool = True,
                     cal_dir: str | Path | None = None) -> tuple[torch.Tensor, str]:
    """Calibration token rows for ``model``: int64 [samples, seqlen] and a description of the
    text. ``calib.calib``: a text/JSON(L)/Parquet file or folder or dataset name
    (:func:`quantpress.calibration.data.load_texts`; ``calib_field`` its text column); None:
    the calibration split of exllamav2's wiki.utf8 (articles 0–1799) from ``cal_dir`` (None:
    :func:`default_cal_dir`). Rows are fixed-seed windows
    (:func:`quantpress.calibration.data.token_rows`); when the model adds a BOS (llama.cpp
    ``add_bos``), the first token of each row is BOS, as llama-imatrix does for each chunk.
    Raises InputError for bad files, unknown columns and too little text."""
    calib = calib or CalibOptions()
    calib.validate()
    p = Path(model)
    ld = loaders.find_loader(p)
    if calib.calib is None:
        texts = cdata.calibration_articles(cal_dir or default_cal_dir())
        source = "exllamav2-0.3.2 standard_cal_data/wiki.utf8 (articles 0-1799)"
    else:
        texts = cdata.load_texts_quietly(calib.calib, field=calib.calib_field, progress=progress)
        source = str(calib.calib)
    tok = ld.tokenizer(p)
    add_bos = ld.add_bos(p, tok)
    try:
        rows = cdata.token_rows(tok, texts, calib.samples, calib.seqlen, seed=calib.seed)
    except InputError as e:
        if "no EOS or BOS" in str(e):
            raise InputError(f"{p}: {e}") from None
        raise
    if add_bos:
        rows[:, 0] = tok.bos_token_id
    return rows, source


# --------------------------------------------------------------------------------------------
# Stages

#: called with (stage name, "start" | "end") around every stage of every run: the benchmark
#: scripts measure memory per stage through it
STAGE_OBSERVERS: list[Callable[[str, str], None]] = []


class Run:
    """Timings per stage (seconds, in order) and progress bars of one output."""

    def __init__(self, progress: bool = True):
        self.progress = progress
        self.stages: dict[str, float] = {}
        self._depth = 0

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` (added to an earlier stage of that name). Stages
        may nest; observers see only the outermost."""
        outer = self._depth == 0
        if outer:
            for f in STAGE_OBSERVERS:
                f(name, "start")
        self._depth += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t0
            self._depth -= 1
            if outer:
                for f in STAGE_OBSERVERS:
                    f(name, "end")

    def split(self, name: str, parts: dict[str, float]) -> None:
        """Replace stage ``name`` by ``parts`` (seconds; what remains of ``name`` after them
        goes to the first part), keeping the order of the stages."""
        total = self.stages.get(name, 0.0)
        first, *rest = parts
        rem = max(0.0, total - sum(parts[k] for k in rest))
        new = {}
        for k, v in self.stages.items():
            if k == name:
                new[first] = rem
                for r in rest:
                    new[r] = parts[r]
            else:
                new[k] = v
        self.stages = new

    def bar(self, iterable: Iterable, desc: str, unit: str = "it", total: int | None = None):
        """A tqdm bar over ``iterable`` (none when progress is off)."""
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, unit=unit, total=total, disable=not self.progress, leave=False)


# --------------------------------------------------------------------------------------------
# The summary

@dataclass
class Summary:
    """What one output is, in one shape for every kind.

    ``kind``: gguf, awq, exl2, imatrix, measurement. ``target``: what was asked (``Q4_K_M``,
    ``w4g128``, ``4.0`` bpw, ...). ``output``: the final path. ``source``: the input model.
    ``files``: bytes per file relative to ``output`` (a single-file output: its name).
    ``tensor_bytes`` / ``parameters``: bytes of tensor data written and weights they stand for
    (``bpw`` = 8 · tensor_bytes / parameters; None when the output is no model).
    ``roundtrip``: what the round trip checked ("ok (...)"). ``seconds`` and ``stages``:
    wall time, in total and per stage. ``details``: the kind's own figures (JSON-able);
    ``lines``: the kind's own text lines."""

    kind: str
    target: str
    output: Path
    source: str
    files: dict[str, int] = field(default_factory=dict)
    tensor_bytes: int = 0
    parameters: int = 0
    roundtrip: str = ""
    seconds: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Bytes of every file of the output."""
        return sum(self.files.values())

    @property
    def bpw(self) -> float | None:
        """Bits per weight: 8 · tensor bytes / weights (None when the output is no model)."""
        return 8.0 * self.tensor_bytes / self.parameters if self.parameters else None

    def text(self) -> str:
        """Human-readable summary: what was written, the kind's lines, size, time per stage,
        the round trip."""
        st = ", ".join(f"{k} {v:.1f} s" for k, v in self.stages.items())
        size = f"{self.bytes:,} bytes ({self.bytes / 2 ** 20:.2f} MiB)"
        if len(self.files) > 1:
            size += f" in {len(self.files)} files"
        if self.bpw is not None:
            size += f", {self.bpw:.4f} bits per weight over {self.parameters:,} weights"
        return "\n".join([f"wrote      {self.output}",
                          f"{self.kind:<10} {self.target} from {self.source}",
                          *self.lines,
                          f"size       {size}",
                          f"time       {self.seconds:.1f} s ({st})",
                          f"round trip {self.roundtrip}"])

    def to_json(self) -> dict:
        """The summary as a JSON-able dict (``details`` merged under its own key)."""
        bpw = self.bpw
        return {"kind": self.kind, "target": self.target, "output": str(self.output),
                "source": self.source, "files": dict(self.files), "bytes": self.bytes,
                "tensor_bytes": self.tensor_bytes, "parameters": self.parameters,
                "bpw": None if bpw is None else round(bpw, 4), "roundtrip": self.roundtrip,
                "seconds": round(self.seconds, 2),
                "stages": {k: round(v, 2) for k, v in self.stages.items()},
                "details": self.details}


def output_files(path: Path) -> dict[str, int]:
    """Bytes per file of an output: a file → {its name: size}; a directory → every regular
    file below it by relative path, sorted."""
    path = Path(path)
    if path.is_file():
        return {path.name: path.stat().st_size}
    return {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}


# --------------------------------------------------------------------------------------------
# Targets and the runner

class Target(abc.ABC):
    """One output kind. A subclass declares itself with class keywords and is registered for
    its options type::

        class ImatrixTarget(Target, kind="imatrix", options=ImatrixOptions): ...

    (``output_is_dir=True`` for a directory output) and implements the four steps;
    ``self.source`` and ``self.options`` are the input model and the validated options."""

    kind: ClassVar[str]
    options_type: ClassVar[type]
    output_is_dir: ClassVar[bool] = False
    #: the stage name under which a shared reference pass is timed (:meth:`reference_consumer`)
    reference_stage: ClassVar[str] = "reference pass"
    #: the stage name under which :meth:`verify` is timed (a target whose round trip runs
    #: beside its writing names the stage that holds that time, so one figure shows it)
    verify_stage: ClassVar[str] = "verify"
    #: whether the target continues an interrupted temporary output in a work directory
    #: (:func:`produce_many` ``work``); the others start it afresh
    resumable: ClassVar[bool] = False
    #: set by :func:`produce_many` with ``work``: the directory, the checkpoint key, the logger
    work: Path | None = None
    work_key: dict = {}
    log: Callable[[str], None] | None = None

    def __init_subclass__(cls, *, kind: str, options: type, output_is_dir: bool = False, **kw):
        super().__init_subclass__(**kw)
        cls.kind, cls.options_type, cls.output_is_dir = kind, options, output_is_dir
        TARGETS[options] = cls

    def __init__(self, source: Source, options: Any):
        self.source = source
        self.options = options

    def prepare(self, run: Run) -> None:
        """Check everything against the model before anything is written (InputError)."""

    def wants_reference(self) -> bool:
        """Whether :meth:`reference_consumer` has a consumer for the shared reference pass."""
        return False

    def checkpoint(self, extra: dict | None = None) -> LayerCheckpoint | None:
        """The checkpoint of a pass of this target's own, ``<work>/<output name>.ckpt``, keyed
        by ``work_key`` and ``extra`` (None without a work directory)."""
        if self.work is None:
            return None
        name = self.work_key["output"]
        return LayerCheckpoint(self.work / f"{name}.ckpt", name, {**self.work_key, **(extra or {})}, self.log)

    def reference_consumer(self, tmp: Path, run: Run, resume: bool = False) -> Any:
        """For an output computed from the reference (unquantized) hidden states of the
        calibration rows: start the output at ``tmp`` and return its consumer (``hooks`` /
        ``on_layer``, :class:`quantpress.calibration.engine.FanOut`), which
        :func:`produce_many` feeds from one streamed pass shared by every such output of the
        source; :meth:`write` then finishes without a pass of its own. ``resume``: the pass
        continues a checkpoint, so an interrupted temporary output at ``tmp`` is continued
        (its consumer implements ``layer_state`` / ``restore`` / ``resumed``). Called only when
        :meth:`wants_reference`."""
        return None

    @classmethod
    def write_together(cls, targets: list["Target"], tmps: list[Path],
                       runs: list[Run]) -> list[Exception | None] | None:
        """Write several prepared targets of this kind and of one source, ``targets[i]`` at
        ``tmps[i]``, timed in ``runs[i]``. Returns, per target, the error that stopped it (its
        output alone fails), or None when all were written; raising fails them all. The
        default writes them one by one (a kind overrides it to share reads or to run side by
        side)."""
        errors: list[Exception | None] = []
        for t, tmp, r in zip(targets, tmps, runs):
            try:
                t.write(tmp, r)
            except Exception as e:
                errors.append(e)
            else:
                errors.append(None)
        return errors

    @abc.abstractmethod
    def write(self, tmp: Path, run: Run) -> None:
        """Write the whole output at ``tmp`` (a file path, or a directory to create)."""

    @abc.abstractmethod
    def verify(self, tmp: Path, run: Run) -> str:
        """Re-read ``tmp`` and check it against what :meth:`write` produced; return what was
        checked ("ok (...)"), raise :class:`quantpress.errors.RoundTripError` otherwise."""

    @abc.abstractmethod
    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        """The :class:`Summary` of the finished output at ``out``."""


#: options type → the :class:`Target` subclass that makes its outputs
TARGETS: dict[type, type[Target]] = {}


def target_for(options: Any) -> type[Target]:
    """The registered :class:`Target` class for an options object (TypeError when none)."""
    try:
        return TARGETS[type(options)]
    except KeyError:
        raise TypeError(f"no output target for options of type {type(options).__name__}") from None


def check_output(out: Path, is_dir: bool, force: bool) -> None:
    """Refuse an existing ``out`` without ``force``, a missing or unwritable parent directory,
    and a directory where a file is expected (InputError naming the path)."""
    out = Path(out)
    if out.exists() and not force:
        raise InputError(f"{out}: already exists (use --force to overwrite)")
    if out.is_dir() and not is_dir:
        raise InputError(f"{out}: is a directory, expected a file path")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{parent}: output directory does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{parent}: output directory is not writable")


def temp_path(out: Path) -> Path:
    """The hidden temporary sibling of ``out`` (with the process id) that is renamed into
    place once verified."""
    out = Path(out)
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def install(tmp: Path, out: Path) -> None:
    """Move the verified ``tmp`` to ``out`` with one rename. An existing ``out`` (allowed by
    ``--force``) is first renamed aside and removed only after the new one is in place."""
    old = None
    if out.exists() or out.is_symlink():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        _remove(old)
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        _remove(old)


@dataclass
class Outcome:
    """What became of one output of :func:`produce_many`: its ``options`` and final path
    ``out``, and either its :class:`Summary` or the ``error`` that stopped it (nothing is left
    at ``out`` then)."""

    options: Any
    out: Path
    summary: Summary | None = None
    error: Exception | None = None

    @property
    def ok(self) -> bool:
        """True when the output was written and verified."""
        return self.error is None and self.summary is not None


class _Trim:
    """The last consumer of a shared pass: gives the allocator the layer's temporaries back."""

    stateless = True
    after_all = True       # alone, once the other consumers of the layer are done
    inputs_unused = True

    def on_layer(self, *args) -> None:
        trim_heap()


def reference_pass(source: Source, consumers: list, progress: bool = True, checkpoint=None) -> None:
    """One streamed pass of the source's calibration rows through the unquantized model,
    feeding every consumer (:class:`quantpress.calibration.engine.FanOut`), in batches of
    :meth:`Source.batch_rows` rows; resumable with ``checkpoint`` (a
    :class:`quantpress.calibration.checkpoint.LayerCheckpoint`; the consumers then implement
    ``layer_state`` / ``restore``). Raises InputError on NaN/Inf hidden states."""
    rows, _ = source.calibration_rows()
    fan = engine.FanOut([*consumers, _Trim()])
    engine.run(source.streaming_model(), rows, hooks_factory=fan.hooks, on_layer=fan.on_layer,
               batch_size=source.batch_rows(rows.shape[1]), progress=progress,
               checkpoint=checkpoint, state=fan, keep_inputs=fan.keep_inputs)


def options_json(o: Any) -> dict:
    """An options dataclass's fields as JSON values (checkpoint keys, batch manifests)."""
    return json.loads(json.dumps({f.name: getattr(o, f.name) for f in fields(o)}))


class WriterShare:
    """A checkpointed pass's share of a consumer that writes each layer's tensors with a
    :class:`quantpress.convert.shards.ModelDirWriter` and keeps one record per linear
    (``records``, names starting with ``prefix`` + the layer index): per layer, that layer's
    records, the writer's parts so far and a copy of ``timed.timings``
    (:meth:`layer_state`); a resumed pass gives them back in order (:meth:`restore`) and the
    writer adopts its parts (:meth:`resumed`). ``hooks`` / ``on_layer``, when given, make it
    the consumer itself (:class:`quantpress.calibration.engine.FanOut`)."""

    def __init__(self, writer, records: list, prefix: str, timed: Any,
                 hooks: Callable | None = None, on_layer: Callable | None = None):
        self.writer, self.records, self.prefix, self.timed = writer, records, prefix, timed
        if hooks is not None:
            self.hooks = hooks
        if on_layer is not None:
            self.on_layer = on_layer
        self._parts: list = []

    def layer_state(self, index: int) -> dict:
        p = f"{self.prefix}{index}."
        return {"records": [r for r in self.records if r.name.startswith(p)],
                "parts": self.writer.state(), "timings": copy.copy(self.timed.timings)}

    def restore(self, index: int, saved: dict) -> None:
        self.records.extend(saved["records"])
        self._parts = saved["parts"]
        self.timed.timings = copy.copy(saved["timings"])

    def resumed(self, start: int) -> None:
        self.writer.adopt(self._parts)


def produce_many(items: list[tuple[Any, str | Path]], source: Source | str | Path, *,
                 force: bool = False, progress: bool = True,
                 on_done: Callable[[Outcome], None] | None = None,
                 work: str | Path | None = None, work_key: dict | None = None,
                 log: Callable[[str], None] | None = None) -> list[Outcome]:
    """Make several verified outputs of one source, sharing what they can: the runner every
    output goes through (:func:`produce` is this with one item).

    ``items``: (registered options dataclass, output path) pairs. For each: options validated,
    output path checked, :meth:`Target.prepare`. Then the outputs computed from the reference
    hidden states (:meth:`Target.wants_reference`, :meth:`Target.reference_consumer`) are fed
    by one shared streamed pass (:func:`reference_pass`, timed as each target's
    ``reference_stage``); the others are written by their kind's :meth:`Target.write_together`
    (GGUF policies from one read of each tensor). Each output is then finished
    (:meth:`Target.write`), verified (stage ``verify_stage``) and renamed into place, and ``on_done``
    is called with its :class:`Outcome`.

    ``work``: a directory for resumable work (``quantize batch``'s ``.work/``): the temporary
    outputs live there as ``<name>.partial`` and the layer-streamed passes keep checkpoints
    (:class:`quantpress.calibration.checkpoint.LayerCheckpoint`, keyed by ``work_key``, the
    outputs' options and the code digest), so that a run killed in a pass resumes at the layer
    it reached (``details["resumed_at_layer"]`` of the summaries says where); ``log`` gets the
    messages about saved work. Without ``work``, temporary siblings of the outputs.

    A failure (bad input, failed round trip, NaN activations, out of memory) fails the outputs
    it concerns (a shared stage: all of its outputs), leaves nothing of them behind and does
    not stop the others. Returns the outcomes in the order of ``items``."""
    if not isinstance(source, Source):
        source = Source(source, progress=progress)
    work = None if work is None else Path(work)
    if work is not None:
        work.mkdir(parents=True, exist_ok=True)
    key = {**(work_key or {}), "code": code_digest()} if work is not None else {}
    outcomes = [Outcome(o, Path(out)) for o, out in items]
    live: list[tuple[Outcome, Target, Run, Path, float]] = []
    tmps: list[Path] = []
    interrupted = True

    def fail(oc: Outcome, e: Exception) -> None:
        oc.error = e
        if on_done is not None:
            on_done(oc)

    try:
        for oc in outcomes:
            t0 = time.perf_counter()
            try:
                cls = target_for(oc.options)
                oc.options.validate()
                check_output(oc.out, cls.output_is_dir, force)
                run = Run(progress)
                target = cls(source, oc.options)
                if work is not None:
                    target.work = work
                    target.work_key = {**key, "output": oc.out.name, "options": options_json(oc.options)}
                    target.log = log
                target.prepare(run)
            except Exception as e:
                fail(oc, e)
                continue
            tmp = temp_path(oc.out) if work is None else work / f"{oc.out.name}.partial"
            if work is None or not cls.resumable:
                _remove(tmp)
            tmps.append(tmp)
            live.append((oc, target, run, tmp, t0))

        fed = [e for e in live if e[1].wants_reference()]
        ckpt = None
        if fed and work is not None:
            ckpt = LayerCheckpoint(work / "reference.ckpt", "reference",
                                   {**key, "outputs": [[e[0].out.name, options_json(e[0].options)] for e in fed]},
                                   log)
        first = ckpt.start()[0] if ckpt is not None else 0
        consumers = []
        for entry in fed:
            oc, target, run, tmp, _ = entry
            if not first:
                _remove(tmp)
            try:
                consumers.append(target.reference_consumer(tmp, run, resume=bool(first)))
            except Exception as e:
                fail(oc, e)
        fed = [e for e in fed if e[0].error is None]
        if fed:
            t0 = time.perf_counter()
            names = {type(e[1]).reference_stage for e in fed}
            stage = names.pop() if len(names) == 1 else Target.reference_stage
            for f in STAGE_OBSERVERS:
                f(stage, "start")
            try:
                reference_pass(source, [c for c in consumers if c is not None], progress, ckpt)
            except Exception as e:
                for oc, *_ in fed:
                    fail(oc, e)
            finally:
                for f in STAGE_OBSERVERS:
                    f(stage, "end")
            dt = time.perf_counter() - t0
            for oc, target, run, _, _ in fed:
                run.stages[type(target).reference_stage] = dt
        fed_ids = {id(e[1]) for e in fed}

        groups: dict[type, list] = {}
        for entry in live:
            if entry[0].error is None and id(entry[1]) not in fed_ids:
                groups.setdefault(type(entry[1]), []).append(entry)
        for cls, group in groups.items():
            try:
                errors = cls.write_together([e[1] for e in group], [e[3] for e in group],
                                            [e[2] for e in group])
            except Exception as e:
                errors = [e] * len(group)
            for entry, err in zip(group, errors or [None] * len(group)):
                if err is not None:
                    fail(entry[0], err)

        for oc, target, run, tmp, t0 in live:
            if oc.error is not None:
                _remove(tmp)
                continue
            try:
                if id(target) in fed_ids:
                    target.write(tmp, run)
                with run.stage(target.verify_stage):
                    roundtrip = target.verify(tmp, run)
                install(tmp, oc.out)
                if work is not None:  # the output's own pass checkpoint, kept until now
                    _remove(work / f"{oc.out.name}.ckpt")
            except Exception as e:
                _remove(tmp)
                if work is not None:  # a failed output's own checkpoint is no use
                    _remove(work / f"{oc.out.name}.ckpt")
                fail(oc, e)
                continue
            s = target.summary(oc.out, roundtrip, run)
            s.files = output_files(oc.out)
            s.stages = dict(run.stages)
            s.seconds = time.perf_counter() - t0
            if id(target) in fed_ids and ckpt is not None and ckpt.resumed_at:
                s.details["resumed_at_layer"] = ckpt.resumed_at
            elif getattr(target, "resumed_at", 0):
                s.details["resumed_at_layer"] = target.resumed_at
            oc.summary = s
            if on_done is not None:
                on_done(oc)
        if ckpt is not None:
            ckpt.remove()
        interrupted = False
    finally:
        if work is None or not interrupted:  # an interrupted batch keeps its work to resume
            for tmp in tmps:
                _remove(tmp)
    return outcomes


def produce(options: Any, source: Source | str | Path, out: str | Path, *, force: bool = False,
            progress: bool = True) -> Summary:
    """Make one verified output: :func:`produce_many` with one item.

    ``options``: a registered options dataclass (the target is chosen by its type);
    ``source``: a :class:`Source` (or a path, with default compute and calibration options);
    ``out``: the output path; ``force``: replace an existing one. Order: options validated,
    output path checked, :meth:`Target.prepare`, :meth:`Target.write` to a hidden temporary
    sibling (with the shared reference pass when the target has one), :meth:`Target.verify`
    (stage ``verify_stage``), one rename into place. Returns the :class:`Summary`. Raises InputError
    for bad input and RoundTripError when the round trip fails; on any error nothing is left
    at ``out`` or at the temporary path."""
    (oc,) = produce_many([(options, out)], source, force=force, progress=progress)
    if oc.error is not None:
        raise oc.error
    return oc.summary
