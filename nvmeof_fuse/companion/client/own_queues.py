"""A companion client's own I/O queues on the mounted controller: the daemon leaves the data path.

The mount daemon leases queue IDs over the companion socket (after its uid
check).  This process connects them itself (over RDMA, RDMA-CM connections and a
protection domain of its own; over NVMe/TCP, a TCP connection per queue with its
ICReq/ICResp; either way a Fabrics Connect carrying the mount's controller ID,
HostNQN and HostID, and DH-HMAC-CHAP with the mount's secrets, which the lease
reply carries: :mod:`nvmeof_fuse.host.attached`), registers its own memory there,
and moves data between the target and that memory with nobody in between.  Over
NVMe/TCP a socket receives into host memory only: CUDA memory is staged by this
process (:mod:`.cuda_via_own_tcp`).  One trio loop on one thread (:class:`SyncController`)
completes every request's future: no thread per request.

Reads never involve the daemon.  A write asks the daemon for the range lock a
FUSE write takes (so it never slips between a read-modify-write's read and its
write), read-modify-writes its partial end LBAs itself, and on unlock the
daemon drops the kernel's cached pages of the file.

This module holds the queues' life (connect, reconnect, the daemon's events and reports)
and the loop's transfers; each other concern has a module of its own: the lease
(:mod:`.lease`), the registration cache (:mod:`.registrations`), polled reads in the
callers' threads (:mod:`.polled`) and the client side of write delegations
(:mod:`.locked_writes`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import trio

from ...errors import NVMeoFError, TransportError
from ...host.attached import GONE, Lease, attach
from ...host.controller import ConnectOptions, make_transport
from ...host.memory import Region
from ...host.sync import SyncController
from ...nvme import command as nvme_cmd
from ...ratelimit import RateLimitedLog
from ...transport import registry
from .. import protocol
from ..cuda import gpu
from ..cuda.dmabuf import DmabufCache, register_dmabuf
from .lease import lease_from, options_from, path_words, renew_timeout
from .locked_writes import LockedWrites
from .polled import POLLED_MAX_BYTES, POLLED_QUEUES, PolledRead, PolledReads
from .registrations import Registrations

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

REPORT_INTERVAL = 1.0  # s between reports of this client's byte counts to the daemon
RECONNECTING = "through the mount daemon while this file's queues reconnect"
"""What :attr:`DirectQueues.path` says between a loss of our queues and their return."""
__all__ = ["POLLED_MAX_BYTES", "POLLED_QUEUES", "DirectQueues", "PolledRead", "lease_from",
           "open_direct", "options_from"]


async def wait_future(future: concurrent.futures.Future, timeout: float) -> Any:
    """Await a future completed by another thread (the socket's reader), bounded."""
    token = trio.lowlevel.current_trio_token()
    done = trio.Event()
    future.add_done_callback(lambda _: token.run_sync_soon(done.set))
    with trio.fail_after(timeout):
        await done.wait()
    return future.result()


class DirectQueues:
    """Leased I/O queues of this process on a mount (one per :class:`File`)."""

    def __init__(self, channel: Any, reply: dict, timeout: float,
                 wish: dict[str, Any] | None = None) -> None:
        self._channel = channel
        self._timeout = timeout
        self._wish = dict(wish or {})  # where our memory is, or a path: asked each lease
        self.path: str = path_words(reply.get("path"))
        """Which path our queues serve on, its device and how near our memory (a multipath
        mount's), or empty."""
        self._leased_path = self.path  # the last lease's: :attr:`path` once they serve there
        self.on_path: Any = None  # called with :attr:`path` when our queues serve elsewhere
        self._first: Lease | None = lease_from(reply)
        self.qids: tuple[int, ...] = self._first.qids
        self._nsids = [shape.nsid for shape in self._first.namespaces]  # asked for again
        self._moved = {"client_queue_read_bytes": 0, "client_queue_write_bytes": 0}
        self._reported = dict(self._moved)
        self.writes = LockedWrites(self._ask, self.moved, timeout)
        per_command = {shape.nsid: nvme_cmd.lbas_per_command(self._first.max_transfer,
                                                             shape.lba_size)
                       for shape in self._first.namespaces}
        self.polled = PolledReads({shape.nsid: shape for shape in self._first.namespaces
                                   if shape.generation != GONE},  # (the loop's path refuses)
                                  per_command, timeout, self.read_on_loop, self._polled_lost)
        options = options_from(reply, max(timeout, reply["timeout"]))  # the mount's at least
        self.renew_timeout = renew_timeout(options)
        self._registrations: Registrations
        self._dmabufs: DmabufCache | None = None  # made on the first CUDA transfer
        self._dmabufs_lock = threading.Lock()
        self._ctrl: Any = None  # the AttachedController, once connected (loop-owned)
        self._transport: Any = None  # made on the loop, with the connection
        self._at_loop_end: list[Any] = []  # called on the loop as it ends (nothing starts after)
        self._bridge = SyncController(options, connect=self._attach)
        try:
            ctrl = self._bridge.controller  # connected, or its error raised here
            log.debug("queues %s connected to controller %d", self.qids, ctrl.cntlid)
        except BaseException:
            self._bridge.close()
            raise

    @property
    def host_memory_only(self) -> str:
        """Why our transport cannot place data in GPU memory (NVMe/TCP); empty if it can
        try (RDMA: dma-bufs)."""
        return getattr(self._transport, "dmabuf_refusal", "")

    @property
    def record_layer(self) -> str:
        """Where our connections' TLS records go (``tls: userspace (TLS_AES_...)``, or
        ``tls: kernel ...``); empty without TLS."""
        layer = getattr(self._transport, "record_layer", None)
        return layer.describe() if layer is not None else ""

    @property
    def fabric(self) -> registry.Capabilities | None:
        """What our transport can do (None before it is made)."""
        return registry.TRANSPORTS.get(getattr(self._transport, "name", ""))

    def at_loop_end(self, fn: Any) -> None:
        """Call ``fn()`` on the loop once it has ended its jobs: a job submitted and not
        started by then never starts."""
        self._at_loop_end.append(fn)

    @property
    def live(self) -> bool:
        """Whether our queues serve now; not while they wait for a lease again (a lost
        controller, or on a multipath mount a lost path: the daemon's other paths can
        serve reads meanwhile)."""
        ctrl = self._ctrl
        return ctrl is not None and ctrl.live

    @contextlib.asynccontextmanager
    async def _attach(self, options: ConnectOptions) -> AsyncIterator[Any]:
        """The leased queues, this client's registrations and its reports, on the loop.

        Registrations go after the requests in flight drained, before the PD goes.
        """
        self._transport = make_transport(options)
        async with attach(options, self._lease, self._transport, polled=POLLED_QUEUES) as ctrl:
            self._ctrl = self.polled.ctrl = ctrl
            ctrl.on_serving = self._serving
            # a namespace replaced (told before our queues are connected again): no polled
            # read goes to it; the loop's path refuses it
            ctrl.events.replaced_listeners.append(
                lambda nsid, old, new: self.polled.shapes.pop(nsid, None))
            self._registrations = Registrations(ctrl.transport.register)
            token = trio.lowlevel.current_trio_token()
            self._channel.on_event = lambda event: token.run_sync_soon(self._on_event, event)
            try:
                async with trio.open_nursery() as nursery:
                    self.writes.nursery = nursery
                    try:
                        nursery.start_soon(self._report_now_and_then)
                        yield ctrl
                        nursery.cancel_scope.cancel()
                    finally:  # before the nursery closes: a recall heard while its tasks
                        # end (a callback may run between its closing and our resuming)
                        # starts nothing; the daemon takes the delegation back as we go
                        self.writes.nursery = None
            finally:
                self._channel.on_event = None
                for ended in self._at_loop_end:
                    ended()
                self._registrations.close()
                with self._dmabufs_lock:
                    dmabufs, self._dmabufs = self._dmabufs, None
                if dmabufs is not None:
                    dmabufs.close()

    def _on_event(self, event: dict) -> None:
        """News from the daemon (on the loop): a delegation recalled, or our queues revoked
        with a lost controller."""
        if event.get("event") == "recall":
            self.writes.recalled(event.get("nsid"), event.get("token"))
            return
        if event.get("event") != "revoked" or not self._ctrl.io_queues:
            return
        limited.log("revoked", logging.INFO, "the mount daemon lost the controller (%s): "
                    "reconnecting our queues", event.get("state"))
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
        # our counts so far go with it: the daemon counts what it hears next on the new path
        reply = await self._ask("lease", self.renew_timeout, want=len(self.qids),
                                nsids=self._nsids, moved=self.moved(), **self._wish)
        self._leased_path = path_words(reply.get("path"))
        return lease_from(reply)

    def _serving(self, lease: Lease | None) -> None:
        """Our queues stopped serving (``lease`` None: they reconnect, and reads go through
        the daemon meanwhile), or serve again, on the path of the lease they connected on,
        which :attr:`path` names from then on (on the loop).  Not before: until they connect
        there, the bytes they move would not be that path's.  Only a multipath mount names
        paths."""
        path = (RECONNECTING if self.path else "") if lease is None else self._leased_path
        if path != self.path:
            self.path = path
            if self.on_path is not None:
                self.on_path(path)

    async def _report_now_and_then(self) -> None:
        """Report our byte counts each second when they changed; while we hold delegations,
        each second in any case: the reply renews them."""
        while True:
            await trio.sleep(REPORT_INTERVAL)
            moved = self.moved()
            live = self.writes.live()
            if live:
                if await self.writes.renew(live, moved):
                    self._reported = moved
            elif moved != self._reported:
                self._reported = moved
                try:
                    self._channel.call_future("report", moved=self._reported)
                except NVMeoFError as exc:  # the daemon is gone: requests will say so
                    log.debug("reporting to the mount daemon: %s", exc)

    def moved(self) -> dict[str, int]:
        """This client's running totals over its own queues (what it reports)."""
        moved = dict(self._moved)
        moved["client_queue_read_bytes"] += self.polled.read_bytes
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
        one-LBA bounce buffer, and ``put(dest, bytes)`` stores the caller's part
        (the namespace's byte range does that: :meth:`Namespace.read_placed`).
        """
        ns = self._ctrl.namespaces[nsid]
        lba_size = ns.lba_size
        if not (file_offset % lba_size or size % lba_size):  # whole LBAs: the common case
            await ns.read_into(file_offset // lba_size, size // lba_size, region.ref(at, size))
        else:
            await ns.read_placed(file_offset, size, region.ref(at, size), put)
        self._moved["client_queue_read_bytes"] += size
        return size

    async def write(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
                    get: Any) -> int:
        """Write ``size`` bytes from ``region`` at ``at`` to ``file_offset``, under the
        daemon's write lock or its delegation of the namespace; ``get(start, length)``
        gives caller bytes of the end LBAs."""
        await self.writes.write(nsid, file_offset, size, functools.partial(
            self._write_placed, nsid, region, at, size, file_offset, get))
        return size

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

    # -- polled reads (the caller's thread drives a queue of ours: polled.py) ----------------

    def read_on_loop(self, nsid: int, region: Region, at: int, size: int, file_offset: int,
                     keep: Any) -> concurrent.futures.Future:
        """The loop's path for a polled read whose queue failed under it."""
        return self.start(self.read, nsid, region, at, size, file_offset,
                          functools.partial(_no_edges, keep))

    def _polled_lost(self, queue: Any, exc: BaseException) -> None:
        self._bridge.call_sync(self._ctrl.polled_lost, queue, exc)

    def close(self) -> None:
        """Drain the requests in flight (bounded), release the memory, disconnect."""
        self.polled.drain(time.perf_counter() + self._timeout)
        self._bridge.close()


def _close_region(handle: tuple[Region, Any]) -> None:
    region, cleanup = handle
    region.close()
    cleanup()


def _no_edges(keep: Any, at: int, data: Any) -> None:
    """The edge writer of a read of whole LBAs, which has none; holds ``keep``."""
    raise AssertionError("a read of whole LBAs has no partial LBAs to copy")


def open_direct(channel: Any, timeout: float, queues: int, nsid: int,
                wish: dict[str, Any] | None = None) -> tuple[DirectQueues | None, str]:
    """This process's own queues on the mount for namespace ``nsid`` (the one the lease
    names), or None and why not (use the daemon's).  ``wish``: what the lease request
    says of where our memory is (``memory``) or which path to take (``path``)."""
    try:
        reply = channel.call("lease", want=queues, nsids=[nsid], **(wish or {}))
    except NVMeoFError as exc:
        return None, str(exc)
    try:
        return DirectQueues(channel, reply, timeout, wish), ""
    except (NVMeoFError, OSError, ImportError) as exc:
        try:
            channel.call("unlease")  # let another client have them
        except NVMeoFError:
            pass
        return None, f"cannot connect queues of our own: {exc}"
