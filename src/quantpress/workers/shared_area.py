"""Tensors between a process and its forked workers without the pipe: a :class:`SharedArea`
(an anonymous ``MAP_SHARED`` mapping made before the fork) that the child announces
(:func:`announce_ready`, touching it first where asked) before the parent copies anything
into it (:func:`wait_ready`). Tensors in shared memory of their own (``share_memory_()``) need
nothing from here: :mod:`torch.multiprocessing`'s reductions send their handles.
"""
from __future__ import annotations

import math
import mmap

import torch


class SharedArea:
    """An anonymous ``MAP_SHARED`` mapping of ``nbytes`` that a process forked after its
    creation shares with the creator (the codec and checker workers), with ``bytes``, a uint8
    tensor over it, and :meth:`view`.

    A forked worker announces it before it answers anything (:func:`announce_ready`), touching
    it first where its pages should exist before the creator copies into them (the codecs',
    written at once); the creator must not write into the area before reading that first
    answer (:func:`wait_ready`): the worker's touch would zero what it wrote (a worker slow to start, such as one left unscheduled on a
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


def announce_ready(conn, area: SharedArea, touch: bool = True) -> bool:
    """In a forked worker: touch ``area`` (:meth:`SharedArea.touch`) unless ``touch`` is
    False, then send ``("ready",)`` over ``conn``; the process that forked it writes nothing
    into the area before reading it (:func:`wait_ready`). An untouched area's pages come into
    being as either process first writes them: memory of the process tree only from then on.
    False when the pipe is closed already (the worker was ended before it started: it should
    return)."""
    if touch:
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
