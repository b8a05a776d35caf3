"""Byte-addressed I/O over a device that only moves whole LBAs: a namespace's one data path.

:class:`ByteRangeIO` turns byte offsets and lengths into LBAs, and counts every read and
write in the namespace's statistics, whether a task waits for it (:meth:`~ByteRangeIO.read_lent`)
or a callback answers it (:meth:`~ByteRangeIO.start_read_lent`).  Below it, :class:`LbaIO`
moves a namespace's whole LBAs over its :class:`~nvmeof_fuse.host.io.CommandIssuer` (a
controller, or a multipath head over several): commands split at the transfer limit, data in
registered memory or through bounce buffers.  Calls only go down: Namespace -> ByteRangeIO ->
LbaIO -> the CommandIssuer (tests/test_read_path.py checks it).

Partial first/last LBAs of a write are read-modify-written. Concurrent writers
must never lose each other's bytes, so every write holds a range lock
(:class:`~nvmeof_fuse.host.namespace.rangelock.LbaRangeLock`) on the LBAs it touches for its whole
duration:

* the edge LBAs it read-modify-writes are held *exclusively*: nobody else may
  write them between our read and our write;
* its aligned middle is held *shared*: aligned writes do not conflict with each
  other (each LBA ends up as one of the writers' data, as on any block device),
  but they must not overlap an edge LBA somebody is read-modify-writing, or the
  RMW's stale copy would overwrite the aligned data (or vice versa).

Reads take no lock.  They come back *lent* from the device (:meth:`LbaDevice.lend_lbas`):
valid until the reading task next yields.  :meth:`ByteRangeIO.read` copies them into bytes;
:meth:`ByteRangeIO.read_lent` passes them on as they are, for a caller that uses
them at once (a FUSE reply), which saves the copy of every read.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import TYPE_CHECKING, Protocol

from ... import nvme
from ...concurrency import run_all
from ...errors import InvalidArgument, NVMeoFError
from ...nvme import command as cmd
from ..memory import DataRef
from .rangelock import LbaRangeLock

if TYPE_CHECKING:
    from ...transport.base import Finished
    from ..io import CommandIssuer
    from .stats import IoStats


class NoSpace(NVMeoFError):
    """A write reaches past the end of the device."""

    errno = errno.ENOSPC


class LbaDevice(Protocol):
    """What ByteRangeIO needs: whole-LBA reads and writes (:class:`LbaIO`, or LBAs in RAM).

    :meth:`ByteRangeIO.start_read_lent`, :meth:`ByteRangeIO.start_write` and
    :meth:`ByteRangeIO.read_placed` need :class:`LbaIO`'s ``start_lend``,
    ``start_write_lbas`` and ``read_into`` too.
    """

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
            start = perf_counter()
            try:
                data = await self.device.lend_lbas(first, last - first + 1)
            except Exception:
                stats.record("read", 0, perf_counter() - start, ok=False)
                raise
            stats.record("read", length, perf_counter() - start)
        skip = offset - first * ls
        if skip == 0 and len(data) == length:
            return data
        return memoryview(data)[skip : skip + length]

    def start_read_lent(self, offset: int, length: int,
                        done: Callable[[memoryview | None], None]) -> bool:
        """:meth:`read_lent` with no task waiting, where the device reads its LBAs with one
        command through a free bounce buffer (:meth:`LbaIO.start_lend`): ``done`` is called
        with the data (lent for that call only) once the target answered (counted as a
        read, and in the counter ``callback_reads``), or with None when the command failed
        (nothing is counted then: read again with :meth:`read_lent`, which retries,
        reconnects or raises the error).  It must not raise.  False, with nothing sent,
        when the read needs more than that (or the device cannot start I/O now)."""
        device = self.device
        ls = device.lba_size
        end = min(offset + length, ls * device.nlb)
        if offset < 0 or end <= offset:
            return False
        first = offset // ls
        skip = offset - first * ls
        length = end - offset
        stats = self.stats
        started = perf_counter()

        def lent(view: memoryview | None) -> None:
            if view is None:
                done(None)
                return
            if stats is not None:
                stats.record("read", length, perf_counter() - started)
                stats.add("callback_reads")
            done(view[skip:skip + length])

        return device.start_lend(first, (end - 1) // ls - first + 1, lent)  # type: ignore[attr-defined]

    async def read_placed(self, offset: int, length: int, dest: DataRef,
                          put: Callable[[int, memoryview], None]) -> int:
        """Read ``length`` bytes at ``offset`` for a caller whose memory ``dest`` (its bytes
        ``0..length``) is registered: whole LBAs land there straight (:meth:`LbaIO.read_into`),
        the partial ones at either end come through a bounce buffer, and ``put(start,
        data)`` stores the caller's bytes from ``start`` (lent data, valid for that call).
        The range must lie inside the device.  Counted as a read."""
        device = self.device
        sp = split_range(offset, length, device.lba_size)
        jobs: list[Callable[[], Awaitable[None]]] = []
        if sp.middle_nlb:
            ref = DataRef(dest.region, dest.offset + sp.middle.start,
                          sp.middle.stop - sp.middle.start)
            jobs.append(functools.partial(device.read_into, sp.middle_slba,  # type: ignore[attr-defined]
                                          sp.middle_nlb, ref))
        jobs.extend(functools.partial(self._read_edge, edge, put) for edge in sp.edges())
        with self._record("read", length):
            await run_all(jobs)
        return length

    async def _read_edge(self, edge: Edge, put: Callable[[int, memoryview], None]) -> None:
        data = await self.device.lend_lbas(edge.lba, 1)  # lent: used before we yield again
        put(edge.data.start, memoryview(data)[edge.start:edge.start + edge.data.stop
                                                - edge.data.start])

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

    def start_write(self, offset: int, data: memoryview, done: Callable[[bool], None]) -> bool:
        """:meth:`write` with no task waiting, for whole LBAs that the device writes with one
        command through a free bounce buffer (:meth:`LbaIO.start_write_lbas`), when their
        range lock is free now: ``data`` is copied at once, and ``done`` is called with True
        once the target has it (counted as a write, and in ``callback_writes``), or with
        False when the command failed (nothing is counted then, and the lock is let go:
        write again with :meth:`write`, which retries, reconnects or raises the error).  It
        must not raise.  False, with nothing sent, otherwise (as :meth:`start_read_lent`)."""
        device = self.device
        ls = device.lba_size
        length = len(data)
        if (offset < 0 or offset % ls or length % ls or not length
                or offset + length > ls * device.nlb):
            return False
        slba = offset // ls
        lock = self.lock
        held = lock.try_acquire([(slba, slba + length // ls, False)])  # shared, as write()
        if held is None:
            return False
        stats = self.stats
        started = perf_counter()

        def landed(ok: bool) -> None:
            lock.release(held)
            if ok and stats is not None:
                stats.record("write", length, perf_counter() - started)
                stats.add("callback_writes")
            done(ok)

        if device.start_write_lbas(slba, data, landed):  # type: ignore[attr-defined]
            return True
        lock.release(held)
        return False

    async def _write_aligned(self, slba: int, data: bytes | memoryview) -> None:
        """What :meth:`write` does for whole LBAs, without the machinery for edges: one
        command under a shared lock (the common case of every O_DIRECT writer)."""
        stats = self.stats
        start = perf_counter()
        req = await self.lock.acquire([(slba, slba + len(data) // self.device.lba_size, False)])
        try:
            await self.device.write_lbas(slba, data)
        except Exception:
            if stats is not None:
                stats.record("write", 0, perf_counter() - start, ok=False)
            raise
        finally:
            self.lock.release(req)
        if stats is not None:
            stats.record("write", len(data), perf_counter() - start, ok=True)

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
        start = perf_counter()
        try:
            yield
        except Exception:
            self.stats.record(op, 0, perf_counter() - start, ok=False)
            raise
        self.stats.record(op, nbytes, perf_counter() - start, ok=True)


class LbaIO:
    """A namespace's whole LBAs over an I/O path: ``io`` runs the commands (a
    :class:`~nvmeof_fuse.host.io.CommandIssuer`: a controller, or a multipath head over
    several).

    ``read_into``/``write_from`` move data straight between the target and caller memory
    registered with the path (no host copy).  ``read_lbas`` and ``write_lbas`` go through
    the path's bounce buffers (``lend_lbas`` hands a read's bounce buffer on instead of
    copying it).  A transfer past the path's limit is split into commands that run at once.
    """

    def __init__(self, io: CommandIssuer, nsid: int, lba_size: int, nlb: int) -> None:
        self.io = io
        self.nsid = nsid
        self.lba_size = lba_size
        self.nlb = nlb
        self.refusal: NVMeoFError | None = None
        """Why the namespace cannot serve I/O (it was removed, or we cannot serve its
        values: host.namespace): every I/O fails with an error like it; None serves."""

    def check_served(self) -> None:
        """Raise (a fresh copy of) :attr:`refusal`, if there is one."""
        refusal = self.refusal
        if refusal is not None:
            raise type(refusal)(*refusal.args)

    def check_range(self, slba: int, nlb: int) -> None:
        self.check_served()
        if nlb <= 0:
            raise InvalidArgument(f"an I/O needs at least one LBA, got {nlb}")
        if slba < 0 or slba + nlb > self.nlb:
            raise InvalidArgument(
                f"LBA range {slba}..{slba + nlb - 1} is outside namespace {self.nsid} "
                f"(LBAs 0..{self.nlb - 1})")

    def per_command(self) -> int:
        """Most LBAs one command moves: the path's transfer limit, at least one LBA."""
        return cmd.lbas_per_command(self.io.max_transfer, self.lba_size)

    def _chunks(self, slba: int, nlb: int) -> Iterator[tuple[int, int, int]]:
        """(slba, nlb, byte offset) pieces no larger than the path's transfer limit."""
        per = self.per_command()
        for start in range(0, nlb, per):
            yield slba + start, min(per, nlb - start), start * self.lba_size

    # -- zero-copy I/O on registered memory ----------------------------------------------------

    async def read_into(self, slba: int, nlb: int, dest: DataRef) -> None:
        """Read ``nlb`` LBAs at ``slba`` straight into registered memory ``dest``."""
        if self._one_command(slba, nlb, dest):  # the hot path: one coroutine frame less
            await self.io.io_command(cmd.read(self.nsid, slba, nlb, nvme.NULL_SGL), dest)
        else:
            await self._split(slba, nlb, dest, write=False)

    async def write_from(self, slba: int, nlb: int, src: DataRef) -> None:
        """Write ``nlb`` LBAs at ``slba`` straight from registered memory ``src``."""
        if self._one_command(slba, nlb, src):
            await self.io.io_command(cmd.write(self.nsid, slba, nlb, nvme.NULL_SGL), src,
                                     to_controller=True)
        else:
            await self._split(slba, nlb, src, write=True)

    def _one_command(self, slba: int, nlb: int, ref: DataRef) -> bool:
        """Check a transfer of ``nlb`` LBAs at ``slba`` with ``ref``; whether one command
        moves it all."""
        self.check_range(slba, nlb)
        if ref.length != nlb * self.lba_size:
            raise InvalidArgument(f"buffer of {ref.length} bytes does not hold {nlb} LBAs "
                                  f"of {self.lba_size} bytes")
        return nlb <= self.per_command()

    async def _split(self, slba: int, nlb: int, ref: DataRef, write: bool) -> None:
        """A transfer past the path's limit: its commands run at once."""
        build = cmd.write if write else cmd.read

        def job(lba: int, n: int, at: int) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                if self.refusal is not None:  # refused meanwhile: nothing of it goes out
                    self.check_served()
                piece = ref.region.ref(ref.offset + at, n * self.lba_size)
                await self.io.io_command(build(self.nsid, lba, n, nvme.NULL_SGL), piece,
                                         to_controller=write)
            return run

        await run_all([job(*c) for c in self._chunks(slba, nlb)])

    # -- bounce-buffered I/O ----------------------------------------------------------------------

    async def read_lbas(self, slba: int, nlb: int) -> bytes:
        """Read ``nlb`` LBAs at ``slba`` into bytes of the caller's own."""
        return bytes(await self.lend_lbas(slba, nlb))

    async def lend_lbas(self, slba: int, nlb: int) -> memoryview:
        """Read ``nlb`` LBAs at ``slba``; the data is *lent*: use it before the calling task
        next yields (awaits anything), after which it may be overwritten.

        A read of one command comes straight out of the bounce buffer it landed in
        (no host copy).  That buffer goes back to the pool before this returns, but
        nothing can take it again until the caller yields, and a caller like a FUSE
        reply copies it out first.  Longer reads are gathered into memory the caller
        then owns.
        """
        self.check_range(slba, nlb)
        if nlb <= self.per_command():
            return await self._bounce_one(slba, nlb, None, write=False)
        out = memoryview(bytearray(nlb * self.lba_size))
        await self._bounced(slba, nlb, out, write=False)
        return out

    async def write_lbas(self, slba: int, data: bytes | memoryview) -> None:
        src = memoryview(data).cast("B")
        if len(src) % self.lba_size:
            raise InvalidArgument(f"write of {len(src)} bytes is not a whole number of "
                                  f"{self.lba_size}-byte LBAs")
        nlb = len(src) // self.lba_size
        self.check_range(slba, nlb)
        await self._bounced(slba, nlb, src, write=True)

    async def _bounced(self, slba: int, nlb: int, host: memoryview, write: bool) -> None:
        """Move ``host`` memory through registered bounce buffers, one chunk per command."""
        if nlb <= self.per_command():  # the common case, without the job machinery
            await self._bounce_one(slba, nlb, host, write)
            return
        ls = self.lba_size

        def job(lba: int, n: int, at: int) -> Callable[[], Awaitable[memoryview]]:
            return lambda: self._bounce_one(lba, n, host[at:at + n * ls], write)

        await run_all([job(*c) for c in self._chunks(slba, nlb)])

    async def _bounce_one(self, slba: int, nlb: int, host: memoryview | None,
                          write: bool) -> memoryview:
        """One command through one bounce buffer, copying to or from ``host``.

        Returns the buffer's view of the data: lent, as in :meth:`lend_lbas`.  While the
        path reconnects it waits before it takes a buffer: a command run again after its
        started form failed (:meth:`start_lend`) gets one only once the buffer it had is
        back.
        """
        length = nlb * self.lba_size
        io = self.io
        pool = io.bounce
        assert pool is not None
        if not io.live:
            await io.wait_live()
        region = await pool.take()
        view = region.view
        assert view is not None
        try:
            # Checked again after the waits: a reconnect may have found another namespace
            # behind the NSID meanwhile, and nothing of this one may go to that one.
            if self.refusal is not None:
                self.check_served()
            if write:
                view[:length] = host
                sqe = cmd.write(self.nsid, slba, nlb, nvme.NULL_SGL)
            else:
                pool.for_read(view, length)
                sqe = cmd.read(self.nsid, slba, nlb, nvme.NULL_SGL)
            # returns or raises only once the target can no longer reach the buffer
            await io.io_command(sqe, DataRef(region, 0, length), to_controller=write)
            if host is not None and not write:
                host[:] = view[:length]
        finally:
            pool.give(region)
        return view[:length]

    # -- started I/O, answered by a callback -------------------------------------------------------

    def start_lend(self, slba: int, nlb: int, done: Callable[[memoryview | None], None]
                   ) -> bool:
        """:meth:`lend_lbas` with no task waiting, where one command through a free bounce
        buffer reads it all: ``done`` is called with the buffer's view once the target
        answered (the LBAs are its first bytes; lent for that call only), or with None when
        the command failed (read again with :meth:`lend_lbas`, which retries, reconnects or
        raises the error).  It must not raise.  False, with nothing sent, when the read
        needs more than one command, the namespace cannot serve I/O, no buffer is free, or the path
        is not live or its queue has no slot for it (``start_io``).  The caller checked
        the range (an unavailable namespace has no LBAs, so none is in range)."""
        if self.refusal is not None or nlb > self.per_command():
            return False
        io = self.io
        pool = io.bounce
        region = pool.take_nowait() if pool is not None else None
        if region is None:
            return False
        pool.for_read(region.view, nlb * self.lba_size)  # type: ignore[arg-type]
        sent_in = pool.generation

        def finished(request: Finished) -> None:
            if request.error is not None:  # the target may still write into the buffer
                io.io_failed(queue, request.error)  # until the queue is torn down
                pool.hold(region, sent_in)
                done(None)
            else:
                pool.give(region)  # nothing takes it before done() returns: no task runs
                done(region.view if request.completion.ok else None)  # type: ignore[union-attr]

        queue = io.start_io(cmd.read(self.nsid, slba, nlb, nvme.NULL_SGL),
                            DataRef(region, 0, nlb * self.lba_size), finished)
        if queue is None:
            pool.give(region)
            return False
        return True

    def start_write_lbas(self, slba: int, data: memoryview, done: Callable[[bool], None]
                         ) -> bool:
        """:meth:`write_lbas` with no task waiting, for whole LBAs that one command through
        a free bounce buffer writes: ``data`` is copied at once, and ``done`` is called with
        True once the target has it, or with False when the command failed (write again
        with :meth:`write_lbas`).  It must not raise.  False, with nothing sent, otherwise
        (as :meth:`start_lend`).  The caller checked the range."""
        length = len(data)
        nlb = length // self.lba_size
        if self.refusal is not None or nlb > self.per_command():
            return False
        io = self.io
        pool = io.bounce
        region = pool.take_nowait() if pool is not None else None
        if region is None:
            return False
        region.view[:length] = data  # type: ignore[index]
        sent_in = pool.generation

        def finished(request: Finished) -> None:
            if request.error is not None:  # the target may still read the buffer
                io.io_failed(queue, request.error)  # until the queue is torn down
                pool.hold(region, sent_in)
                done(False)
            else:
                pool.give(region)
                done(request.completion.ok)  # type: ignore[union-attr]

        queue = io.start_io(cmd.write(self.nsid, slba, nlb, nvme.NULL_SGL),
                            DataRef(region, 0, length), finished, to_controller=True)
        if queue is None:
            pool.give(region)
            return False
        return True
