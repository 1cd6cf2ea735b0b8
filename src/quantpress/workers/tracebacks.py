"""A worker's exception carried back to its parent: a request that fails in the child
answers :func:`sendable` of its exception; unpickled in the parent it is the same exception
(class and message) with ``__cause__`` a :class:`WorkerTraceback` holding the child's
traceback as text, as :mod:`concurrent.futures.process` does. An exception that cannot make
the trip becomes an InputError (for bad input) or a RuntimeError naming its class.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback

from quantpress.errors import InputError


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (the ``__cause__`` of the
    exception that :func:`sendable` carried to the parent)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _rebuild(exc: BaseException, text: str) -> BaseException:
    exc.__cause__ = WorkerTraceback(text)
    return exc


class _Carried:
    # what sendable() returns: pickles as the exception, rebuilt with its traceback text
    def __init__(self, exc: BaseException, text: str):
        self.exc, self.text = exc, text

    def __reduce__(self):
        return _rebuild, (self.exc, self.text)


def sendable(e: BaseException):
    """What a worker sends back for its exception ``e``: an object that unpickles in the
    parent as ``e`` (same class and message; else an InputError with its message when ``e``
    is one, a RuntimeError ``"<class>: <message>"`` otherwise) whose ``__cause__`` is a
    :class:`WorkerTraceback` with the worker's traceback (process name and id, then
    :func:`traceback.format_exception`'s text). Only for sending through a pipe."""
    text = "".join(traceback.format_exception(e))
    text = f"in {multiprocessing.current_process().name} (pid {os.getpid()}):\n{text}"
    try:
        same = pickle.loads(pickle.dumps(e))
        ok = type(same) is type(e) and str(same) == str(e)
    except Exception:  # noqa: BLE001 - any exception that does not survive pickling
        ok = False
    if not ok:
        e = InputError(str(e)) if isinstance(e, InputError) else RuntimeError(f"{type(e).__name__}: {e}")
    e.__traceback__ = None          # (the frames stay here)
    return _Carried(e, text)
