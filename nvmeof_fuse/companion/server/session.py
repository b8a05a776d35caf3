"""One companion client's registrations and requests, inside the mount daemon.

A :class:`ClientSession` owns the memory a client registered with the mounted
controller (memfd mappings, dma-bufs, or in-process addresses) and runs its
reads and writes.  Data always moves between the target and that memory by
RDMA: a read never copies payload in the daemon, and a write copies only the
partial LBAs at its ends (read-modify-write under the namespace's range lock).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import mmap
import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from ...concurrency import run_all
from ...errors import (
    CommandTimeout,
    InvalidArgument,
    NamespaceUnavailable,
    NVMeoFError,
    TransportError,
    unavailable_line,
)
from ...host.memory import Region
from ...host.namespace.byterange import NoSpace
from .. import protocol
from ..cuda.dmabuf import register_dmabuf
from ..protocol import Piece

if TYPE_CHECKING:
    from .roles import Role

log = logging.getLogger(__name__)


class ReadOnly(NVMeoFError):
    errno = errno.EROFS


@dataclass
class CompanionStats:
    """Counters shown in ``.nvmeof/stats.json`` under ``companion``."""

    clients: int = 0  # companion clients connected now (the mount's own processes apart)
    clients_total: int = 0
    refused: int = 0
    regions: int = 0
    requests: int = 0
    errors: int = 0
    dmabuf_refused: int = 0  # dma-bufs the transport could not take: the client stages
    leases: int = 0  # clients holding queue IDs of their own (the mount's processes apart)
    lease_refusals: int = 0
    client_queue_read_bytes: int = 0  # moved over the clients' own queues (daemon not involved)
    client_queue_write_bytes: int = 0
    direct_read_bytes: int = 0  # moved over the daemon's queues, straight into client memory
    direct_write_bytes: int = 0
    staged_read_bytes: int = 0  # through a client's bounce memory
    staged_write_bytes: int = 0
    daemon_copied_bytes: int = 0  # payload the daemon itself copied (write edges only)
    own: dict[str, int] = field(default_factory=dict)
    """The sessions of each role (:mod:`.roles`): its counter now and ``_total`` ever."""
    by_path: dict[int, dict[str, int]] = field(default_factory=dict)
    """Bytes over the clients' own queues by the path (its index) they were leased on, on a
    multipath mount: counted as the clients report them (each second, and with a lease
    request, before it moves them to another path), on the path leased then."""

    def snapshot(self) -> dict[str, Any]:
        """The counters, each role's right after the clients'; on a multipath mount the
        clients' own queues' bytes by path (``client_queue_bytes_by_path``)."""
        counts: dict[str, Any] = dict(self.__dict__)
        own = counts.pop("own")
        by_path = counts.pop("by_path")
        clients = {name: counts.pop(name) for name in ("clients", "clients_total")}
        if by_path:
            counts["client_queue_bytes_by_path"] = {
                str(index): dict(moved) for index, moved in sorted(by_path.items())}
        return {**clients, **own, **counts}


PATH_COUNTERS = ("client_queue_read_bytes", "client_queue_write_bytes", "direct_read_bytes",
                 "direct_write_bytes", "staged_read_bytes", "staged_write_bytes",
                 "dmabuf_refused")
"""Bytes by path (and refused dma-bufs), counted per client as well as in total."""
CLIENT_QUEUE_COUNTERS = ("client_queue_read_bytes", "client_queue_write_bytes")
"""What clients report of their own queues: counted by path as well."""
PLACEMENT_KINDS = ("shared", "host", "cuda", "path")
"""The kinds of caller memory a client reports where it places: ``nvmeof_fuse.empty``
arrays, other host memory, CUDA memory; and on a multipath mount the path its own queues
are on (``direct via path 1 (mlx5_1, PIX to GPU 0000:9a:00.0)``)."""
PLACEMENT_CHARS = 300
"""Characters kept of a client's placement line (printable ASCII: each is one byte in a
reply, so that any clients' lines fit a ``stats`` reply)."""
MAX_COUNT = 1 << 63  # a client's running byte total past this is not taken


@dataclass(eq=False)
class Registered:
    """A registered region and how to let go of it."""

    region: Region
    staging: bool  # a client's bounce memory: bytes through it count as staged
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    busy: int = 0
    doomed: bool = False  # unregister asked while busy
    tainted: bool = False  # a command on it timed out: the target may still write it

    def release(self) -> None:
        self.region.close()
        for step in self.cleanup:
            step()
        self.cleanup.clear()


def _close_fd(fd: int) -> Callable[[], None]:
    return lambda: os.close(fd)


class ClientSession:
    """Registrations and requests of one client of a mounted controller."""

    def __init__(self, controller: Any, stats: CompanionStats, peer: str, *,
                 read_only: bool = False, quarantine: list[Registered] | None = None) -> None:
        self.controller = controller
        self.stats = stats
        self.peer = peer
        self.pid: int | None = None  # the client's process (SO_PEERCRED)
        self.read_only = read_only
        self.regions: dict[int, Registered] = {}
        self._next = 1
        self._quarantine = quarantine if quarantine is not None else []
        self.counts = dict.fromkeys(PATH_COUNTERS, 0)
        self.placement: dict[str, str] = {}  # kind of memory -> how the client moves it
        self.qids: list[int] = []  # leased queue IDs
        self.role: Role | None = None  # one of the mount's own processes (it leased as one)
        self.own_report: dict | None = None  # what such a process last reported of itself
        self.lessor: Any = None  # with several paths: the path's controller they are on
        self.lease_place: tuple[str, str, int] | None = None  # where (transport, address)
        self.lease_wish: dict[str, Any] = {}  # where its memory is (near), or a path named
        self.lease_path: int | None = None  # the index of the path leased, with several
        self.lease_transport = ""  # what its own queues run over (rdma, tcp)
        self.write_locks: dict[int, trio.Event] = {}  # token -> set to release the lock
        self.next_token = 0
        self._waits: set[trio.CancelScope] = set()  # lease and lock waits under way
        self.ended = False
        self.nursery: trio.Nursery | None = None  # where held locks live (the connection's)
        self.notify: Callable[[dict[str, Any]], Awaitable[bool]] | None = None
        """Sends the client unasked news; says whether it was sent."""
        self.pinned: dict[int, Any] = {}
        """The namespaces this client opened (its ``hello``), by nsid: its requests go to
        these, and fail once one was removed or replaced, never to another of its NSID."""

    def pin(self, nsid: int) -> None:
        """The client opened namespace ``nsid`` as it is now (see :attr:`pinned`)."""
        ns = self.controller.namespaces.get(nsid)
        if ns is not None:
            self.pinned.setdefault(nsid, ns)

    # -- registration ---------------------------------------------------------------------

    def _add(self, reg: Registered) -> int:
        rid = self._next
        self._next += 1
        self.regions[rid] = reg
        self.stats.regions += 1
        return rid

    def register_memfd(self, fd: int, length: int, staging: bool = False) -> int:
        """Map a client's memfd (taking ownership of ``fd``) and register the mapping."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument("register: the descriptor is not a memfd")
            if not 0 < length <= st.st_size:
                raise InvalidArgument(f"register: length {length} is outside the "
                                      f"{st.st_size}-byte memfd")
            mem = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        anchor = ctypes.c_char.from_buffer(mem)
        addr = ctypes.addressof(anchor)
        del anchor
        try:
            registration = self.controller.transport.register(addr, length, mem)
        except BaseException:
            mem.close()
            os.close(fd)
            raise
        return self._add(Registered(Region(addr, length, registration, mem), staging,
                                    [mem.close, _close_fd(fd)]))

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> int:
        """Register a dma-buf (a GPU allocation) at ``iova``, taking ownership of ``fd``.

        A dma-buf the transport cannot take raises :class:`PlacementRefused`, which
        is counted as ``dmabuf_refused``, not as an error: the client stages instead.
        """
        try:
            if length <= 0 or offset < 0 or iova < 0:
                raise InvalidArgument(f"register: bad dma-buf range offset {offset} "
                                      f"length {length} iova {iova:#x}")
            try:
                region, cleanup = register_dmabuf(self.controller.transport, fd, offset,
                                                  length, iova)
            except TransportError as exc:
                self.add("dmabuf_refused", 1)
                raise protocol.PlacementRefused(str(exc)) from None
        except BaseException:
            os.close(fd)
            raise
        return self._add(Registered(region, False, [cleanup, _close_fd(fd)]))

    def register_address(self, addr: int, length: int, owner: object,
                         staging: bool = False) -> int:
        """Register memory of this very process (the in-process API)."""
        if length <= 0:
            raise InvalidArgument("cannot register an empty buffer")
        registration = self.controller.transport.register(addr, length, owner)
        return self._add(Registered(Region(addr, length, registration, owner), staging))

    def unregister(self, rid: int) -> None:
        reg = self._get(rid)
        del self.regions[rid]
        self._drop(reg)

    def _drop(self, reg: Registered) -> None:
        self.stats.regions -= 1
        if reg.busy and not reg.tainted:
            reg.doomed = True  # released when its last command is done
        else:
            self._let_go(reg)

    def _let_go(self, reg: Registered) -> None:
        if reg.tainted:
            self._quarantine.append(reg)  # released with the controller, never reused
        else:
            reg.release()

    def _get(self, rid: int) -> Registered:
        try:
            return self.regions[rid]
        except KeyError:
            raise InvalidArgument(f"region {rid} is not registered") from None

    def close(self) -> None:
        """Release every registration (the client closed or died)."""
        for rid in list(self.regions):
            self.unregister(rid)

    # -- I/O --------------------------------------------------------------------------------

    def namespace(self, nsid: int) -> Any:
        ns = self.pinned.get(nsid) or self.controller.namespaces.get(nsid)
        if ns is None:
            raise InvalidArgument(f"namespace {nsid} does not exist on this mount")
        if ns.unavailable:
            raise NamespaceUnavailable(unavailable_line(nsid, ns.unavailable))
        return ns

    async def _using(self, reg: Registered, job: Callable[[], Any]) -> None:
        reg.busy += 1
        try:
            await job()
        except (CommandTimeout, TransportError):
            reg.tainted = True
            raise
        finally:
            reg.busy -= 1
            if reg.doomed and not reg.busy:
                reg.doomed = False
                self._let_go(reg)

    def _count(self, reg: Registered, nbytes: int, write: bool) -> None:
        name = ("staged_" if reg.staging else "direct_") + ("write" if write else "read")
        self.add(name + "_bytes", nbytes)

    def add(self, counter: str, nbytes: int) -> None:
        """Count ``nbytes`` moved by ``counter``'s path, for this client and in total (and
        over its own queues, by the multipath mount's path they are leased on)."""
        self.counts[counter] += nbytes
        setattr(self.stats, counter, getattr(self.stats, counter) + nbytes)
        if self.lease_path is not None and counter in CLIENT_QUEUE_COUNTERS:
            on_path = self.stats.by_path.setdefault(
                self.lease_path, dict.fromkeys(CLIENT_QUEUE_COUNTERS, 0))
            on_path[counter] += nbytes

    def report(self, moved: dict[str, int], placement: object = None) -> None:
        """The client's own running totals of bytes over its own queues, and where it
        places each kind of memory (``placement``, when it changed)."""
        if not isinstance(moved, dict):
            raise protocol.ProtocolError(f"companion field 'moved' must be an object, "
                                         f"got {moved!r}")
        if placement is not None:
            if not isinstance(placement, dict):
                raise protocol.ProtocolError(f"companion field 'placement' must be an "
                                             f"object, got {placement!r}")
            self.placement = {kind: _printable(placement[kind]) for kind in PLACEMENT_KINDS
                              if kind in placement}
        for counter in CLIENT_QUEUE_COUNTERS:
            total = moved.get(counter)
            if type(total) is int and self.counts[counter] < total < MAX_COUNT:
                self.add(counter, total - self.counts[counter])

    @contextlib.contextmanager
    def waiting(self) -> Iterator[trio.CancelScope]:
        """A scope for a wait on the client's behalf, cancelled when the client goes."""
        scope = trio.CancelScope()
        if self.ended:
            scope.cancel()
        self._waits.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._waits.discard(scope)

    def end_waits(self) -> None:
        """The client is gone: stop its lease and lock waits and release its locks."""
        self.ended = True
        for scope in self._waits:
            scope.cancel()
        for release in self.write_locks.values():
            release.set()
        self.write_locks.clear()

    async def read(self, nsid: int, pieces: list[Piece]) -> None:
        """Read each piece's LBAs straight into its registered region."""
        ns = self.namespace(nsid)
        jobs = []
        for piece in pieces:  # all checked before any is issued
            reg = self._get(piece.region)
            ns.check_range(piece.slba, piece.nlb)
            ref = reg.region.ref(piece.offset, piece.nlb * ns.lba_size)
            jobs.append(functools.partial(self._read_piece, ns, reg, piece, ref))
        await run_all(jobs)

    async def _read_piece(self, ns: Any, reg: Registered, piece: Piece, ref: Any) -> None:
        await self._using(reg, lambda: ns.read_into(piece.slba, piece.nlb, ref))
        self._count(reg, ref.length, write=False)

    async def write(self, nsid: int, offset: int, length: int, rid: int, region_offset: int,
                    head: bytes, tail: bytes) -> None:
        """Write ``length`` bytes at ``offset``: whole LBAs from the region, edges from bytes."""
        if self.read_only:
            raise ReadOnly("the namespace is mounted read-only")
        ns = self.namespace(nsid)
        if offset < 0 or length <= 0:
            raise InvalidArgument(f"bad write: offset {offset}, length {length}")
        if offset + length > ns.size:
            raise NoSpace(f"write of {length} bytes at offset {offset} extends past the end "
                          f"of namespace {nsid} ({ns.size} bytes)")
        plan = protocol.plan_write(offset, length, ns.lba_size)
        if len(head) != plan.head.stop - plan.head.start or \
                len(tail) != plan.tail.stop - plan.tail.start:
            raise InvalidArgument(f"write edges of {len(head)}+{len(tail)} bytes do not fit "
                                  f"offset {offset} length {length}")
        reg = self._get(rid)
        middle = None
        if plan.middle.stop > plan.middle.start:
            middle = reg.region.ref(region_offset + plan.middle.start,
                                    plan.middle.stop - plan.middle.start)

        def edge_data(edge) -> bytes:  # the head edge is the one starting the range
            return head if edge.data.start == 0 else tail

        async def write_middle(slba: int, nlb: int) -> None:
            assert middle is not None
            await self._using(reg, lambda: ns.write_from(slba, nlb, middle))
            self._count(reg, middle.length, write=True)

        await ns.write_placed(offset, length, edge_data, write_middle)
        self.stats.daemon_copied_bytes += len(head) + len(tail)


def _printable(line: object) -> str:
    """A client's placement line as printable ASCII, at most PLACEMENT_CHARS."""
    text = line if isinstance(line, str) else type(line).__name__
    return "".join(c if " " <= c <= "~" else "?" for c in text[:PLACEMENT_CHARS])
