"""The worker pool: every process-parallel job of quantpress (the GGUF codec processes, the
round trip's checker processes, the batch's side lane, forked calls) starts its processes
here and talks to them with one protocol.

* **Starting.** :func:`start_worker` starts ``target(conn, *args)`` in a child process over a
  :mod:`multiprocessing` pipe: forked by default (the child is a copy of this process: it
  imports nothing and inherits read-only state such as compiled kernels and glibc's heap
  policy), spawned where asked (the side lane, which must not inherit a parent's threads).
  Every child of this module is recorded (:func:`worker_ids`); a forked child first closes
  the pipe ends of its siblings that the fork gave it, so that only this process holds them.
* **Tensors.** They travel through shared memory, not the pipe: a :class:`SharedArea`
  (an anonymous ``MAP_SHARED`` mapping made before the fork) that the child touches and
  announces (:func:`announce_ready`) before the parent copies anything into it
  (:func:`wait_ready`), or tensors in shared memory of their own (``share_memory_()``),
  whose handles :mod:`torch.multiprocessing`'s reductions send.
* **Errors.** A request that fails in the child answers :func:`sendable` of its exception:
  unpickled in the parent it is the same exception (class and message) with
  ``__cause__`` a :class:`WorkerTraceback` holding the child's traceback as text, as
  :mod:`concurrent.futures.process` does; an exception that cannot make the trip becomes an
  InputError (for bad input) or a RuntimeError naming its class.
* **Shutdown.** A child dies with this process however it ends: it gets SIGKILL when its
  parent dies (Linux ``PR_SET_PDEATHSIG``, set when the main thread starts it: the signal
  fires when the *thread* that forked it ends, so children started by other threads rely
  on the next point), it ends when its pipe closes (this process's death closes it: the
  siblings do not hold its end), and this process ends every child when it exits
  (``atexit``): SIGINT raises KeyboardInterrupt as Python's own handler does, SIGTERM
  ``SystemExit(143)`` (instead of ending the process on the spot), so that ``finally``
  blocks remove temporary outputs before the exit ends the workers; a second signal while
  that unwinding hangs kills the workers and exits at once. The handlers are installed by
  the main thread's first start, only over Python's defaults.
  Children ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: the parent
  decides) and take SIGTERM's default.

Nothing here imports any other part of quantpress but :mod:`quantpress.errors`.
"""
from __future__ import annotations

import atexit
import ctypes
import math
import mmap
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback

import torch

from quantpress.errors import InputError

_lock = threading.RLock()


def _fresh_lock() -> None:
    # a forked child's copy of the lock may be held by the forking thread (start_worker forks
    # under it): the child starts with a free one
    global _lock
    _lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_lock)
#: (pid of the process that started them, {child pid: (process, this process's pipe end)})
_live: list = [0, {}]
_handlers_installed: list[int] = []


def _children() -> dict:
    # the record of this process's children (a forked child's copy of its parent's is not its own)
    if _live[0] != os.getpid():
        _live[0], _live[1] = os.getpid(), {}
    return _live[1]


def can_fork_workers() -> bool:
    """Whether this process may start worker processes (:mod:`multiprocessing` forbids a
    daemonic process children; the batch's side lane is one)."""
    return not multiprocessing.current_process().daemon


def worker_ids() -> list[int]:
    """Process ids of the live workers that this process started (every job's)."""
    with _lock:
        return [pid for pid, (proc, _) in _children().items() if proc.is_alive()]


def die_with_parent() -> None:
    """Have the calling process killed (SIGKILL) when the thread that started it ends (its
    parent's main thread: the process), Linux ``prctl(PR_SET_PDEATHSIG)``; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def end_workers() -> None:
    """Kill every live worker that this process started (SIGKILL; what they were doing is
    lost) and reap them. For this process's end: :func:`start_worker` registers it with
    ``atexit``, and a second SIGINT/SIGTERM calls it. This process's pipe ends stay open
    (code still unwinding reads the workers' end from them, as from workers that died)."""
    with _lock:
        procs = [proc for proc, _ in _children().values()]
        _children().clear()
    for proc in procs:
        try:
            if proc.is_alive():
                proc.kill()
        except (OSError, AttributeError, ValueError):
            pass
    for proc in procs:
        try:
            proc.join(5)
        except (OSError, AssertionError, ValueError):
            pass


_signalled: list[int] = []


def _on_signal(signum, frame) -> None:
    # the first signal unwinds the main thread (finally blocks remove temporary outputs and
    # end the jobs' workers; atexit ends the rest); a second one, while that hangs, ends the
    # workers and the process at once
    if _signalled == [os.getpid()]:
        end_workers()
        os._exit(128 + signum)
    _signalled[:] = [os.getpid()]
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    # once per process, from its main thread, and only over Python's own handlers: an
    # embedding program's handlers are left alone (atexit still ends the workers)
    if _handlers_installed == [os.getpid()] or threading.current_thread() is not threading.main_thread():
        return
    _handlers_installed[:] = [os.getpid()]
    atexit.register(end_workers)
    for sig, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        try:
            if signal.getsignal(sig) is default:
                signal.signal(sig, _on_signal)
        except (ValueError, OSError):
            pass


def _child_main(target, conn, args, inherited, parent: int, pdeath: bool) -> None:
    # a worker's first steps, whatever its job: signals, dying with the parent, the pipe ends
    # of its siblings closed (only the parent holds them, so that its death closes them)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if pdeath:
        die_with_parent()
    if os.getppid() != parent:              # the parent died before prctl took effect
        os._exit(1)
    for end in inherited:
        try:
            end.close()
        except OSError:
            pass
    target(conn, *args)


class Worker:
    """A started worker: ``proc`` (its :class:`multiprocessing.Process`), ``conn`` (this
    process's end of its pipe), ``name`` and ``pid``."""

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn

    @property
    def name(self) -> str:
        """The process's name (given to :func:`start_worker`)."""
        return self.proc.name

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def is_alive(self) -> bool:
        """Whether the process runs."""
        return self.proc.is_alive()

    def died(self, what: str) -> RuntimeError:
        """Reap the process (after it ended or was killed: waits up to 5 s) and return the
        error that says so: ``"<what> <name> died (exit code N)"``."""
        self.proc.join(5)
        self.forget()
        return RuntimeError(f"{what} {self.name} died (exit code {self.proc.exitcode})")

    def forget(self) -> None:
        """Close this process's end of the pipe and drop the worker from the record."""
        with _lock:
            _children().pop(self.proc.pid, None)
        try:
            self.conn.close()
        except OSError:
            pass

    def close(self, timeout: float = 5) -> None:
        """End the worker: its pipe closes (it ends at its next read), and it is killed when
        still running ``timeout`` seconds later. Idempotent."""
        self.forget()
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def kill(self) -> None:
        """Kill the worker now (SIGKILL) and reap it."""
        self.proc.kill()
        self.proc.join()
        self.forget()


def start_worker(target, args: tuple = (), name: str = "quantpress-worker", method: str = "fork",
                 duplex: bool = True) -> Worker:
    """Start ``target(conn, *args)`` in a daemonic child process (see the module docstring:
    its signals, its death with this process, the siblings' pipe ends it closes) and return
    its :class:`Worker`. ``conn``: the child's end of a new pipe (``duplex`` False: the child
    only sends). ``method``: "fork" (a copy of this process, at once; fork only while no
    other thread of this process holds a lock the child needs) or "spawn" (a fresh
    interpreter: ``target`` and ``args`` are pickled; slow to start, inherits nothing).
    Raises OSError when it cannot be started (also in a daemonic process)."""
    if not can_fork_workers():
        raise OSError("a daemonic process cannot start workers")
    ctx = multiprocessing.get_context(method)
    if duplex:
        mine, theirs = ctx.Pipe()
    else:
        mine, theirs = ctx.Pipe(duplex=False)
    _install_handlers()
    pdeath = threading.current_thread() is threading.main_thread()
    with _lock:
        # a forked child inherits these ends: it closes them first thing (a spawned one
        # inherits no descriptor but its own end)
        inherited = [c for _, c in _children().values()] + [mine] if method == "fork" else []
        proc = ctx.Process(target=_child_main, args=(target, theirs, tuple(args), inherited, os.getpid(), pdeath),
                           daemon=True, name=name)
        try:
            proc.start()
        finally:
            theirs.close()
        _children()[proc.pid] = (proc, mine)
    return Worker(proc, mine)


# --------------------------------------------------------------------------------------------
# errors


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


# --------------------------------------------------------------------------------------------
# shared memory


class SharedArea:
    """An anonymous ``MAP_SHARED`` mapping of ``nbytes`` that a process forked after its
    creation shares with the creator (the codec and checker workers), with ``bytes``, a uint8
    tensor over it, and :meth:`view`.

    A forked worker touches it and says so before it answers anything (:func:`announce_ready`),
    so that the area's pages exist before the creator copies into them; the creator must not
    write into the area before reading that first answer (:func:`wait_ready`): the worker's
    touch would zero what it wrote (a worker slow to start, such as one left unscheduled on a
    busy machine, made the round trip fail on zeros, tests/test_gguf_many.py)."""

    def __init__(self, nbytes: int):
        self.size = nbytes
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED)
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)

    def touch(self) -> None:
        """Fault in every page (zero-filling the area)."""
        self.bytes.fill_(0)

    def view(self, start: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` lying at byte ``start`` of the area."""
        return self.bytes[start:start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def close(self) -> None:
        """Unmap the area (left mapped while a view of it is still alive)."""
        self.bytes = None
        try:
            self.map.close()
        except BufferError:
            pass


def announce_ready(conn, area: SharedArea) -> bool:
    """In a forked worker: touch ``area`` (:meth:`SharedArea.touch`), then send ``("ready",)``
    over ``conn``; the process that forked it writes nothing into the area before reading it
    (:func:`wait_ready`). False when the pipe is closed already (the worker was ended before
    it started: it should return)."""
    area.touch()
    try:
        conn.send(("ready",))
    except OSError:
        return False
    return True


def wait_ready(conn) -> bool:
    """Read a forked worker's ``("ready",)`` (:func:`announce_ready`) from ``conn``: True, or
    False when the worker ended first (its pipe closed)."""
    try:
        return conn.recv() == ("ready",)
    except (EOFError, OSError):
        return False


# --------------------------------------------------------------------------------------------
# forked calls


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
