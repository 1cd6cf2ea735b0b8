"""``quantize``: quantization verbs.

  quantize gguf IN-F16.gguf --policy Q4_K_M -o OUT.gguf   (llama-quantize's job, verified)
"""
from __future__ import annotations

import argparse
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        from cli.gguf_pipeline import gguf_requantize

        s = gguf_requantize(args.input, args.output, args.policy, force=args.force,
                            device=args.device, report=args.report, progress=not args.quiet)
        print(s.text())
        return 0

    return run_command(go)


if __name__ == "__main__":
    sys.exit(main())
