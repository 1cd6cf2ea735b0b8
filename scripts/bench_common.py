"""The set-up that the benchmark and quality scripts share (never part of quantpress): where
things are, the models they run on, the reference tools, timing and memory measurement.

- **Paths**: :data:`REPO`, :func:`use_tests` (``tests/`` on ``sys.path`` for ``synth``,
  ``refs``, ``make``, ``ggml_ref``), :func:`offline_env`.
- **Models**: :func:`add_model_arg` / :func:`model_dir` (``--model``, SmolLM2-135M-Instruct
  from quantpress's cache by default), :func:`named_model` (``smollm2``, ``synth4x`` or a
  directory), :func:`synth4x` (the cached 554M random llama), :func:`tiny_llama` (a random
  llama of a few layers, ``tests/synth.py``), :func:`truncated_model` (the first N decoder
  layers of a model).
- **Reference tools** (llama.cpp through ``scripts/llamacpp_tools.py``):
  :func:`llamacpp_convert_cmd`, :func:`llama_quantize_code`, :func:`same_tensors`.
- **Memory**: :func:`status` (``/proc/<pid>/status``), :func:`tree_pss_mib` and
  :func:`measure` (wall time, peak RSS and the peak PSS of a command's process tree),
  :class:`PeakSampler` (one status field's peak, sampled on a thread), :class:`PhaseWatch`
  (per runner stage), :func:`libraries_baseline`.
- **Timing**: :func:`sync`, :func:`best_ms`, :func:`best_of`, :func:`alternate` (A/B runs
  interleaved, so that a shared host's drift falls on every way alike), :func:`best_step`,
  :class:`CPUClock` and :func:`cpu_line`, :func:`run_child` (a ``python -c`` child that
  reports ``TAG {json}`` lines).
- **Quality scripts** (``awq_quality.py``, ``gptq_fp8_quality.py``,
  ``gguf_imatrix_quality.py``): :func:`add_calibration_args`, :func:`add_output_args`,
  :func:`timed_produce`, :func:`evaluate_into`, :func:`held_out`, :func:`print_table`.

Importing this module loads only the standard library; quantpress, torch and the tests'
helpers are imported by the functions that need them, so that ``--help`` is quick and
``scripts/gpu_checks.py --compare-imatrix`` or a ``python -c`` child pays only for what it
uses.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
TESTS = REPO / "tests"
PY = sys.executable

#: ``--model``'s help where the model is a directory (or SmolLM2 by default)
MODEL_HELP = "HF directory (default: SmolLM2-135M-Instruct from the cache)"


# ---- paths ------------------------------------------------------------------------------------

def use_tests() -> None:
    """Put ``tests/`` (``synth``, ``refs``, ``make``, ``ggml_ref``) and ``scripts/`` on
    ``sys.path``, once each."""
    for p in (str(SCRIPTS), str(TESTS)):
        if p not in sys.path:
            sys.path.insert(0, p)


def offline_env(**extra: str) -> dict:
    """This process's environment with ``HF_HUB_OFFLINE=1`` (llama.cpp's converter and
    transformers then never reach for the network) and ``extra`` set."""
    return dict(os.environ, HF_HUB_OFFLINE="1", **extra)


def digests(path) -> dict[str, str]:
    """SHA-256 (hex) of a file keyed by its name, or of every file below a directory keyed by
    its relative path (``tests/make.digests``' rule, which the batch tests compare)."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    return {(f.name if f == path else str(f.relative_to(path))): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in files}


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"8x128,16x256"`` -> [(8, 128), (16, 256)] (calibration rows x seqlen, or a tensor's
    rows x columns). ValueError on a part that is not two integers joined by ``x``."""
    out = []
    for part in text.split(","):
        a, b = part.strip().lower().split("x")
        out.append((int(a), int(b)))
    return out


# ---- models -----------------------------------------------------------------------------------

def add_model_arg(ap: argparse.ArgumentParser, help: str = MODEL_HELP) -> None:
    """``--model DIR`` (default None: :func:`model_dir` then takes SmolLM2)."""
    ap.add_argument("--model", help=help)


def model_dir(arg: str | None) -> Path:
    """``--model``'s directory, or SmolLM2-135M-Instruct from quantpress's cache (downloaded
    once by :func:`quantpress.assets.smollm2_dir` when missing) when ``arg`` is None or empty."""
    if arg:
        return Path(arg).expanduser()
    from quantpress import assets

    return assets.smollm2_dir()


def model_shape(model: Path) -> tuple[int, int, int, int, int]:
    """(hidden, ffn, attention heads, key/value heads, head dim) from ``model/config.json``
    (key/value heads default to the heads, head dim to hidden / heads, as transformers' llama
    config does): what the scripts' memory and operation counts are made of."""
    cfg = json.loads((Path(model) / "config.json").read_text())
    h, f, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    return h, f, heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim", h // heads)


def named_model(arg: str, tokenizer: str | Path | None = None) -> Path:
    """``smollm2`` (:func:`model_dir`), ``synth4x`` (:func:`synth4x` with ``tokenizer``) or a
    model directory."""
    if arg == "smollm2":
        return model_dir(None)
    if arg == "synth4x":
        return synth4x(Path(tokenizer) if tokenizer else None)
    return Path(arg)


def synth4x(tokenizer: Path | None = None) -> Path:
    """A random llama with ~554M parameters (4.1x SmolLM2: hidden 1,536, 16 layers, 12 heads,
    4 key/value heads), float16, cached in ``<cache>/models/synth-llama-554M`` (built once,
    in a temporary directory renamed into place); its tokenizer files from ``tokenizer``
    (default: SmolLM2's directory in the cache)."""
    from quantpress import assets

    out = assets.cache_root() / "models" / "synth-llama-554M"
    if (out / "config.json").exists():
        return out
    use_tests()
    import synth
    import torch

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    synth.make_model(tmp, "llama", tokenizer or assets.smollm2_dir(), dtype=torch.float16, hidden_size=1536,
                     intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                     num_key_value_heads=4, max_shard_size="400MB")
    tmp.chmod(0o755)
    tmp.rename(out)
    return out


def tiny_llama(out: Path, tokenizer_dir: Path, layers: int = 2) -> Path:
    """A random llama with ``layers`` decoder layers (``tests/synth.py``'s ``make_model``
    defaults: hidden 256, GQA, untied, float16) saved at ``out`` with the tokenizer files of
    ``tokenizer_dir``; returns ``out``."""
    use_tests()
    import synth

    return synth.make_model(out, "llama", tokenizer_dir, num_hidden_layers=layers)


def truncated_model(model: str | Path, layers: int, dest: str | Path) -> Path:
    """A copy of the Hugging Face directory ``model`` under ``dest`` with its first ``layers``
    decoder layers: config.json's ``num_hidden_layers`` = ``layers``, one model.safetensors
    with every tensor but those of the later layers (``*.layers.<i>.*``, i ≥ ``layers``), the
    other files symlinked. A calibrated pass costs the same per decoder layer whatever the
    depth, so a bench on the copy sees every per-layer cost at full size in minutes. Returns
    the copy's path. ValueError when ``layers`` is not in 1..num_hidden_layers."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    model, dest = Path(model), Path(dest) / f"{Path(model).name}-{layers}L"
    cfg = json.loads((model / "config.json").read_text())
    if not 1 <= layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"--layers {layers}: {model} has {cfg['num_hidden_layers']} decoder layers")
    dest.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.name != "config.json" and not f.name.startswith("model") and not (dest / f.name).exists():
            os.symlink(f.resolve(), dest / f.name)
    keep = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                m = re.search(r"\.layers\.(\d+)\.", k)
                if m is None or int(m.group(1)) < layers:
                    keep[k] = st.get_tensor(k)
    save_file(keep, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}, indent=2))
    return dest


# ---- reference tools (llama.cpp) -----------------------------------------------------------------

def llamacpp_convert_cmd(model: Path, out: Path, outtype: str = "f16") -> list[str]:
    """The command line of llama.cpp's own ``convert_hf_to_gguf.py MODEL --outtype OUTTYPE
    --outfile OUT`` from the pinned source (``llamacpp_tools.llamacpp_src``, unpacked on first
    use); run it with :func:`offline_env`."""
    import llamacpp_tools

    return [PY, str(llamacpp_tools.llamacpp_src() / "convert_hf_to_gguf.py"), str(model), "--outtype",
            outtype, "--outfile", str(out)]


def llama_quantize_code(policy: str, nthread: int) -> str:
    """A ``python -c`` program, argv ``F16 OUT``, that quantizes F16 into OUT with
    ``llama_model_quantize`` (llama-cpp-python's binding of the function the llama-quantize
    tool calls) at ``LLAMA_FTYPE_MOSTLY_<policy>`` on ``nthread`` threads; its exit status is
    the function's return code."""
    return ("import ctypes,sys,llama_cpp as l;p=l.llama_model_quantize_default_params();"
            f"p.ftype=l.LLAMA_FTYPE_MOSTLY_{policy};p.nthread={nthread};"
            "sys.exit(l.llama_model_quantize(sys.argv[1].encode(),sys.argv[2].encode(),ctypes.byref(p)))")


def same_tensors(*paths: Path) -> bool:
    """Whether the GGUF files carry identical tensors (``tests/refs.tensors_of``), read in a
    process of its own: read here they would grow this process, and a child it forks
    afterwards starts its peak RSS (``ru_maxrss``, which :func:`measure` reports) at this
    process's size (a later run's steps of ``bench_gguf.py --repeat`` reported 701 MiB for
    llama.cpp's 547 and 542 MiB)."""
    # tests/refs.py imports scripts/llamacpp_tools.py: both directories on the child's path
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; from refs import tensors_of; "
            "t = [tensors_of(p) for p in sys.argv[3:]]; sys.exit(0 if all(x == t[0] for x in t[1:]) else 1)")
    return subprocess.run([PY, "-c", code, str(TESTS), str(SCRIPTS), *map(str, paths)]).returncode == 0


# ---- memory -----------------------------------------------------------------------------------

def status(key: str, pid: int | str = "self") -> int:
    """A ``/proc/<pid>/status`` field in bytes (``VmHWM``, ``RssAnon``, ``VmRSS``, ...).
    KeyError when the field is not there; OSError when the process is gone."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def tree_pss_mib(pid: int) -> float:
    """The summed PSS (MiB) of process ``pid`` and its descendants, from /proc (0 when gone).
    PSS splits each shared page between its processes, so forked workers that share most of
    their parent's pages are not counted twice, as a sum of RSS would count them."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass
    return total / 1024


def measure(cmd: list[str], env: dict | None = None, log: list[str] | None = None) -> tuple[float, float, float]:
    """Run ``cmd``; return (wall seconds, peak RSS MiB of that process, peak PSS MiB of its
    process tree sampled every 0.25 s). Peak RSS is ``ru_maxrss`` from ``os.wait4``: that
    process's, or a child's it waited for if larger. PSS is sampled no oftener because reading
    a process's PSS walks its page tables (about 5 ms for a 300 MB process; every 20 ms it
    slowed the measured tools by a fifth). With ``log`` (a list), the process's stdout and
    stderr are appended to it as one string. SystemExit with the end of its output when the
    command fails."""
    with tempfile.TemporaryFile() as err:  # a pipe would fill up and block the child
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL if log is None else err, stderr=err)
        peak, done = [0.0], threading.Event()

        def sample():
            while not done.wait(0.25):
                peak[0] = max(peak[0], tree_pss_mib(p.pid))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, wstatus, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        err.seek(0)
        text = err.read().decode(errors="replace")
        if os.waitstatus_to_exitcode(wstatus) != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{text[-2000:]}")
        if log is not None:
            log.append(text)
    return wall, ru.ru_maxrss / 1024, peak[0]


class PeakSampler:
    """The peak of one ``/proc/<pid>/status`` field (bytes; default ``RssAnon``, the memory
    the process owns, page cache excluded), sampled every ``period`` seconds on a daemon
    thread from construction until :meth:`stop` or until the process is gone (or a zombie,
    whose status has no memory fields)."""

    def __init__(self, pid: int | str = "self", key: str = "RssAnon", period: float = 0.005,
                 start: bool = True):
        self.pid, self.key, self.period = pid, key, period
        self.peak = self._read()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        if start:
            self._t.start()

    def _read(self) -> int:
        try:
            return status(self.key, self.pid)
        except (OSError, KeyError):
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, status(self.key, self.pid))
            except (OSError, KeyError):
                break
            time.sleep(self.period)

    def stop(self) -> int:
        """Stop sampling (one last reading if the process is still there); returns the peak."""
        self._stop.set()
        if self._t.is_alive():
            self._t.join()
        self.peak = max(self.peak, self._read())
        return self.peak


def libraries_baseline(model: str | Path) -> int:
    """Build ``model``'s streaming skeleton and tokenizer once, drop them, trim the heap;
    returns the anonymous RSS then (bytes): what every run loads whatever the model (torch,
    transformers' model classes and what they import, the tokenizer), so that the figures
    above it are the model's and the data's."""
    from quantpress.calibration import engine
    from quantpress.convert import loaders
    from quantpress.memory import trim_heap

    sm = engine.StreamingModel(model)
    tok = loaders.find_loader(Path(model)).tokenizer(Path(model))
    tok(["warm up"], add_special_tokens=False)
    del sm, tok
    trim_heap()
    return status("RssAnon")


class PhaseWatch:
    """Per-stage peaks of this process's anonymous RSS (bytes): ``peaks``, ``starts`` (the
    level at the stage's start, after giving freed heap memory back) and ``where`` (the
    innermost frames of quantpress's code at the moment of the peak). Stages are the runner's
    (:data:`quantpress.targets.base.STAGE_OBSERVERS`: tokenize, layers, measurement,
    allocation, quantization, head, write, verify, ...); :meth:`start` subscribes."""

    def __init__(self, period: float = 0.002):
        import quantpress

        self.package = str(Path(quantpress.__file__).resolve().parent)
        self.period = period
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, int] = {}
        self.where: dict[str, list[str]] = {}
        self._main = threading.get_ident()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            a, ph = status("RssAnon"), self.phase
            if a > self.peaks.get(ph, 0):
                self.peaks[ph] = a
                f = sys._current_frames().get(self._main)
                st = traceback.extract_stack(f) if f is not None else []
                self.where[ph] = [f"{Path(x.filename).name}:{x.name}:{x.lineno}"
                                  for x in st if self.package in x.filename][-3:]
            time.sleep(self.period)

    def observe(self, stage: str, event: str) -> None:
        """A runner stage starts or ends (``quantpress.targets.base.STAGE_OBSERVERS``)."""
        from quantpress.memory import trim_heap

        if event == "start":
            trim_heap()
            self.starts.setdefault(stage, status("RssAnon"))
            self.phase = stage
        else:
            self.phase = "setup"

    def start(self) -> "PhaseWatch":
        """Start sampling and follow the runner's stages."""
        from quantpress.targets.base import STAGE_OBSERVERS

        STAGE_OBSERVERS.append(self.observe)
        self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling; returns {"phases", "starts", "where"} for the parent."""
        from quantpress.targets.base import STAGE_OBSERVERS

        self._done.set()
        self._thread.join()
        STAGE_OBSERVERS.remove(self.observe)
        return {"phases": self.peaks, "starts": self.starts, "where": self.where}


# ---- timing -----------------------------------------------------------------------------------

def sync(device) -> None:
    """Wait for the queued kernels of ``device`` (a torch.device or name) to finish, so that
    wall-clock times cover the work; nothing to do on the CPU (torch is not imported then)."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def best_ms(fn, n: int = 5) -> float:
    """``fn()`` once untimed (warm-up: caches, lazy imports, compiled kernels), then ``n``
    times; the shortest run in milliseconds."""
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def best_of(fn, repeat: int, device: str = "cpu"):
    """(best wall seconds, best process CPU seconds over ``repeat`` runs of ``fn()``, the last
    result), ``device`` synchronized around each run. On a shared CPU the CPU seconds of
    single-threaded runs are the steadier figure."""
    best, best_cpu, out = math.inf, math.inf, None
    for _ in range(repeat):
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu, out


def alternate(ways: dict, rounds: int, before=None, after=None) -> dict:
    """Time each of ``ways`` (key -> function of no arguments), ``rounds`` times, the ways
    interleaved (A, B, A, B, ...: a shared host's slow spells then fall on every way alike,
    not on whichever ran second). ``before(key)`` runs untimed before each call (installing
    the setting the call measures), ``after(key, seconds)`` after it (a progress line).
    Returns {key: [wall seconds of each round]}."""
    took: dict = {k: [] for k in ways}
    for _ in range(rounds):
        for k, fn in ways.items():
            if before is not None:
                before(k)
            t = time.perf_counter()
            fn()
            took[k].append(time.perf_counter() - t)
            if after is not None:
                after(k, took[k][-1])
    return took


def best_step(runs: list[dict], key: str) -> tuple[float, float, float]:
    """Over ``runs`` (dicts whose ``key`` holds :func:`measure`'s (wall, RSS, PSS)), the
    shortest wall time of that step with the largest peaks."""
    return (min(r[key][0] for r in runs), max(r[key][1] for r in runs), max(r[key][2] for r in runs))


class CPUClock:
    """Wall, user and system seconds and minor page faults since construction, of this
    process (``who`` = ``resource.RUSAGE_SELF``) or of its waited-for children
    (``resource.RUSAGE_CHILDREN``)."""

    def __init__(self, who: int = resource.RUSAGE_SELF):
        self.who = who
        self.r0, self.t0 = resource.getrusage(who), time.perf_counter()

    def read(self) -> dict:
        """{"wall_s", "user_s", "sys_s", "minflt"} since construction."""
        r1 = resource.getrusage(self.who)
        return {"wall_s": time.perf_counter() - self.t0, "user_s": r1.ru_utime - self.r0.ru_utime,
                "sys_s": r1.ru_stime - self.r0.ru_stime, "minflt": r1.ru_minflt - self.r0.ru_minflt}


def cpu_line(c: dict) -> str:
    """``CPUClock.read()`` as one line: user and system seconds, system share, page faults."""
    return (f"CPU user {c['user_s']:.1f} s, system {c['sys_s']:.1f} s ({c['sys_s'] / max(c['wall_s'], 1e-9):.1%} "
            f"of wall {c['wall_s']:.1f} s), {c['minflt'] / 1e6:.2f} M page faults")


def run_child(code: str, argv: list[str], env: dict | None = None, sample_anon: bool = False) -> tuple[dict, int]:
    """Run ``python -c code *argv`` in a fresh process (its peak RSS its own) with
    ``scripts/`` importable, and collect the lines it prints as ``TAG {json}`` (``RESULT``,
    ``BASE``, ...): returns ({tag: decoded JSON}, the child's peak ``RssAnon`` in bytes
    sampled every 5 ms when ``sample_anon``, else 0). Other lines are dropped; stderr passes
    through. SystemExit when the child fails or prints no ``RESULT`` line."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), *filter(None, [env.get("PYTHONPATH")])])
    p = subprocess.Popen([PY, "-c", code, *argv], stdout=subprocess.PIPE, text=True, env=env)
    peak = PeakSampler(p.pid) if sample_anon else None
    tags = {}
    for line in p.stdout:
        tag, _, rest = line.partition(" ")
        if tag.isupper() and rest.startswith(("{", "[")):
            tags[tag] = json.loads(rest)
    p.wait()
    anon = peak.stop() if peak is not None else 0
    if p.returncode or "RESULT" not in tags:
        raise SystemExit(f"child failed with exit code {p.returncode}")
    return tags, anon


# ---- quality scripts --------------------------------------------------------------------------

def add_calibration_args(ap: argparse.ArgumentParser, samples: int, seqlen: int) -> None:
    """``--model`` (:func:`model_dir`), ``--samples``, ``--seqlen`` (calibration rows and their
    tokens)."""
    add_model_arg(ap)
    ap.add_argument("--samples", type=int, default=samples)
    ap.add_argument("--seqlen", type=int, default=seqlen)


def add_output_args(ap: argparse.ArgumentParser, out: str, what: str = "directories") -> None:
    """``--chunks`` (evaluation chunks of 512 tokens, default all), ``--out`` (default
    ``out``), ``--device``."""
    ap.add_argument("--chunks", type=int, default=None, help="eval chunks of 512 (default: all)")
    ap.add_argument("--out", default=out, help=f"where the {what} go")
    ap.add_argument("--device", default="cpu")


def quality_setup(args):
    """A quality script's (model directory, output directory (made), ComputeOptions on
    ``args.device``, calibrated :class:`quantpress.targets.Source` of ``args.samples`` x
    ``args.seqlen`` tokens) from :func:`add_calibration_args` / :func:`add_output_args`'s
    options."""
    from quantpress.targets import CalibOptions, ComputeOptions, Source

    model = model_dir(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    compute = ComputeOptions(device=args.device)
    return model, out, compute, Source(model, compute, CalibOptions(samples=args.samples, seqlen=args.seqlen))


def timed_produce(options, source, out: Path):
    """``quantpress.targets.produce(options, source, out, force=True)``, its summary printed;
    returns (wall seconds, the summary)."""
    from quantpress.targets import produce

    t0 = time.perf_counter()
    s = produce(options, source, out, force=True)
    seconds = time.perf_counter() - t0
    print(s.text(), flush=True)
    return seconds, s


def evaluate_into(out: Path, model: Path, outputs: list[Path], chunks: int | None, compute):
    """``quantize eval`` of ``outputs`` against ``model`` on the held-out split (chunks of 512
    tokens, ``chunks`` of them, None: all), its JSON written to ``out/eval.json``; returns the
    :class:`quantpress.targets.eval.EvalReport`."""
    from quantpress.targets.eval import EvalOptions, evaluate

    rep = evaluate(model, list(outputs), EvalOptions(ctx=512, chunks=chunks), compute)
    (out / "eval.json").write_text(json.dumps(rep.to_json(), indent=1))
    return rep


def held_out(rep) -> str:
    """What an evaluation ran on, for a table's heading."""
    return f"eval: {rep.n_chunks} chunks of {rep.n_ctx} (held-out articles 1800-2348)"


def print_table(rep, names: list[str], bpw: dict[str, float], times: dict[str, float],
                first: str = "model") -> None:
    """The Markdown quality table of a ``quantize eval`` report. ``rep``:
    :class:`quantpress.targets.eval.EvalReport` whose models are the base then ``names`` in
    order; ``bpw`` / ``times`` (seconds) by name. Prints the FP16 row, then bits per weight,
    PPL, ΔPPL, KL divergence mean / 99th percentile, top-1 agreement and time."""
    base = rep.models[0].ppl["ppl"]
    print(f"| {first} | bpw | PPL | ΔPPL | KLD mean | KLD 99% | top-1 | time |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| FP16 | 16 | {base:.4f} | | | | | |")
    for name, m in zip(names, rep.models[1:]):
        p = m.ppl["ppl"]
        print(f"| {name} | {bpw[name]:.2f} | {p:.4f} | {p - base:+.4f} | {m.kl['kld_mean']:.5f} "
              f"| {m.kl['kld_p99']:.4f} | {100 * m.kl['same_top']:.2f}% | {times[name]:.0f} s |")
