"""The errors that decide a command's exit code.

- :class:`InputError` (exit 2): bad input. The message names the file, tensor, key or option
  at fault and what was expected; the CLI prints its first line.
- :class:`RoundTripError` (exit 3): an output was written but re-reading it did not give back
  what was quantized; nothing is left at the output path.
- Anything else is an internal error (exit 1): a bug, an out-of-memory, a full disk.

Nothing here imports any other part of quantpress: every layer may raise these.
"""

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_ROUND_TRIP = 3


class InputError(ValueError):
    """Bad user input (a model file, a tensor, an option); the message says which and why."""


class RoundTripError(Exception):
    """An output re-read from disk differs from what the quantizer produced; the message names
    the tensor or key that differs."""
