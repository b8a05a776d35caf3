"""The one bridge from a queue's threads into trio.

A queue's threads (the TCP receiver thread, the threads sending bulk data) never
touch the queue's trio-side state: they post messages, and the trio thread
handles them in the order they were posted, in batches.  One ``run_sync_soon``
wakes the trio thread per batch however many messages arrive meanwhile, and
:meth:`Mailbox.drain` hands over what waits at once (the watchdog does, before
it judges deadlines).  A thread's end is a message too
(:meth:`Mailbox.run_in_thread`), so the trio thread learns of a thread's work
and of its end in the order they happened, by the same road.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import outcome
import trio

from .parking import uncancellable


class _Done:
    """A thread's end: wake ``task`` with the thread's ``result``."""

    __slots__ = ("task", "result")

    def __init__(self, task: trio.lowlevel.Task, result: outcome.Outcome) -> None:
        self.task = task
        self.result = result


class Mailbox:
    """Messages from threads to one trio thread's ``handle(list)``, in order, batched."""

    def __init__(self, handle: Callable[[list], None]) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._handle = handle
        self._lock = threading.Lock()
        self._items: list = []
        self._scheduled = False  # a wakeup of the trio thread is on its way

    def post(self, items: list) -> None:
        """Any thread: queue ``items`` for the trio thread.  Raises trio.RunFinishedError
        once trio's run is over (no one will read them)."""
        with self._lock:
            self._items.extend(items)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._token.run_sync_soon(self._wakeup)
        except trio.RunFinishedError:
            with self._lock:
                self._scheduled = False
            raise

    def _wakeup(self) -> None:
        with self._lock:
            self._scheduled = False
        self.drain()

    def drain(self) -> None:
        """Trio thread: handle what was posted, now.  (A callback of trio's when woken: the
        handler must not raise.)"""
        with self._lock:
            if not self._items:
                return
            items, self._items = self._items, []
        batch = []
        for item in items:
            if type(item) is _Done:  # runs later than the batch is handled, in any case
                trio.lowlevel.reschedule(item.task, item.result)
            else:
                batch.append(item)
        if batch:
            self._handle(batch)

    async def run_in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a worker thread; its result or exception comes back by the
        mailbox, after what the thread posted.  Not cancellable: the thread may use the
        caller's memory until it ends."""
        task = trio.lowlevel.current_task()

        def ended(result: outcome.Outcome) -> None:
            try:
                self.post([_Done(task, result)])
            except trio.RunFinishedError:
                pass  # no one waits any more

        trio.lowlevel.start_thread_soon(lambda: fn(*args), ended)
        return await trio.lowlevel.wait_task_rescheduled(uncancellable)
