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

from quantpress.errors import (EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_ROUND_TRIP, InputError,
                               RoundTripError)
from quantpress.devices import DEFAULT_BATCH_TOKENS


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
    """``--device``, ``--dtype``, ``--batch-tokens`` (:class:`~quantpress.targets.ComputeOptions`)
    and ``--quiet``."""
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
    options (``compute``; ``dtype``: also --dtype and --batch-tokens), --debug; ``run(args)``
    is what the verb does."""
    if calib:
        add_calib(p)
    if compute:
        add_compute(p, dtype=dtype)
    add_debug(p)
    p.set_defaults(run=run)


def main(prog: str, description: str, add_verbs: Callable, argv: list[str] | None) -> int:
    """A command's entry point: parse ``argv`` with the verbs ``add_verbs`` adds, run the verb
    and return its exit code (:func:`run_command`)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_verbs(p.add_subparsers(dest="verb", required=True, metavar="VERB"))
    args = p.parse_args(argv)
    return run_command(lambda: args.run(args), debug=args.debug)


def exit_with(code: int) -> NoReturn:
    """End a console command with exit ``code`` (what the command-line entry points call
    after ``main``; ``main`` itself returns, for callers in Python). The objects the run made
    (transformers' modules, the tokenizer's vocabulary, the GGUF metadata: hundreds of
    thousands) are first frozen out of the garbage collector (``gc.freeze``), so that the
    interpreter's shutdown does not trace them all once more: SmolLM2's ``convert
    hf-to-gguf`` to Q4_K_M took 5.28-5.65 s ended this way against 6.11-6.40 s with a plain
    ``sys.exit`` on this project's 2-core machine (``scripts/micro_figures.py --exit``, three
    runs each, alternating). Exit handlers run as usual."""
    gc.freeze()
    sys.exit(code)


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


def source(args: argparse.Namespace, path: str, calibrated: bool = True):
    """The :class:`~quantpress.targets.Source` of a verb's input model."""
    from quantpress.targets import Source

    return Source(path, compute_options(args), calib_options(args) if calibrated else None,
                  progress=not args.quiet)


def produce(args: argparse.Namespace, options, src, out: str, report: str | None = None) -> int:
    """Run the target for ``options`` on ``src`` into ``out`` and print its summary (text, or
    JSON with ``--json``); ``report``: also write the JSON summary there. Returns 0."""
    from quantpress.targets import produce as run

    s = run(options, src, out, force=args.force, progress=not args.quiet)
    if report:
        with open(report, "w", encoding="utf-8") as f:
            json.dump(s.to_json(), f, indent=1)
    print(json.dumps(s.to_json(), indent=1) if getattr(args, "json", False) else s.text())
    return 0


def add_gguf_options(p: argparse.ArgumentParser) -> None:
    """llama-quantize's options of ``convert hf-to-gguf`` and ``quantize gguf``: ``--imatrix``
    (with ``--include-weights`` / ``--exclude-weights``) and the per-tensor controls
    (:class:`~quantpress.targets.GGUFOptions`), plus the calibration options that
    ``--imatrix auto`` uses."""
    p.add_argument("--imatrix", metavar="FILE|auto",
                   help="importance matrix for the quantizers: a GGUF imatrix (quantize imatrix, "
                        "llama-imatrix) or a legacy .dat; 'auto' computes one first with the "
                        "calibration options below and keeps it as OUTPUT.imatrix.gguf")
    p.add_argument("--include-weights", action="append", default=[], metavar="NAME",
                   help="use the imatrix only for tensors whose name contains NAME (repeatable)")
    p.add_argument("--exclude-weights", action="append", default=[], metavar="NAME",
                   help="do not use the imatrix for tensors whose name contains NAME (repeatable)")
    p.add_argument("--output-tensor-type", metavar="TYPE", help="ggml type of output.weight")
    p.add_argument("--token-embedding-type", metavar="TYPE", help="ggml type of token_embd.weight")
    p.add_argument("--leave-output-tensor", action="store_true",
                   help="do not quantize output.weight")
    p.add_argument("--pure", action="store_true",
                   help="the policy's default type for every quantized tensor (no k-quant mixtures)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="ggml type for the tensors whose name matches the regular expression "
                        "PATTERN (repeatable, first match wins), e.g. attn_v=q8_0")


def gguf_options(args: argparse.Namespace):
    """:class:`~quantpress.targets.GGUFOptions` from the parsed arguments."""
    from quantpress.targets import GGUFOptions

    return GGUFOptions(policy=args.policy, imatrix=args.imatrix,
                       include_weights=tuple(args.include_weights),
                       exclude_weights=tuple(args.exclude_weights),
                       output_tensor_type=args.output_tensor_type,
                       token_embedding_type=args.token_embedding_type,
                       leave_output_tensor=args.leave_output_tensor, pure=args.pure,
                       tensor_type=tuple(args.tensor_type))


def produce_gguf(args: argparse.Namespace, model: str, out: str) -> int:
    """A GGUF output of ``model`` (HF directory or GGUF file) at ``out``. With ``--imatrix
    auto`` the importance matrix is made first (``quantize imatrix`` with the calibration
    options, verified, kept as ``OUT.imatrix.gguf``; its summary goes to stderr) and the GGUF
    is quantized with it. Returns 0."""
    import dataclasses
    from pathlib import Path

    from quantpress.targets import ImatrixOptions, check_output
    from quantpress.targets import produce as run

    opts = gguf_options(args)
    if opts.imatrix == "auto":
        im_out = Path(out).with_name(Path(out).name + ".imatrix.gguf")
        opts = dataclasses.replace(opts, imatrix=str(im_out))
        opts.validate()
        check_output(Path(out), False, args.force)
        s = run(ImatrixOptions(), source(args, model), im_out, force=args.force, progress=not args.quiet)
        print(s.text(), file=sys.stderr)
    return produce(args, opts, source(args, model, False), out, report=getattr(args, "report", None))
