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
from ...errors import (
    NamespaceRemoved,
    NamespaceReplaced,
    NamespaceUnavailable,
    NVMeoFError,
    unavailable_line,
)
from ...nvme import command as cmd
from ..io import CommandIssuer
from ..memory import DataRef
from .byterange import ByteRangeIO, Edge, LbaIO
from .rangelock import LbaRangeLock
from .sharedranges import NamespaceRanges, SharedRanges
from .stats import IoStats

UNAVAILABLE_LBA_SIZE = 512
"""The LBA size an unavailable namespace shows (it has no LBAs)."""
GONE = -1
"""The generation a lease gives a namespace its client knew that was removed or replaced
since (:mod:`.attached`)."""


_IO_PARTS = frozenset({"lbas", "_bytes", "stats"})
"""The attributes of a namespace's I/O stack, built at its first use (Namespace.__getattr__)."""


class Namespace:
    """One active namespace; ``controller`` runs its commands (a :class:`Controller`, or
    anything else that is a :class:`~nvmeof_fuse.host.io.CommandIssuer`).

    Its I/O stack (:attr:`lbas`, the byte range with its range lock, :attr:`stats`) is built
    at the first use of any of them, so that a namespace never used costs a few hundred
    bytes: a target may have 65,536 of them (docs/reliability.md, "Many namespaces").

    ``generation`` tells this namespace from those that had or will have its NSID on the
    same mount (one found anew after a removal, or behind the NSID after its identity
    changed: :mod:`.events`); ``identity`` is what it was known by, once read.
    """

    __slots__ = ("controller", "nsid", "generation", "identity", "conflict", "identify",
                 "unavailable", "lba_size", "nlb", "size", "_refusal", "_io_built", "lbas",
                 "_bytes", "stats")

    def __init__(self, controller: CommandIssuer, nsid: int,
                 identify: nvme.IdentifyNamespace, generation: int = 0) -> None:
        self.controller = controller
        self.nsid = nsid
        self.generation = generation
        self.identity: nvme.NamespaceIdentity | None = None
        self.conflict = ""
        """Why we refuse to serve it although its values are servable: it reports the
        identifiers of another namespace of the subsystem (set by the rescan)."""
        self._refusal: NVMeoFError | None = None
        """Why the namespace serves no I/O (removed, replaced, or values we cannot serve);
        None serves.  Its LbaIO holds the same, once built."""
        self._io_built = False
        self._take(identify)

    def __getattr__(self, name: str):
        """Build the I/O stack at the first use of any part of it (called only while a slot
        of it is unset: once built, reaching it costs nothing more)."""
        if name not in _IO_PARTS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        self._build_io()
        return getattr(self, name)

    def _build_io(self) -> None:
        stats = self.stats = IoStats()
        lbas = self.lbas = LbaIO(self.controller, self.nsid, self.lba_size, self.nlb)
        lbas.refusal = self._refusal
        self._bytes = ByteRangeIO(lbas, stats)
        self._io_built = True
        ranges = getattr(self.controller, "shared_ranges", None)
        if ranges is not None:
            self.share_locks(ranges)

    def share_locks(self, ranges: SharedRanges) -> None:
        """Let this namespace's writes take ``ranges``' locks too (the mount's other
        processes write it: :mod:`.sharedranges`); a namespace whose I/O is not built yet
        takes them as it is built."""
        if self._io_built:
            lbas = self.lbas
            self._bytes.lock.shared = NamespaceRanges(ranges, self.nsid, lambda: lbas.nlb)

    def _take(self, identify: nvme.IdentifyNamespace) -> None:
        """Size and format from ``identify``; one we cannot serve leaves the namespace
        unavailable (:attr:`unavailable` says why): 0 LBAs, and every I/O fails."""
        self.identify = identify
        # what has no ``unusable`` (a test's stand-in with lba_size and nsze) is servable
        self.unavailable = getattr(identify, "unusable", "") or self.conflict
        if self.unavailable:
            self.lba_size, self.nlb = UNAVAILABLE_LBA_SIZE, 0
        else:
            self.lba_size, self.nlb = identify.lba_size, identify.nsze
        if not self.removed:  # a removed namespace stays removed
            self._refusal = (NamespaceUnavailable(unavailable_line(self.nsid, self.unavailable))
                             if self.unavailable else None)
        if self._io_built:
            lbas = self.lbas
            lbas.refusal, lbas.lba_size, lbas.nlb = self._refusal, self.lba_size, self.nlb
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
        return isinstance(self._refusal, NamespaceRemoved)

    def remove(self, reason: str) -> None:
        """The namespace is gone: every I/O from now on fails with NamespaceRemoved."""
        self._refuse(NamespaceRemoved(reason))

    def replace(self, reason: str) -> None:
        """Another namespace answers behind the NSID now: every I/O of this one from now on
        fails with NamespaceReplaced (EIO), and never reaches the other."""
        self._refuse(NamespaceReplaced(reason))

    def _refuse(self, refusal: NVMeoFError) -> None:
        self._refusal = refusal
        if self._io_built:
            self.lbas.refusal = refusal

    def refuse_as(self, conflict: str) -> None:
        """Serve nothing (unavailable, as one whose values we cannot serve), for
        ``conflict``: why."""
        self.conflict = conflict
        self._take(self.identify)

    def check_range(self, slba: int, nlb: int) -> None:
        """Raise unless ``nlb`` LBAs at ``slba`` lie inside the namespace (and it is there)."""
        self.lbas.check_range(slba, nlb)

    @property
    def written(self) -> bool:
        """Whether anything was written to the namespace since its last :meth:`flush` began
        (what the final flush at unmount flushes).  Every write holds the namespace's range
        lock, whose release says so (:attr:`LbaRangeLock.written`), and so do the writes
        here that take no lock: the write path pays one attribute store.  In a mount of
        several processes, any of them (:mod:`.sharedranges`)."""
        if self._io_built and self._bytes.lock.written:
            return True
        ranges = getattr(self.controller, "shared_ranges", None)
        return ranges is not None and ranges.written(self.nsid)

    @property
    def io_stats(self) -> IoStats | None:
        """:attr:`stats`, or None while the namespace did no I/O (a report that reads this
        builds nothing)."""
        return self.stats if self._io_built else None

    def _wrote(self) -> None:
        lock = self._bytes.lock
        lock.written = True
        if lock.shared is not None:
            lock.shared.written = True

    # -- whole LBAs (LbaIO) ----------------------------------------------------------------------

    async def read_into(self, slba: int, nlb: int, dest: DataRef) -> None:
        """Read ``nlb`` LBAs at ``slba`` straight into registered memory ``dest``."""
        await self.lbas.read_into(slba, nlb, dest)

    async def write_from(self, slba: int, nlb: int, src: DataRef) -> None:
        """Write ``nlb`` LBAs at ``slba`` straight from registered memory ``src``."""
        try:
            await self.lbas.write_from(slba, nlb, src)
        finally:
            self._wrote()

    async def read_lbas(self, slba: int, nlb: int) -> bytes:
        """Read ``nlb`` LBAs at ``slba`` into bytes of the caller's own."""
        return await self.lbas.read_lbas(slba, nlb)

    async def lend_lbas(self, slba: int, nlb: int) -> memoryview:
        """Read ``nlb`` LBAs at ``slba``, lent: valid until the calling task next yields
        (:meth:`LbaIO.lend_lbas`)."""
        return await self.lbas.lend_lbas(slba, nlb)

    async def write_lbas(self, slba: int, data: bytes | memoryview) -> None:
        try:
            await self.lbas.write_lbas(slba, data)
        finally:
            self._wrote()

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
        target: the final flush at unmount must stay quiet).  :attr:`written` is cleared as
        the Flush goes out (a write that ends after that sets it again), and set again if
        the Flush fails."""
        refusal = self._refusal
        if isinstance(refusal, NamespaceRemoved):  # or replaced: its own error
            raise type(refusal)(*refusal.args)
        lock = self._bytes.lock if self._io_built else None
        ranges = getattr(self.controller, "shared_ranges", None)
        if lock is not None:
            lock.written = False
        if ranges is not None:
            ranges.clear_written(self.nsid)
        try:
            await self.controller.io_command(cmd.flush(self.nsid))
        except BaseException:
            if lock is not None:
                lock.written = True
            if ranges is not None:
                ranges.mark_written(self.nsid)
            raise

    async def write_zeroes(self, slba: int, nlb: int, deallocate: bool = False) -> None:
        self.check_range(slba, nlb)
        jobs = []
        for start in range(slba, slba + nlb, cmd.MAX_NLB):
            n = min(cmd.MAX_NLB, slba + nlb - start)
            jobs.append(lambda s=start, n=n: self.controller.io_command(
                cmd.write_zeroes(self.nsid, s, n, deallocate)))
        try:
            await run_all(jobs)
        finally:
            self._wrote()

    async def deallocate(self, ranges: list[tuple[int, int]]) -> None:
        """Dataset Management with the Deallocate attribute over ``[(slba, nlb), ...]``."""
        for slba, nlb in ranges:
            self.check_range(slba, nlb)
        payload = cmd.dsm_ranges(ranges)
        async with self.controller.scratch(len(payload)) as ref:
            ref.region.view[:len(payload)] = payload
            try:
                await self.controller.io_command(
                    cmd.dataset_management(self.nsid, len(ranges), sgl=nvme.NULL_SGL), ref,
                    to_controller=True)
            finally:
                self._wrote()
