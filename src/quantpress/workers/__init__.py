"""The worker pool: every process-parallel job of quantpress (the GGUF codec processes, the
round trip's checker processes, the batch's side lane, forked calls) starts its processes
here and talks to them with one protocol. Its parts, by concern:

* **Starting and ending** (:mod:`.lifecycle`): :func:`start_worker` starts
  ``target(conn, *args)`` in a child process over a :mod:`multiprocessing` pipe, forked by
  default (the child is a copy of this process: it imports nothing and inherits read-only
  state such as compiled kernels and glibc's heap policy), spawned where asked (the side
  lane, which must not inherit a parent's threads). Every child is recorded
  (:func:`worker_ids`) and dies with this process however it ends (``PR_SET_PDEATHSIG``, its
  pipe closing, :func:`end_workers` at exit; SIGINT / SIGTERM unwind the main thread first).
* **Tensors** (:mod:`.shared_area`): they travel through shared memory, not the pipe: a
  :class:`SharedArea` that the child touches and announces (:func:`announce_ready`) before
  the parent copies anything into it (:func:`wait_ready`), or tensors in shared memory of
  their own (``share_memory_()``), whose handles :mod:`torch.multiprocessing` sends.
* **Errors** (:mod:`.tracebacks`): a request that fails in the child answers
  :func:`sendable` of its exception, re-raised in the parent as the same exception with the
  child's traceback in its ``__cause__`` (:class:`WorkerTraceback`).
* **Forked calls** (:mod:`.forked_calls`): :func:`fork_call` computes one function in a
  forked worker while this process goes on.

The jobs import these names from here. Nothing in this package imports any other part of
quantpress but :mod:`quantpress.errors`.
"""
from quantpress.workers.forked_calls import ForkedCall, fork_call
from quantpress.workers.lifecycle import (Worker, can_fork_workers, die_with_parent, end_workers,
                                          start_worker, worker_ids)
from quantpress.workers.shared_area import SharedArea, announce_ready, wait_ready
from quantpress.workers.tracebacks import WorkerTraceback, sendable

__all__ = ["ForkedCall", "SharedArea", "Worker", "WorkerTraceback", "announce_ready",
           "can_fork_workers", "die_with_parent", "end_workers", "fork_call", "sendable",
           "start_worker", "wait_ready", "worker_ids"]
