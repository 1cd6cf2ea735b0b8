"""``quantize``: quantization verbs.

  quantize gguf IN-F16.gguf --policy Q4_K_M -o OUT.gguf   (llama-quantize's job, verified)
  quantize imatrix MODEL -o imatrix.gguf [--calib FILE] [--samples N --seqlen L]
  quantize exl2 MODEL --bpw 4.25 -o OUT_DIR [--head-bits 6] [--measurement FILE | --measure-only FILE]
  quantize eval BASE [OUTPUT ...] [--text FILE] [--ctx 512] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

from cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    from convert.gguf_policy import POLICIES

    p = argparse.ArgumentParser(prog="quantize", description="quantpress quantization")
    sub = p.add_subparsers(dest="verb", required=True)
    g = sub.add_parser("gguf", help="requantize an F32/F16/BF16 GGUF with a llama.cpp policy")
    g.add_argument("input", help="input .gguf (F32/F16/BF16 tensors)")
    g.add_argument("-o", "--output", required=True, help="output .gguf path")
    g.add_argument("--policy", required=True, choices=POLICIES, help="llama.cpp ftype, e.g. Q4_K_M")
    g.add_argument("--force", action="store_true", help="overwrite an existing output")
    g.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    g.add_argument("--report", help="write the round-trip report as JSON")
    g.add_argument("--quiet", action="store_true", help="no progress bars")

    m = sub.add_parser("imatrix", help="llama.cpp importance matrix (GGUF imatrix file for "
                                       "llama-quantize --imatrix)")
    m.add_argument("model", help="Hugging Face model directory or GGUF file")
    m.add_argument("-o", "--output", required=True, help="output imatrix .gguf path")
    _calib(m)
    _common(m)
    m.add_argument("--force", action="store_true", help="overwrite an existing output")
    m.add_argument("--json", action="store_true", help="print the summary as JSON")

    a = sub.add_parser("awq", help="AWQ (activation-aware) 4-bit quantization to an AutoAWQ "
                                   "GEMM directory (vLLM, transformers)")
    a.add_argument("model", help="Hugging Face model directory (FP16/BF16/F32 safetensors)")
    a.add_argument("-o", "--output", required=True, help="output directory")
    a.add_argument("--bits", type=int, default=4, help="weight bits (4: the GEMM layout)")
    a.add_argument("--group-size", type=int, default=128,
                   help="input columns per scale and zero point (default 128; 64 for widths like 576)")
    _calib(a)
    a.add_argument("--no-clip", dest="clip", action="store_false", help="skip the clipping search")
    a.add_argument("--duo-scaling", dest="duo_scaling", action="store_true", default=True,
                   help="s = x^r / w^(1-r) (default, AutoAWQ)")
    a.add_argument("--no-duo-scaling", dest="duo_scaling", action="store_false",
                   help="s = x^r (the original llm-awq grid)")
    a.add_argument("--rtn", action="store_true",
                   help="plain round-to-nearest (no calibration), same quantizer and packing: the baseline")
    a.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    _common(a)
    a.add_argument("--force", action="store_true", help="overwrite an existing output")
    a.add_argument("--json", action="store_true", help="print the summary as JSON")

    x = sub.add_parser("exl2", help="EXL2 (exllamav2 0.3.2) mixed-bit GPTQ quantization to a target "
                                    "bits per weight")
    x.add_argument("model", help="Hugging Face model directory (FP16/BF16/F32 safetensors)")
    x.add_argument("-o", "--output", help="output directory (required unless --measure-only)")
    x.add_argument("--bpw", type=float, help="target bits per weight of the decoder layers "
                                             "(exllamav2 -b; required unless --measure-only)")
    x.add_argument("--head-bits", type=int, default=6, help="lm_head bits: 2, 3, 4, 5, 6 or 8 (default 6)")
    x.add_argument("--measurement", help="reuse this measurement.json (skips the measurement pass)")
    x.add_argument("--measure-only", metavar="FILE", help="only measure; write measurement.json to FILE")
    _calib(x)
    x.add_argument("--objective", default="content", choices=("content", "sum", "max"),
                   help="bit allocation: minimize the sum of squared module errors relative to "
                        "the norm of the non-sink tokens (content, default), the sum of "
                        "exllamav2's module errors (sum) or their maximum (max, exllamav2's intent)")
    x.add_argument("--max-shard-size", type=float, default=8192,
                   help="MB per output file (exllamav2 -ss; default 8192, 0 = one file)")
    _common(x)
    x.add_argument("--force", action="store_true", help="overwrite an existing output")
    x.add_argument("--json", action="store_true", help="print the summary as JSON")

    e = sub.add_parser("eval", help="perplexity and KL divergence against the base model "
                                    "(llama-perplexity conventions)")
    e.add_argument("base", help="base model: Hugging Face directory or GGUF file")
    e.add_argument("outputs", nargs="*", help="models to compare with the base (GGUF files, HF directories)")
    e.add_argument("--text", help="UTF-8 text file (default: held-out split of exllamav2's wiki.utf8)")
    e.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512; the second half is scored)")
    e.add_argument("--chunks", type=int, help="evaluate only the first N chunks")
    _common(e)
    e.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _calib(p: argparse.ArgumentParser, samples: int = 128, seqlen: int = 512) -> None:
    """The calibration-data options shared by the calibrating verbs."""
    p.add_argument("--calib", help="calibration text: .txt/.utf8/.md (one document), .json/.jsonl "
                                   "or .parquet, a datasets folder, or a dataset name "
                                   "owner/name[:config][@split] when online (default: calibration "
                                   "split of exllamav2's wiki.utf8)")
    p.add_argument("--calib-field", default="text", help="text column of a JSON/Parquet file (default text)")
    p.add_argument("--samples", type=int, default=samples, help=f"calibration rows (default {samples})")
    p.add_argument("--seqlen", type=int, default=seqlen, help=f"tokens per row (default {seqlen})")
    p.add_argument("--seed", type=int, default=0, help="row selection seed (default 0)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="compute dtype (default float32)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per forward batch (default 4096)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        if args.verb == "imatrix":
            from cli.calib_pipeline import compute_imatrix

            s = compute_imatrix(args.model, args.output, calib=args.calib, calib_field=args.calib_field,
                                samples=args.samples, seqlen=args.seqlen, seed=args.seed,
                                device=args.device, dtype=args.dtype, batch_tokens=args.batch_tokens,
                                force=args.force, progress=not args.quiet)
            print(json.dumps(s.to_json(), indent=1) if args.json else s.text())
            return 0
        if args.verb == "awq":
            from cli.awq_pipeline import quantize_awq

            s = quantize_awq(args.model, args.output, bits=args.bits, group_size=args.group_size,
                             duo_scaling=args.duo_scaling, clip=args.clip, rtn=args.rtn,
                             calib=args.calib, calib_field=args.calib_field, samples=args.samples,
                             seqlen=args.seqlen, seed=args.seed, device=args.device, dtype=args.dtype,
                             batch_tokens=args.batch_tokens, max_shard_size=args.max_shard_size,
                             force=args.force, progress=not args.quiet)
            print(json.dumps(s.to_json(), indent=1) if args.json else s.text())
            return 0
        if args.verb == "exl2":
            from cli.exl2_pipeline import quantize_exl2

            s = quantize_exl2(args.model, args.output, bpw=args.bpw, head_bits=args.head_bits,
                              measurement=args.measurement, measure_only=args.measure_only,
                              calib=args.calib, calib_field=args.calib_field, samples=args.samples,
                              seqlen=args.seqlen, seed=args.seed, device=args.device, dtype=args.dtype,
                              batch_tokens=args.batch_tokens, max_shard_size=args.max_shard_size,
                              force=args.force, progress=not args.quiet, objective=args.objective)
            print(json.dumps(s.to_json(), indent=1) if args.json else s.text())
            return 0
        if args.verb == "eval":
            from cli.calib_pipeline import evaluate

            r = evaluate(args.base, args.outputs, text=args.text, ctx=args.ctx, chunks=args.chunks,
                         device=args.device, dtype=args.dtype, batch_tokens=args.batch_tokens,
                         progress=not args.quiet)
            print(json.dumps(r.to_json(), indent=1) if args.json else r.text_table())
            return 0
        from cli.gguf_pipeline import gguf_requantize

        s = gguf_requantize(args.input, args.output, args.policy, force=args.force,
                            device=args.device, report=args.report, progress=not args.quiet)
        print(s.text())
        return 0

    return run_command(go)


if __name__ == "__main__":
    sys.exit(main())
