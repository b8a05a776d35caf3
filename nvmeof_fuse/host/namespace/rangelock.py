"""A FIFO range lock over LBAs, with shared and exclusive parts per request: what every write
of a namespace holds (:mod:`nvmeof_fuse.host.namespace.byterange` says which parts, and why).

Requests are granted in arrival order (a request waits only for earlier
conflicting ones), which is deadlock- and starvation-free.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio


class _Request:
    """One holder (or waiter) of the lock; ``event`` exists only while it has to wait."""

    __slots__ = ("parts", "exclusive", "granted", "event")

    def __init__(self, parts: list[tuple[int, int, bool]]) -> None:
        self.parts = parts  # (first LBA, end LBA, exclusive)
        self.exclusive = False
        for part in parts:  # not any(...): a generator costs more than this, per write
            if part[2]:
                self.exclusive = True
                break
        self.granted = False
        self.event: trio.Event | None = None

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
        so this says whether one ended since its owner last cleared it (at a flush)."""

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
            return req
        queue.append(req)
        if not any(req.conflicts(earlier) for earlier in queue[:-1]):
            req.granted = True
            return req
        req.event = trio.Event()
        self._waiting += 1
        try:
            if self.on_wait is not None:
                self.on_wait()
            await req.event.wait()
        except BaseException:
            self.release(req)  # cancelled while waiting (or granted as it was cancelled)
            raise
        return req

    def release(self, req: _Request) -> None:
        self.written = True
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
