"""``python -m quantpress VERB ...``: the verbs of ``convert`` and ``quantize`` in one command,
named alone (``python -m quantpress hf-to-gguf ...``) or after their command
(``python -m quantpress convert hf-to-gguf ...``, ``python -m quantpress quantize awq ...``)."""
from __future__ import annotations

import sys

from quantpress import __version__
from quantpress.cli import common, convert_main, quantize_main


def _all_verbs(sub) -> None:
    convert_main.add_verbs(sub)
    quantize_main.add_verbs(sub)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (0, 1, 2 or 3)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("convert", "quantize"):
        return (convert_main if argv[0] == "convert" else quantize_main).main(argv[1:])
    if argv in (["--version"], ["-V"]):
        print(f"quantpress {__version__}")
        return 0
    return common.main("python -m quantpress", "quantpress: verified GGUF, AWQ and EXL2 outputs "
                       "of Hugging Face models (VERB: the verbs of convert and quantize)", _all_verbs, argv)


if __name__ == "__main__":
    common.exit_with(main())
