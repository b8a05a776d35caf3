"""A controller joined through I/O queues of our own, whose admin side another process runs.

NVMe-oF lets any connection whose SubNQN, HostNQN and controller ID match a
live controller connect one of its I/O queues (nvmet's
``nvmet_execute_io_connect``).  A mount daemon owns the controller (admin
queue, keep-alive, reconnects) and *leases* spare queue IDs; a companion
client connects them itself with a transport of its own and moves data
between the target and its own registered memory with nobody in between.

:class:`AttachedController` is that client side.  It has no admin queue, so it
never enables, identifies or shuts the controller down.  When its queues fail
(a lost connection, or the daemon's reconnect replaced the controller) it asks
the lease source again, which waits for the daemon's controller to be live and
names its new controller ID, and connects the same queue IDs again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from .. import nvme
from ..concurrency import unwrap_groups
from ..errors import ConnectError, NVMeoFError
from ..ratelimit import FailureStreak, RateLimitedLog
from ..transport.base import Transport
from .controller import (
    ConnectOptions,
    Controller,
    make_transport,
    reconnect_attempts,
)
from .memory import host_buffer
from .namespace import GONE, Namespace
from .state import CONNECTING, LIVE

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

QID_BUSY_RETRIES = 10
"""Connects of a leased QID answered Command Sequence Error (its previous holder's queue is
not torn down yet on the target) are tried again this many times."""
QID_BUSY_DELAY = 0.5  # s between those tries
SC_COMMAND_SEQUENCE_ERROR = 0x0C  # generic status: the QID is in use
EDGE_BUFFERS = 16  # one-LBA bounce buffers for the partial LBAs at the ends of a transfer


@dataclass(frozen=True)
class NamespaceShape:
    """What a client needs of a namespace to address it: its LBA size and count, and its
    generation (:attr:`Namespace.generation`), which changes when another namespace takes
    its NSID; :data:`GONE` when the namespace this client knew is no longer there."""

    nsid: int
    lba_size: int
    nsze: int
    generation: int = 0



@dataclass(frozen=True)
class Lease:
    """Queue IDs of a live controller that we may connect, and how."""

    qids: tuple[int, ...]
    cntlid: int
    queue_size: int
    in_capsule_bytes: int
    max_transfer: int
    namespaces: tuple[NamespaceShape, ...]
    traddr: str | None = None
    """Where the lease's controller is (a multipath mount leases on one of its paths):
    the queues connect there, following the lease when it moves to another path."""
    trsvcid: int | None = None
    host_iface: str | None = None
    """The local device and address of the lease's path (each path may have its own: one
    rail's NIC), which the queues follow with its address."""
    host_traddr: str | None = None


LeaseSource = Callable[[], Awaitable[Lease]]
"""Asks the controller's owner for a lease; waits while it reconnects; raises
:class:`ControllerLost` once it never will be live again."""


def polled_share(wanted: int, leased: int) -> int:
    """How many of ``leased`` queues callers' threads drive: ``wanted`` at most, and the
    loop keeps half at least (writes, partial LBAs and large reads with one polled)."""
    return max(0, min(wanted, leased // 2))


def _qid_busy(exc: ConnectError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, nvme.NVMeStatusError) and \
        (cause.sct, cause.sc) == (0, SC_COMMAND_SEQUENCE_ERROR)


class AttachedController(Controller):
    """I/O queues of our own on a controller another process owns (see the module)."""

    def __init__(self, options: ConnectOptions, transport, nursery: trio.Nursery,
                 lease_source: LeaseSource, polled: int = 0, bounce_buffers: int = 0) -> None:
        super().__init__(options, transport, nursery)
        self._lease_source = lease_source
        self._bounce_buffers = bounce_buffers
        self.lease: Lease | None = None
        self._polled = polled
        self.polled_queues: list = []
        """Queues handed to callers' threads (:mod:`nvmeof_fuse.transport.rdma.polled`):
        not in ``io_queues``; replaced (never changed) on each reconnect."""
        self.on_serving: Callable[[Lease | None], None] | None = None
        """Told, on the loop, when our queues stop serving (None: a reconnect begins), and
        of the lease they serve on each time a reconnect made them live again (a multipath
        mount's lease may have moved them to another path)."""

    async def start(self) -> None:
        self._change_state(CONNECTING)
        lease = await self._lease_source()
        self.max_transfer = lease.max_transfer
        await self._connect_leased(lease)
        largest = max((ns.lba_size for ns in lease.namespaces), default=4096)
        if self._bounce_buffers:  # whole transfers go through them (a FUSE worker's)
            self.bounce = self.new_bounce_pool(max(largest, lease.max_transfer),
                                               self._bounce_buffers)
        else:
            self.bounce = self.new_bounce_pool(largest, EDGE_BUFFERS)
        for shape in lease.namespaces:
            ns = self.namespaces[shape.nsid] = Namespace(self, shape.nsid, shape,
                                                         max(shape.generation, 0))
            if shape.generation == GONE:
                ns.replace(gone_line(shape.nsid))
        await self._nursery.start(self.supervise)  # runs _reconnect after each loss
        self._change_state(LIVE)

    def _follow_lease(self, lease: Lease) -> None:
        """Before our queues connect again: a namespace of ours that the lease names by
        another generation (or as gone) was replaced or removed meanwhile, and refuses I/O
        from now on; nothing that waits for it goes out (:meth:`namespace_replaced`)."""
        for shape in lease.namespaces:
            ns = self.namespaces.get(shape.nsid)
            if ns is None or ns.removed or shape.generation == ns.generation:
                continue
            ns.replace(gone_line(shape.nsid))
            self.namespace_replaced(shape.nsid, ns, ns)

    async def _connect_leased(self, lease: Lease) -> None:
        """Connect every leased queue ID to the lease's controller.

        A QID whose previous holder's queue the target has not torn down yet is
        answered Command Sequence Error: then all of them are tried again, a little later.
        """
        self.lease = lease
        self.cntlid = lease.cntlid
        self._follow_path(lease)
        for attempt in range(QID_BUSY_RETRIES + 1):
            try:
                self.io_queues = [await self._connect_one(qid, lease) for qid in lease.qids]
                await self._hand_over()
                return
            except ConnectError as exc:
                await self._drop_queues()
                if not _qid_busy(exc) or attempt == QID_BUSY_RETRIES:
                    raise
                log.debug("a leased queue is still held on the target; trying again")
                await trio.sleep(QID_BUSY_DELAY)

    def _follow_path(self, lease: Lease) -> None:
        """A lease on another path of a multipath mount: connect the queues there (the same
        transport, so the memory registered with it stays valid)."""
        transport = self.transport
        if lease.traddr is None or not hasattr(transport, "traddr"):
            return
        port = lease.trsvcid if lease.trsvcid is not None else transport.trsvcid
        if (transport.traddr, transport.trsvcid) != (lease.traddr, port):
            log.info("leased queues move to %s:%s", lease.traddr, port)
            transport.traddr, transport.trsvcid = lease.traddr, port
            self.options.traddr, self.options.trsvcid = lease.traddr, port
        for local in ("host_iface", "host_traddr"):  # the path's own local side, if any
            if hasattr(transport, local):
                setattr(transport, local, getattr(lease, local))
                setattr(self.options, local, getattr(lease, local))

    async def _connect_one(self, qid: int, lease: Lease):
        queue = await self.transport.connect_queue(self._nursery, qid, lease.queue_size,
                                                   lease.in_capsule_bytes, cntlid=lease.cntlid)
        if self._scratch is None:  # the Connect data's buffer; registering needs the PD
            self._scratch = host_buffer(self.transport.register, 4096)
        await self._fabrics_connect(queue)
        return queue

    async def _hand_over(self) -> None:
        """Give the last ``polled`` RDMA queues to callers' threads (see :func:`polled_share`)."""
        count = polled_share(self._polled, len(self.io_queues))
        take_over = getattr(self.transport, "take_over", None)  # a transport's option
        if count <= 0 or take_over is None:
            return
        polled = []
        for queue in self.io_queues[-count:]:
            taken = await take_over(queue, self.options.timeout)
            if taken is not None:
                polled.append(taken)
        if polled:
            given = {p.queue for p in polled}
            self.io_queues = [q for q in self.io_queues if q not in given]
            self.polled_queues = polled
            log.debug("queues %s are driven by callers' threads",
                      ",".join(str(p.queue.qid) for p in polled))

    def detach_polled(self, why: str) -> None:
        """Take the callers' queues back before they are torn down (their requests fail)."""
        polled, self.polled_queues = self.polled_queues, []
        for queue in polled:
            queue.detach(why)

    def polled_lost(self, polled: Any, exc: BaseException) -> None:
        """A callers' queue failed (on the loop): reconnect, unless it is an old one."""
        if polled in self.polled_queues and not polled.detached and self.io_queues:
            self.connection_lost(self.io_queues[0], exc)

    async def _drop_queues(self) -> None:
        self.detach_polled("its connection is being reset")
        await super()._drop_queues()

    async def _reconnect(self, reason: str) -> None:
        """Renew the lease (waits for the owner's reconnect), then connect the queues again."""
        opts = self.options
        if self.on_serving is not None:
            self.on_serving(None)
        await self._drop_queues()
        attempts = reconnect_attempts(opts.ctrl_loss_tmo, opts.reconnect_delay)
        tried = 0
        failing = FailureStreak(log)
        if attempts and not self._change_state(CONNECTING):
            return  # closed meanwhile
        while tried < attempts:
            tried += 1
            try:
                lease = await self._lease_source()
            except NVMeoFError as exc:  # the owner gave up on the controller, or is gone
                self._dead_reason = str(exc)
                break
            self._follow_lease(lease)
            try:
                await self._connect_leased(lease)
            except NVMeoFError as exc:
                failing.failed(logging.WARNING, "reconnecting leased queues failed: %s", exc)
                await self._drop_queues()
                await trio.sleep(opts.reconnect_delay)
                continue
            if not self._change_state(LIVE):
                return  # closed meanwhile
            if self.on_serving is not None:
                self.on_serving(lease)
            self._failing_io = ""
            self.reconnects += 1
            limited.log("connected again", logging.INFO, "leased queues %s connected again to "
                        "controller %d%s", ",".join(map(str, lease.qids)), lease.cntlid,
                        failing.end())
            return
        why = self._dead_reason or (f"the leased queues to {opts.nqn} were lost ({reason}) and "
                                    f"did not come back after {tried} tries")
        log.error("%s", why)
        self.close_state(why)

    async def shutdown(self, why: str = "") -> None:
        """Nothing to do: the controller's owner shuts it down, not a queue's tenant."""


def gone_line(nsid: int) -> str:
    return (f"namespace n{nsid} was replaced by another namespace, or removed, on the "
            "target: the mount serves another under its name now")


@contextlib.asynccontextmanager
async def attach(options: ConnectOptions, lease_source: LeaseSource,
                 transport: Transport | None = None, polled: int = 0,
                 bounce_buffers: int = 0) -> AsyncIterator[AttachedController]:
    """Connect leased I/O queues; on exit disconnect them and release every resource.

    ``polled`` of them (RDMA, when more than that are leased) are driven by callers'
    threads: ``controller.polled_queues``.  ``bounce_buffers``: a bounce pool of that many
    buffers of a whole transfer each (else one-LBA buffers for the edges of placed I/O).
    """
    if transport is None:
        transport = make_transport(options)
    controller = None
    try:
        with unwrap_groups():
            async with trio.open_nursery() as nursery:
                controller = AttachedController(options, transport, nursery, lease_source,
                                                polled, bounce_buffers)
                try:
                    await controller.start()
                    yield controller
                finally:
                    controller.detach_polled("the leased queues are closed")
                    controller.close_state(f"the leased queues of {options.nqn} are closed")
                    nursery.cancel_scope.cancel()
    finally:
        if controller is not None:
            controller.release()
        else:
            transport.close()

