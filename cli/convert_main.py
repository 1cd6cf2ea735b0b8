"""``convert``: format conversion verbs.

  convert hf-to-gguf MODEL_DIR --policy Q4_K_M -o model-Q4_K_M.gguf [--force] [--report r.json]
  convert inspect FILE.gguf [--json]
"""
from __future__ import annotations

import argparse
import json
import sys

from cli.common import run_command


def build_parser() -> argparse.ArgumentParser:
    from convert.gguf_policy import POLICIES

    p = argparse.ArgumentParser(prog="convert", description="quantpress format conversion")
    sub = p.add_subparsers(dest="verb", required=True)
    h = sub.add_parser("hf-to-gguf", help="Hugging Face FP16/BF16 directory -> verified GGUF file")
    h.add_argument("model_dir", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    h.add_argument("-o", "--output", required=True, help="output .gguf path")
    h.add_argument("--policy", default="F16", choices=POLICIES, help="llama.cpp ftype (default F16)")
    h.add_argument("--force", action="store_true", help="overwrite an existing output")
    h.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    h.add_argument("--report", help="write the round-trip report (per-tensor RMSE, max error, SNR) as JSON")
    h.add_argument("--quiet", action="store_true", help="no progress bars")
    i = sub.add_parser("inspect", help="metadata and per-tensor table of any GGUF file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def go() -> int:
        if args.verb == "hf-to-gguf":
            from cli.gguf_pipeline import hf_to_gguf

            s = hf_to_gguf(args.model_dir, args.output, args.policy, force=args.force,
                           device=args.device, report=args.report, progress=not args.quiet)
            print(s.text())
            return 0
        from convert.gguf_inspect import format_inspection, inspect_gguf

        info = inspect_gguf(args.file)
        print(json.dumps(info, indent=1) if args.json else format_inspection(info))
        return 0

    return run_command(go)


if __name__ == "__main__":
    sys.exit(main())
