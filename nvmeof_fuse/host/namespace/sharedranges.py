"""Range locks across the processes of a mount: the kernel's open-file-description locks.

A mount with FUSE workers writes each namespace from several processes.  Each process keeps
its own :class:`~.rangelock.LbaRangeLock` (FIFO, cheap, on its trio loop), and a request it
grants also takes the kernel's byte-range lock (``F_OFD_SETLK``) of the same LBAs on one
memfd that the main process makes and hands every worker (:class:`SharedRanges`): byte
offsets stand for LBAs, a shared part is a read lock and an exclusive part a write lock.
So no write asks another process for its lock, and a process that dies holding one never
leaves it held: the kernel drops an open file description's locks as its last descriptor
closes.

Open-file-description locks belong to the description, not the process, so every request
held at once locks on a description of its own (the memfd opened again through
``/proc/self/fd``, kept in a pool): two requests of one process then never merge or release
each other's locks.  The process's own range lock grants a request before it asks the
kernel, so two requests of one process never conflict there.  A request locks its parts in
ascending order of LBA and waits holding those it has (deadlock-free, as any ordered
locking); the kernel is asked without blocking (``F_OFD_SETLK``), and while another process
holds a part the task polls with a growing sleep, so trio's loop stays free, bounded by the
mount's timeout (:class:`RangeLockTimeout`).

Namespace ``nsid``'s LBA ``lba`` is byte ``nsid << 31 | lba >> shift``, where ``shift``
folds a namespace of more than 2**31 LBAs into 2**31 units (a unit then covers several
LBAs: more exclusion, never less; such a namespace's request locks its whole span with one
lock).  The file's first page holds a byte per namespace (NSID modulo 4096) that every
write's release sets, so the main process knows what any process wrote since its last
flush (two namespaces that share a byte only cost a flush more).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any

import trio

from ...errors import NVMeoFError

F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
"""Linux's ``F_OFD_SETLK`` (36 is ``F_OFD_GETLK``, 38 ``F_OFD_SETLKW``)."""
_FLOCK = struct.Struct("hhqqi4x")
"""``struct flock`` on Linux: type, whence, start, length, pid (0 for these locks)."""
_pack = _FLOCK.pack
_KIND = {False: fcntl.F_RDLCK, True: fcntl.F_WRLCK}  # a part's lock by its exclusiveness
_BUSY = (errno.EAGAIN, errno.EACCES)  # another description holds a conflicting lock
NSID_SHIFT = 31
"""Bits of lock units per namespace: NSIDs (32 bits) shifted by this stay inside off_t."""
FLAG_BYTES = mmap.PAGESIZE
"""The page of written-since-the-last-flush bytes at the start of the file."""
POOL_KEPT = 64
"""Descriptions kept open for reuse once their requests are done (more are opened as
more requests hold locks at once, and closed as they end)."""
FIRST_WAIT = 0.0005
MAX_WAIT = 0.004
"""Seconds a task sleeps between its tries of a part another process holds: growing from
the first to the last (a contended write waits for another's command, some microseconds
to milliseconds)."""


class RangeLockTimeout(NVMeoFError):
    """Another process of the mount held LBAs a write needs for longer than the timeout."""

    errno = errno.ETIMEDOUT


class RangeLockFailed(NVMeoFError):
    """The kernel refused a range lock operation (no memory for locks, no /proc)."""

    errno = errno.EIO


def _failed(what: str, exc: OSError) -> RangeLockFailed:
    return RangeLockFailed(f"{what} of the mount's range locks failed: "
                           f"{exc.strerror or exc}")


def lock_units(nsid: int, nlb: int, parts: Sequence[tuple[int, int, bool]]
               ) -> list[tuple[int, int, bool]]:
    """The file's bytes that ``parts`` (``(first LBA, end LBA, exclusive)`` of namespace
    ``nsid`` with ``nlb`` LBAs) lock: ``(start, end, exclusive)`` in ascending order."""
    if not 0 <= nsid < 1 << 32:
        raise ValueError(f"NSID {nsid} is outside 0..2**32-1")
    base = nsid << NSID_SHIFT
    shift = max(0, (nlb - 1).bit_length() - NSID_SHIFT)
    if shift:  # units of several LBAs: one lock over the span, exclusive if any part is
        first = min(p[0] for p in parts) >> shift
        end = ((max(p[1] for p in parts) - 1) >> shift) + 1
        return [(base + first, base + end, any(p[2] for p in parts))]
    units = [(base + first, base + end, exclusive) for first, end, exclusive in parts]
    units.sort()
    return units


class SharedRanges:
    """The mount's file of range locks (see the module); ``wait_limit`` bounds each wait."""

    def __init__(self, fd: int, wait_limit: float) -> None:
        self.fd = fd
        self.wait_limit = wait_limit
        self._free: list[int] = []  # open descriptions holding no lock
        self._flags = mmap.mmap(fd, FLAG_BYTES)
        self.contended = 0  # requests that found a part held by another process

    @classmethod
    def create(cls, wait_limit: float) -> SharedRanges:
        """A new file, for the main process (its workers wrap the descriptor it hands them
        in the constructor)."""
        fd = os.memfd_create("nvmeof-fuse-range-locks", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, FLAG_BYTES)
            return cls(fd, wait_limit)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        for fd in self._free:
            os.close(fd)
        self._free.clear()
        self._flags.close()
        os.close(self.fd)

    # -- the written bytes --------------------------------------------------------------

    def mark_written(self, nsid: int) -> None:
        self._flags[nsid % FLAG_BYTES] = 1

    def written(self, nsid: int) -> bool:
        return bool(self._flags[nsid % FLAG_BYTES])

    def clear_written(self, nsid: int) -> None:
        self._flags[nsid % FLAG_BYTES] = 0

    # -- locks ----------------------------------------------------------------------------

    def _description(self) -> int:
        free = self._free
        if free:
            return free.pop()
        try:
            return os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise _failed("opening a description (/proc/self/fd)", exc) from None

    def _put(self, fd: int) -> None:
        if len(self._free) < POOL_KEPT:
            self._free.append(fd)
        else:
            os.close(fd)

    @staticmethod
    def _try(fd: int, unit: tuple[int, int, bool]) -> bool:
        start, end, exclusive = unit
        try:
            fcntl.fcntl(fd, F_OFD_SETLK, _pack(_KIND[exclusive], 0, start, end - start, 0))
        except OSError as exc:
            if exc.errno in _BUSY:
                return False
            raise _failed("taking a lock", exc) from None
        return True

    @staticmethod
    def _unlock(fd: int, units: list[tuple[int, int, bool]]) -> None:
        """Unlock the span of ``units`` (ascending and disjoint: the last ends it)."""
        start = units[0][0]
        try:
            fcntl.fcntl(fd, F_OFD_SETLK, _pack(fcntl.F_UNLCK, 0, start, units[-1][1] - start, 0))
        except OSError as exc:
            raise _failed("letting go of a lock", exc) from None

    def try_lock(self, units: list[tuple[int, int, bool]]) -> int | None:
        """Lock ``units`` (:func:`lock_units`) now: the description that holds them, for
        :meth:`unlock`, or None (nothing held) when another process holds one."""
        free = self._free
        fd = free.pop() if free else self._description()
        if len(units) == 1:  # the common case (an aligned write), inline: it runs per write
            start, end, exclusive = units[0]
            try:
                fcntl.fcntl(fd, F_OFD_SETLK, _pack(_KIND[exclusive], 0, start, end - start, 0))
                return fd
            except OSError as exc:
                self._put(fd)
                if exc.errno in _BUSY:
                    return None
                raise _failed("taking a lock", exc) from None
        for i, unit in enumerate(units):
            if not self._try(fd, unit):
                if i:
                    self._unlock(fd, units[:i])
                self._put(fd)
                return None
        return fd

    async def lock(self, units: list[tuple[int, int, bool]], what: str) -> int:
        """Lock ``units``, waiting (polled, bounded by :attr:`wait_limit`) for those another
        process holds: the description that holds them, for :meth:`unlock`.  ``what``
        names the LBAs for the error."""
        fd = self._description()
        held = 0
        try:
            for unit in units:
                if self._try(fd, unit):
                    held += 1
                    continue
                self.contended += 1
                await self._wait_for(fd, unit, what)
                held += 1
        except BaseException:
            if held:
                self._unlock(fd, units[:held])
            self._put(fd)
            raise
        return fd

    async def _wait_for(self, fd: int, unit: tuple[int, int, bool], what: str) -> None:
        began = time.monotonic()
        wait = FIRST_WAIT
        while True:
            await trio.sleep(wait)
            if self._try(fd, unit):
                return
            if time.monotonic() - began > self.wait_limit:
                raise RangeLockTimeout(f"{what} stayed locked by another process of the "
                                       f"mount for over {self.wait_limit:g} s")
            wait = min(2 * wait, MAX_WAIT)

    def unlock(self, fd: int, units: list[tuple[int, int, bool]]) -> None:
        """Release what :meth:`lock` or :meth:`try_lock` took on ``fd``."""
        start = units[0][0]
        try:  # the span of units (ascending and disjoint: the last ends it), as _unlock
            fcntl.fcntl(fd, F_OFD_SETLK, _pack(fcntl.F_UNLCK, 0, start, units[-1][1] - start, 0))
        except OSError as exc:  # (never expected) a description in doubt is not reused
            os.close(fd)
            raise _failed("letting go of a lock", exc) from None
        free = self._free
        if len(free) < POOL_KEPT:
            free.append(fd)
        else:
            os.close(fd)


Held = tuple[int, list[tuple[int, int, bool]]]
"""A request's locks in the file: the description holding them, and their units."""


class NamespaceRanges:
    """One namespace's locks in a :class:`SharedRanges`, as its
    :class:`~.rangelock.LbaRangeLock` takes them; ``nlb()`` is its size now."""

    __slots__ = ("ranges", "nsid", "nlb", "base")

    def __init__(self, ranges: SharedRanges, nsid: int, nlb: Callable[[], int]) -> None:
        self.ranges = ranges
        self.nsid = nsid
        self.nlb = nlb
        self.base = lock_units(nsid, 1, [(0, 1, False)])[0][0]  # (checks the NSID too)

    def units(self, parts: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
        """:func:`lock_units` of ``parts``, with the common case (one part of a namespace
        of at most 2**31 LBAs) cut short: it runs for every write."""
        if len(parts) == 1 and self.nlb() <= 1 << NSID_SHIFT:
            first, end, exclusive = parts[0]
            base = self.base
            return [(base + first, base + end, exclusive)]
        return lock_units(self.nsid, self.nlb(), parts)

    def try_lock(self, parts: list[tuple[int, int, bool]]) -> Held | None:
        units = self.units(parts)
        fd = self.ranges.try_lock(units)
        return None if fd is None else (fd, units)

    async def lock(self, parts: list[tuple[int, int, bool]]) -> Held:
        units = self.units(parts)
        first, end = min(p[0] for p in parts), max(p[1] for p in parts)
        fd = await self.ranges.lock(units, f"LBAs {first}..{end - 1} of n{self.nsid}")
        return fd, units

    def unlock(self, held: Held) -> None:
        """Release ``held`` and say the namespace was written (a lock is let go as its
        write ends)."""
        self.ranges.mark_written(self.nsid)
        self.ranges.unlock(*held)

    @property
    def written(self) -> bool:
        return self.ranges.written(self.nsid)

    @written.setter
    def written(self, value: bool) -> None:
        if value:
            self.ranges.mark_written(self.nsid)
        else:
            self.ranges.clear_written(self.nsid)


def share_range_locks(controller: Any, ranges: SharedRanges) -> None:
    """From now on the writes of ``controller``'s namespaces (a controller or a multipath
    head: its ``shared_ranges``) take ``ranges``' locks too, those built already included
    (call it before they write)."""
    controller.shared_ranges = ranges
    for ns in list(controller.namespaces.values()):
        ns.share_locks(ranges)
