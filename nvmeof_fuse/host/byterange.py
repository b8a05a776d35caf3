"""Byte-addressed reads and writes over a device that only moves whole LBAs.

Partial first/last LBAs of a write are read-modify-written. Concurrent writers
must never lose each other's bytes, so every write holds a range lock on the
LBAs it touches for its whole duration:

* the edge LBAs it read-modify-writes are held *exclusively*: nobody else may
  write them between our read and our write;
* its aligned middle is held *shared*: aligned writes do not conflict with each
  other (each LBA ends up as one of the writers' data, as on any block device),
  but they must not overlap an edge LBA somebody is read-modify-writing, or the
  RMW's stale copy would overwrite the aligned data (or vice versa).

Requests are granted in arrival order (a request waits only for earlier
conflicting ones), which is deadlock- and starvation-free. Reads take no lock.

Reads come back *lent* from the device (:meth:`LbaDevice.lend_lbas`): valid until
the reading task next yields.  :meth:`ByteRangeIO.read` copies them into bytes;
:meth:`ByteRangeIO.read_lent` passes them on as they are, for a caller that uses
them at once (a FUSE reply), which saves the copy of every read.
"""

from __future__ import annotations

import errno
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from nvmeof_fuse.concurrency import run_all
from nvmeof_fuse.errors import InvalidArgument, NVMeoFError

if TYPE_CHECKING:
    from nvmeof_fuse.host.stats import IoStats


class NoSpace(NVMeoFError):
    """A write reaches past the end of the device."""

    errno = errno.ENOSPC


class LbaDevice(Protocol):
    """What ByteRangeIO needs: whole-LBA reads and writes."""

    lba_size: int
    nlb: int

    async def lend_lbas(self, slba: int, nlb: int) -> bytes | memoryview:
        """``nlb`` LBAs at ``slba``, valid until the calling task next yields."""
        ...

    async def write_lbas(self, slba: int, data: bytes | memoryview) -> None: ...


@dataclass(frozen=True)
class Edge:
    """A partially covered LBA: caller bytes ``data`` go at ``start`` inside ``lba``."""

    lba: int
    start: int
    data: slice


@dataclass(frozen=True)
class Split:
    """A byte range cut at LBA boundaries; slices index the caller's buffer."""

    head: Edge | None
    middle_slba: int
    middle_nlb: int
    middle: slice
    tail: Edge | None

    @property
    def first_lba(self) -> int:
        return self.head.lba if self.head else self.middle_slba

    @property
    def nlb(self) -> int:
        """Number of LBAs touched, edges included."""
        return self.middle_nlb + (self.head is not None) + (self.tail is not None)

    def edges(self) -> Iterator[Edge]:
        yield from (e for e in (self.head, self.tail) if e is not None)


def split_range(offset: int, length: int, lba_size: int) -> Split:
    """Cut ``[offset, offset+length)`` into partial head LBA, aligned middle, partial tail."""
    if offset < 0 or length < 0 or lba_size <= 0:
        raise InvalidArgument(
            f"bad byte range: offset {offset}, length {length}, LBA size {lba_size}"
        )
    head = None
    pos = offset
    if length:
        start = offset % lba_size
        n = min(length, lba_size - start)
        if n < lba_size:
            head = Edge(offset // lba_size, start, slice(0, n))
            pos += n
    end = offset + length
    mid_nlb = (end - pos) // lba_size
    mid_end = pos + mid_nlb * lba_size
    middle = slice(pos - offset, mid_end - offset)
    tail = None
    if mid_end < end:
        tail = Edge(mid_end // lba_size, 0, slice(mid_end - offset, length))
    return Split(head, pos // lba_size, mid_nlb, middle, tail)


def write_lock_parts(sp: Split) -> list[tuple[int, int, bool]]:
    """The lock a write of ``sp`` takes: its edge LBAs exclusive, its middle shared."""
    parts = [(e.lba, e.lba + 1, True) for e in sp.edges()]
    if sp.middle_nlb:
        parts.append((sp.middle_slba, sp.middle_slba + sp.middle_nlb, False))
    return parts


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


class ByteRangeIO:
    """Reads and writes at any byte offset and length over an :class:`LbaDevice`."""

    def __init__(self, device: LbaDevice, stats: IoStats | None = None) -> None:
        self.device = device
        self.stats = stats
        self.lock = LbaRangeLock()

    @property
    def size(self) -> int:
        return self.device.lba_size * self.device.nlb

    async def read(self, offset: int, length: int) -> bytes:
        """Read up to ``length`` bytes; short at the end, ``b""`` at or past it."""
        return bytes(await self.read_lent(offset, length))

    async def read_lent(self, offset: int, length: int) -> bytes | memoryview:
        """:meth:`read`, but lent: the result is valid until the calling task next yields."""
        if offset < 0 or length < 0:
            raise InvalidArgument(f"bad read: offset {offset}, length {length}")
        ls = self.device.lba_size
        length = min(length, ls * self.device.nlb - offset)
        if length <= 0:
            return b""
        first, last = offset // ls, (offset + length - 1) // ls
        stats = self.stats
        if stats is None:
            data = await self.device.lend_lbas(first, last - first + 1)
        else:  # what _record does, inline: this runs for every read
            start = time.perf_counter()
            try:
                data = await self.device.lend_lbas(first, last - first + 1)
            except Exception:
                stats.record("read", 0, time.perf_counter() - start, ok=False)
                raise
            stats.record("read", length, time.perf_counter() - start)
        skip = offset - first * ls
        if skip == 0 and len(data) == length:
            return data
        return memoryview(data)[skip : skip + length]

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write all of ``data`` at ``offset``; raises :class:`NoSpace` past the end."""
        buf = memoryview(data).cast("B")
        if offset < 0:
            raise InvalidArgument(f"bad write: negative offset {offset}")
        if offset + len(buf) > self.size:
            raise NoSpace(
                f"write of {len(buf)} bytes at offset {offset} extends past the end "
                f"of the device ({self.size} bytes)"
            )
        if not buf:
            return 0
        ls = self.device.lba_size
        if not offset % ls and not len(buf) % ls:
            await self._write_aligned(offset // ls, data if isinstance(data, bytes) else buf)
            return len(buf)

        async def write_middle(slba: int, nlb: int) -> None:
            at = slba * ls - offset
            await self.device.write_lbas(slba, buf[at:at + nlb * ls])

        await self.write_placed(offset, len(buf), lambda edge: buf[edge.data], write_middle)
        return len(buf)

    async def _write_aligned(self, slba: int, data: bytes | memoryview) -> None:
        """What :meth:`write` does for whole LBAs, without the machinery for edges: one
        command under a shared lock (the common case of every O_DIRECT writer)."""
        stats = self.stats
        start = time.perf_counter()
        req = await self.lock.acquire([(slba, slba + len(data) // self.device.lba_size, False)])
        try:
            await self.device.write_lbas(slba, data)
        except Exception:
            if stats is not None:
                stats.record("write", 0, time.perf_counter() - start, ok=False)
            raise
        finally:
            self.lock.release(req)
        if stats is not None:
            stats.record("write", len(data), time.perf_counter() - start, ok=True)

    async def write_placed(
        self,
        offset: int,
        length: int,
        edge_data: Callable[[Edge], bytes | memoryview],
        write_middle: Callable[[int, int], Awaitable[None]],
    ) -> None:
        """Write a range whose whole LBAs ``write_middle(slba, nlb)`` moves itself.

        The caller places the aligned middle (for example straight from registered
        memory); ``edge_data(edge)`` gives the caller bytes of each partial LBA,
        merged here by read-modify-write.  Locking is as for :meth:`write`.
        """
        sp = split_range(offset, length, self.device.lba_size)
        jobs = [functools.partial(self._rmw, e, edge_data(e)) for e in sp.edges()]
        if sp.middle_nlb:
            jobs.append(functools.partial(write_middle, sp.middle_slba, sp.middle_nlb))
        with self._record("write", length):
            async with self.lock.hold(write_lock_parts(sp)):
                await run_all(jobs)

    @asynccontextmanager
    async def write_locked(self, offset: int, length: int) -> AsyncIterator[None]:
        """Hold the LBAs a write of ``[offset, offset + length)`` touches, as a write does.

        For a writer elsewhere (a companion client on queues of its own) that must not
        slip between a read-modify-write's read and its write, nor be slipped into.
        """
        sp = split_range(offset, length, self.device.lba_size)
        async with self.lock.hold(write_lock_parts(sp)):
            yield

    async def _rmw(self, edge: Edge, data: bytes | memoryview) -> None:
        """Merge ``data`` into one LBA; the caller holds the LBA exclusively."""
        block = bytearray(await self.device.lend_lbas(edge.lba, 1))  # copied before we yield
        block[edge.start : edge.start + len(data)] = data
        await self.device.write_lbas(edge.lba, block)
        if self.stats is not None:
            self.stats.add("rmw_lbas", 1)

    @contextmanager
    def _record(self, op: str, nbytes: int) -> Iterator[None]:
        if self.stats is None:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        except Exception:
            self.stats.record(op, 0, time.perf_counter() - start, ok=False)
            raise
        self.stats.record(op, nbytes, time.perf_counter() - start, ok=True)
