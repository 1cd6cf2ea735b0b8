"""What every verb shares: the options that map onto :class:`~quantpress.targets.CalibOptions`
and :class:`~quantpress.targets.ComputeOptions`, printing a summary, and the exit codes.

Exit codes (:mod:`quantpress.errors`): 0 done; 2 bad input (InputError: one line naming the
file, tensor, key or option); 3 failed round trip (RoundTripError); 1 anything else, with a
one-line message and the traceback only with ``--debug`` (or ``QUANTPRESS_DEBUG=1``). CUDA out
of memory says so and suggests ``--batch-tokens`` or ``--device cpu``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from typing import Callable, NoReturn

from quantpress.convert.sources import REPO_HELP
from quantpress.errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_ROUND_TRIP, InputError,
                               RoundTripError)
from quantpress.devices import DEFAULT_BATCH_TOKENS

#: the verb inputs (:attr:`~quantpress.targets.registry.Verb.input`) that are models, so that a
#: repo id is accepted for them (``gguf``: a file, not a repo)
MODEL_INPUTS = ("hf", "any")


def _first_line(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return text.splitlines()[0] if text.strip() else type(e).__name__


def run_command(fn: Callable[[], int], debug: bool = False) -> int:
    """Run ``fn`` and map what it raises to an exit code and one ``error: ...`` line on stderr
    (see the module docstring). ``debug``: also print the traceback."""
    debug = debug or bool(os.environ.get("QUANTPRESS_DEBUG"))
    try:
        return fn()
    except KeyboardInterrupt:
        print("interrupted; no output written", file=sys.stderr)
        return 130
    except InputError as e:
        code, msg, exc = EXIT_BAD_INPUT, _first_line(e), e
    except RoundTripError as e:
        code, msg, exc = EXIT_ROUND_TRIP, _first_line(e), e
    except Exception as e:  # noqa: BLE001 - the one place that turns internal errors into exit 1
        code, exc = EXIT_INTERNAL, e
        import torch

        if isinstance(e, torch.cuda.OutOfMemoryError):
            msg = (f"CUDA out of memory ({_first_line(e)[:120]}); lower --batch-tokens "
                   f"(default {DEFAULT_BATCH_TOKENS}) or use --device cpu; no output written")
        elif isinstance(e, MemoryError):
            msg = "out of memory; lower --batch-tokens or --samples; no output written"
        else:
            msg = (f"internal error ({type(e).__name__}: {_first_line(e)}); no output written"
                   + ("" if debug else "; run with --debug for the traceback"))
    if debug:
        traceback.print_exception(exc)
    print(f"error: {msg}", file=sys.stderr)
    return code


def add_debug(p: argparse.ArgumentParser) -> None:
    """``--debug``: tracebacks for internal errors."""
    p.add_argument("--debug", action="store_true", help="print the traceback of an internal error")


def add_compute(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    """``--device``, ``--dtype`` (only with ``dtype``: where the compute dtype changes the
    output), ``--batch-tokens`` (:class:`~quantpress.targets.ComputeOptions`) and ``--quiet``."""
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    if dtype:
        p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                       help="compute dtype (default float32)")
    p.add_argument("--batch-tokens", type=int, default=DEFAULT_BATCH_TOKENS,
                   help=f"tokens per forward batch (default {DEFAULT_BATCH_TOKENS})")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_calib(p: argparse.ArgumentParser, samples: int = 128, seqlen: int = 512) -> None:
    """The calibration options (:class:`~quantpress.targets.CalibOptions`)."""
    p.add_argument("--calib", help="calibration text: .txt/.utf8/.md (one document), .json/.jsonl "
                                   "or .parquet, a datasets folder, or a dataset name "
                                   "owner/name[:config][@split] when online (default: calibration "
                                   "split of exllamav2's wiki.utf8)")
    p.add_argument("--calib-field", default="text", help="text column of a JSON/Parquet file (default text)")
    p.add_argument("--samples", type=int, default=samples, help=f"calibration rows (default {samples})")
    p.add_argument("--seqlen", type=int, default=seqlen, help=f"tokens per row (default {seqlen})")
    p.add_argument("--seed", type=int, default=0, help="row selection seed (default 0)")


def verb_options(p: argparse.ArgumentParser, run: Callable, calib: bool = False,
                 compute: bool = True, dtype: bool = True) -> None:
    """The options every verb ends with: the calibration options (``calib``), the compute
    options (``compute``; ``dtype``: also --dtype), --debug; ``run(args)`` is what the verb
    does."""
    if calib:
        add_calib(p)
    if compute:
        add_compute(p, dtype=dtype)
    add_debug(p)
    p.set_defaults(run=run)


def main(prog: str, description: str, add_verbs: Callable, argv: list[str] | None) -> int:
    """A command's entry point: parse ``argv`` with the verbs ``add_verbs`` adds, run the verb
    and return its exit code (:func:`run_command`). Building the verbs loads the plugins'
    targets (:func:`quantpress.targets.registry.load_plugins`): a bad plugin is one error line
    and exit 2 like any bad input, not a traceback."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    words = sys.argv[1:] if argv is None else argv
    code = run_command(lambda: add_verbs(p.add_subparsers(dest="verb", required=True, metavar="VERB")) or 0,
                       debug="--debug" in words)
    if code:
        return code
    args = p.parse_args(argv)
    return run_command(lambda: args.run(args), debug=args.debug)


def exit_with(code: int) -> NoReturn:
    """End a console command with exit ``code`` (what the command-line entry points call
    after ``main``; ``main`` itself returns, for callers in Python). The objects the run made
    (transformers' modules, the tokenizer's vocabulary, the GGUF metadata: hundreds of
    thousands) are first frozen out of the garbage collector (``gc.freeze``), so that the
    interpreter's shutdown does not trace them all once more: SmolLM2's ``convert
    hf-to-gguf`` to Q4_K_M ends measurably sooner this way than with a plain ``sys.exit``
    (figures and the command in docs/benchmarks.md, "Figures behind the code",
    ``cli/common.py``). Exit handlers run as usual."""
    gc.freeze()
    sys.exit(code)


def add_model_source(p: argparse.ArgumentParser, what: str = "MODEL") -> None:
    """``--revision`` and ``--allow-download``: where a repo-id model argument (``what``
    names it in the help) is read from (:func:`quantpress.convert.sources.resolve_model`)."""
    p.add_argument("--revision", help=f"branch, tag or commit of a repo-id {what} (default main)")
    p.add_argument("--allow-download", action="store_true",
                   help=f"fetch a repo-id {what} from the Hugging Face Hub when the local cache "
                        f"lacks it (default: offline, the cache only)")


def model_source(args: argparse.Namespace, spec: str, revision: bool = True):
    """The :class:`~quantpress.convert.sources.ModelSource` of a model argument ``spec``: its
    path is ``spec`` itself or the cached snapshot of a repo id
    (:func:`quantpress.convert.sources.resolve_model`, with ``--allow-download`` and, where
    ``revision``, ``--revision``)."""
    from quantpress.convert.sources import resolve_model

    return resolve_model(spec, getattr(args, "revision", None) if revision else None,
                         allow_download=getattr(args, "allow_download", False))


def model_path(args: argparse.Namespace, spec: str, revision: bool = True):
    """The local path of a model argument ``spec`` (:func:`model_source`)."""
    return model_source(args, spec, revision).path


def compute_options(args: argparse.Namespace):
    """:class:`~quantpress.targets.ComputeOptions` from the parsed arguments."""
    from quantpress.targets import ComputeOptions

    return ComputeOptions(device=args.device, dtype=getattr(args, "dtype", None),
                          batch_tokens=getattr(args, "batch_tokens", DEFAULT_BATCH_TOKENS))


def calib_options(args: argparse.Namespace):
    """:class:`~quantpress.targets.CalibOptions` from the parsed arguments."""
    from quantpress.targets import CalibOptions

    return CalibOptions(calib=args.calib, calib_field=args.calib_field, samples=args.samples,
                        seqlen=args.seqlen, seed=args.seed)


def source(args: argparse.Namespace, path: str, calibrated: bool = True, repo_id: str | None = None):
    """The :class:`~quantpress.targets.Source` of a verb's input model (``repo_id``: the repo
    id ``path`` is the snapshot of)."""
    from quantpress.targets import Source

    return Source(path, compute_options(args), calib_options(args) if calibrated else None,
                  progress=not args.quiet, repo_id=repo_id)


def add_target_verbs(sub, command: str) -> None:
    """Add a verb for every registered target verb of ``command`` (``quantize`` or
    ``convert``; :func:`quantpress.targets.registry.verbs`) to an argparse subparsers object:
    its input argument, ``-o``, ``--force``, ``--report`` where it has one, ``--json``, one
    flag per declared option of the target's options dataclass
    (:func:`quantpress.targets.options.add_arguments`), the verb's own arguments, then the
    calibration (where calibrated) and compute options."""
    import functools

    from quantpress.targets import registry
    from quantpress.targets.options import add_arguments

    registry.load_plugins()
    for cls, verb in registry.verbs(command):
        p = sub.add_parser(verb.name, help=verb.help)
        reads_models = verb.input in MODEL_INPUTS
        p.add_argument(verb.arg, help=verb.arg_help + (REPO_HELP if reads_models else ""))
        if reads_models:
            add_model_source(p)
        p.add_argument("-o", "--output", required=verb.out_required, help=verb.out_help)
        p.add_argument("--force", action="store_true", help="overwrite an existing output")
        if verb.report:
            p.add_argument("--report", help=verb.report)
        p.add_argument("--json", action="store_true", help="print the summary as JSON")
        add_arguments(p, cls.options_type, verb.overrides)
        for flags, kw in verb.extra:
            p.add_argument(*flags, **kw)
        verb_options(p, functools.partial(run_target, cls, verb), calib=verb.calibrated, dtype=verb.dtype)


def run_target(cls: type, verb, args: argparse.Namespace) -> int:
    """What a target verb does: check its input (``verb.check_input``), build the options from
    the flags (:func:`quantpress.targets.options.from_args`), then make each of the verb's
    steps (:meth:`~quantpress.targets.registry.Verb.plan`) with :func:`produce`. Returns 0."""
    from quantpress.targets.options import from_args

    path, repo_id = getattr(args, verb.arg), None
    if verb.input in MODEL_INPUTS:
        resolved = model_source(args, path)
        path, repo_id = str(resolved.path), resolved.repo_id
    if verb.check_input is not None:
        verb.check_input(path)
    for step in verb.plan(args, from_args(cls.options_type, args)):
        produce(args, step.options, source(args, path, step.calibrated, repo_id), step.out, report=step.report,
                aside=step.aside)
    return 0


def produce(args: argparse.Namespace, options, src, out: str, report: str | None = None,
            aside: bool = False) -> int:
    """Run the target for ``options`` on ``src`` into ``out`` and print its summary (text, or
    JSON with ``--json``; ``aside``: the text on stderr, an output made on the way);
    ``report``: also write the JSON summary there. Returns 0."""
    from quantpress.targets import produce as run

    s = run(options, src, out, force=args.force, progress=not args.quiet)
    if report:
        with open(report, "w", encoding="utf-8") as f:
            json.dump(s.to_json(), f, indent=1)
    if aside:
        print(s.text(), file=sys.stderr)
    else:
        print(json.dumps(s.to_json(), indent=1) if getattr(args, "json", False) else s.text())
    return 0
