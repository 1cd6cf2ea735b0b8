"""``convert``: format conversion verbs.

  convert hf-to-gguf MODEL_DIR --policy Q4_K_M -o model-Q4_K_M.gguf [--imatrix FILE|auto]
                     [--tensor-type PATTERN=TYPE ...] [--pure] [--force] [--report r.json]
  convert inspect FILE.gguf [--json]
"""
from __future__ import annotations

import json
from typing import NoReturn
from pathlib import Path

from quantpress.cli import common
from quantpress.errors import InputError


def add_verbs(sub) -> None:
    """Add the ``convert`` verbs to an argparse subparsers object."""
    from quantpress.convert.gguf_policy import POLICIES

    h = sub.add_parser("hf-to-gguf", help="Hugging Face FP16/BF16 directory -> verified GGUF file")
    h.add_argument("model_dir", help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    h.add_argument("-o", "--output", required=True, help="output .gguf path")
    h.add_argument("--policy", default="F16", choices=POLICIES, help="llama.cpp ftype (default F16)")
    h.add_argument("--force", action="store_true", help="overwrite an existing output")
    h.add_argument("--report", help="also write the summary with every tensor's round-trip figures "
                                    "(RMSE, max error, SNR) as JSON")
    h.add_argument("--json", action="store_true", help="print the summary as JSON")
    common.add_gguf_options(h)
    common.verb_options(h, _hf_to_gguf, calib=True)
    i = sub.add_parser("inspect", help="metadata and per-tensor table of any GGUF file")
    i.add_argument("file")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    common.verb_options(i, _inspect, compute=False)


def _hf_to_gguf(args) -> int:
    from quantpress.convert.gguf_load import is_gguf

    if is_gguf(Path(args.model_dir)):
        raise InputError(f"{args.model_dir}: a GGUF file; 'quantize gguf' requantizes GGUF files, "
                         f"hf-to-gguf reads Hugging Face directories")
    return common.produce_gguf(args, args.model_dir, args.output)


def _inspect(args) -> int:
    from quantpress.convert.gguf_inspect import format_inspection, inspect_gguf

    info = inspect_gguf(args.file)
    print(json.dumps(info, indent=1) if args.json else format_inspection(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``convert`` entry point; returns the exit code (0, 1, 2 or 3)."""
    return common.main("convert", "quantpress format conversion", add_verbs, argv)


def console() -> NoReturn:
    """The ``convert`` command (console script): :func:`main` on ``sys.argv``, then
    :func:`~quantpress.cli.common.exit_with` its code."""
    common.exit_with(main())


if __name__ == "__main__":
    console()
