"""A FIFO range lock over LBAs, with shared and exclusive parts per request: what every write
of a namespace holds (:mod:`nvmeof_fuse.host.namespace.byterange` says which parts, and why).

Requests are granted in arrival order (a request waits only for earlier
conflicting ones), which is deadlock- and starvation-free.  In a mount of several processes
(FUSE workers) a granted request also takes the same LBAs in the kernel's locks of the
mount (:attr:`LbaRangeLock.shared`, :mod:`.sharedranges`), which exclude the other
processes' writes without a message to any of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from .sharedranges import Held, NamespaceRanges


class _Request:
    """One holder (or waiter) of the lock; ``event`` exists only while it has to wait."""

    __slots__ = ("parts", "exclusive", "granted", "event", "held")

    def __init__(self, parts: list[tuple[int, int, bool]]) -> None:
        self.parts = parts  # (first LBA, end LBA, exclusive)
        self.exclusive = False
        for part in parts:  # not any(...): a generator costs more than this, per write
            if part[2]:
                self.exclusive = True
                break
        self.granted = False
        self.event: trio.Event | None = None
        self.held: Held | None = None  # its locks in the mount's shared file, if any

    def conflicts(self, other: _Request) -> bool:
        return any(
            (ex1 or ex2) and s1 < e2 and s2 < e1
            for s1, e1, ex1 in self.parts
            for s2, e2, ex2 in other.parts
        )


class LbaRangeLock:
    """FIFO range lock over LBAs with shared and exclusive parts per request.

    Shared parts never conflict with each other, so while no request with an exclusive
    part is queued (aligned writes only, the common case) a request is granted at once,
    without an event or a scan of the queue.
    """

    def __init__(self) -> None:
        self._queue: list[_Request] = []  # held and waiting, in arrival order
        self._exclusive = 0  # requests in the queue with an exclusive part
        self._waiting = 0  # requests in the queue not granted yet
        self.on_wait: Callable[[], None] | None = None
        """Called when a request has to wait (a holder may then be asked to let go)."""
        self.written = False
        """Set by every release: the namespace's writes each hold the lock until they end,
        so this says whether one ended since its owner last cleared it (at a flush).  (With
        :attr:`shared`, its ``written`` says so for every process of the mount.)"""
        self.shared: NamespaceRanges | None = None
        """The namespace's locks across the mount's processes, which every request granted
        here takes too (None: this process is the mount's only writer)."""

    def __len__(self) -> int:
        return len(self._queue)

    @asynccontextmanager
    async def hold(self, parts: list[tuple[int, int, bool]]) -> AsyncIterator[None]:
        req = await self.acquire(parts)
        try:
            yield
        finally:
            self.release(req)

    def try_acquire(self, parts: list[tuple[int, int, bool]]) -> _Request | None:
        """A request for ``parts``, granted now, or None (and nothing queued) if it would
        have to wait; :meth:`release` it."""
        req = _Request(parts)
        queue = self._queue
        # (with no exclusive part queued or asked for, nothing can conflict)
        if (req.exclusive or self._exclusive) and any(req.conflicts(e) for e in queue):
            return None
        shared = self.shared
        if shared is not None:
            req.held = shared.try_lock(parts)
            if req.held is None:
                return None
        if req.exclusive:
            self._exclusive += 1
        req.granted = True
        queue.append(req)
        return req

    async def acquire(self, parts: list[tuple[int, int, bool]]) -> _Request:
        """Queue a request for ``parts`` and wait until it is granted; :meth:`release` it."""
        req = _Request(parts)
        queue = self._queue
        if req.exclusive:
            self._exclusive += 1
        elif not self._exclusive:  # nothing queued can conflict with shared parts
            req.granted = True
            queue.append(req)
            if self.shared is None or self._took_shared(req):
                return req
            return await self._wait_shared(req)
        queue.append(req)
        if not any(req.conflicts(earlier) for earlier in queue[:-1]):
            req.granted = True
            if self.shared is None or self._took_shared(req):
                return req
            return await self._wait_shared(req)
        req.event = trio.Event()
        self._waiting += 1
        try:
            if self.on_wait is not None:
                self.on_wait()
            await req.event.wait()
        except BaseException:
            self.release(req)  # cancelled while waiting (or granted as it was cancelled)
            raise
        if self.shared is None or self._took_shared(req):
            return req
        return await self._wait_shared(req)

    def _took_shared(self, req: _Request) -> bool:
        """Whether the granted ``req`` took its LBAs from the other processes too at once
        (the common case: nobody else holds them)."""
        assert self.shared is not None
        try:
            req.held = self.shared.try_lock(req.parts)
        except BaseException:  # the kernel refused (a one-line error): nothing held
            self.release(req)
            raise
        return req.held is not None

    async def _wait_shared(self, req: _Request) -> _Request:
        """Wait for the other processes to let go of the granted ``req``'s LBAs (bounded:
        :class:`~.sharedranges.RangeLockTimeout`), or release it and raise."""
        assert self.shared is not None
        try:
            req.held = await self.shared.lock(req.parts)
        except BaseException:
            self.release(req)
            raise
        return req

    def release(self, req: _Request) -> None:
        self.written = True
        if req.held is not None:
            assert self.shared is not None
            held, req.held = req.held, None
            self.shared.unlock(held)
        self._queue.remove(req)
        if req.exclusive:
            self._exclusive -= 1
        if not req.granted:
            self._waiting -= 1
        if self._waiting:
            self._grant()

    def _grant(self) -> None:
        for i, req in enumerate(self._queue):
            if not req.granted and not any(
                req.conflicts(earlier) for earlier in self._queue[:i]
            ):
                req.granted = True
                self._waiting -= 1
                assert req.event is not None
                req.event.set()
