"""The tasks that read a FUSE session's requests and run them, leader/follower.

One of them at a time is the reader, which reads with nonblocking reads and parks in
``wait_readable`` only when the kernel has none queued; once it has a request, it makes
another task the reader and runs the request itself (so a slow request never holds up the
others, and none is handed from task to task).  A task that has answered one reads the
next queued request itself and runs it, and when it answered the last one in flight it
polls briefly for the next before it sleeps (:mod:`.idlepoll`).  What a request is, and how
it is answered, is the session's (:mod:`.session`): this module only schedules.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from nvmeof_fuse.concurrency import tasks_runnable
from nvmeof_fuse.fs.idlepoll import IdlePoll

BATCH = 64  # requests read before the reader lets the handlers run


class SessionEnded(Exception):
    """The kernel ended the session (DESTROY, unmounted, or the fake kernel closed)."""


Job = tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]


class RequestLoop:
    """Tasks that read requests and run them.  At most one of them, the reader, reads the
    descriptor: it reads every queued request (nonblocking) and parks in ``wait_readable``
    only when there is none.  Each request it read but the last goes to a parked task (a
    reschedule; a new task only when none is idle).  The last one, read just before the
    kernel had no more (the only one, at QD1), it runs itself, in the same step, once it has
    handed the reading on to another task (leader/follower): no hand-over of that request,
    one trio scheduler round less per request at QD1, and a handler that waits still holds
    up only its own task.  A task that has finished a request first takes one already
    queued in the kernel (no hand-over at all: under load most requests go this way), and
    parks only when there is none.  When it has answered the last request in flight and no
    other task can run, it first polls the descriptor briefly (:class:`IdlePoll`), so a
    client that keeps one request in flight does not wake us from a sleep for each.

    ``take`` reads one request: its (handler, args), or None when it needs no handler;
    it raises BlockingIOError when none is queued and SessionEnded at the end.

    ``limit`` (0: none) is for a connection other processes read too (FUSE workers): with
    that many requests running or queued here, no task reads more until one is answered,
    so that the kernel hands the rest to a process with room.  Each process holds a
    bounce buffer per request in flight, as many as the kernel lets one process's share
    be; a process that read past them ran the rest on tasks that waited for a buffer,
    at about twice the CPU per request (issue #60)."""

    def __init__(self, nursery: trio.Nursery, fd: int, take: Callable[[], Job | None],
                 limit: int = 0) -> None:
        self.nursery = nursery
        self.fd = fd
        self.take = take
        self.queue: deque[Job] = deque()  # read by the reader, for the other tasks
        self.reading = False  # a task is the reader (reading, or parked on the descriptor)
        self.parked = False  # ... parked in wait_readable
        self.drained = False  # the last reader stopped at EAGAIN: the next may park at once
        self.idle: list[trio.lowlevel.Task] = []
        self.closing = False
        self.running = 0  # requests being run
        self.served = 0  # requests run since the last idle moment (see _poll)
        self.idle_poll = IdlePoll()
        self.limit = limit
        self.room: trio.Event | None = None  # set when a request ends, while a reader waits
        self.full_waits = 0  # times a reader waited for room (see limit)
        self.parks = 0  # waits on the descriptor: requests per park say how well they batch

    def start(self) -> None:
        self.nursery.start_soon(self._work)

    def _wake(self) -> None:
        """Get a task going: an idle one (a reschedule), else a new one."""
        if self.idle:
            trio.lowlevel.reschedule(self.idle.pop())
        else:
            self.nursery.start_soon(self._work)

    async def _read(self) -> Job | None:
        """As the reader: read the queued requests, handing all but the last to other tasks;
        park while none is queued.  Returns the last one, for this task to run, or None
        once closing (the session ended, or stop_reading)."""
        take, fd, queue = self.take, self.fd, self.queue
        held: Job | None = None  # read last: run here if the kernel has no more
        got = 0
        if self.drained:  # the last reader just found none: wait (epoll sees any since)
            self.drained = False
            await self._park(fd)
        while not self.closing:
            if self.limit and self.running + len(queue) + (held is not None) >= self.limit:
                if held is not None:  # full (see limit): run what we hold, read no more
                    return held
                await self._wait_for_room()
                got = 0
                continue
            try:
                job = take()
            except BlockingIOError:
                if held is not None:
                    self.drained = True
                    return held
                got = 0
                await self._park(fd)
                continue
            except SessionEnded:
                self.close()
                break
            got += 1
            if job is not None:  # (None: answered here: INIT, FORGET, ...)
                if held is not None:
                    queue.append(held)
                    self._wake()
                held = job
            if got >= BATCH:  # let the handlers run
                got = 0
                if held is not None:
                    queue.append(held)
                    self._wake()
                    held = None
                await trio.lowlevel.checkpoint()
        return held  # closing: a request read is still answered

    async def _wait_for_room(self) -> None:
        self.full_waits += 1
        room = self.room = trio.Event()
        try:
            await room.wait()
        finally:
            self.room = None

    def _made_room(self) -> None:
        """A request ended while a reader waits for room: wake it once there is."""
        room = self.room
        if room is not None and self.running + len(self.queue) < self.limit:
            room.set()

    async def _park(self, fd: int) -> None:
        self.parks += 1
        self.parked = True
        try:
            await trio.lowlevel.wait_readable(fd)
        except trio.ClosedResourceError:  # close() woke us
            if not self.closing:
                raise
        finally:
            self.parked = False

    async def _work(self) -> None:
        idle, take, queue = self.idle, self.take, self.queue
        task = trio.lowlevel.current_task()
        ran = 0  # requests run one after another without a checkpoint

        def abort(_: object) -> trio.lowlevel.Abort:
            idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        while True:
            job: Job | None
            if queue:
                job = queue.popleft()
            elif self.closing:
                if not self.running:
                    return
                idle.append(task)  # a callback may still hand a request back (end())
                await trio.lowlevel.wait_task_rescheduled(abort)
                continue
            elif not self.reading:
                self.reading = True
                try:
                    job = await self._read()
                finally:
                    self.reading = False
                if job is None:
                    continue
                if not self.closing:
                    self._wake()  # the next reader, while this task runs the request
                ran = 0  # the reader's wait or the hand-on's yield let the others run
                await self._run(job)
                continue
            else:  # another task reads: run what is already queued in the kernel
                try:
                    if self.limit and self.running + len(queue) >= self.limit:
                        job = None  # full (see limit): the reader takes more once there is room
                    else:
                        job = take()
                except BlockingIOError:
                    job = None if self.running else self._poll()
                except SessionEnded:
                    self.close()
                    continue
                if job is None:
                    if self.closing:  # (the poll met the session's end)
                        continue
                    ran = 0
                    idle.append(task)
                    await trio.lowlevel.wait_task_rescheduled(abort)
                    continue
            await self._run(job)
            ran += 1
            if ran >= BATCH:  # handlers that never yield must not starve the rest
                ran = 0
                await trio.lowlevel.checkpoint()

    async def _run(self, job: Job) -> None:
        self.served += 1
        self.running += 1
        try:
            await job[0](*job[1])
        finally:
            self.running -= 1  # what end() does, inline: this runs for every request
            if self.room is not None:
                self._made_room()
            if self.closing and not self.running:
                self._release_idle()

    def begin(self) -> None:
        """A request goes on with no task (a callback will answer it): it counts as
        running, so that no task polls for the next request while it is in flight, and
        the tasks stay, once closing, until it is answered (or handed back)."""
        self.running += 1

    def end(self, retry: Job | None = None) -> None:
        """A running request was answered; or it is handed back, to run as ``retry``."""
        self.running -= 1
        if retry is not None:
            self.queue.append(retry)
            self._wake()
        elif self.closing and not self.running:
            self._release_idle()
        if self.room is not None:
            self._made_room()

    def _release_idle(self) -> None:
        """Closing, with nothing running: the idle tasks wait for this, to exit."""
        while self.idle:
            trio.lowlevel.reschedule(self.idle.pop())

    def _poll(self) -> Job | None:
        """At an idle moment (the last request in flight answered, none queued): poll the
        descriptor for the next request for up to the idle poll's budget, if no other task
        can run meanwhile (nothing waits on this thread but the descriptor and others' I/O,
        which the poll delays by at most the budget).  Between reads it yields the CPU to
        any thread that can run on it: the client may be one."""
        served, self.served = self.served, 0
        budget = self.idle_poll.budget(served)
        if not budget or self.closing or tasks_runnable():
            return None
        take, clock, yield_cpu = self.take, time.perf_counter, os.sched_yield
        start = clock()
        while (now := clock()) < start + budget:
            try:
                job = take()
            except BlockingIOError:
                yield_cpu()
                continue
            except SessionEnded:
                self.close()
                return None
            if job is not None:
                self.idle_poll.caught(now - start)
                return job
        self.idle_poll.missed()
        return None

    def close(self) -> None:
        """Take no more requests: the tasks exit once the requests read are answered."""
        if self.closing:
            return
        self.closing = True
        if self.room is not None:  # a reader waits for room: it stops instead
            self.room.set()
        while self.idle:
            trio.lowlevel.reschedule(self.idle.pop())
        if self.parked:  # the reader parked in wait_readable: wake it (the public way)
            trio.lowlevel.notify_closing(self.fd)


