"""Errors raised for bad input. Every message names the file, tensor or key at fault and
what was expected; the CLI prints it on one line and exits non-zero."""


class InputError(ValueError):
    """Bad user input (a model file, a tensor, an option); the message says which and why."""
