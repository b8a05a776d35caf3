"""A companion client's own I/O queues on the mounted controller: the daemon leaves the data path.

The mount daemon leases queue IDs over the companion socket (after its uid
check).  This process connects them itself (RDMA-CM connections and a
protection domain of its own, a Fabrics Connect carrying the mount's
controller ID, HostNQN and HostID: :mod:`nvmeof_fuse.host.attached`), registers
its own memory there, and moves data between the target and that memory with
nobody in between.  One trio loop on one thread (:class:`SyncController`)
completes every request's future: no thread per request.

Reads never involve the daemon.  A write asks the daemon for the range lock a
FUSE write takes (so it never slips between a read-modify-write's read and its
write), read-modify-writes its partial end LBAs itself, and on unlock the
daemon drops the kernel's cached pages of the file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import trio

from ..concurrency import run_all
from ..errors import CommandTimeout, InvalidArgument, NVMeoFError, TransportError
from ..host.attached import Lease, NamespaceShape, attach
from ..host.byterange import split_range
from ..host.controller import ConnectOptions, make_transport
from ..host.memory import Region, buffer_address
from ..host.sync import SyncController
from ..nvme import command as nvme_cmd
from ..nvme.sgl import NULL_SGL
from . import gpu, protocol, shm
from .dmabuf import DmabufCache, register_dmabuf
from .future import IOFuture

log = logging.getLogger(__name__)

POLLED_QUEUES = 2
"""Of a client's leased queues, how many its callers' threads drive themselves (whole-LBA
reads into registered host memory; :mod:`nvmeof_fuse.transport.rdma_polled`); the loop
keeps the others, half at least (writes, partial LBAs, CUDA).  Reads up to
:data:`POLLED_MAX_BYTES` keep to the first, larger ones go to the one with fewer commands
unanswered: large reads then cost the client far less CPU (no trip through its trio
thread), and small ones poll one completion queue, cheaper than two
(docs/performance-history.md, 2026-12-03, has the A/B)."""
POLLED_MAX_BYTES = 128 * 1024
"""Reads up to this size keep to the first polled queue.  What a small read costs is CPU per
command, which polling one queue saves; what a large one costs is the transfer, which the
target and the fabric move in parallel per queue (one polled queue held 1 MiB reads back),
so those are spread over two polled queues, or over the loop's when only one is polled."""
RECENT_BASES = 256
"""Array bases whose region :meth:`_Registrations.find_array` remembers (forgotten all at
once past this: a loop over fresh arrays pays a search each, as before)."""
REPORT_INTERVAL = 1.0  # s between reports of this client's byte counts to the daemon
REDELEGATE_AFTER = 1.0
"""Seconds after a recall before this client asks for a namespace's delegation again (a
namespace that FUSE or another client uses now and then is not bounced back and forth)."""
REDELEGATE_MAX = 16.0
"""Seconds between asks at most while the daemon keeps refusing or recalling (the namespace
is in use): each ask waits for this client's range-locked writes of it to finish first."""
DELEGATION_TERM = 10.0
"""Seconds a delegation is written under after the daemon last confirmed it (its grant, or
a ``report`` reply, each second): shorter than the grace the daemon gives a recalled
holder beyond its write bound (``server.LOCK_GRACE``), so a recall that never arrived
cannot leave writes going on after the daemon took the namespace back."""
RENEW_FOREVER = 365 * 86400.0  # s: bound of a lease wait when the mount never gives up


def lease_from(reply: dict) -> Lease:
    return Lease(qids=tuple(reply["qids"]), cntlid=reply["cntlid"],
                 queue_size=reply["queue_size"], in_capsule_bytes=reply["in_capsule_bytes"],
                 max_transfer=reply["max_transfer"],
                 namespaces=tuple(NamespaceShape(n, ls, nlb) for n, ls, nlb in
                                  reply["namespaces"]),
                 traddr=reply.get("traddr"), trsvcid=reply.get("trsvcid"))


def options_from(reply: dict, timeout: float) -> ConnectOptions:
    """How to connect: the mount's own target, host identity and recovery rules."""
    return ConnectOptions(
        traddr=reply["traddr"], nqn=reply["subnqn"], transport=reply["transport"],
        trsvcid=reply["trsvcid"], host_traddr=reply["host_traddr"],
        hostnqn=reply["hostnqn"], hostid=reply["hostid"], nr_io_queues=len(reply["qids"]),
        companion_queues=0, keep_alive_tmo=0, timeout=max(timeout, reply["timeout"]),
        reconnect_delay=reply["reconnect_delay"], ctrl_loss_tmo=reply["ctrl_loss_tmo"],
        fast_io_fail_tmo=reply["fast_io_fail_tmo"], dhchap_secret=reply.get("dhchap_secret"),
        dhchap_ctrl_secret=reply.get("dhchap_ctrl_secret"))


async def wait_future(future: concurrent.futures.Future, timeout: float) -> Any:
    """Await a future completed by another thread (the socket's reader), bounded."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future.add_done_callback(lambda _: token.run_sync_soon(done.set))
    with trio.fail_after(timeout):
        await done.wait()
    return future.result()


class _Registrations:
    """Caller memory registered in our PD, kept while its owning object lives.

    The key is the object that owns the pages (an ``nvmeof_fuse.empty``
    allocation, a numpy array's base, a tensor): its registration is dropped once
    it is freed, so a later allocation at the same address is never served by a
    stale registration.  Memory with no such owner is registered per call.
    """

    def __init__(self, register) -> None:
        self._register = register
        self._by_owner: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._register_lock = threading.Lock()  # one registration per owner
        self._recent: dict[int, tuple[weakref.ref, Region]] = {}  # id(base) -> its region
        self._closed = False

    def find(self, addr: int, size: int, obj: Any) -> tuple[Region, int, bool]:
        """``(region, offset of addr in it, temporary)``; close a temporary one after use."""
        owner, base, length = _owning_span(addr, size, obj)
        if owner is None:
            return Region(addr, size, self._register(addr, size, obj), obj), 0, True
        region = self._owned(owner, base, length)
        return region, addr - region.addr, False

    def _owned(self, owner: Any, base: int, length: int) -> Region:
        """The region of ``owner``'s ``length`` bytes at ``base``, registered on first use."""
        with self._lock:
            region = self._by_owner.get(id(owner))
        if region is None:
            with self._register_lock:  # threads starting on one new array register it once
                with self._lock:
                    region = self._by_owner.get(id(owner))
                if region is None:  # not kept alive by its registration: watched instead
                    region = Region(base, length, self._register(base, length, None))
                    with self._lock:
                        if self._closed:
                            region.close()
                            raise InvalidArgument("the file is closed")
                        self._by_owner[id(owner)] = region
                    weakref.finalize(owner, self._forget, id(owner))
        return region

    def find_array(self, addr: int, size: int, array: Any) -> tuple[Region, int] | None:
        """:meth:`find` for a slice of a numpy array that is not temporary, remembered per
        the array's ``base`` (the rows of one allocation share theirs): ``(region, offset)``,
        or None when its memory is registered per call (the caller takes the general path)."""
        key = array.base
        if key is None:
            key = array
        entry = self._recent.get(id(key))
        if entry is not None and entry[0]() is key:
            region = entry[1]
            at = addr - region.addr
            if 0 <= at and at + size <= region.length and region.registration is not None:
                return region, at
        owner, base, length = _owning_span(addr, size, array)
        if owner is None:
            return None
        region = self._owned(owner, base, length)
        at = addr - region.addr
        try:
            ref = weakref.ref(key)
        except TypeError:  # a base that cannot be watched (bytes): found by search each time
            return region, at
        if len(self._recent) >= RECENT_BASES:
            self._recent.clear()
        self._recent[id(key)] = (ref, region)
        return region, at

    def _forget(self, key: int) -> None:
        with self._lock:
            region = self._by_owner.pop(key, None)
        if region is not None:
            region.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            regions, self._by_owner = list(self._by_owner.values()), {}
        for region in regions:
            region.close()


def _owning_span(addr: int, size: int, obj: Any) -> tuple[Any, int, int]:
    """``(owner, base, length)`` of the allocation holding ``[addr, addr+size)``.

    ``owner`` is None when no object that owns those pages can be watched.
    """
    np = sys.modules.get("numpy")  # no array without it; hasattr(__array_interface__) builds a dict
    if np is not None and isinstance(obj, np.ndarray):
        root = obj
        while isinstance(getattr(root, "base", None), np.ndarray):
            root = root.base
        if isinstance(root, np.ndarray):
            exporter = root.base.obj if isinstance(root.base, memoryview) else root.base
            if isinstance(exporter, shm.SharedMemory):  # nvmeof_fuse.empty: no search
                if exporter.addr <= addr and addr + size <= exporter.addr + len(exporter):
                    return exporter, exporter.addr, len(exporter)
            elif root.base is None and root.flags.c_contiguous:
                base, length, _ = buffer_address(root)
                if base <= addr and addr + size <= base + length:
                    return root, base, length
    found = shm.find(addr, size)
    if found is not None:
        mem, _ = found
        return mem, mem.addr, len(mem)
    if hasattr(obj, "data_ptr"):  # a CPU tensor: watched as itself, registered whole
        base, length, _ = buffer_address(obj)
        if base <= addr and addr + size <= base + length:
            return obj, base, length
    return None, addr, size


class _Delegated:
    """A namespace the daemon delegated to us (:mod:`~nvmeof_fuse.companion.delegation`)."""

    __slots__ = ("token", "hold_s", "inflight", "recalled", "returned", "since",
                 "valid_until")

    def __init__(self, token: int, hold_s: int, asked_at: float, recalled: bool = False
                 ) -> None:
        self.token = token
        self.hold_s = hold_s  # what our writes under it may take (the daemon's bound)
        self.inflight = 0  # writes under it not done yet
        self.recalled = recalled  # no new writes under it: hand it back once idle
        self.returned = False
        self.since = time.monotonic()  # known to the daemon's replies from here on
        self.valid_until = asked_at + DELEGATION_TERM  # no new writes under it after this

    def usable(self, hold_s: int) -> bool:
        return (not self.recalled and hold_s <= self.hold_s
                and time.monotonic() < self.valid_until)

    def confirmed(self, hold_s: int, asked_at: float) -> None:
        """The daemon confirmed it, bounding our writes by ``hold_s``, to an ask sent at
        ``asked_at``."""
        self.hold_s = max(self.hold_s, hold_s)
        self.valid_until = max(self.valid_until, asked_at + DELEGATION_TERM)


class DirectQueues:
    """Leased I/O queues of this process on a mount (one per :class:`File`)."""

    def __init__(self, channel: Any, reply: dict, timeout: float) -> None:
        self._channel = channel
        self._timeout = timeout
        self._first: Lease | None = lease_from(reply)
        self.qids: tuple[int, ...] = self._first.qids
        self._moved = {"client_queue_read_bytes": 0, "client_queue_write_bytes": 0}
        self._polled_read_bytes = 0  # moved by polled reads (callers' threads)
        self._polled_lock = threading.Lock()
        self._reported = dict(self._moved)
        self._shapes = {shape.nsid: shape for shape in self._first.namespaces}
        self._delegated: dict[int, _Delegated] = {}  # nsid -> its delegation (loop-owned)
        self._delegate_after: dict[int, float] = {}  # nsid -> no asking before (monotonic)
        self._delegate_delay: dict[int, float] = {}  # nsid -> next wait after a refusal
        self._asking: dict[int, trio.Event] = {}  # nsid -> set once its delegation ask ends
        self._range_locked: dict[int, int] = {}  # nsid -> our range-locked writes in flight
        self._drained: dict[int, trio.Event] = {}  # nsid -> set when those reach none
        self._nursery: trio.Nursery | None = None
        self._max_transfer = self._first.max_transfer
        self._per_command = {shape.nsid: nvme_cmd.lbas_per_command(self._max_transfer,
                                                                     shape.lba_size)
                             for shape in self._first.namespaces}
        options = options_from(reply, timeout)
        self.renew_timeout = (RENEW_FOREVER if options.ctrl_loss_tmo < 0 else
                               options.ctrl_loss_tmo + 2 * options.timeout)
        self._registrations: _Registrations
        self._dmabufs: DmabufCache | None = None  # made on the first CUDA transfer
        self._dmabufs_lock = threading.Lock()
        self._ctrl: Any = None  # the AttachedController, once connected (loop-owned)
        self._bridge = SyncController(options, connect=self._attach)
        try:
            ctrl = self._bridge.controller  # connected, or its error raised here
            log.debug("queues %s connected to controller %d", self.qids, ctrl.cntlid)
        except BaseException:
            self._bridge.close()
            raise

    @contextlib.asynccontextmanager
    async def _attach(self, options: ConnectOptions) -> AsyncIterator[Any]:
        """The leased queues, this client's registrations and its reports, on the loop.

        Registrations go after the requests in flight drained, before the PD goes.
        """
        async with attach(options, self._lease, make_transport(options),
                          polled=POLLED_QUEUES) as ctrl:
            self._ctrl = ctrl
            self._registrations = _Registrations(ctrl.transport.register)
            token = trio.lowlevel.current_trio_token()
            self._channel.on_event = lambda event: token.run_sync_soon(self._on_event, event)
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._report_now_and_then)
                    yield ctrl
                    nursery.cancel_scope.cancel()
            finally:
                self._nursery = None
                self._channel.on_event = None
                self._registrations.close()
                with self._dmabufs_lock:
                    dmabufs, self._dmabufs = self._dmabufs, None
                if dmabufs is not None:
                    dmabufs.close()

    def _on_event(self, event: dict) -> None:
        """News from the daemon (on the loop): a delegation recalled, or our queues revoked
        with a lost controller."""
        if event.get("event") == "recall":
            self._recalled(event.get("nsid"), event.get("token"))
            return
        if event.get("event") != "revoked" or not self._ctrl.io_queues:
            return
        log.info("the mount daemon lost the controller (%s): reconnecting our queues",
                 event.get("state"))
        self._ctrl.connection_lost(self._ctrl.io_queues[0], TransportError(
            "the mount daemon lost the controller; our queues were revoked"))

    async def _ask(self, op: str, timeout: float, **fields: Any) -> dict:
        """One request to the daemon from the loop (its reply arrives on the reader thread)."""
        future = self._channel.call_future(op, **fields)
        try:
            header = await wait_future(future, timeout)
        except BaseException as exc:
            if op == "lock":  # granted after we gave up, it would hold the range: give it back
                future.add_done_callback(functools.partial(self._unlock_late, fields["nsid"]))
            if isinstance(exc, trio.TooSlowError):
                raise protocol.NoAnswer(f"the mount daemon did not answer {op} within "
                                        f"{timeout:g} s") from None
            raise
        return protocol.raise_for_reply(header)

    def _unlock_late(self, nsid: int, future: concurrent.futures.Future) -> None:
        """Release a write lock its writer stopped waiting for (on the reader thread)."""
        if future.exception() is not None or not future.result().get("ok"):
            return
        if future.result().get("delegated"):
            return  # a delegation is handed back when the daemon recalls it
        try:
            self._channel.call_future("unlock", token=future.result()["token"], nsid=nsid,
                                      moved=self.moved())
        except NVMeoFError as exc:  # the daemon is gone, and the lock with it
            log.debug("giving back a write lock: %s", exc)

    async def _lease(self) -> Lease:
        if self._first is not None:
            lease, self._first = self._first, None
            return lease
        return lease_from(await self._ask("lease", self.renew_timeout, want=len(self.qids)))

    async def _report_now_and_then(self) -> None:
        """Report our byte counts each second when they changed; while we hold delegations,
        each second in any case: the reply renews them."""
        while True:
            await trio.sleep(REPORT_INTERVAL)
            moved = self.moved()
            live = {nsid: held for nsid, held in self._delegated.items()
                    if not held.recalled and not held.returned}
            if live:
                await self._renew(live, moved)
            elif moved != self._reported:
                self._reported = moved
                try:
                    self._channel.call_future("report", moved=self._reported)
                except NVMeoFError as exc:  # the daemon is gone: requests will say so
                    log.debug("reporting to the mount daemon: %s", exc)

    async def _renew(self, live: dict[int, _Delegated], moved: dict[str, int]) -> None:
        """Report, and renew the term of each delegation the daemon still counts as ours;
        one it does not (taken back, its recall lost) is handed back once idle."""
        asked_at = time.monotonic()
        try:
            reply = await self._ask("report", self._timeout, moved=moved)
        except NVMeoFError as exc:  # their terms run out: writes ask the daemon again
            log.debug("renewing delegations: %s", exc)
            return
        self._reported = moved
        tokens = reply.get("delegated") or []
        for nsid, held in live.items():
            if held.token in tokens:
                held.confirmed(0, asked_at)
            elif held.since < asked_at and self._delegated.get(nsid) is held:
                self._recalled(nsid, held.token)

    def moved(self) -> dict[str, int]:
        """This client's running totals over its own queues (what it reports)."""
        moved = dict(self._moved)
        moved["client_queue_read_bytes"] += self._polled_read_bytes
        return moved

    # -- memory ---------------------------------------------------------------------------

    def host_region(self, addr: int, size: int, obj: Any) -> tuple[Region, int, bool]:
        return self._registrations.find(addr, size, obj)

    def array_region(self, addr: int, size: int, array: Any) -> tuple[Region, int] | None:
        """A numpy array's registered region and offset, None if only a temporary one would do."""
        return self._registrations.find_array(addr, size, array)

    def dmabufs(self, cuda: gpu.Cuda) -> DmabufCache:
        """CUDA allocations registered as dma-bufs in our PD, one per allocation (kept until
        this file closes, or evicted)."""
        with self._dmabufs_lock:
            if self._dmabufs is None:
                if self._ctrl is None:
                    raise TransportError("our own queues are not connected")
                self._dmabufs = DmabufCache(cuda, self._register_dmabuf_fd, _close_region)
            return self._dmabufs

    def _register_dmabuf_fd(self, fd: int, offset: int, length: int, iova: int
                            ) -> tuple[Region, Any]:
        try:
            return register_dmabuf(self._ctrl.transport, fd, offset, length, iova)
        finally:
            os.close(fd)  # the registration holds the dma-buf (or its mapping)

    def dmabuf_counts(self) -> dict[str, int]:
        return dict(self._dmabufs.counts) if self._dmabufs is not None else {}

    def dmabuf_live(self) -> int:
        return self._dmabufs.live() if self._dmabufs is not None else 0

    # -- transfers (run on the loop) ------------------------------------------------------

    def start(self, job: Any, nsid: int, region: Region, at: int, size: int,
              file_offset: int, edge: Any, release: Any = None) -> Any:
        """Start ``job`` (:meth:`read` or :meth:`write`) on the loop: its future.

        ``release`` (the region's, when only this job uses it) runs once the job ended.
        """
        if release is not None:
            return self._bridge.submit(self._then_release, release, job, nsid, region, at,
                                       size, file_offset, edge)
        return self._bridge.submit(job, nsid, region, at, size, file_offset, edge)

    @staticmethod
    async def _then_release(release: Any, job: Any, *args: Any) -> int:
        try:
            return await job(*args)
        finally:
            release()

    async def read(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
                   put: Any) -> int:
        """Read ``size`` bytes at ``file_offset`` into ``region`` at ``at``.

        Whole LBAs land in place; the partial ones at either end come through a
        one-LBA bounce buffer, and ``put(dest, bytes)`` stores the caller's part.
        """
        ns = self._ctrl.namespaces[nsid]
        lba_size = ns.lba_size
        if not (file_offset % lba_size or size % lba_size):  # whole LBAs: the common case
            await ns.read_into(file_offset // lba_size, size // lba_size, region.ref(at, size))
            self._moved["client_queue_read_bytes"] += size
            return size
        sp = split_range(file_offset, size, lba_size)
        jobs = []
        if sp.middle_nlb:
            ref = region.ref(at + sp.middle.start, sp.middle.stop - sp.middle.start)
            jobs.append(lambda: ns.read_into(sp.middle_slba, sp.middle_nlb, ref))
        for edge in sp.edges():
            async def read_edge(edge=edge) -> None:
                data = await ns.lend_lbas(edge.lba, 1)  # lent: used before we yield again
                put(edge.data.start, data[edge.start:edge.start + edge.data.stop -
                                          edge.data.start])
            jobs.append(read_edge)
        await run_all(jobs)
        self._moved["client_queue_read_bytes"] += size
        return size

    async def write(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
                    get: Any) -> int:
        """Write ``size`` bytes from ``region`` at ``at`` to ``file_offset``, under the
        daemon's write lock or its delegation of the namespace; ``get(start, length)``
        gives caller bytes of the end LBAs."""
        budget = self._timeout + size / 5e6
        hold_s = math.ceil(budget)
        while True:
            held = self._delegated.get(nsid)
            if held is not None and held.usable(hold_s):
                break  # the common case once delegated: no round trip to the daemon
            asking = self._asking.get(nsid)
            if asking is not None:  # another write asks for the delegation: wait for it
                await asking.wait()
                continue
            # Ours but its term or its bound runs short: the daemon confirms it.  (Recalled
            # and not handed back yet: range locks, which wait for the hand-back.)
            ours = held is not None and not held.recalled
            asked_at = time.monotonic()
            if ours or ((held is None or held.returned) and self._may_delegate(nsid)):
                reply = await self._ask_delegation(nsid, file_offset, size, hold_s, budget)
            else:
                reply = await self._ask("lock", budget, nsid=nsid, offset=file_offset,
                                        length=size, hold_s=hold_s)
            if not reply.get("delegated"):
                await self._write_range_locked(nsid, region, at, size, file_offset, get,
                                               reply["token"])
                return size
            held = self._delegated.get(nsid)
            if held is None or held.token != reply["token"]:  # a new delegation
                held = self._delegated[nsid] = _Delegated(reply["token"], hold_s, asked_at)
                break
            if not held.returned:  # ours still (maybe recalled: this write ends first)
                held.confirmed(hold_s, asked_at)
                break
        held.inflight += 1
        try:
            await self._write_placed(nsid, region, at, size, file_offset, get)
        finally:
            held.inflight -= 1
            if held.recalled and not held.inflight:
                self._hand_back(nsid, held)
        return size

    async def _ask_delegation(self, nsid: int, file_offset: int, size: int, hold_s: int,
                              budget: float) -> dict:
        """Ask for ``n<nsid>``'s delegation (or else a range lock of this write), one write
        at a time; the others wait for the answer.  The daemon delegates only a namespace
        of which nobody holds a range, so our own range-locked writes drain first."""
        asking = self._asking[nsid] = trio.Event()
        try:
            with trio.move_on_after(budget):  # (each is bounded; if not, the daemon refuses)
                while self._range_locked.get(nsid):
                    await self._drained.setdefault(nsid, trio.Event()).wait()
            reply = await self._ask("lock", budget, nsid=nsid, offset=file_offset,
                                    length=size, hold_s=hold_s, delegate=True)
        finally:
            del self._asking[nsid]
            asking.set()
        if not reply.get("delegated"):  # used by others
            self._back_off(nsid)
        return reply

    def _back_off(self, nsid: int, reset: bool = False) -> None:
        """Ask for ``n<nsid>``'s delegation again later, less often each time (``reset``:
        a delegation that was held long)."""
        delay = REDELEGATE_AFTER if reset else self._delegate_delay.get(nsid, REDELEGATE_AFTER)
        self._delegate_after[nsid] = time.monotonic() + delay
        self._delegate_delay[nsid] = min(2 * delay, REDELEGATE_MAX)

    async def _write_range_locked(self, nsid: int, region: Region, at: int, size: int,
                                  file_offset: int, get: Any, token: int) -> None:
        self._range_locked[nsid] = self._range_locked.get(nsid, 0) + 1
        try:
            await self._write_placed(nsid, region, at, size, file_offset, get)
        finally:
            try:
                with trio.CancelScope(shield=True):
                    await self._ask("unlock", self._timeout, token=token, nsid=nsid,
                                    moved=self.moved())
            finally:
                self._range_locked[nsid] -= 1
                if not self._range_locked[nsid] and nsid in self._drained:
                    self._drained.pop(nsid).set()

    async def _write_placed(self, nsid: int, region: Region, at: int, size: int,
                            file_offset: int, get: Any) -> None:
        ns = self._ctrl.namespaces[nsid]

        async def write_middle(slba: int, nlb: int) -> None:
            start = slba * ns.lba_size - file_offset
            await ns.write_from(slba, nlb, region.ref(at + start, nlb * ns.lba_size))

        await ns.write_placed(file_offset, size,
                              lambda edge: get(edge.data.start, edge.data.stop - edge.data.start),
                              write_middle)
        self._moved["client_queue_write_bytes"] += size

    def _may_delegate(self, nsid: int) -> bool:
        return time.monotonic() >= self._delegate_after.get(nsid, 0.0)

    def _recalled(self, nsid: Any, token: Any) -> None:
        """The daemon wants ``n<nsid>`` back: no new writes under it; hand it back once the
        writes under it are done."""
        if not isinstance(nsid, int) or not isinstance(token, int):
            return
        held = self._delegated.get(nsid)
        if held is not None and held.token == token and held.recalled:
            return  # heard already (a report's reply, then the recall itself)
        self._back_off(nsid, reset=held is not None and held.token == token
                       and time.monotonic() - held.since >= REDELEGATE_MAX)
        if held is None or held.token != token:  # granted, the reply still on its way
            held = self._delegated[nsid] = _Delegated(token, 0, time.monotonic(),
                                                      recalled=True)
            if self._nursery is not None:  # its writer hands it back, or this does
                self._nursery.start_soon(self._hand_back_unclaimed, nsid, held)
            return
        held.recalled = True
        if not held.inflight:
            self._hand_back(nsid, held)

    def _hand_back(self, nsid: int, held: _Delegated) -> None:
        if held.returned or self._nursery is None:
            return  # (with no loop left, the daemon takes it back as the client goes)
        held.returned = True
        self._nursery.start_soon(self._give_back, nsid, held.token)

    async def _hand_back_unclaimed(self, nsid: int, held: _Delegated) -> None:
        """Hand back a recalled delegation whose grant no write took up (its lock request
        had timed out here): the daemon need not wait for its bound."""
        await trio.sleep(REDELEGATE_AFTER)
        if not held.inflight:
            self._hand_back(nsid, held)

    async def _give_back(self, nsid: int, token: int) -> None:
        try:
            await self._ask("unlock", self._timeout, token=token, nsid=nsid, moved=self.moved())
        except NVMeoFError as exc:  # the daemon is gone, or takes it back at its bound
            log.debug("handing back the delegation of n%d: %s", nsid, exc)

    # -- polled reads (the caller's thread drives a queue of ours) -------------------------

    def polling_queues(self, size: int) -> list:
        """The polled queues a read of ``size`` bytes may take now: the first for a small
        read, all of them for a large one; none (a large read with one queue polled, or
        while reconnecting): the loop's path serves it."""
        ctrl = self._ctrl
        if ctrl is None or size <= 0:
            return []
        polled = ctrl.polled_queues
        if size <= POLLED_MAX_BYTES:
            return polled[:1]  # small reads keep to one queue: one CQ to poll
        return polled if len(polled) > 1 else []

    def polled_read(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
                    keep: Any, limit: float, post: bool = True) -> PolledRead | None:
        """Post a read of whole LBAs from this thread on a polled queue (no loop, no thread
        switch); None when it cannot go there (partial LBAs, no free slot, no polled
        queue), and then :meth:`start` serves it.  ``keep`` (the owner of the memory) is
        held until the read is done; ``limit`` bounds a ``get()`` given no timeout.
        With ``post=False`` the read waits for :meth:`post_reads` (a batch)."""
        shape = self._shapes.get(nsid)
        if shape is None:
            return None
        lba_size = shape.lba_size
        if file_offset % lba_size or size % lba_size:
            return None
        slba, nlb = file_offset // lba_size, size // lba_size
        if slba + nlb > shape.nsze:
            return None  # the loop's path names the error
        polled = self.polling_queues(size)
        if not polled:
            return None
        return self.polled_read_lbas(polled, nsid, region, at, size, file_offset, slba, nlb,
                                     keep, limit, post)

    def polled_read_lbas(self, polled: list, nsid: int, region: Region, at: int, size: int,
                         file_offset: int, slba: int, nlb: int, keep: Any, limit: float,
                         post: bool) -> PolledRead | None:
        """:meth:`polled_read` of whole LBAs the caller checked: ``nlb`` of them from
        ``slba`` (at ``file_offset``, ``size`` bytes), all on namespace ``nsid``, on one of
        ``polled`` (:meth:`polling_queues`)."""
        # A large read: the less loaded, ties to the first.
        queue = polled[0] if len(polled) == 1 else min(polled, key=lambda q: q.unanswered)
        per = self._per_command[nsid]
        if nlb <= per:  # one command: the common case
            request = queue.submit_read(nsid, slba, nlb, region.ref(at, size), keep, post=post)
            requests = None if request is None else [request]
        else:
            lba_size = size // nlb
            requests = queue.submit(
                [(nvme_cmd.read(nsid, slba + start, min(per, nlb - start), NULL_SGL),
                  region.ref(at + start * lba_size, min(per, nlb - start) * lba_size))
                 for start in range(0, nlb, per)], keep, post=post)
        if requests is None:  # full, or failed: the loop's queues serve it
            return None
        return PolledRead(self, queue, requests, size, limit,
                          (nsid, region, at, size, file_offset, keep))

    def read_on_loop(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
                     keep: Any) -> concurrent.futures.Future:
        """The loop's path for a polled read whose queue failed under it."""
        return self.start(self.read, nsid, region, at, size, file_offset,
                          functools.partial(_no_edges, keep))

    def post_reads(self) -> None:
        """Post the polled reads started with ``post=False``: one ``post_send`` per queue."""
        ctrl = self._ctrl
        for queue in ctrl.polled_queues if ctrl is not None else ():
            queue.flush()

    def polled_done(self, size: int) -> None:
        with self._polled_lock:
            self._polled_read_bytes += size

    def polled_failed(self, queue: Any, exc: BaseException) -> None:
        """A polled queue failed under a caller: have the loop reconnect (unless it did)."""
        if queue.detached:
            return
        try:
            self._bridge.call_sync(self._ctrl.polled_lost, queue, exc)
        except NVMeoFError as error:  # the loop is gone: the fallback will say so
            log.debug("reporting a lost queue: %s", error)

    def close(self) -> None:
        """Drain the requests in flight (bounded), release the memory, disconnect."""
        ctrl = self._ctrl
        if ctrl is not None:
            until = time.perf_counter() + self._timeout
            for queue in list(ctrl.polled_queues):
                queue.drain(until)
        self._bridge.close()


def _close_region(handle: tuple[Region, Any]) -> None:
    region, cleanup = handle
    region.close()
    cleanup()


def _no_edges(keep: Any, at: int, data: Any) -> None:
    """The edge writer of a read of whole LBAs, which has none; holds ``keep``."""
    raise AssertionError("a read of whole LBAs has no partial LBAs to copy")


class PolledRead(IOFuture):
    """A read posted on a polled queue; waiting for it reaps the queue in the waiter's thread.

    If the queue fails under it (lost connection, command timeout), the read is
    run again on the loop's path, which waits for the reconnect and fails with
    the same EIO rules as any other request.
    """

    __slots__ = ("_direct", "_queue", "_requests", "_size", "_fallback", "_done")

    def __init__(self, direct: DirectQueues, queue: Any, requests: list, size: int,
                 limit: float | None, fallback: tuple) -> None:
        """``fallback``: the arguments of :meth:`DirectQueues.read_on_loop`."""
        super().__init__(None, None, limit)  # _future: the loop's, once the read went there
        self._direct = direct
        self._queue = queue
        self._requests = requests
        self._size = size
        self._fallback = fallback
        self._done = False  # read and counted: a second result() counts nothing

    def done(self) -> bool:
        if self._done:
            return True
        if self._future is not None:
            return self._future.done()
        if not all(r.finished for r in self._requests):
            self._queue.progress()
        return all(r.finished for r in self._requests)

    def result(self, timeout: float | None = None) -> int:
        """Bytes read; ``concurrent.futures.TimeoutError`` after ``timeout`` s."""
        if self._done:
            return self._size
        if self._future is not None:
            return self._future.result(timeout)
        clock = time.perf_counter
        limit = math.inf if timeout is None else clock() + timeout
        queue = self._queue
        try:
            for request in self._requests:
                if not request.finished:
                    give_up = request.deadline + self._direct._timeout  # posted + its timeout
                    try:
                        completion = queue.wait(request, min(limit, give_up))
                    except CommandTimeout:
                        if clock() < give_up:  # the caller's own bound, not the command's
                            raise concurrent.futures.TimeoutError from None
                        raise
                else:
                    completion = queue.wait(request, limit)
                if not completion.ok:
                    completion.raise_for_status("Read")
        except (TransportError, CommandTimeout) as exc:
            self._direct.polled_failed(queue, exc)
            self._future = self._direct.read_on_loop(*self._fallback)
            return self._future.result(None if timeout is None else max(0.0, limit - clock()))
        self._direct.polled_done(self._size)
        self._done = True
        return self._size


def open_direct(channel: Any, timeout: float, queues: int) -> tuple[DirectQueues | None, str]:
    """This process's own queues on the mount, or None and why not (use the daemon's)."""
    try:
        reply = channel.call("lease", want=queues)
    except NVMeoFError as exc:
        return None, str(exc)
    try:
        return DirectQueues(channel, reply, timeout), ""
    except (NVMeoFError, OSError, ImportError) as exc:
        try:
            channel.call("unlease")  # let another client have them
        except NVMeoFError:
            pass
        return None, f"cannot connect queues of our own: {exc}"
