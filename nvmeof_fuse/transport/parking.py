"""Callers parked on their queue's commands, and the watchdog that times them out.

Both transports park a caller on its command's request without a cancel scope
per command: the target may still be moving data into the caller's memory, so
a caller may not leave early.  One watchdog task per queue sleeps until the
earliest deadline of a parked caller and has the queue expire those past it.
A request is any object with ``cid``, ``task``, ``deadline`` and ``timeout``; a queue
shows the watchdog only those whose caller still waits (a command started with a
callback, on RDMA, is watched by :meth:`Watchdog.watch` without a task parked).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import outcome
import trio

from ..errors import CommandTimeout, TransportError


def uncancellable(raise_cancel) -> trio.lowlevel.Abort:
    """A command is waited for, not cancelled: the target may still be moving data."""
    return trio.lowlevel.Abort.FAILED


class Watchdog:
    """The deadlines of one queue's parked callers."""

    def __init__(self, requests: Callable[[], Iterable[Any]],
                 expire: Callable[[float], None]) -> None:
        self._requests = requests  # the queue's requests in flight with a caller waiting
        self._expire = expire  # the queue's: time out (or fail for) those past ``now``
        self._scope: trio.CancelScope | None = None

    async def park(self, request: Any, timeout: float) -> None:
        """Wait, not cancellable, until ``request`` is finished or its ``timeout`` passed
        (then whoever lets the caller go hands it the error)."""
        request.task = trio.lowlevel.current_task()
        self.watch(request, timeout)
        await trio.lowlevel.wait_task_rescheduled(uncancellable)

    def watch(self, request: Any, timeout: float) -> None:
        """Give ``request`` its deadline, ``timeout`` s from now."""
        request.timeout = timeout
        request.deadline = deadline = trio.current_time() + timeout
        scope = self._scope
        if scope is not None and deadline < scope.deadline:
            scope.deadline = deadline

    def cut(self, deadline: float) -> None:
        """End every wait in flight by ``deadline`` (trio time) at the latest: the mount
        stops.  A request keeps as its ``timeout`` what it had in all, for its message."""
        for request in self._requests():
            if request.deadline > deadline:
                request.timeout = round(request.timeout - (request.deadline - deadline), 2)
                request.deadline = deadline
        scope = self._scope
        if scope is not None and deadline < scope.deadline:
            scope.deadline = deadline

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Sleep until the earliest deadline of a waiting caller (parked, or a callback);
        then expire (forever)."""
        task_status.started()
        while True:
            earliest = min((r.deadline for r in self._requests()), default=math.inf)
            with trio.CancelScope(deadline=earliest) as self._scope:
                await trio.sleep_forever()
            self._expire(trio.current_time())


def timeout_error(request: Any, queue_name: str, note: str = "") -> CommandTimeout:
    """What the caller of a timed-out command is told (``note`` says what became of it)."""
    return CommandTimeout(f"{queue_name}: command {request.cid} got no completion within "
                          f"{request.timeout:g} s{note}")


def closed_for_timeout(request: Any, queue_name: str) -> TransportError:
    """What the other commands of a queue closed for ``request``'s timeout fail with."""
    return TransportError(f"{queue_name}: closed as command {request.cid} timed out "
                          "(the target may still move its data)")


def time_out(request: Any, queue_name: str) -> None:
    """Let ``request``'s parked caller go with CommandTimeout.  The queue must have been
    stopped first: the caller may reuse its memory at once."""
    task, request.task = request.task, None
    trio.lowlevel.reschedule(task, outcome.Error(timeout_error(request, queue_name)))


def for_caller(error: Exception) -> Exception:
    """A copy of a queue's shared ``error`` for one caller to raise: raised itself, it would
    gather every caller's frames on its traceback, and with them the memory they refer to."""
    return copy.copy(error)


def unsent(error: Exception) -> Exception:
    """:func:`for_caller` for a command that failed before it was sent (its queue had
    failed): it costs the command no try."""
    error = copy.copy(error)
    error.sent = False  # type: ignore[attr-defined]
    return error
