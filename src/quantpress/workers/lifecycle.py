"""Starting worker processes and ending them: :func:`start_worker` (fork or spawn, over a
:mod:`multiprocessing` pipe), the record of this process's children (:func:`worker_ids`),
and the shutdown that leaves no child behind (:func:`end_workers`, the SIGINT / SIGTERM
handlers, ``PR_SET_PDEATHSIG``).

A child dies with this process however it ends: it gets SIGKILL when its parent dies (Linux
``PR_SET_PDEATHSIG``, set when the main thread starts it: the signal fires when the *thread*
that forked it ends, so children started by other threads rely on the next point), it ends
when its pipe closes (this process's death closes it: a forked child first closes the pipe
ends of its siblings that the fork gave it, so that only this process holds them), and this
process ends every child when it exits (``atexit``). SIGINT raises KeyboardInterrupt as
Python's own handler does and SIGTERM ``SystemExit(143)`` (instead of ending the process on
the spot), so that ``finally`` blocks remove temporary outputs before the exit ends the
workers; a second signal while that unwinding hangs kills the workers and exits at once.
The handlers are installed by the main thread's first start, only over Python's defaults.
Children ignore SIGINT (a terminal's Ctrl-C reaches the whole process group: the parent
decides) and take SIGTERM's default.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading

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


def name_process(name: str) -> None:
    """Set the calling process's name as ``ps``, ``top`` and ``/proc/<pid>/comm`` show it
    (Linux ``prctl(PR_SET_NAME)``, at most 15 bytes: a leading ``quantpress-`` becomes
    ``qp-``, the rest is cut); elsewhere a no-op. Workers carry their job's name
    (``quantpress-check-0`` shows as ``qp-check-0``), so that a process listing or a memory
    trace (scripts/trace_memory.py) tells them apart."""
    if name.startswith("quantpress-"):
        name = "qp-" + name[len("quantpress-"):]
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15] + b"\0")  # PR_SET_NAME
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
    name_process(multiprocessing.current_process().name)
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
        if method == "fork":
            # the objects this process holds now go to the collector's permanent generation in
            # the child: its collections (every import it makes triggers some) then do not
            # write into their headers, and their pages stay shared (copy-on-write) instead of
            # being copied into the child; this process takes them back at once
            gc.freeze()
        try:
            proc.start()
        finally:
            if method == "fork":
                gc.unfreeze()
            theirs.close()
        _children()[proc.pid] = (proc, mine)
    return Worker(proc, mine)
