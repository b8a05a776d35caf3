"""A command in flight on an NVMe/TCP queue, as the queue, its reader and its sender see it."""

from __future__ import annotations

import math
from collections.abc import Callable

from ...nvme import Completion
from ..region import DataRef
from .data import data_view


class Request:
    """One command in flight on a TCP queue.

    Its caller is parked on it (``task``), without a cancel scope, until the
    receive task finishes it or the queue's watchdog times it out.  ``unsent``
    counts its PDUs still queued for the socket: they read the caller's memory,
    so the caller is not let go while any is left.  Only the
    trio thread changes it; the receiver thread reads ``cid``, ``data``, ``view``
    and ``to_controller``, which never change while the command is in flight.
    """

    __slots__ = ("cid", "serial", "data", "view", "to_controller", "in_capsule", "completion",
                 "error", "finished", "unsent", "task", "done", "deadline", "timeout")

    def __init__(self, cid: int, data: DataRef | None, to_controller: bool,
                 serial: int = 0, in_capsule: bool = False) -> None:
        self.cid = cid
        self.serial = serial
        """Which use of ``cid`` this is (per queue): the reader remembers answered commands
        by it, so that it holds no request, and with it no caller memory, once answered."""
        self.data = data
        self.view = data_view(data) if data is not None else None  # the caller's bytes
        self.to_controller = to_controller
        self.in_capsule = in_capsule
        """A write whose data rides in its capsule; any other write's data goes only where
        the target's R2Ts ask (the reader checks that they asked for all of it)."""
        self.completion: Completion | None = None
        self.error: Exception | None = None
        self.finished = False
        """The caller may go on: answered with nothing left to send, or failed."""
        self.unsent = 0
        self.task = None  # the trio task parked on this request, if any
        self.done: Callable[[Request], None] | None = None  # or the callback told its end
        self.deadline = math.inf
        self.timeout = 0.0

    def buffer(self) -> memoryview:
        assert self.view is not None
        return self.view
