"""``quantize eval``: perplexity of a base model and of its quantized outputs, and each output's
KL divergence from the base, with llama-perplexity's conventions (:mod:`quantpress.calibration.eval`).

Not an output target (it writes no file): a report over models that any loader opens
(:mod:`quantpress.convert.loaders`: HF directories, GGUF files, AWQ and EXL2 directories), on
the same compute options as the targets.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quantpress.calibration import data as cdata
from quantpress.calibration import engine
from quantpress.calibration import eval as ceval
from quantpress.convert import loaders
from quantpress.errors import InputError
from quantpress.devices import pick_device, pick_dtype, rows_per_batch
from quantpress.memory import bound_heap, trim_heap
from quantpress.targets.base import ComputeOptions, default_cal_dir

#: bytes of float32 logits computed at once from final hidden states (the KL step holds about
#: eight arrays of that size: two models' logits, log-probabilities and their products)
LOGITS_BUDGET = 1 << 26


@dataclass(frozen=True)
class EvalOptions:
    """``text``: a UTF-8 text file (None: the held-out split of exllamav2's wiki.utf8, articles
    1800–2348); ``ctx``: tokens per chunk (the second half of each is scored); ``chunks``: only
    the first N chunks (None: all)."""

    text: str | None = None
    ctx: int = 512
    chunks: int | None = None

    def validate(self) -> None:
        """InputError naming the option when ``ctx`` < 2 or ``chunks`` < 1."""
        if isinstance(self.ctx, bool) or not isinstance(self.ctx, int) or self.ctx < 2:
            raise InputError(f"--ctx {self.ctx!r}: expected an integer >= 2")
        if self.chunks is not None and (isinstance(self.chunks, bool) or not isinstance(self.chunks, int)
                                        or self.chunks < 1):
            raise InputError(f"--chunks {self.chunks!r}: expected a positive integer")


@dataclass
class ModelEval:
    """Figures of one evaluated model (see :mod:`quantpress.calibration.eval` for their
    definitions): ``ppl`` (perplexity dict), ``kl`` (outputs only), wall ``seconds``."""

    path: str
    kind: str
    ppl: dict
    kl: dict | None = None
    seconds: float = 0.0


@dataclass
class EvalReport:
    """Result of :func:`evaluate`: the base model first, then each output."""

    models: list[ModelEval]
    n_ctx: int
    n_chunks: int
    text: str
    device: str
    dtype: str
    seconds: float = 0.0

    def text_table(self) -> str:
        """Side-by-side table: PPL ± uncertainty, ΔPPL, mean / 99th-percentile KLD, top-1
        agreement."""
        base = self.models[0].ppl["ppl"]
        tokens = self.models[0].ppl["tokens"]
        lines = [f"text      {self.text}: {self.n_chunks} chunks of {self.n_ctx} tokens, "
                 f"{tokens} scored tokens (second half of each chunk)",
                 f"compute   {self.device}, {self.dtype}, {self.seconds:.1f} s", ""]
        names = [Path(m.path).name or m.path for m in self.models]
        w = max(8, *(len(n) for n in names))
        head = (f"{'model':<{w}}  {'kind':<5}  {'PPL':>18}  {'ΔPPL':>9}  {'KLD mean':>10}  "
                f"{'KLD 99%':>9}  {'top-1':>8}")
        lines += [head, "-" * len(head)]
        for m, n in zip(self.models, names):
            ppl = f"{m.ppl['ppl']:.4f} ± {m.ppl['ppl_unc']:.4f}"
            if m.kl is None:
                lines.append(f"{n:<{w}}  {m.kind:<5}  {ppl:>18}  {'(base)':>9}  {'':>10}  {'':>9}  {'':>8}")
            else:
                lines.append(f"{n:<{w}}  {m.kind:<5}  {ppl:>18}  {m.ppl['ppl'] - base:>+9.4f}  "
                             f"{m.kl['kld_mean']:>10.6f}  {m.kl['kld_p99']:>9.5f}  "
                             f"{100 * m.kl['same_top']:>7.2f}%")
        return "\n".join(lines)

    def to_json(self) -> dict:
        """The report as JSON-able dict: run parameters and, per model, the perplexity figures
        and (outputs only) the ``kl`` dict of :meth:`quantpress.calibration.eval.KLStats.result`."""
        return {"text": self.text, "n_ctx": self.n_ctx, "n_chunks": self.n_chunks,
                "device": self.device, "dtype": self.dtype, "seconds": self.seconds,
                "models": [{"path": m.path, "kind": m.kind, "seconds": m.seconds, **m.ppl,
                            **({"kl": m.kl} if m.kl is not None else {})} for m in self.models]}


def read_text_file(path: str | Path) -> str:
    """Whole file as UTF-8 text (what ``llama-perplexity -f`` reads). Raises InputError for a
    missing, unreadable, empty or non-UTF-8 file."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: text file not found")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected a text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read ({e.strerror or e})") from None
    if not text.strip():
        raise InputError(f"{p}: text file is empty")
    return text


def tokenize_stream(tok, text: str, bos_id: int | None) -> torch.Tensor:
    """llama.cpp ``common_tokenize(text, add_special=true)``: the text as one int64 sequence
    [n], BOS first when ``bos_id`` is given."""
    tok.model_max_length = int(1e30)  # one long sequence on purpose: no length warning
    ids = tok(text, add_special_tokens=False)["input_ids"]
    t = torch.as_tensor(ids, dtype=torch.long)
    if bos_id is not None:
        t = torch.cat([t.new_tensor([bos_id]), t])
    return t


def _final_scored_hidden(sm, chunks: torch.Tensor, batch_rows: int, progress: bool) -> torch.Tensor:
    """Last decoder layer's output at the scored positions: [n_chunk, n_ctx−first−1, hidden]."""
    h = engine.run(sm, chunks, batch_size=batch_rows, progress=progress, on_layer=trim_heap,
                   keep_inputs=False)
    sl = ceval.scored_slice(chunks.shape[1])
    out = h[:, sl].clone()
    del h
    return out


def _bar(it, progress: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="batch", disable=not progress, leave=False)


def _logit_rows(n_scored: int, vocab: int) -> int:
    return max(1, LOGITS_BUDGET // max(1, 4 * n_scored * vocab))


class Evaluation:
    """The base model of an evaluation, scored once, against which any number of outputs are
    then scored: :func:`evaluate` is one :meth:`report` of this. ``quantize batch`` keeps one per
    model and asks for a report of each stage's outputs as the stage finishes, from whichever
    thread runs it (the base is scored once, under a lock, by the first report; what later
    reports read of it is not changed again). Arguments as :func:`evaluate`; the options are
    validated here (InputError naming the option). Call :meth:`close` when done."""

    def __init__(self, base: str | Path, options: EvalOptions | None = None,
                 compute: ComputeOptions | None = None, progress: bool = True,
                 cal_dir: str | Path | None = None):
        self.options = options or EvalOptions()
        self.compute = compute or ComputeOptions()
        self.options.validate()
        self.compute.validate()
        self.progress = progress
        self.cal_dir = cal_dir
        self.device, self.dtype = pick_device(self.compute.device), pick_dtype(self.compute.dtype)
        self.base_path = Path(base)
        self.base_loader = loaders.find_loader(self.base_path)
        self.vocab = self.base_loader.vocabulary(self.base_path)
        self._lock = threading.Lock()
        self._base: ModelEval | None = None
        self._sm = None

    def _outputs(self, outputs) -> list[tuple[Path, loaders.Loader]]:
        out_lds = [(Path(o), loaders.find_loader(o)) for o in outputs]
        for out_p, ld in out_lds:  # before any computation
            v = ld.vocabulary(out_p)
            if v != self.vocab:
                raise InputError(f"{out_p}: vocabulary of {v} tokens, the base model has {self.vocab}; "
                                 f"KL divergence needs the same vocabulary")
        return out_lds

    def _score_base(self) -> ModelEval:
        with self._lock:
            if self._base is not None:
                return self._base
            base_p, base_ld, options = self.base_path, self.base_loader, self.options
            if options.text is None:
                text_str = cdata.heldout_text(self.cal_dir or default_cal_dir())
                self.text_name = "wiki.utf8 held-out split (articles 1800-2348)"
            else:
                text_str = read_text_file(options.text)
                self.text_name = str(options.text)
            tok = base_ld.tokenizer(base_p)
            bos = tok.bos_token_id if base_ld.add_bos(base_p, tok) else None
            self.toks = ceval.make_chunks(tokenize_stream(tok, text_str, bos), options.ctx, options.chunks, bos)
            self.targets = ceval.scored_targets(self.toks)
            n_chunk, n_scored = self.targets.shape
            self.rows = rows_per_batch(self.compute.batch_tokens, options.ctx)
            self.base_cfg = base_ld.hf_config(base_p) if base_ld.kind == "hf" else None
            self.lrows = _logit_rows(n_scored, self.vocab)
            t1 = time.perf_counter()
            sm = base_ld.open(base_p, self.device, self.dtype)
            self.h_base = _final_scored_hidden(sm, self.toks, self.rows, self.progress)
            ppl = ceval.PerplexityStats()
            for r in _bar(range(0, n_chunk, self.lrows), self.progress, f"logits {base_p.name}"):
                ppl.update(sm.final_logits(self.h_base[r:r + self.lrows]), self.targets[r:r + self.lrows],
                           what=str(base_p))
            self._sm = sm
            self._base = ModelEval(str(base_p), base_ld.kind, ppl.result(), None, time.perf_counter() - t1)
            return self._base

    def _score(self, out_p: Path, ld: loaders.Loader) -> ModelEval:
        t1 = time.perf_counter()
        n_chunk, lrows = self.targets.shape[0], self.lrows
        sm = ld.open(out_p, self.device, self.dtype, self.base_cfg if ld.kind != "hf" else None)
        try:
            h = _final_scored_hidden(sm, self.toks, self.rows, self.progress)
            kl = ceval.KLStats()
            for r in _bar(range(0, n_chunk, lrows), self.progress, f"logits {out_p.name}"):
                lb = self._sm.final_logits(self.h_base[r:r + lrows])
                lq = sm.final_logits(h[r:r + lrows])
                kl.update(lb, lq, self.targets[r:r + lrows], what=str(out_p))
                del lb, lq
            return ModelEval(str(out_p), ld.kind, kl.perplexity(), kl.result(), time.perf_counter() - t1)
        finally:
            sm.release()

    def report(self, outputs: list[str | Path] = (), side_by_side: int = 1) -> EvalReport:
        """The base (scored by the first report) and every model of ``outputs``, in order;
        raises as :func:`evaluate`. ``side_by_side``: score up to that many outputs at once,
        each in a thread of its own on one torch intra-op thread
        (:func:`quantpress.calibration.engine.run_side_by_side`; CPU, torch on one thread);
        they share only what the base left, which none of them changes, and each output's
        figures are those it gets alone."""
        t0 = time.perf_counter()
        bound_heap()
        out_lds = self._outputs(outputs)
        results = [self._score_base()]
        threads = engine.side_by_side_threads(self.device, min(side_by_side, len(out_lds)))
        if threads > 1:
            scored: list = [None] * len(out_lds)

            def one(i: int) -> Callable[[], None]:
                def call() -> None:
                    scored[i] = self._score(*out_lds[i])
                return call
            engine.raise_first(engine.run_side_by_side([one(i) for i in range(len(out_lds))], threads))
            results += scored
        else:
            results += [self._score(out_p, ld) for out_p, ld in out_lds]
        return EvalReport(results, self.options.ctx, self.targets.shape[0], self.text_name, str(self.device),
                          str(self.dtype).replace("torch.", ""), time.perf_counter() - t0)

    def close(self) -> None:
        """Release the base model's cached head and hidden states."""
        if self._sm is not None:
            self._sm.release()
        self._sm = self.h_base = None


def evaluate(base: str | Path, outputs: list[str | Path] = (), options: EvalOptions | None = None,
             compute: ComputeOptions | None = None, progress: bool = True,
             cal_dir: str | Path | None = None) -> EvalReport:
    """Perplexity of ``base`` and of every model in ``outputs``, and each output's KL
    divergence from ``base``, with llama-perplexity's conventions (:mod:`quantpress.calibration.eval`).

    The text (:class:`EvalOptions`; default the held-out split of exllamav2's wiki.utf8,
    :func:`quantpress.calibration.data.heldout_text`, from ``cal_dir`` or the cache) is
    tokenized once with the base model's tokenizer (all models must share its vocabulary), cut
    into chunks of ``ctx`` tokens. Each model runs through the streaming engine over all chunks
    (one decoder layer in memory at a time); the last layer's output at the scored positions is
    kept (``n_chunk · ctx/2 · hidden`` floats for the base, the same for the output being
    evaluated), and logits are computed from it a few chunks at a time, so neither the model nor
    the logits of the whole text are ever in memory. A GGUF output is built with the base's
    config.json when the base is an HF directory.

    Raises InputError for unknown or unreadable models, a text that is missing, empty, not
    UTF-8 or shorter than 2·ctx tokens, mismatched vocabularies, and NaN/Inf activations or
    logits (naming the layer / model)."""
    ev = Evaluation(base, options, compute, progress, cal_dir)
    try:
        return ev.report(outputs)
    finally:
        ev.close()
