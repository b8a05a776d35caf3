"""A namespace of a controller: its identity and size, and its I/O, which goes one way down.

Every byte-addressed read and write goes to the namespace's :class:`ByteRangeIO` (byte offsets
to LBAs, read-modify-write of partial LBAs under a range lock, the statistics), whose LBAs
go to :class:`LbaIO` (commands split at MDTS, registered memory or bounce buffers), which
runs them on the :class:`~nvmeof_fuse.host.io.CommandIssuer` (the controller).  Nothing
below calls back up here (docs/architecture.md, "The read path").

``read_into``/``write_from`` move data straight between the target and caller memory
registered with the controller (no host copy).  ``read_lbas`` and ``write_lbas`` go through
the controller's bounce buffers (``lend_lbas`` hands a read's bounce buffer on instead of
copying it), and ``read``/``write`` take any byte offset and length.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ... import nvme
from ...concurrency import run_all
from ...errors import NamespaceRemoved, NamespaceUnavailable, unavailable_line
from ...nvme import command as cmd
from ..io import CommandIssuer
from ..memory import DataRef
from .byterange import ByteRangeIO, Edge, LbaIO
from .rangelock import LbaRangeLock
from .stats import IoStats

UNAVAILABLE_LBA_SIZE = 512
"""The LBA size an unavailable namespace shows (it has no LBAs)."""


class Namespace:
    """One active namespace; ``controller`` runs its commands (a :class:`Controller`, or
    anything else that is a :class:`~nvmeof_fuse.host.io.CommandIssuer`)."""

    def __init__(self, controller: CommandIssuer, nsid: int,
                 identify: nvme.IdentifyNamespace) -> None:
        self.controller = controller
        self.nsid = nsid
        self.stats = IoStats()
        self.lbas = LbaIO(controller, nsid, UNAVAILABLE_LBA_SIZE, 0)
        self._bytes = ByteRangeIO(self.lbas, self.stats)
        self._take(identify)

    def _take(self, identify: nvme.IdentifyNamespace) -> None:
        """Size and format from ``identify``; one we cannot serve leaves the namespace
        unavailable (:attr:`unavailable` says why): 0 LBAs, and every I/O fails."""
        self.identify = identify
        # what has no ``unusable`` (a test's stand-in with lba_size and nsze) is servable
        self.unavailable = getattr(identify, "unusable", "")
        lbas = self.lbas
        if self.unavailable:
            self.lba_size, self.nlb = UNAVAILABLE_LBA_SIZE, 0
        else:
            self.lba_size, self.nlb = identify.lba_size, identify.nsze
        if not self.removed:  # a removed namespace stays removed
            lbas.refusal = (NamespaceUnavailable(unavailable_line(self.nsid, self.unavailable))
                            if self.unavailable else None)
        lbas.lba_size, lbas.nlb = self.lba_size, self.nlb
        self.size = self.nlb * self.lba_size

    def __repr__(self) -> str:
        return f"<Namespace {self.nsid}: {self.nlb} x {self.lba_size} B>"

    # -- changes on the target (see host.events) -------------------------------------------------

    def resize(self, identify: nvme.IdentifyNamespace) -> int | None:
        """Take new Identify data; the old size in bytes if the size changed, else None."""
        old = self.size
        self._take(identify)
        return old if self.size != old else None

    @property
    def removed(self) -> bool:
        """Whether the namespace is gone from the subsystem (:meth:`remove`)."""
        return isinstance(self.lbas.refusal, NamespaceRemoved)

    def remove(self, reason: str) -> None:
        """The namespace is gone: every I/O from now on fails with NamespaceRemoved."""
        self.lbas.refusal = NamespaceRemoved(reason)

    def check_range(self, slba: int, nlb: int) -> None:
        """Raise unless ``nlb`` LBAs at ``slba`` lie inside the namespace (and it is there)."""
        self.lbas.check_range(slba, nlb)

    # -- whole LBAs (LbaIO) ----------------------------------------------------------------------

    async def read_into(self, slba: int, nlb: int, dest: DataRef) -> None:
        """Read ``nlb`` LBAs at ``slba`` straight into registered memory ``dest``."""
        await self.lbas.read_into(slba, nlb, dest)

    async def write_from(self, slba: int, nlb: int, src: DataRef) -> None:
        """Write ``nlb`` LBAs at ``slba`` straight from registered memory ``src``."""
        await self.lbas.write_from(slba, nlb, src)

    async def read_lbas(self, slba: int, nlb: int) -> bytes:
        """Read ``nlb`` LBAs at ``slba`` into bytes of the caller's own."""
        return await self.lbas.read_lbas(slba, nlb)

    async def lend_lbas(self, slba: int, nlb: int) -> memoryview:
        """Read ``nlb`` LBAs at ``slba``, lent: valid until the calling task next yields
        (:meth:`LbaIO.lend_lbas`)."""
        return await self.lbas.lend_lbas(slba, nlb)

    async def write_lbas(self, slba: int, data: bytes | memoryview) -> None:
        await self.lbas.write_lbas(slba, data)

    # -- byte-addressed I/O (ByteRangeIO) --------------------------------------------------------

    async def read(self, offset: int, length: int) -> bytes:
        """Read at any byte offset; short at the end of the namespace."""
        return await self._bytes.read(offset, length)

    async def read_lent(self, offset: int, length: int) -> memoryview | bytes:
        """:meth:`read` without the copy: lent data, valid until the calling task next
        yields (see :meth:`lend_lbas`).  For handing straight on, as a FUSE reply does."""
        return await self._bytes.read_lent(offset, length)

    def start_read_lent(self, offset: int, length: int,
                        done: Callable[[memoryview | None], None]) -> bool:
        """:meth:`read_lent` with no task waiting, answered by ``done`` where one command
        through a free bounce buffer reads it all (:meth:`ByteRangeIO.start_read_lent`)."""
        return self._bytes.start_read_lent(offset, length, done)

    async def read_placed(self, offset: int, length: int, dest: DataRef,
                          put: Callable[[int, memoryview], None]) -> int:
        """A read whose whole LBAs land in registered memory ``dest`` and whose partial ones
        ``put`` stores (see :meth:`ByteRangeIO.read_placed`)."""
        return await self._bytes.read_placed(offset, length, dest, put)

    def start_write(self, offset: int, data: memoryview,
                    done: Callable[[bool], None]) -> bool:
        """:meth:`write` with no task waiting, answered by ``done``, for whole LBAs that one
        command through a free bounce buffer writes (:meth:`ByteRangeIO.start_write`)."""
        return self._bytes.start_write(offset, data, done)

    async def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write at any byte offset; partial LBAs by read-modify-write."""
        return await self._bytes.write(offset, data)

    async def write_placed(self, offset: int, length: int,
                           edge_data: Callable[[Edge], bytes | memoryview],
                           write_middle: Callable[[int, int], Awaitable[None]]) -> None:
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
        """Flush; one of a removed namespace fails (one we cannot serve still asks the
        target: the final flush of every namespace, at unmount, must stay quiet)."""
        if self.removed:
            self.lbas.check_served()
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
