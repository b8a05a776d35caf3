"""NVMe/RDMA transport over the PyPI ``ibverbs`` bindings (NVMe/RDMA transport spec).

Wire formats first (RDMA-CM private data and the command-slot bookkeeping are
plain code), then the I/O: one RC queue pair per NVMe queue, connected through
RDMA-CM.  Each queue has its own protection domain (the ``ibverbs`` API ties a
QP's PD to its RDMA-CM endpoint), so a region registered with the transport
holds one memory region per queue, and each queue picks its own keys.  Data
travels by keyed SGL (the target RDMA-READs/WRITEs our registered memory) or,
for small writes, inside the command capsule.
Completions wake trio through the completion channel's fd; while completions
keep coming the reaper polls without sleeping.  A command alone on its queue is
polled for by its caller instead, for about twice the queue's recent latency for
commands of its size (as the kernel's hybrid polling: :mod:`..pollbudget`), so a QD1
reader pays no sleep and wake-up per I/O; past that, or with an idle queue, nothing
polls and the channel is armed.
With several commands in flight nothing polls before sleeping either: a command
alone says nothing of the gaps between completions at depth, and polls that miss take
the CPU the target side needs.

The per-command path is kept lean: work
requests are built once per command slot, capsule SENDs complete on their own
CQ that raises no wakeup unless a caller waits on it, and a waiting caller is
parked without a cancel scope; one watchdog per queue enforces the timeouts.
A command started with :meth:`RdmaQueue.start` has no caller task at all: the task
that reaps its completion calls its callback.

Why one module: the transport and its queue pairs share each queue's protection domain,
memory regions and completion channels; the wire formats at the top are pure and tested
on their own, and the queue that callers' threads drive lives apart (:mod:`.polled`).
"""

from __future__ import annotations

import errno
import math
import os
import struct
import time
from collections.abc import Callable
from typing import NoReturn

import trio

from ...concurrency import tasks_runnable
from ...errors import CommandTimeout, ConnectError, DeviceMismatch, TransportError
from ...nvme import Completion
from ...nvme.sgl import NULL_SGL, in_capsule_data, pack_keyed_data_block_into
from ..base import LocalDevice
from ..cids import CommandIds
from ..parking import Watchdog, closed_for_timeout, for_caller, time_out, timeout_error, unsent
from ..pollbudget import PollBudget
from ..region import DataRef, Region, host_buffer

SQE_BYTES = 64
CQE_BYTES = 16
CM_PRIVATE_DATA_BYTES = 32
_CM_REQUEST = struct.Struct("<HHHHH22x")  # recfmt, qid, hrqsize, hsqsize, cntlid
_CM_ACCEPT = struct.Struct("<HH28x")  # recfmt, crqsize
STOP_TIMEOUT = 5.0  # s for a queue's reaper to end once stopped
POLL_MAX = 0.002
"""Seconds of recent latency past which a command alone on its queue is not polled for
(but for a probe now and then: :mod:`..pollbudget`); below, its caller polls for twice that."""
YIELD_EVERY = POLL_MAX
"""Seconds a caller polling for its command alone may go on without a scheduler pass."""
ACK_TIMEOUT = 16
"""The QP's local ACK timeout, as the exponent n of 4.096 us * 2**n (about 0.27 s): a SEND
the target's device has not acknowledged by then is sent again."""
RETRY_COUNT = 2
"""Resends of an unacknowledged SEND before it fails with "transport retry counter exceeded":
a queue whose peer is gone fails (RETRY_COUNT + 1) ACK timeouts after a SEND, about 0.8 s.
A target that is merely slow still acknowledges at once (its device does, not its software).
Not 7, RDMA-CM's default: Soft-RoCE takes 7 as "forever", and a device that counts takes
eight timeouts."""
PROBE_AFTER = 0.5
"""Seconds a command may wait before the controller sends a Keep Alive at once: commands
whose SENDs were acknowledged before the peer went away wait on without a SEND to fail, and
a probe brings one."""
_SEND, _RECV = 1 << 62, 1 << 61
_INDEX = (1 << 32) - 1
_CID = struct.Struct("<H")  # the command ID, bytes 2..3 of a capsule


# --- wire formats -------------------------------------------------------------------------------

def cm_request(qid: int, size: int, cntlid: int = 0) -> bytes:
    """RDMA-CM connect private data (NVMe/RDMA spec, "RDMA_CM_REQUEST"): 32 bytes.

    HRQSIZE is the queue's entry count; HSQSIZE is 0's based.
    """
    return _CM_REQUEST.pack(0, qid, size, size - 1, cntlid)


def parse_cm_accept(data: bytes) -> int:
    """The controller's receive queue size (CRQSIZE) from "RDMA_CM_ACCEPT" private data."""
    if len(data) < _CM_ACCEPT.size:
        raise ConnectError(f"RDMA-CM accept carried {len(data)} bytes of private data, "
                           f"expected {_CM_ACCEPT.size}")
    recfmt, crqsize = _CM_ACCEPT.unpack_from(data)
    if recfmt != 0:
        raise ConnectError(f"RDMA-CM accept has record format {recfmt}, expected 0")
    return crqsize


class Request:
    """One command in flight.

    Its slot (command ID, capsule buffer, send queue entry) is reusable once both
    the capsule SEND and the response completed.  The caller may go on at the
    response already: the target can only answer a capsule it received, and data
    moved by keyed SGL was placed before the response (RC ordering).  A capsule
    that carries the caller's data in-capsule (``inline``) holds the caller until
    its SEND completed too, so that memory is no longer read by the HCA.
    The caller is a task parked on it (``task``) or, for a command started with
    :meth:`RdmaQueue.start`, a callback (``done``).
    """

    __slots__ = ("cid", "slot", "data", "inline", "sent", "completion", "error", "finished",
                 "task", "done", "deadline", "timeout")

    def __init__(self, cid: int, slot: int, data: DataRef | None) -> None:
        self.cid = cid
        """Its command ID: ``slot`` and the slot's generation (:mod:`..cids`)."""
        self.slot = slot
        """Its capsule, response and send work request."""
        self.data = data
        self.inline = False
        self.sent = False
        self.completion: Completion | None = None
        self.error: Exception | None = None
        self.finished = False
        """The caller may go on: answered (and sent, if ``inline``), or failed."""
        self.task = None  # the trio task parked on this request, if any
        self.done: Callable[[Request], None] | None = None  # or the callback told its end
        self.deadline = math.inf
        self.timeout = 0.0


class CommandSlots(CommandIds):
    """Command IDs of one queue and the requests holding them (no I/O).

    A response is matched by its whole command ID, the slot's generation included: one
    for an earlier use of a slot is not in flight (a protocol error, never the answer of
    the command using the slot now).
    """

    __slots__ = ("size", "pending", "awaiting_send")

    def __init__(self, size: int) -> None:
        super().__init__(size - 1)  # an SQ of N entries holds N-1 commands
        self.size = size
        self.pending: dict[int, Request] = {}
        """The requests in flight, by slot."""
        self.awaiting_send = 0
        """Requests answered whose SEND completion has not been seen yet."""

    @property
    def available(self) -> int:
        return len(self.free)

    def allocate(self, data: DataRef | None) -> Request:
        slot = self.free.pop()  # (CommandIds.take, inline: this is the hot path)
        last = self.last
        cid = last[slot] = (last[slot] + self.step) & 0xFFFF
        request = self.pending[slot] = Request(cid, slot, data)
        return request

    def release(self, request: Request) -> None:
        """Give back a request's slot without finishing it (it was never sent)."""
        del self.pending[request.slot]
        self.free.append(request.slot)

    def send_completed(self, slot: int) -> None:
        request = self.pending.get(slot)
        if request is None:
            raise TransportError(f"send completion for slot {slot}, which holds no command")
        request.sent = True
        if request.completion is not None:
            self.awaiting_send -= 1
            self._retire(request)
            if request.inline:
                self.finish(request)

    def response(self, completion: Completion) -> None:
        cid = completion.command_id
        request = self.pending.get(cid & self.mask)
        if request is None or request.cid != cid:
            self._unknown(cid, "response")
        if request.completion is not None:
            raise TransportError(f"second response for command ID {request.cid}")
        request.completion = completion
        if request.sent:
            self._retire(request)
        else:
            self.awaiting_send += 1
            if request.inline:
                return
        self.finish(request)

    def fail_all(self, error: Exception) -> None:
        """Fail the requests in flight; one already finished (answered, its SEND not reaped
        yet) keeps its completion: its caller may not have read it yet."""
        for request in list(self.pending.values()):
            self._retire(request)
            if not request.finished:
                request.error = error
                self.finish(request)
        self.awaiting_send = 0

    @staticmethod
    def _unknown(cid: int, what: str) -> NoReturn:
        raise TransportError(f"{what} for command ID {cid}, which is not in flight")

    def _retire(self, request: Request) -> None:
        """Both halves are done: the slot may carry a new command."""
        del self.pending[request.slot]
        self.free.append(request.slot)

    @staticmethod
    def finish(request: Request) -> None:
        """Let the caller of ``request`` go on (it reads ``completion`` or ``error``): wake
        its task, or call its callback now."""
        request.finished = True
        task = request.task
        if task is not None:
            request.task = None
            trio.lowlevel.reschedule(task)
        elif request.done is not None:
            done, request.done = request.done, None
            done(request)


# --- I/O ------------------------------------------------------------------------------------------

_ibverbs = None


def _verbs():
    """The ``ibverbs`` module, imported on first use (the wire formats above need none)."""
    global _ibverbs
    if _ibverbs is None:
        import ibverbs

        _ibverbs = ibverbs
    return _ibverbs


def _access(ib) -> int:
    flags = ib.AccessFlags
    return int(flags.LOCAL_WRITE | flags.REMOTE_WRITE | flags.REMOTE_READ)


class RdmaRegistration:
    """Memory registered in every queue's protection domain: one MR per PD.

    Queues come and go (reconnects); a registration lives on, and is registered
    in each new queue's PD when that queue is set up.  ``keys(pd)`` is the MR
    (``lkey``/``rkey``) a queue with that PD must use.
    """

    __slots__ = ("addr", "length", "owner", "_dmabuf", "_transport", "_mrs")

    def __init__(self, transport: RdmaTransport, addr: int, length: int, owner: object,
                 dmabuf: tuple[int, int] | None = None) -> None:
        self.addr = addr
        self.length = length
        self.owner = owner  # keeps the memory alive while it is registered
        self._dmabuf = dmabuf  # (our own fd of the dma-buf, offset in it), for GPU memory
        self._transport = transport
        self._mrs: dict = {}  # PD -> MR

    def keys(self, pd):
        """The MR of this memory in ``pd`` (its ``lkey`` and ``rkey``)."""
        return self._mrs[pd]

    def add(self, pd) -> None:
        """Register the memory in ``pd`` as well."""
        access = _access(_verbs())
        what = "memory" if self._dmabuf is None else "dma-buf"
        try:
            if self._dmabuf is None:
                mr = pd.reg_mr(self.addr, self.length, access)
            else:
                fd, offset = self._dmabuf
                mr = pd.reg_dmabuf_mr(offset, self.length, self.addr, fd, access)
        except OSError as exc:
            raise TransportError(f"cannot register {self.length} bytes of {what} for RDMA: "
                                 f"{exc.strerror or exc}") from exc
        self._mrs[pd] = mr

    def remove(self, pd) -> None:
        """Deregister the memory from ``pd`` (before the PD is closed)."""
        mr = self._mrs.pop(pd, None)
        if mr is not None:
            _close_quietly(mr)

    def close(self) -> None:
        for pd in list(self._mrs):
            self.remove(pd)
        self._transport._registrations.pop(self, None)
        if self._dmabuf is not None:
            os.close(self._dmabuf[0])
            self._dmabuf = None
        self.owner = None


class _QueueMemory:
    """A queue's own buffers (capsules, responses): registered in its PD only."""

    __slots__ = ("mr",)

    def __init__(self, mr) -> None:
        self.mr = mr

    def keys(self, pd):
        return self.mr

    def close(self) -> None:
        _close_quietly(self.mr)


class RdmaTransport:
    """The RDMA side of one controller: every queue's endpoint, PD and QP, and the
    registrations that are valid on all of them."""

    name = "rdma"
    needs_keyed_sgls = True
    places_in_other_processes = True
    counts_read_data = False  # the target's RDMA writes land unseen
    dmabuf_refusal = ""
    """Empty: dma-bufs may be registered (the device or its driver may still refuse one)."""
    probe_after = PROBE_AFTER
    """Seconds a command may wait before the controller probes the connection: an RDMA-CM
    disconnect from the target does not reach us, so a lost path shows only when a SEND goes
    unacknowledged (see ACK_TIMEOUT)."""

    def __init__(self, traddr: str, trsvcid: int = 4420, host_traddr: str | None = None,
                 connect_timeout: float = 10.0, *, host_iface: str | None = None) -> None:
        self.traddr = traddr
        self.trsvcid = trsvcid
        self.host_traddr = host_traddr
        self.host_iface = host_iface
        """The RDMA device RDMA-CM must bind the queues to (``mlx5_3``), or None: any."""
        self.local_device: LocalDevice | None = None
        """The RDMA device RDMA-CM bound the last queue to."""
        self.connect_timeout = connect_timeout
        self._queues: list[RdmaQueue] = []
        self._registrations: dict[RdmaRegistration, None] = {}  # ordered set
        self.yielded_at = 0.0  # perf_counter of the last checkpoint before a caller's poll

    @property
    def address(self) -> str:
        return f"rdma {self.traddr}:{self.trsvcid}"

    def register(self, addr: int, length: int, owner: object) -> RdmaRegistration:
        """Register ``[addr, addr+length)`` on every queue, now and after reconnects."""
        return self._add(RdmaRegistration(self, addr, length, owner))

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> RdmaRegistration:
        """Register a dma-buf (a GPU allocation exported by its driver) on every queue.

        The transport keeps a duplicate of ``fd``: new queues register it again.
        """
        return self._add(RdmaRegistration(self, iova, length, None, (os.dup(fd), offset)))

    def _add(self, registration: RdmaRegistration) -> RdmaRegistration:
        try:
            for queue in self._queues:
                registration.add(queue.pd)
        except BaseException:
            registration.close()
            raise
        self._registrations[registration] = None
        return registration

    async def _resolve(self):
        ib = _verbs()

        def resolve():
            return ib.CMID.resolve(self.traddr, self.trsvcid, source=self.host_traddr)

        try:
            with trio.fail_after(self.connect_timeout):
                cm = await trio.to_thread.run_sync(resolve, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise ConnectError(f"no RDMA route to {self.traddr}:{self.trsvcid} within "
                               f"{self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(f"cannot reach {self.traddr}:{self.trsvcid} over RDMA: "
                               f"{exc.strerror or exc}") from None
        return self._bound(cm)

    def _bound(self, cm):
        """``cm`` if RDMA-CM bound it to the device asked for (``host_iface``); the
        device it bound is this transport's ``local_device`` from now."""
        try:
            device = str(cm.context.name)
        except (AttributeError, OSError):  # a context that cannot say: unknown, not refused
            return cm
        if self.host_iface and device != self.host_iface:
            _close_quietly(cm)
            raise DeviceMismatch(f"RDMA-CM bound the route to {self.traddr}:{self.trsvcid} to "
                                 f"{device}, not to {self.host_iface} (host_iface): refused")
        self.local_device = LocalDevice("infiniband", device)
        return cm

    async def connect_queue(self, nursery: trio.Nursery, qid: int, size: int,
                            in_capsule_bytes: int = 0, cntlid: int = 0) -> RdmaQueue:
        """Connect queue ``qid`` of ``size`` entries and start its completion reaper."""
        cm = await self._resolve()
        try:
            pd = cm.context.alloc_pd()
        except OSError as exc:
            _close_quietly(cm)
            raise TransportError(f"cannot allocate an RDMA protection domain: {exc}") from exc
        try:
            for registration in self._registrations:
                registration.add(pd)
            queue = RdmaQueue(self, cm, pd, qid, size, in_capsule_bytes)
        except BaseException:
            self._release_domain(cm, pd)
            raise
        self._queues.append(queue)
        await queue.connect(cntlid)
        await nursery.start(queue.reap)
        return queue

    def _release_domain(self, cm, pd) -> None:
        """Deregister every registration from ``pd``, close it, then its endpoint."""
        for registration in self._registrations:
            registration.remove(pd)
        _close_quietly(pd)
        _close_quietly(cm)

    async def drop_queues(self) -> None:
        """Stop and tear down every queue with its endpoint and PD.

        Commands still waiting fail with TransportError.  Registrations stay: the
        next ``connect_queue`` registers them in the new queue's PD.
        """
        queues = list(self._queues)
        for queue in reversed(queues):
            await queue.stop()
        self._close_queues()

    def _close_queues(self) -> None:
        queues, self._queues = self._queues, []
        for queue in reversed(queues):
            queue.close()
            self._release_domain(queue.cm, queue.pd)

    def close(self) -> None:
        """Tear down every queue; then nothing of this controller is left on the device."""
        self._close_queues()
        for registration in list(self._registrations):
            registration.close()


def _close_quietly(resource) -> None:
    try:
        resource.close()
    except OSError:
        pass


class RdmaQueue:
    """One NVMe queue over an RC QP: command capsules out, 16-byte responses in."""

    connect_cattr = 0
    """RDMA queues keep SQ flow control (as Linux nvme-rdma): every command gets a response."""

    def __init__(self, transport: RdmaTransport, cm, pd, qid: int, size: int,
                 in_capsule_bytes: int) -> None:
        ib = self._ib = _verbs()
        self.transport = transport
        self.qid = qid
        self.size = size
        self.in_capsule_bytes = in_capsule_bytes
        self.cm = cm
        self.pd = pd
        self._slots = CommandSlots(size)
        self._slot_waiters = trio.lowlevel.ParkingLot()
        self._slot_wanted = 0  # callers waiting for a slot, parked or woken and not yet run
        self._failed: TransportError | None = None
        self._watchdog = Watchdog(self._waited_for, self._expire)
        self._reaper: trio.CancelScope | None = None  # the reaper's scope, once it runs
        self._reaped = trio.Event()
        self._poster = None  # the task posting queued capsules, once started
        self._idle_reaper = None  # the reaper's task while it waits for a command, unarmed
        self.poll_budget = PollBudget(POLL_MAX)
        """Latency of commands alone on the queue, from posting to their end, per size."""
        self._poster_woken = False
        self._queued: list = []  # SendWRs waiting for the poster
        self._queued_requests: list[Request] = []
        self._recv_armed = self._send_armed = False
        self._sends: list = []
        self._recvs: list = []
        self._capsule_sges: list = []
        self.channel = self.recv_cq = self.send_cq = self.qp = None
        self.capsules: Region | None = None
        self.responses: Region | None = None
        try:
            self._create(ib, cm, pd, size)
        except BaseException:
            self.close()
            raise

    def _create(self, ib, cm, pd, size: int) -> None:
        """The verbs objects: channel, CQs, QP, capsule and response buffers, work requests."""
        # Two CQs on one channel: responses always wake the reaper; capsule SEND
        # completions are picked up alongside them and wake it only when needed.
        self.channel = cm.context.create_comp_channel()
        self.recv_cq = cm.context.create_cq(size + 1, self.channel)
        self.send_cq = cm.context.create_cq(size + 1, self.channel)
        self.qp = cm.create_qp(pd, ib.QPInitAttr(
            send_cq=self.send_cq, recv_cq=self.recv_cq, qp_type=ib.QPType.RC,
            max_send_wr=size, max_recv_wr=size, max_send_sge=2, max_recv_sge=1))

        def register(addr: int, length: int, owner: object) -> _QueueMemory:
            return _QueueMemory(pd.reg_mr(addr, length, _access(ib)))

        self.capsules = host_buffer(register, SQE_BYTES * size)
        self.responses = host_buffer(register, CQE_BYTES * size)
        # Work requests never change per slot: build them once.
        caps, resp = self.capsules, self.responses
        caps_lkey, resp_lkey = caps.registration.keys(pd).lkey, resp.registration.keys(pd).lkey
        self._capsule_sges = [ib.SGE(caps.addr + cid * SQE_BYTES, SQE_BYTES, caps_lkey)
                              for cid in range(size)]
        self._sends = [[self._send_wr(cid, [sge])] for cid, sge in enumerate(self._capsule_sges)]
        self._recvs = [ib.RecvWR(wr_id=_RECV | slot,
                                 sg_list=[ib.SGE(resp.addr + slot * CQE_BYTES, CQE_BYTES,
                                                 resp_lkey)])
                       for slot in range(size)]

    @property
    def name(self) -> str:
        return "admin queue" if self.qid == 0 else f"I/O queue {self.qid}"

    @property
    def available(self) -> int:
        """Free command slots: callers pick the least busy queue by this."""
        return len(self._slots.free)

    async def connect(self, cntlid: int) -> None:
        device = self.cm.context.query_device()
        request = cm_request(self.qid, self.size, cntlid)

        def connect():
            return self.cm.connect(request,
                                    responder_resources=min(255, device.max_qp_rd_atom),
                                    initiator_depth=0, retry_count=RETRY_COUNT)

        self.qp.post_recv(self._recvs)
        where = f"{self.transport.traddr}:{self.transport.trsvcid}"
        try:
            with trio.fail_after(self.transport.connect_timeout):
                accept = await trio.to_thread.run_sync(connect, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise ConnectError(f"NVMe/RDMA {self.name} connect to {where} timed out after "
                               f"{self.transport.connect_timeout:g} s") from None
        except OSError as exc:
            reason = ("refused: is an NVMe/RDMA port listening there?"
                      if exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET)
                      else exc.strerror or str(exc))
            raise ConnectError(f"NVMe/RDMA {self.name} connect to {where} {reason}") from None
        crqsize = parse_cm_accept(accept)
        if crqsize < self.size - 1:
            raise ConnectError(f"{where} accepted a receive queue of {crqsize} entries for "
                               f"{self.name}, fewer than the {self.size - 1} commands we send")
        self._shorten_ack_timeout()

    def _shorten_ack_timeout(self) -> None:
        """Lower the QP's local ACK timeout to ACK_TIMEOUT where RDMA-CM chose a longer one
        (or none).  A device that refuses the change (RTS to RTS) keeps RDMA-CM's: a lost
        peer then shows after RETRY_COUNT + 1 of its timeouts instead."""
        try:
            current = self.qp.query()[0]["timeout"]
            if current == 0 or current > ACK_TIMEOUT:
                self.qp.modify(int(self._ib.QPAttrMask.TIMEOUT), timeout=ACK_TIMEOUT)
        except (OSError, KeyError, TypeError):
            pass

    def oldest_command(self) -> Request | None:
        """The command in flight the longest, or None (``pending`` keeps the order commands
        were allocated in): what :mod:`..overdue` looks at."""
        for request in self._slots.pending.values():
            return request
        return None

    def _send_wr(self, cid: int, sg_list: list):
        ib = self._ib
        return ib.SendWR(wr_id=_SEND | cid, opcode=ib.WROpcode.SEND,
                         send_flags=ib.SendFlags.SIGNALED, sg_list=sg_list)

    def data_pointer(self, data: DataRef | None, to_controller: bool) -> tuple[bytes, list]:
        """The SGL for ``data`` and the extra send SGEs (in-capsule data) it needs."""
        sgl = bytearray(16)
        extra = self._place_data(sgl, 0, data, to_controller)
        return bytes(sgl), list(extra)

    def _place_data(self, buf, at: int, data: DataRef | None, to_controller: bool):
        """Write the SGL for ``data`` into ``buf`` at ``at``; the extra send SGEs
        (in-capsule data) it needs, if any."""
        if data is None or data.length == 0:
            buf[at:at + 16] = NULL_SGL
            return ()
        region = data.region
        keys = region.registration.keys(self.pd)
        if to_controller and data.length <= self.in_capsule_bytes:
            buf[at:at + 16] = in_capsule_data(0, data.length)
            return (self._ib.SGE(region.addr + data.offset, data.length, keys.lkey),)
        pack_keyed_data_block_into(buf, at, region.addr + data.offset, data.length, keys.rkey)
        return ()

    async def _allocate(self, data: DataRef | None, timeout: float) -> Request:
        if self._failed:
            raise unsent(self._failed)
        self._slot_wanted += 1  # start() leaves freed slots to us meanwhile
        try:
            with trio.move_on_after(timeout):
                while not self._slots.available and not self._failed:
                    await self._slot_waiters.park()
        finally:
            self._slot_wanted -= 1
        if self._failed:
            raise unsent(self._failed)
        if not self._slots.available:
            raise CommandTimeout(f"{self.name} stayed full for {timeout:g} s")
        return self._slots.allocate(data)

    async def execute(self, sqe: bytearray, data: DataRef | None = None, *,
                      to_controller: bool = False, timeout: float) -> Completion:
        slots = self._slots
        if self._failed is None and slots.free:
            request = slots.allocate(data)
        else:
            request = await self._allocate(data, timeout)
        alone = len(slots.pending) == 1
        wrs = self._fill_capsule(request, sqe, data, to_controller)
        if len(slots.pending) > 1 and self._poster is not None:
            self._post_soon(request, wrs)
        else:
            try:
                self.qp.post_send(wrs)
            except OSError as exc:
                slots.release(request)
                raise TransportError(f"{self.name}: cannot post a command: {exc}") from exc
        polled = False
        if alone:
            posted = time.perf_counter()
            nbytes = data.length if data is not None else 0
            if self._idle_reaper is not None and not self._others_in_flight():
                budget = self.poll_budget.budget(nbytes)
                if budget:
                    await self._poll_for(request, posted + budget)
                    polled = request.finished
                    if slots.awaiting_send:  # answered before its SEND completed: the
                        self._wake_reaper()  # reaper, idle and unarmed, arms for it
        if not request.finished:
            if self._idle_reaper is not None:
                self._wake_reaper()
            await self._watchdog.park(request, timeout)
        if alone:
            self.poll_budget.record(nbytes, time.perf_counter() - posted, polled=polled)
        if request.error is not None:
            raise for_caller(request.error)
        return request.completion  # type: ignore[return-value]

    def start(self, sqe: bytearray, data: DataRef | None,
              done: Callable[[Request], None], *, to_controller: bool = False,
              timeout: float) -> bool:
        """Send ``sqe`` without waiting for it: ``done(request)`` is called once it finished
        (``request.completion``, or ``request.error``: failed, timed out), by whichever task
        reaps it; it must not raise.  False, with nothing sent, when the queue failed or no
        slot is free for it (callers waiting for one go first).  Nothing polls for such a
        command: a caller with nothing else in flight does better with :meth:`execute`,
        which does."""
        slots = self._slots
        if (self._failed is not None or not slots.free or self._slot_wanted
                or self._poster is None):
            return False
        request = slots.allocate(data)
        request.done = done
        self._post_soon(request, self._fill_capsule(request, sqe, data, to_controller))
        self._watchdog.watch(request, timeout)
        if self._idle_reaper is not None:
            self._wake_reaper()
        return True

    def _fill_capsule(self, request: Request, sqe: bytearray, data: DataRef | None,
                      to_controller: bool) -> list:
        """Write ``sqe`` into ``request``'s registered capsule, with its command ID and
        data pointer; the send work requests that post it."""
        slot = request.slot
        offset = slot * SQE_BYTES
        capsule = self.capsules.view
        capsule[offset:offset + SQE_BYTES] = sqe
        _CID.pack_into(capsule, offset + 2, request.cid)
        extra = self._place_data(capsule, offset + 24, data, to_controller)
        if extra:
            request.inline = True
            return [self._send_wr(slot, [self._capsule_sges[slot], *extra])]
        return self._sends[slot]

    def _post_soon(self, request: Request, wrs: list) -> None:
        """Queue ``wrs`` for the poster.  With others in flight, other callers likely post in
        this trio batch too: the poster hands them to the QP in one post_send (one syscall,
        one rxe run)."""
        self._queued.extend(wrs)
        self._queued_requests.append(request)
        if not self._poster_woken:
            self._poster_woken = True
            trio.lowlevel.reschedule(self._poster)

    def _waited_for(self):
        """The requests in flight whose caller waits (parked, or a callback): the watchdog's."""
        return (r for r in self._slots.pending.values()
                if r.task is not None or r.done is not None)

    async def _poll_for(self, request: Request, until: float) -> None:
        """Poll the CQs until ``request`` finished or ``until`` (``perf_counter``) passed.

        Other tasks waiting to run go first (one checkpoint), while the target works;
        then the caller polls without yielding, bounded by ``until``.  With none
        waiting, the checkpoint (a scheduler pass: an ``epoll_wait``, the timers) is
        skipped, but never for more than ``YIELD_EVERY``, so timers and file
        descriptors are still looked at while a QD1 caller finds every completion by
        polling.  Nothing is armed meanwhile, so a completion found here raises no
        wake-up.
        """
        clock = time.perf_counter
        transport = self.transport
        if (clock() - transport.yielded_at > YIELD_EVERY
                or tasks_runnable()):
            await trio.lowlevel.cancel_shielded_checkpoint()
            transport.yielded_at = clock()
        try:
            while not request.finished and self._failed is None:
                if not self._drain() and clock() > until:
                    return
        except (TransportError, OSError) as exc:
            if not isinstance(exc, TransportError):
                exc = TransportError(f"{self.name}: completion queue failed: {exc}")
            self._fail(exc)
            if self._reaper is not None:
                self._reaper.cancel()

    def _others_in_flight(self) -> bool:
        """Whether another I/O queue of this controller has commands in flight: polling
        this one would hold up their completions (one thread reaps every queue).  The
        admin queue does not count: it always holds an Asynchronous Event Request, and a
        keep-alive or an AER may wait a poll's length."""
        for queue in self.transport._queues:
            if queue is not self and queue.qid and queue._slots.pending:
                return True
        return False

    def _wake_reaper(self) -> None:
        task, self._idle_reaper = self._idle_reaper, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def reap(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Dispatch completions: poll while they come, sleep on the channel fd when idle.

        Also runs the queue's command watchdog.
        """
        os.set_blocking(self.channel.fd, False)
        try:
            with trio.CancelScope() as self._reaper:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._watchdog.run)
                    await nursery.start(self._post_queued)
                    task_status.started()
                    try:
                        await self._reap()
                    except TransportError as exc:
                        self._fail(exc)
                    except OSError as exc:
                        self._fail(TransportError(f"{self.name}: completion queue failed: {exc}"))
                    finally:
                        if self._failed is None:  # cancelled: nothing answers callers now
                            self._fail(TransportError(f"{self.name}: stopped"))
                        nursery.cancel_scope.cancel()
        finally:
            self._reaped.set()

    async def stop(self) -> None:
        """End the reaper (waiting callers fail with TransportError); then close() is safe."""
        if self._reaper is None:
            return
        self._reaper.cancel()
        with trio.move_on_after(STOP_TIMEOUT):
            await self._reaped.wait()

    async def _reap(self) -> None:
        slots = self._slots
        fd = self.channel.fd
        while True:
            if not slots.pending:  # nothing can complete: wait, unarmed, for a command
                self._idle_reaper = trio.lowlevel.current_task()  # cleared by whoever ends
                await trio.lowlevel.wait_task_rescheduled(self._reaper_cancelled)  # the wait
                continue
            if self._drain():
                if len(slots.pending) > 1:
                    await trio.sleep(0)  # more are due soon: let callers post, then look again
                continue
            self._arm()
            if self._drain():
                continue  # they came before the arming: look again, unarmed
            await trio.lowlevel.wait_readable(fd)
            try:
                cq = self.channel.get_cq_event()
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    raise
                continue
            cq.ack_events(1)
            if cq is self.recv_cq:
                self._recv_armed = False
            elif cq is self.send_cq:
                self._send_armed = False
            else:  # a wrapper of its own: re-arming an armed CQ is harmless
                self._recv_armed = self._send_armed = False

    def _arm(self) -> None:
        """Ask for a wakeup on responses, and on SEND completions while one is awaited.

        Arming comes before the drain that follows it, so nothing slips between.
        """
        if not self._recv_armed:
            self.recv_cq.req_notify()
            self._recv_armed = True
        if self._slots.awaiting_send and not self._send_armed:
            self.send_cq.req_notify()
            self._send_armed = True

    def _drain(self) -> bool:
        """Handle every completion there is; True if there were any."""
        slots = self._slots
        found = self.take_completions(slots)
        if self._slot_waiters and slots.available:
            self._slot_waiters.unpark(count=slots.available)
        return bool(found)

    def take_completions(self, slots: CommandSlots,
                         answered: Callable[[int], object] | None = None) -> int:
        """Hand every SEND completion and response there is to ``slots`` and repost the
        receives; how many there were.  ``answered`` is told each response's command ID.
        A failed work request raises TransportError."""
        sends = self._take_sends(slots)
        # No more than the commands in flight can complete: a poll zeroes room for as many
        # entries as it asks for, so asking for a queue's size costs more than one entry).
        recvs = self.recv_cq.poll(len(slots.pending) or 1)
        if recvs:
            view = self.responses.view
            reposts = []
            for wc in recvs:
                if wc.status:
                    raise self._wc_error(wc)
                slot = wc.wr_id & _INDEX
                completion = Completion.unpack_from(view, slot * CQE_BYTES)
                reposts.append(self._recvs[slot])
                slots.response(completion)
                if answered is not None:
                    answered(completion.command_id)
            self.qp.post_recv(reposts)
            if slots.awaiting_send:  # their SENDs have mostly completed by now
                sends += self._take_sends(slots)
        return sends + len(recvs)

    def _take_sends(self, slots: CommandSlots) -> int:
        sends = self.send_cq.poll(len(slots.pending) or 1)
        for wc in sends:
            if wc.status:
                raise self._wc_error(wc)
            slots.send_completed(wc.wr_id & _INDEX)
        return len(sends)

    def _wc_error(self, wc) -> TransportError:
        return TransportError(f"{self.name}: work request failed: {wc.status_str} "
                              f"(vendor error {wc.vendor_err:#x})")

    def _poster_cancelled(self, _raise_cancel) -> trio.lowlevel.Abort:
        """The parked poster is cancelled: it is already due to run (with Cancelled), so
        nobody may reschedule it again; callers in the same batch post for themselves."""
        self._poster = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _reaper_cancelled(self, _raise_cancel) -> trio.lowlevel.Abort:
        """The idle reaper is cancelled: it is already due to run, so nobody may wake it."""
        self._idle_reaper = None
        return trio.lowlevel.Abort.SUCCEEDED

    async def _post_queued(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Post the capsules queued during one trio batch with a single ``post_send``."""
        self._poster = trio.lowlevel.current_task()
        task_status.started()
        try:
            while True:
                await trio.lowlevel.wait_task_rescheduled(self._poster_cancelled)
                self._poster_woken = False
                wrs, requests = self._queued, self._queued_requests
                self._queued, self._queued_requests = [], []
                if self._failed is not None:
                    continue  # _fail already finished their requests
                try:
                    self.qp.post_send(wrs)
                except OSError as exc:
                    error = TransportError(f"{self.name}: cannot post a command: {exc}")
                    for request in requests:
                        self._slots.release(request)
                        request.error = error
                        self._slots.finish(request)
        finally:
            self._poster = None

    def cut_timeouts(self, deadline: float) -> None:
        self._watchdog.cut(deadline)

    def _expire(self, now: float) -> None:
        """Time out the parked callers past their deadline, and stop the queue first.

        As Linux ``nvme_rdma_timeout``: the target may still move a timed-out command's
        data, by RDMA into or out of the caller's memory (a bounce buffer that is about
        to be reused), so the QP goes to the error state before any caller gets its
        memory back.  The other commands fail with the queue; the controller reconnects.
        """
        expired = [request for request in self._waited_for() if request.deadline <= now]
        if not expired:
            return
        self._disconnect()
        for request in expired:
            if request.task is not None:
                time_out(request, self.name)
            else:
                request.error = timeout_error(request, self.name)
                self._slots.finish(request)
        self._fail(closed_for_timeout(expired[0], self.name))

    def _fail(self, error: TransportError) -> None:
        """Fail every command in flight, stopping the QP first (as :meth:`_expire`): the target
        may still RDMA their data, into or out of memory their callers then reuse."""
        if self._slots.pending:  # (a queue taken over idle keeps its QP: rdma_polled)
            self._disconnect()
        self._failed = error.with_traceback(None)  # the reaper's frames hold requests
        self._queued, self._queued_requests = [], []  # never posted: failed with the rest
        self._slots.fail_all(error)
        self._slot_waiters.unpark_all()

    def _disconnect(self) -> None:
        """RDMA-CM disconnect: the QP goes to the error state, so the target's RDMA
        reaches none of our memory through it any more."""
        if getattr(self.cm, "connected", False):
            try:
                self.cm.disconnect()
            except OSError:
                pass

    def close(self) -> None:
        """Disconnect and destroy the QP, CQs, channel and queue buffers (not the PD and
        endpoint: the transport releases those)."""
        if self._failed is None:
            self._failed = TransportError(f"{self.name} is closed")
        self._slots.fail_all(self._failed)
        self._disconnect()
        self._sends = []
        self._recvs = []
        self._capsule_sges = []
        for resource in (self.qp, self.capsules, self.responses, self.recv_cq, self.send_cq,
                         self.channel):
            if resource is not None:
                _close_quietly(resource)
