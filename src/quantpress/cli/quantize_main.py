"""``quantize``: quantization verbs.

  quantize gguf IN-F16.gguf --policy Q4_K_M -o OUT.gguf [--imatrix FILE|auto] [--pure] ...
                                                          (llama-quantize's job, verified)
  quantize imatrix MODEL -o imatrix.gguf [--calib FILE] [--samples N --seqlen L]
  quantize awq MODEL -o OUT_DIR [--group-size 128] [--rtn] [--no-clip]
  quantize gptq MODEL -o OUT_DIR [--bits 4] [--group-size 128] [--act-order] [--asym]
  quantize fp8 MODEL -o OUT_DIR [--scheme dynamic|static|block] [--ignore NAME ...]
  quantize exl2 MODEL --bpw 4.25 -o OUT_DIR [--head-bits 6] [--measurement FILE | --measure-only FILE]
  quantize eval BASE [OUTPUT ...] [--text FILE] [--ctx 512] [--json]
  quantize batch JOBS.toml -o OUT_ROOT [--dry-run] [--ray [ADDRESS]] [--device cpu] [--force] [--json]
"""
from __future__ import annotations

import argparse
import json
from typing import NoReturn
from pathlib import Path

from quantpress.cli import common
from quantpress.errors import InputError


def _out_args(p: argparse.ArgumentParser, required: bool = True, help: str = "output path") -> None:
    p.add_argument("-o", "--output", required=required, help=help)
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _hf_verb(sub, name: str, help: str, out_required: bool = True,
             out_help: str = "output directory") -> argparse.ArgumentParser:
    """A verb that reads a Hugging Face model directory and writes a directory: its parser with
    the ``model`` argument and the output options."""
    p = sub.add_parser(name, help=help)
    p.add_argument("model", help="Hugging Face model directory (FP16/BF16/F32 safetensors)")
    _out_args(p, required=out_required, help=out_help)
    return p


def _rtn_arg(p: argparse.ArgumentParser, kept: str) -> None:
    """``--rtn``: the verb's quantizer without calibration (``kept``: what stays the same)."""
    p.add_argument("--rtn", action="store_true",
                   help=f"plain round-to-nearest (no calibration), same {kept} and packing: the baseline")


def _shard_arg(p: argparse.ArgumentParser) -> None:
    """``--max-shard-size`` of the safetensors writers (AWQ, GPTQ, FP8)."""
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")


def add_verbs(sub) -> None:
    """Add the ``quantize`` verbs to an argparse subparsers object."""
    from quantpress.calibration.exl2_alloc import DEFAULT_OBJECTIVE, OBJECTIVE_MODES
    from quantpress.convert.gguf_policy import POLICIES

    g = sub.add_parser("gguf", help="requantize an F32/F16/BF16 GGUF with a llama.cpp policy")
    g.add_argument("input", help="input .gguf (F32/F16/BF16 tensors)")
    _out_args(g, help="output .gguf path")
    g.add_argument("--policy", required=True, choices=POLICIES, help="llama.cpp ftype, e.g. Q4_K_M")
    g.add_argument("--report", help="also write the summary with every tensor's round-trip figures as JSON")
    common.add_gguf_options(g)
    common.verb_options(g, _gguf, calib=True)

    m = sub.add_parser("imatrix", help="llama.cpp importance matrix (GGUF imatrix file for "
                                       "llama-quantize --imatrix)")
    m.add_argument("model", help="Hugging Face model directory or GGUF file")
    _out_args(m, help="output imatrix .gguf path")
    common.verb_options(m, _imatrix, calib=True)

    a = _hf_verb(sub, "awq", "AWQ (activation-aware) 4-bit quantization to an AutoAWQ GEMM "
                             "directory (vLLM, transformers)")
    a.add_argument("--bits", type=int, default=4, help="weight bits (4: the GEMM layout)")
    a.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale and zero point (default 128; 64 for widths like 576)")
    a.add_argument("--no-clip", dest="clip", action="store_false", help="skip the clipping search")
    a.add_argument("--duo-scaling", dest="duo_scaling", action="store_true", default=True,
                   help="s = x^r / w^(1-r) (default, AutoAWQ)")
    a.add_argument("--no-duo-scaling", dest="duo_scaling", action="store_false",
                   help="s = x^r (the original llm-awq grid)")
    _rtn_arg(a, "quantizer")
    _shard_arg(a)
    common.verb_options(a, _awq, calib=True)

    q = _hf_verb(sub, "gptq", "GPTQ (Hessian-based, layer by layer) to a GPTQ checkpoint "
                              "directory (vLLM gptq/Marlin, transformers with gptqmodel)")
    q.add_argument("--bits", type=int, default=4, help="weight bits: 4 (default) or 8")
    q.add_argument("--group-size", type=int, default=128,
                   help="input rows per scale and zero point: 128 (default), 32, 64, or -1 (one per column)")
    q.add_argument("--sym", dest="sym", action="store_true", default=True,
                   help="symmetric quantization, zero point 2^(bits-1) (default; what Marlin takes)")
    q.add_argument("--asym", dest="sym", action="store_false", help="asymmetric (min-max zero points)")
    q.add_argument("--act-order", action="store_true",
                   help="quantize inputs by descending Hessian diagonal (desc_act: true, with g_idx)")
    q.add_argument("--damp", type=float, default=0.01,
                   help="damping: fraction of the mean Hessian diagonal added to it (default 0.01)")
    _rtn_arg(q, "groups")
    _shard_arg(q)
    common.verb_options(q, _gptq, calib=True)

    f = _hf_verb(sub, "fp8", "FP8 E4M3 weights (and activation scales) in the "
                             "compressed-tensors format (vLLM, transformers)")
    f.add_argument("--scheme", default="dynamic",
                   help="dynamic: per-channel weight scales, per-token activation scales at run "
                        "time (default; no calibration); static: per-tensor weight scales and "
                        "calibrated input_scale; block: one scale per 128x128 weight block")
    f.add_argument("--ignore", nargs="+", default=[], metavar="NAME",
                   help="more linears to keep unquantized besides lm_head: module names or re:REGEX")
    f.add_argument("--lm-head", action="store_true",
                   help="quantize lm_head too (tied embeddings: a separate FP8 lm_head, the embedding kept)")
    _shard_arg(f)
    common.verb_options(f, _fp8, calib=True)

    x = _hf_verb(sub, "exl2", "EXL2 (exllamav2 0.3.2) mixed-bit GPTQ quantization to a target "
                              "bits per weight", out_required=False,
                 out_help="output directory (required unless --measure-only)")
    x.add_argument("--bpw", type=float, help="target bits per weight of the decoder layers "
                                             "(exllamav2 -b; required unless --measure-only)")
    x.add_argument("--head-bits", type=int, default=6, help="lm_head bits: 2, 3, 4, 5, 6 or 8 (default 6)")
    x.add_argument("--measurement", help="reuse this measurement.json (skips the measurement pass)")
    x.add_argument("--measure-only", metavar="FILE", help="only measure; write measurement.json to FILE")
    x.add_argument("--objective", default=DEFAULT_OBJECTIVE, choices=tuple(OBJECTIVE_MODES),
                   help="bit allocation: minimize the sum of squared module errors relative to "
                        "the norm of the non-sink tokens (content, default), the sum of "
                        "exllamav2's module errors (sum) or their maximum (max, exllamav2's intent)")
    x.add_argument("--max-shard-size", type=float, default=8192,
                   help="MB per output file (exllamav2 -ss; default 8192, 0 = one file)")
    common.verb_options(x, _exl2, calib=True)

    e = sub.add_parser("eval", help="perplexity and KL divergence against the base model "
                                    "(llama-perplexity conventions)")
    e.add_argument("base", help="base model: Hugging Face directory or GGUF file")
    e.add_argument("outputs", nargs="*", help="models to compare with the base (GGUF files, HF, "
                                              "AWQ or EXL2 directories)")
    e.add_argument("--text", help="UTF-8 text file (default: held-out split of exllamav2's wiki.utf8)")
    e.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512; the second half is scored)")
    e.add_argument("--chunks", type=int, help="evaluate only the first N chunks")
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    common.verb_options(e, _eval)

    b = sub.add_parser("batch", help="many outputs of many models from one TOML job file, sharing "
                                     "one load and one calibration pass per model; resumable")
    b.add_argument("jobs", help="job file (TOML: [defaults] and [[model]] entries)")
    b.add_argument("-o", "--output", required=True, help="OUT_ROOT: outputs go to OUT_ROOT/<name>/")
    b.add_argument("--dry-run", action="store_true",
                   help="check the job file and print the plan (outputs, estimated disk and memory)")
    b.add_argument("--force", action="store_true",
                   help="overwrite output paths that this batch did not make")
    b.add_argument("--json", action="store_true", help="print the closing table as JSON")
    b.add_argument("--device", default=None, help="override every model's device (auto, cpu, cuda, cuda:N)")
    b.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the models as Ray tasks on the cluster at ADDRESS (or a local Ray "
                        "instance without one; one GPU per task where there are GPUs); OUT_ROOT "
                        "must be a path every node sees. Needs pip install 'quantpress[ray]'")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_debug(b)
    b.set_defaults(run=_batch)


def _gguf(args) -> int:
    if not Path(args.input).is_file():
        raise InputError(f"{args.input}: no such file (quantize gguf reads a .gguf file; "
                         f"'convert hf-to-gguf' reads Hugging Face directories)")
    return common.produce_gguf(args, args.input, args.output)


def _imatrix(args) -> int:
    from quantpress.targets import ImatrixOptions

    return common.produce(args, ImatrixOptions(), common.source(args, args.model), args.output)


def _awq(args) -> int:
    from quantpress.targets import AWQOptions

    opts = AWQOptions(bits=args.bits, group_size=args.group_size, duo_scaling=args.duo_scaling,
                      clip=args.clip, rtn=args.rtn, max_shard_size=args.max_shard_size)
    return common.produce(args, opts, common.source(args, args.model), args.output)


def _gptq(args) -> int:
    from quantpress.targets import GPTQOptions

    opts = GPTQOptions(bits=args.bits, group_size=args.group_size, sym=args.sym,
                       act_order=args.act_order, damp=args.damp, rtn=args.rtn,
                       max_shard_size=args.max_shard_size)
    return common.produce(args, opts, common.source(args, args.model), args.output)


def _fp8(args) -> int:
    from quantpress.targets import FP8Options

    opts = FP8Options(scheme=args.scheme, ignore=tuple(args.ignore), max_shard_size=args.max_shard_size,
                      lm_head=args.lm_head)
    return common.produce(args, opts, common.source(args, args.model), args.output)


def _exl2(args) -> int:
    from quantpress.targets import EXL2MeasurementOptions, EXL2Options

    if args.measure_only is not None:
        if args.measurement is not None:
            raise InputError("--measure-only and --measurement exclude each other (one writes a "
                             "measurement, the other reuses one)")
        return common.produce(args, EXL2MeasurementOptions(), common.source(args, args.model),
                              args.measure_only)
    if args.output is None:
        raise InputError("-o/--output is required (or --measure-only FILE)")
    if args.bpw is None:
        raise InputError("--bpw is required (or --measure-only FILE)")
    opts = EXL2Options(bpw=args.bpw, head_bits=args.head_bits, measurement=args.measurement,
                       objective=args.objective, max_shard_size=args.max_shard_size)
    return common.produce(args, opts, common.source(args, args.model), args.output)


def _eval(args) -> int:
    from quantpress.targets.eval import EvalOptions, evaluate

    r = evaluate(args.base, args.outputs, EvalOptions(args.text, args.ctx, args.chunks),
                 common.compute_options(args), progress=not args.quiet)
    print(json.dumps(r.to_json(), indent=1) if args.json else r.text_table())
    return 0


def _batch(args) -> int:
    from quantpress.batch import jobfile, runner

    jobs = jobfile.read_jobs(args.jobs, args.output, device=args.device)
    if args.ray is not None:
        from quantpress.batch import ray_exec

        ray_exec.check_ray()
    plans = [runner.plan_model(j, Path(args.output), args.force) for j in jobs]
    if args.dry_run:
        print(runner.plan_text(plans))
        return 0
    Path(args.output).mkdir(parents=True, exist_ok=True)
    bar = None
    if not args.quiet:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(j.outputs) for j in jobs), desc="batch", unit="output", position=0)

    def on_row(r):
        if bar is not None:
            bar.set_postfix_str(f"{r.model}: {r.path} {r.status}")
            bar.update(1)

    if args.ray is not None:
        rows = ray_exec.run_batch_ray(plans, None if args.ray == "local" else args.ray, on_row=on_row)
    else:
        rows = runner.run_plans(plans, progress=not args.quiet, on_row=on_row)
    if bar is not None:
        bar.close()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=1))
    else:
        print(runner.closing_table(rows))
    return runner.exit_code(rows)


def main(argv: list[str] | None = None) -> int:
    """``quantize`` entry point; returns the exit code (0, 1, 2 or 3)."""
    return common.main("quantize", "quantpress quantization", add_verbs, argv)


def console() -> NoReturn:
    """The ``quantize`` command (console script): :func:`main` on ``sys.argv``, then
    :func:`~quantpress.cli.common.exit_with` its code."""
    common.exit_with(main())


if __name__ == "__main__":
    console()
