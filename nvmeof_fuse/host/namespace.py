"""Namespace I/O: LBA ranges over registered memory, split at MDTS across queues.

``read_into``/``write_from`` move data straight between the target and caller
memory registered with the controller (no host copy).  ``read_lbas`` and
``write_lbas`` go through the controller's bounce buffers (``lend_lbas`` hands
a read's bounce buffer on instead of copying it), and ``read``/``write`` take
any byte offset and length (partial LBAs by read-modify-write).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .. import nvme
from ..concurrency import run_all
from ..errors import InvalidArgument, NamespaceRemoved
from ..nvme import command as cmd
from .byterange import ByteRangeIO, LbaRangeLock
from .io import CommandIssuer
from .memory import DataRef
from .stats import IoStats

if TYPE_CHECKING:
    from ..transport.base import Finished


class Namespace:
    """One active namespace; ``controller`` runs its commands (a :class:`Controller`, or
    anything else that is a :class:`~nvmeof_fuse.host.io.CommandIssuer`)."""

    def __init__(self, controller: CommandIssuer, nsid: int,
                 identify: nvme.IdentifyNamespace) -> None:
        self.controller = controller
        self.nsid = nsid
        self.identify = identify
        self.lba_size = identify.lba_size
        self.nlb = identify.nsze
        self.size = self.nlb * self.lba_size
        self.stats = IoStats()
        self._bytes = ByteRangeIO(self, self.stats)
        self.removed = ""  # why, once the namespace is gone from the subsystem

    def __repr__(self) -> str:
        return f"<Namespace {self.nsid}: {self.nlb} x {self.lba_size} B>"

    # -- changes on the target (see host.events) -------------------------------------------------

    def resize(self, identify: nvme.IdentifyNamespace) -> int | None:
        """Take new Identify data; the old size in bytes if the size changed, else None."""
        old = self.size
        self.identify = identify
        self.lba_size = identify.lba_size
        self.nlb = identify.nsze
        self.size = self.nlb * self.lba_size
        return old if self.size != old else None

    def remove(self, reason: str) -> None:
        """The namespace is gone: every I/O from now on fails with NamespaceRemoved."""
        self.removed = reason

    # -- checks and splitting ------------------------------------------------------------------

    def check_range(self, slba: int, nlb: int) -> None:
        if self.removed:
            raise NamespaceRemoved(self.removed)
        if nlb <= 0:
            raise InvalidArgument(f"an I/O needs at least one LBA, got {nlb}")
        if slba < 0 or slba + nlb > self.nlb:
            raise InvalidArgument(
                f"LBA range {slba}..{slba + nlb - 1} is outside namespace {self.nsid} "
                f"(LBAs 0..{self.nlb - 1})")

    def _per_command(self) -> int:
        """Most LBAs one command moves: the controller's transfer limit, at least one LBA."""
        return cmd.lbas_per_command(self.controller.max_transfer, self.lba_size)

    def _chunks(self, slba: int, nlb: int):
        """(slba, nlb, byte offset) pieces no larger than the controller's transfer limit."""
        per = self._per_command()
        for start in range(0, nlb, per):
            yield slba + start, min(per, nlb - start), start * self.lba_size

    # -- zero-copy I/O on registered memory ----------------------------------------------------

    async def read_into(self, slba: int, nlb: int, dest: DataRef) -> None:
        """Read ``nlb`` LBAs at ``slba`` straight into registered memory ``dest``."""
        if self._one_command(slba, nlb, dest):  # the hot path: one coroutine frame less
            await self.controller.io_command(cmd.read(self.nsid, slba, nlb, nvme.NULL_SGL), dest)
        else:
            await self._split(slba, nlb, dest, write=False)

    async def write_from(self, slba: int, nlb: int, src: DataRef) -> None:
        """Write ``nlb`` LBAs at ``slba`` straight from registered memory ``src``."""
        if self._one_command(slba, nlb, src):
            await self.controller.io_command(cmd.write(self.nsid, slba, nlb, nvme.NULL_SGL), src,
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
        return nlb <= self._per_command()

    async def _split(self, slba: int, nlb: int, ref: DataRef, write: bool) -> None:
        """A transfer past the controller's limit: its commands run at once."""
        build = cmd.write if write else cmd.read

        def job(lba: int, n: int, at: int):
            async def run() -> None:
                piece = ref.region.ref(ref.offset + at, n * self.lba_size)
                await self.controller.io_command(build(self.nsid, lba, n, nvme.NULL_SGL), piece,
                                                 to_controller=write)
            return run

        await run_all([job(*c) for c in self._chunks(slba, nlb)])

    # -- bounce-buffered LBA I/O (the LbaDevice of ByteRangeIO) ----------------------------------

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
        if nlb <= self._per_command():
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
        if nlb <= self._per_command():  # the common case, without the job machinery
            await self._bounce_one(slba, nlb, host, write)
            return
        ls = self.lba_size

        def job(lba: int, n: int, at: int):
            return lambda: self._bounce_one(lba, n, host[at:at + n * ls], write)

        await run_all([job(*c) for c in self._chunks(slba, nlb)])

    async def _bounce_one(self, slba: int, nlb: int, host: memoryview | None,
                          write: bool) -> memoryview:
        """One command through one bounce buffer, copying to or from ``host``.

        Returns the buffer's view of the data: lent, as in :meth:`lend_lbas`.  While the
        controller reconnects it waits before it takes a buffer: a command run again after
        its started form failed (:meth:`start_read_lent`) gets one only once the buffer it
        had is back.
        """
        length = nlb * self.lba_size
        ctrl = self.controller
        pool = ctrl.bounce
        assert pool is not None
        if not ctrl.live:
            await ctrl.wait_live()
        region = await pool.take()
        view = region.view
        assert view is not None
        try:
            if write:
                view[:length] = host
                sqe = cmd.write(self.nsid, slba, nlb, nvme.NULL_SGL)
            else:
                sqe = cmd.read(self.nsid, slba, nlb, nvme.NULL_SGL)
            # returns or raises only once the target can no longer reach the buffer
            await ctrl.io_command(sqe, DataRef(region, 0, length), to_controller=write)
            if host is not None and not write:
                host[:] = view[:length]
        finally:
            pool.give(region)
        return view[:length]

    # -- byte-addressed I/O ----------------------------------------------------------------------

    async def read(self, offset: int, length: int) -> bytes:
        """Read at any byte offset; short at the end of the namespace."""
        return await self._bytes.read(offset, length)

    async def read_lent(self, offset: int, length: int) -> memoryview | bytes:
        """:meth:`read` without the copy: lent data, valid until the calling task next
        yields (see :meth:`lend_lbas`).  For handing straight on, as a FUSE reply does."""
        return await self._bytes.read_lent(offset, length)

    def start_read_lent(self, offset: int, length: int,
                        done: Callable[[memoryview | None], None]) -> bool:
        """:meth:`read_lent` with no task waiting, where one command through a free bounce
        buffer reads it all: ``done`` is called with the data (lent for that call only)
        once the target answered (counted as a read, and in the counter
        ``callback_reads``), or with None when the command failed (nothing is counted then:
        read again with :meth:`read_lent`, which retries, reconnects or
        raises the error).  It must not raise.  False, with nothing sent, when the read
        needs more than that, the controller is not live, or the queue it picks has no slot
        for it (:meth:`CommandIssuer.start_io`)."""
        ls = self.lba_size
        end = min(offset + length, self.size)
        if self.removed or offset < 0 or end <= offset:
            return False
        first = offset // ls
        nlb = (end - 1) // ls - first + 1
        if nlb > self._per_command():
            return False
        pool = self.controller.bounce
        region = pool.take_nowait() if pool is not None else None
        if region is None:
            return False
        skip = offset - first * ls
        stats = self.stats
        started = time.perf_counter()
        ctrl = self.controller
        sent_in = pool.generation

        def finished(request: Finished) -> None:
            if request.error is not None:  # the target may still write into the buffer
                ctrl.io_failed(queue, request.error)  # until the queue is torn down
                pool.hold(region, sent_in)
                done(None)
            else:
                pool.give(region)  # nothing takes it before done() returns: no task runs
                if request.completion.ok:  # type: ignore[union-attr]
                    stats.record("read", end - offset, time.perf_counter() - started)
                    stats.add("callback_reads")
                    done(region.view[skip:skip + end - offset])  # type: ignore[index]
                else:
                    done(None)

        queue = ctrl.start_io(cmd.read(self.nsid, first, nlb, nvme.NULL_SGL),
                              DataRef(region, 0, nlb * ls), finished)
        if queue is None:
            pool.give(region)
            return False
        return True

    def start_write(self, offset: int, data: memoryview,
                    done: Callable[[bool], None]) -> bool:
        """:meth:`write` with no task waiting, for whole LBAs that one command through a
        free bounce buffer writes, when their range lock is free now: ``data`` is copied
        at once, and ``done`` is called with True once the target has it (counted as a
        write, and in ``callback_writes``), or with False
        when the command failed (nothing is counted then, and the lock is let go: write
        again with :meth:`write`, which retries, reconnects or raises the error).  It
        must not raise.  False, with nothing sent, otherwise (as :meth:`start_read_lent`)."""
        ls = self.lba_size
        length = len(data)
        if (self.removed or offset < 0 or offset % ls or length % ls or not length
                or offset + length > self.size):
            return False
        nlb = length // ls
        if nlb > self._per_command():
            return False
        slba = offset // ls
        lock = self._bytes.lock
        held = lock.try_acquire([(slba, slba + nlb, False)])  # shared, as write() takes it
        if held is None:
            return False
        pool = self.controller.bounce
        region = pool.take_nowait() if pool is not None else None
        if region is None:
            lock.release(held)
            return False
        region.view[:length] = data  # type: ignore[index]
        stats = self.stats
        started = time.perf_counter()
        ctrl = self.controller
        sent_in = pool.generation

        def finished(request: Finished) -> None:
            lock.release(held)
            if request.error is not None:  # the target may still read the buffer
                ctrl.io_failed(queue, request.error)  # until the queue is torn down
                pool.hold(region, sent_in)
                done(False)
            else:
                pool.give(region)
                ok = request.completion.ok  # type: ignore[union-attr]
                if ok:
                    stats.record("write", length, time.perf_counter() - started)
                    stats.add("callback_writes")
                done(ok)

        queue = ctrl.start_io(cmd.write(self.nsid, slba, nlb, nvme.NULL_SGL),
                              DataRef(region, 0, length), finished, to_controller=True)
        if queue is None:
            pool.give(region)
            lock.release(held)
            return False
        return True

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write at any byte offset; partial LBAs by read-modify-write."""
        return await self._bytes.write(offset, data)

    async def write_placed(self, offset: int, length: int, edge_data, write_middle) -> None:
        """A write whose whole LBAs the caller moves (see ByteRangeIO.write_placed)."""
        await self._bytes.write_placed(offset, length, edge_data, write_middle)

    def write_locked(self, offset: int, length: int):
        """Hold the range lock a write of these bytes takes (see ByteRangeIO.write_locked)."""
        return self._bytes.write_locked(offset, length)

    @property
    def write_lock(self) -> LbaRangeLock:
        """The LBA range lock every write holds (:class:`LbaRangeLock`)."""
        return self._bytes.lock

    # -- other commands --------------------------------------------------------------------------

    async def flush(self) -> None:
        if self.removed:
            raise NamespaceRemoved(self.removed)
        await self.controller.io_command(cmd.flush(self.nsid))

    async def write_zeroes(self, slba: int, nlb: int, deallocate: bool = False) -> None:
        self.check_range(slba, nlb)
        jobs = []
        for start in range(slba, slba + nlb, cmd.MAX_NLB):
            n = min(cmd.MAX_NLB, slba + nlb - start)
            jobs.append(lambda s=start, n=n: self.controller.io_command(
                cmd.write_zeroes(self.nsid, s, n, deallocate)))
        await run_all(jobs)

    async def deallocate(self, ranges: list[tuple[int, int]]) -> None:
        """Dataset Management with the Deallocate attribute over ``[(slba, nlb), ...]``."""
        for slba, nlb in ranges:
            self.check_range(slba, nlb)
        payload = cmd.dsm_ranges(ranges)
        async with self.controller.scratch(len(payload)) as ref:
            ref.region.view[:len(payload)] = payload
            await self.controller.io_command(
                cmd.dataset_management(self.nsid, len(ranges), sgl=nvme.NULL_SGL), ref,
                to_controller=True)
