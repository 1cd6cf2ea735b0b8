"""One function computed in a forked worker while this process goes on (:func:`fork_call`,
:class:`ForkedCall`): for work that holds the interpreter (imports, parsing) while this
process computes with torch, such as the GGUF metadata read beside the first tensors.
"""
from __future__ import annotations

from quantpress.workers.lifecycle import Worker, start_worker
from quantpress.workers.tracebacks import sendable


class ForkedCall:
    """``fn(*args)`` computed in a forked worker while this process goes on (:func:`fork_call`).

    :meth:`ready` polls without blocking; :meth:`result` waits and returns the value, or
    raises the call's exception as :func:`sendable` carried it (the worker's traceback in
    its ``__cause__``); a RuntimeError when the process ended without an answer (killed, out
    of memory)."""

    def __init__(self, worker: Worker):
        self._worker, self._answer = worker, None

    @property
    def pid(self) -> int:
        """The forked process's id."""
        return self._worker.pid

    def ready(self) -> bool:
        """Whether :meth:`result` would return at once."""
        if self._answer is None:
            try:
                if not self._worker.conn.poll():
                    return False
            except (EOFError, OSError):
                pass
            self._receive()
        return True

    def _receive(self) -> None:
        try:
            self._answer = self._worker.conn.recv()
        except (EOFError, OSError):
            self._answer = ("err", RuntimeError(f"the forked {self._worker.name} ended without an answer "
                                                f"(exit code {self._worker.proc.exitcode})"))
        self._worker.close()

    def close(self) -> None:
        """End the process if it has not answered (its answer is not wanted); idempotent."""
        if self._answer is None:
            self._answer = ("err", RuntimeError(f"the forked {self._worker.name} was ended unanswered"))
            self._worker.proc.terminate()
            self._worker.close()

    def result(self):
        """The call's value (waits for it); its exception is raised here."""
        if self._answer is None:
            self._receive()
        kind, value = self._answer
        if kind == "err":
            raise value
        return value


def _run_call(conn, fn, args) -> None:
    try:
        answer = ("ok", fn(*args))
    except BaseException as e:              # noqa: BLE001 -- every failure goes back
        answer = ("err", sendable(e))
    conn.send(answer)
    conn.close()


def fork_call(fn, *args, name: str = "quantpress-call") -> ForkedCall:
    """Compute ``fn(*args)`` in a forked worker (:func:`start_worker`: a copy of this process,
    importing nothing it does not need) and return its :class:`ForkedCall`; the value and
    any exception come back pickled through the pipe. For work that holds the interpreter
    (imports, parsing) while this process computes with torch: fork it only while this
    process runs no other thread. OSError when the process cannot be started (also in a
    daemonic process)."""
    return ForkedCall(start_worker(_run_call, (fn, args), name=name, duplex=False))
