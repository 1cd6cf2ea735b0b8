"""The side lane of a local ``quantize batch``: a child process that writes a model's GGUF
policies and scores its outputs while this process runs the calibrated passes.

Why a process and not a thread: the passes are many small torch ops issued from Python, so
two stages in threads of one process wait on each other's interpreter lock, each op's
dispatch holding it (``scripts/micro_figures.py`` prints what a codec slice's dispatches cost
beyond its work); in another process they do not. The child runs at the lowest CPU priority (nice 19, :data:`SIDE_NICE`) on one torch
intra-op thread, so it takes the cycles the pass leaves idle, and its bytes are those of the
same stage run anywhere else; it is a worker of :mod:`quantpress.workers` (spawned), so it
dies with its parent and a killed batch leaves no writer behind. It keeps one
:class:`~quantpress.targets.eval.Evaluation` per model: the source is scored once, each
stage's outputs as that stage finishes.

The protocol is the worker pool's pipe with pickled tuples (a failed request's exception
carries the child's traceback, :func:`quantpress.workers.sendable`); the parent
(:func:`quantpress.batch.runner.run_model`) decides what runs where and when, and alone
records outcomes, writes the manifest and renames the outputs into place: the child leaves
each verified output among the model's verified outputs
(:func:`quantpress.batch.stage_work.run_stage`), so that a batch killed before the parent
wrote an output's entry leaves no output its manifest does not know.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from quantpress.workers import sendable, start_worker

#: CPU priority (nice value) of the side lane's process
SIDE_NICE = 19


def _serve(conn) -> None:
    """The child's loop: requests ``(kind, plan, payload)`` with kind "stage" (payload: the
    (output, options) pairs of :meth:`ModelRun.start`) or "eval" (payload: the paths to score
    and how many of them at once, ``Evaluation.report``'s ``side_by_side``),
    or ``("close", plan, None)`` (forget that model's evaluation); answers with events
    ``("outcome", Outcome)``, ``("eval", EvalReport)``, ``("log", str)`` and a last
    ``("done", exception or None)`` per request. Ends when the pipe closes."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(SIDE_NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    except (OSError, AttributeError):
        pass
    import torch

    from quantpress.batch.stage_work import open_source, run_stage
    from quantpress.targets.eval import Evaluation

    torch.set_num_threads(1)
    sources: dict = {}
    evaluations: dict = {}
    while True:
        try:
            kind, plan, payload = conn.recv()
        except (EOFError, OSError):
            return
        if kind == "close":
            sources.pop(plan.dir, None)
            ev = evaluations.pop(plan.dir, None)
            if ev is not None:
                ev.close()
            continue
        error = None
        try:
            with torch.no_grad():
                if kind == "eval":
                    if plan.dir not in evaluations:
                        job = plan.job
                        evaluations[plan.dir] = Evaluation(job.source, job.eval, job.compute, progress=False)
                    paths, side_by_side = payload
                    conn.send(("eval", evaluations[plan.dir].report([plan.dir / p for p in paths], side_by_side)))
                else:
                    if plan.dir not in sources:
                        sources[plan.dir] = open_source(plan)
                    run_stage(plan, payload, sources[plan.dir], lambda oc: conn.send(("outcome", oc)),
                              False, lambda m: conn.send(("log", m)))
        except Exception as e:  # noqa: BLE001 - the request's failure, sent back
            error = sendable(e)
        conn.send(("done", error))


class SideLane:
    """The parent's handle on the side lane's process (started on the first request; again
    after it died). One request at a time: :meth:`start` sends it and a reader thread hands
    each event the child sends to ``put``; when the child dies mid-request, ``put`` gets
    ``("done", RuntimeError)`` naming its exit code. :meth:`close` ends the child."""

    def __init__(self):
        self._proc = None
        self._conn = None
        self._worker = None

    def _spawn(self) -> None:
        self._worker = start_worker(_serve, name="quantpress-side", method="spawn")
        self._proc, self._conn = self._worker.proc, self._worker.conn

    @property
    def pid(self) -> int | None:
        """The process id of the child, None before the first request."""
        return None if self._proc is None else self._proc.pid

    def start(self, kind: str, plan, payload: Any, put: Callable[[tuple], None]) -> None:
        """Send one request (see :func:`_serve`); its events go to ``put`` from a reader thread."""
        if self._proc is None or not self._proc.is_alive():
            self._spawn()
        conn, proc = self._conn, self._proc
        conn.send((kind, plan, payload))

        def read() -> None:
            while True:
                try:
                    ev = conn.recv()
                except (EOFError, OSError):
                    proc.join(5)
                    put(("done", RuntimeError(f"the side process ({kind}) exited with code {proc.exitcode}")))
                    return
                put(ev)
                if ev[0] == "done":
                    return

        threading.Thread(target=read, name="quantpress-side-reader", daemon=True).start()

    def forget(self, plan) -> None:
        """Drop what the child keeps for ``plan``'s model (its source, its evaluation)."""
        if self._proc is not None and self._proc.is_alive():
            self._conn.send(("close", plan, None))

    def close(self) -> None:
        """End the child (it finishes nothing more)."""
        if self._proc is not None:
            self._worker.close(10)
            self._proc = self._conn = self._worker = None
