"""NVMe/TCP host transport (NVMe/TCP Transport Specification) on trio.

The PDUs are built and parsed in :mod:`nvmeof_fuse.nvme.tcp_pdu`; this module
owns the sockets: one TCP connection per NVMe queue, opened with ICReq/ICResp,
then command capsules out and responses in, with many commands in flight.  A
queue's socket is a plain one, used with MSG_DONTWAIT on the trio thread (a send
or receive that can go on at once costs no trio scheduling; otherwise it waits on
the fd), and with blocking, bounded calls by the queue's threads.

Data moves once: a read's C2HData payload is received straight into the
caller's memory (``recv_into``); a write's data is sent from it, inside the
capsule up to the in-capsule limit, otherwise in H2CData PDUs answering the
controller's R2Ts (split at MAXH2CDATA), spliced when large.  An R2T for bulk
data is answered by the queue's receiver thread the moment it reads it (no hand-off
to the trio thread and on to another thread and back); capsules and small PDUs go
from the trio thread.  A per-socket send lock keeps PDUs from interleaving.
Memory needs no registration, so :meth:`TcpTransport.register` hands back a
trivial one.  The socket reaches host memory only: GPU memory (a dma-buf, a CUDA
tensor) is refused by name, and the companion API stages it through host memory
instead, as kvikio's compat mode does.

Small PDUs are read on the trio thread.  From a PDU over :data:`BULK_BYTES` on,
the queue's receiver thread reads the stream, headers and data, as the kernel's
io_work does, until it goes quiet: no hand-off to another thread per payload,
and the stream is read on while the trio thread wakes the callers it answered
(handed over in batches through the queue's :class:`~.mailbox.Mailbox`, the one
bridge from its threads into trio; the GIL is released for the copies, so those of
several queues run on several CPUs).  An R2T asking for bulk data starts the receiver
thread too.  The receiver thread never changes a command's state: it hands over
``(request, completion)`` pairs (and R2Ts it did not answer), and only the trio thread
acts on them; the data it sends for an R2T is the caller's until the command's answer,
which the target sends only after it has all the data.  Anything that breaks the protocol (a bad
digest, a length that disagrees with its header, an unknown PDU type, data for a
command not in flight) fails every command of the queue with
:class:`TransportError` and closes the connection, which makes the controller
reconnect.  So does a command timeout, as in Linux (``nvme_tcp_timeout`` stops
the queue before the request completes): the target may still send C2HData or
an R2T for the command, so its caller gets its memory back only once the
connection is closed, never while a late PDU could land in it or read it.
"""

from __future__ import annotations

import ctypes
import errno
import math
import select
import socket
import struct
import threading
from collections import deque

import trio

from ..errors import CommandTimeout, ConnectError, TransportError
from ..nvme import Completion, set_command_id
from ..nvme import tcp_pdu as pdu
from ..nvme.command import CONNECT_DISABLE_SQFLOW
from ..nvme.sgl import in_capsule_data
from ..nvme.tcp_pdu import ICResp, icreq_pdu, parse_icresp  # noqa: F401 - re-exported
from .mailbox import Mailbox
from .parking import Watchdog, cancellable, closed_for_timeout, for_caller, timeout_error
from .region import DataRef
from .splice import Spliced, Splicer, open_splicer

_SENT, _BLOCKED, _LOCKED = range(3)  # what TcpQueue._flush got to

ADMIN_IN_CAPSULE_BYTES = 8192  # NVME_TCP_ADMIN_CCSZ: the admin queue's in-capsule data
RECV_BUFFER_BYTES = 256 * 1024
RECV_BYTES = 64 * 1024
"""Bytes asked for per receive into the buffer: enough for many small PDUs, while little
of a large C2HData payload is copied out of the buffer instead of received in place."""
DIRECT_RECV_BYTES = 16 * 1024
"""A C2HData payload rest at least this large is received straight into its destination
(by the receiver thread; the trio thread handles only PDUs it has whole in the buffer)."""
AFTER_PAYLOAD_BYTES = 128
"""Bytes asked for after a payload received in place: its digest, a CapsuleResp and the
next C2HData header, with digests and padding."""
BULK_BYTES = 64 * 1024
"""Data from this size on is moved by the queue's receiver thread, not the trio thread: a PDU
received larger than this (and the stream after it), and the H2CData answering an R2T that
asks for this much (and the stream after that R2T).  The copy and the TCP work of a large
payload take about as long as many small PDUs, and the GIL is released for them, so the
queues' large transfers run in parallel on the machine's CPUs.  Smaller ones stay on the
trio thread, where they cost less than the hop to a thread and back."""
MAX_IOV = 512  # buffers per sendmsg (the kernel's IOV_MAX is 1024)
STOP_TIMEOUT = 5.0
STALL_TIMEOUT = 30.0
"""The receiver thread's longest wait to send H2CData (SO_SNDTIMEO); a command's own deadline,
when sooner, fails its queue first (the watchdog)."""
RECEIVE_POLL = 1.0
"""The receiver thread's longest socket wait (SO_RCVTIMEO) before it looks whether its queue
was closed (a shutdown of the socket ends the wait at once)."""
QUIET_SECONDS = 0.1
"""The receiver thread hands the reading back to the trio thread once the stream stayed quiet
this long at a PDU boundary ..."""
SMALL_STREAK = 64
"""... or after this many small PDUs in a row (no bulk payload among them)."""
TRANSPORT_SGL = struct.pack("<QI3xB", 0, 0, 0x5A)
"""Transport SGL Data Block (type 5, subtype 0xA), length 0: no data, as Linux nvme-tcp."""


HOST_MEMORY_ONLY = ("NVMe/TCP receives data into host memory only, so GPU memory is staged "
                    "(received into host memory, then copied to the device)")


def is_device_memory(owner: object) -> bool:
    """Whether ``owner`` is a GPU array (torch ``is_cuda``, the CUDA Array Interface)."""
    return getattr(owner, "is_cuda", False) is True \
        or hasattr(owner, "__cuda_array_interface__")


def transport_data_block(length: int) -> bytes:
    """Transport SGL Data Block: ``length`` bytes moved by C2HData or R2T/H2CData PDUs."""
    return struct.pack("<QI3xB", 0, length, 0x5A)


class TcpRegistration:
    """Memory over TCP needs no registration; this keeps the address for ``recv_into``."""

    lkey = 0
    rkey = 0

    def __init__(self, addr: int, length: int, owner: object) -> None:
        self.addr = addr
        self.length = length
        self.owner = owner
        self._memory: memoryview | None = None

    @property
    def memory(self) -> memoryview:
        """A writable byte view of the registered range."""
        if self._memory is None:
            self._memory = host_memory(self.addr, self.length)
        return self._memory

    def close(self) -> None:
        self._memory = None
        self.owner = None


def host_memory(addr: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes of host memory at ``addr``."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def data_view(data: DataRef) -> memoryview:
    """The bytes ``data`` names, as a writable memoryview (no copy)."""
    region = data.region
    view = region.view
    if view is None:
        registration = region.registration
        view = (registration.memory if isinstance(registration, TcpRegistration)
                else host_memory(region.addr, region.length))
    return view[data.offset:data.offset + data.length]


class Bulk(Spliced):
    """Write data sent by the receiver thread: spliced when ``splice``, otherwise copied."""

    __slots__ = ("splice",)

    def __init__(self, view: memoryview, splice: bool) -> None:
        super().__init__(view)
        self.splice = splice


class Stalled(Exception):
    """The receiver thread's socket send wait ran past its limit (SO_SNDTIMEO)."""


class ReceiverStopped(Exception):
    """The receiver thread ends: its queue failed or stopped (or trio's run is over)."""


def send_exactly(sock: socket.socket, splicer: Splicer | None, data: Bulk,
                 more: bool = False) -> None:
    """Receiver thread: send all of ``data`` into the (blocking) socket, spliced when it can be;
    ``more``: more follows at once (MSG_MORE).  Raises Stalled when the socket took nothing
    within the timeout, OSError on failure."""
    try:
        while len(data):
            if data.splice and splicer is not None:
                splicer.send(sock.fileno(), data, more)  # advances data.view
            else:
                data.view = data.view[sock.send(data.view, socket.MSG_MORE if more else 0):]
    except BlockingIOError:
        raise Stalled from None


def send_pdus(sock: socket.socket, splicer: Splicer | None, pdus: list[list]) -> None:
    """Receiver thread: send the buffers of ``pdus`` in order, bulk data by :func:`send_exactly`,
    each but the last with MSG_MORE: a PDU header leaves in one segment with the data behind
    it, not alone (TCP_NODELAY would push it at once).  Raises Stalled when the socket took
    nothing within the timeout, OSError on failure."""
    buffers = [data for pdu_buffers in pdus for data in pdu_buffers]
    last = len(buffers) - 1
    try:
        for i, data in enumerate(buffers):
            if type(data) is Bulk:
                send_exactly(sock, splicer, data, i < last)
            else:
                sock.sendall(data, socket.MSG_MORE if i < last else 0)
    except BlockingIOError:
        raise Stalled from None


def h2c_pdus(request: Request, header: pdu.Header, *, maxh2cdata: int, cpda: int,
             header_digest: bool, data_digest: bool, splice: bool) -> list[list]:
    """The H2CData PDUs (each a list of buffers) answering ``header``, an R2T for
    ``request``: pieces of at most MAXH2CDATA, bulk ones marked for a thread to send."""
    payload = request.buffer()
    splice = splice and not payload.readonly  # vmsplice needs writable memory
    pieces = pdu.h2c_pieces(header.offset, header.length, maxh2cdata)
    pdus = []
    for i, (at, length) in enumerate(pieces):
        piece = payload[at:at + length]
        buffers = [pdu.h2c_data_header(header.cid, header.ttag, at, length,
                                       last=i == len(pieces) - 1,
                                       header_digest=header_digest,
                                       data_digest=data_digest, cpda=cpda),
                   Bulk(piece, splice) if length >= BULK_BYTES else piece]
        if data_digest:
            buffers.append(pdu.digest(piece))
        pdus.append(buffers)
    return pdus


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class TcpTransport:
    """The TCP side of one controller: a connection per queue, nothing shared but options."""

    name = "tcp"

    def __init__(self, traddr: str, trsvcid: int = 4420, host_traddr: str | None = None,
                 connect_timeout: float = 10.0, *, header_digest: bool = False,
                 data_digest: bool = False, splice: bool = True) -> None:
        self.traddr = traddr
        self.splice = splice  # large write data by vmsplice/splice (see .splice)
        self.trsvcid = trsvcid
        self.host_traddr = host_traddr
        self.connect_timeout = connect_timeout
        self.header_digest = header_digest
        self.data_digest = data_digest
        self._queues: list[TcpQueue] = []

    @property
    def address(self) -> str:
        return f"tcp {self.traddr}:{self.trsvcid}"

    def register(self, addr: int, length: int, owner: object) -> TcpRegistration:
        """A trivial registration of host memory; GPU memory is refused by name."""
        if is_device_memory(owner):
            raise TransportError(f"cannot register GPU memory: {HOST_MEMORY_ONLY}")
        return TcpRegistration(addr, length, owner)

    def register_dmabuf(self, fd: int, offset: int, length: int, iova: int) -> TcpRegistration:
        """Refused: a socket cannot receive into a dma-buf (the caller stages instead)."""
        raise TransportError(f"cannot register the dma-buf: {HOST_MEMORY_ONLY}")

    async def _open(self, what: str) -> trio.socket.SocketType:
        where = f"{self.traddr}:{self.trsvcid}"
        sock = None
        try:
            with trio.fail_after(self.connect_timeout):
                infos = await trio.socket.getaddrinfo(self.traddr, self.trsvcid,
                                                      type=socket.SOCK_STREAM)
                family, kind, proto, _, addr = infos[0]
                sock = trio.socket.socket(family, kind, proto)
                if self.host_traddr:
                    await sock.bind((self.host_traddr, 0))
                await sock.connect(addr)
        except trio.TooSlowError:
            reason = f"timed out after {self.connect_timeout:g} s"
        except socket.gaierror as exc:
            reason = f"failed: cannot resolve the address ({exc.strerror})"
        except OSError as exc:
            if exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET):
                reason = "refused: is an NVMe/TCP port listening there?"
            elif self.host_traddr and exc.errno == errno.EADDRNOTAVAIL:
                reason = f"failed: --host-traddr {self.host_traddr} is not a local address"
            else:
                reason = f"failed: {exc.strerror or exc}"
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Close with a reset, dropping what is still queued (as Linux nvme_tcp_alloc_queue,
            # sock_no_linger): spliced H2CData in the send queue refers to the caller's pages,
            # which a failed command's caller gets back once the socket is closed.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return sock
        if sock is not None:
            sock.close()
        raise ConnectError(f"NVMe/TCP {what} connect to {where} {reason}")

    async def connect_queue(self, nursery: trio.Nursery, qid: int, size: int,
                            in_capsule_bytes: int = 0, cntlid: int = 0) -> TcpQueue:
        """Open queue ``qid``'s connection, exchange ICReq/ICResp, start its receive task."""
        what = "admin queue" if qid == 0 else f"I/O queue {qid}"
        sock = await self._open(what)
        try:
            resp = await self._initialize(sock, what)
        except BaseException:
            sock.close()
            raise
        if qid == 0:
            in_capsule_bytes = max(in_capsule_bytes, ADMIN_IN_CAPSULE_BYTES)
        queue = TcpQueue(self, sock, qid, size, in_capsule_bytes, resp)
        self._queues.append(queue)
        await nursery.start(queue.receive)
        return queue

    async def _initialize(self, sock, what: str) -> ICResp:
        where = f"{self.traddr}:{self.trsvcid}"
        buf = bytearray(pdu.IC_PDU_LENGTH)
        try:
            with trio.fail_after(self.connect_timeout):
                await sock.send(icreq_pdu(header_digest=self.header_digest,
                                          data_digest=self.data_digest))
                got = 0
                while got < len(buf):
                    n = await sock.recv_into(memoryview(buf)[got:])
                    if n == 0:
                        raise ConnectError(f"NVMe/TCP {what}: {where} closed the connection "
                                           "before its ICResp")
                    got += n
        except trio.TooSlowError:
            raise ConnectError(f"NVMe/TCP {what}: no ICResp from {where} within "
                               f"{self.connect_timeout:g} s") from None
        except OSError as exc:
            raise ConnectError(f"NVMe/TCP {what}: {where} failed during ICReq/ICResp: "
                               f"{exc.strerror or exc}") from None
        try:
            resp = parse_icresp(bytes(buf))
            pdu.check_icresp(resp, header_digest=self.header_digest,
                             data_digest=self.data_digest)
        except ValueError as exc:
            raise ConnectError(f"NVMe/TCP {what}: {where} answered with {exc}") from None
        return resp

    async def drop_queues(self) -> None:
        """Stop and close every queue (waiting commands fail with TransportError)."""
        queues, self._queues = self._queues, []
        for queue in reversed(queues):
            await queue.stop()
            queue.close()

    def close(self) -> None:
        for queue in reversed(self._queues):
            queue.close()
        self._queues.clear()


class Request:
    """One command in flight on a TCP queue.

    Its caller is parked on it (``task``), without a cancel scope, until the
    receive task finishes it or the queue's watchdog times it out.  ``unsent``
    counts its PDUs still queued for the socket: they read the caller's memory,
    so the caller is not let go while any is left.  Only the
    trio thread changes it; the receiver thread reads ``cid``, ``data``, ``view``
    and ``to_controller``, which never change while the command is in flight.
    """

    __slots__ = ("cid", "serial", "data", "view", "to_controller", "completion", "error",
                 "finished", "unsent", "task", "deadline", "timeout")

    def __init__(self, cid: int, data: DataRef | None, to_controller: bool,
                 serial: int = 0) -> None:
        self.cid = cid
        self.serial = serial
        """Which use of ``cid`` this is (per queue): the reader remembers answered commands
        by it, so that it holds no request, and with it no caller memory, once answered."""
        self.data = data
        self.view = data_view(data) if data is not None else None  # the caller's bytes
        self.to_controller = to_controller
        self.completion: Completion | None = None
        self.error: Exception | None = None
        self.finished = False
        """The caller may go on: answered with nothing left to send, or failed."""
        self.unsent = 0
        self.task = None  # the trio task parked on this request, if any
        self.deadline = math.inf
        self.timeout = 0.0

    def buffer(self) -> memoryview:
        assert self.view is not None
        return self.view


class TcpQueue:
    """One NVMe queue over one TCP connection.

    Three tasks per queue, all in :meth:`receive`: one reads small PDUs or waits
    for the receiver thread, which reads and parses every PDU and hands answered
    commands and R2Ts to the trio thread in batches (:meth:`_deliver`); a sender,
    which hands the PDUs queued during one trio batch to the kernel in one ``sendmsg``; a watchdog,
    which times out commands past their deadline.

    Bulk H2CData (:data:`BULK_BYTES`) is sent by the receiver thread, in blocking
    calls under the send lock, as it reads the R2T; the sender waits for it meanwhile
    (:data:`_LOCKED`).  No caller of a failed queue is let go while a thread still
    uses the socket (:meth:`_release_held`).
    """

    def __init__(self, transport: TcpTransport, sock, qid: int, size: int,
                 in_capsule_bytes: int, resp: ICResp) -> None:
        self.transport = transport
        # A plain socket in blocking mode, for the receiver thread (a whole payload in one
        # call, received or sent); the trio thread passes MSG_DONTWAIT: a send that
        # can go on at once does not yield to trio (two scheduler passes per command saved);
        # otherwise it waits on the fd.
        self.sock = socket.socket(fileno=sock.detach())
        self.sock.setblocking(True)
        self._mailbox = Mailbox(self._deliver)  # the threads' one way into trio
        self._threads = 0  # threads using the socket: it is closed once none is
        self._closed = False
        self.qid = qid
        self.size = size
        self.connect_cattr = CONNECT_DISABLE_SQFLOW if qid else 0
        """CATTR of this queue's fabrics Connect: an I/O queue disables SQ flow control (it
        never holds more than ``size - 1`` commands), so that the controller may end a
        successful read with its C2HData (SUCCESS flag): one PDU less per read."""
        self.in_capsule_bytes = in_capsule_bytes
        self.cpda = resp.cpda
        self.maxh2cdata = resp.maxh2cdata
        self.header_digest = resp.header_digest
        self.data_digest = resp.data_digest
        self._free = list(range(size - 1))  # an SQ of N entries holds N-1 commands
        self._pending: dict[int, Request] = {}
        self._slot_waiters = trio.lowlevel.ParkingLot()
        self._failed: TransportError | None = None
        self._receiver: trio.CancelScope | None = None
        self._received = trio.Event()
        self._outgoing: deque[list] = deque()
        """PDUs not yet (wholly) handed to the kernel: ``[buffers, request or None]``."""
        self._sender = None  # the sender task
        self._sender_idle = False  # parked, waiting for PDUs to send
        self._watchdog = Watchdog(lambda: self._pending.values(), self._expire)
        self._splice = transport.splice
        self._send_lock = threading.Lock()
        """Held by whichever thread puts PDUs into the socket, so that they never
        interleave: the trio thread (never waiting for it) and the receiver thread
        answering an R2T (waiting, bounded)."""
        self._trio_sending = False  # the trio thread holds _send_lock
        self._partial = False  # the head of _outgoing is partly with the kernel (lock kept)
        self._send_wanted = False  # the trio thread found _send_lock taken: wake the sender
        self._in_receiver = False  # the receiver thread runs (and answers R2Ts itself)
        self._receiver_splicer: Splicer | None = None  # the receiver thread's own pipe
        # The reader's own state (the receiver thread's while it runs, else the trio thread's):
        self._inbox: list = []  # (request, completion) and (request, R2T) pairs to hand over
        self._answered: dict[int, int] = {}  # by command ID: the serial last answered
        self._serial = 0  # of the last request made (Request.serial)
        self._progress: dict[int, tuple[Request, int]] = {}  # C2HData bytes of a read so far
        self._mid_payload: Request | None = None  # its data is being received (trio reads it)
        self._poll: select.poll | None = None  # set as the receiver thread first runs
        self._woke = False  # the receive loop let a caller go since it last yielded
        self._held: list[Request] = []  # failed, let go once no thread uses the socket
        self._rbuf = bytearray(RECV_BUFFER_BYTES)
        self._rview = memoryview(self._rbuf)
        self._rstart = self._rend = 0
        self._after_payload = False  # the last receive went straight into a payload

    @property
    def name(self) -> str:
        return "admin queue" if self.qid == 0 else f"I/O queue {self.qid}"

    @property
    def available(self) -> int:
        return len(self._free)

    # -- commands ---------------------------------------------------------------------------

    async def _allocate(self, timeout: float) -> int:
        if self._failed is None and not self._free:
            with trio.move_on_after(timeout):
                while not self._free and self._failed is None:
                    await self._slot_waiters.park()
        if self._failed is not None:
            raise for_caller(self._failed)
        if not self._free:
            raise CommandTimeout(f"{self.name} stayed full for {timeout:g} s")
        return self._free.pop()

    def _release(self, request: Request) -> None:
        if self._pending.get(request.cid) is request:
            del self._pending[request.cid]
            self._free.append(request.cid)
            if self._slot_waiters:
                self._slot_waiters.unpark()

    async def execute(self, sqe: bytearray, data: DataRef | None = None, *,
                      to_controller: bool = False, timeout: float) -> Completion:
        if self._failed is None and self._free:
            cid = self._free.pop()
        else:
            cid = await self._allocate(timeout)
        length = data.length if data is not None else 0
        self._serial += 1
        request = Request(cid, data if length else None, to_controller, self._serial)
        self._pending[cid] = request
        inline = to_controller and 0 < length <= self.in_capsule_bytes
        if inline:
            sqe[24:40] = in_capsule_data(0, length)
        elif length:
            sqe[24:40] = transport_data_block(length)
        else:
            sqe[24:40] = TRANSPORT_SGL
        set_command_id(sqe, cid)
        head = pdu.capsule_cmd_header(sqe, length if inline else 0,
                                      header_digest=self.header_digest,
                                      data_digest=self.data_digest, cpda=self.cpda)
        buffers = [head]
        if inline:
            payload = request.buffer()
            buffers.append(payload)
            if self.data_digest:
                buffers.append(pdu.digest(payload))
        # With others in flight, other callers likely submit in this trio batch too: the
        # sender hands them to the kernel together, in one sendmsg.
        self._submit(buffers, request, batch=len(self._pending) > 1)
        if not request.finished:
            await self._watchdog.park(request, timeout)
        if request.error is not None:
            raise for_caller(request.error)
        return request.completion  # type: ignore[return-value]

    # -- sending ------------------------------------------------------------------------------

    def _submit(self, buffers: list, request: Request | None, *, batch: bool) -> None:
        """Queue one PDU (a list of buffers) for the socket; PDUs never interleave.

        Sent at once when nothing else is queued and ``batch`` is false; otherwise
        by the sender task, with whatever else was queued meanwhile.
        """
        if self._failed is not None:
            if request is not None and not request.finished:
                request.error = self._failed
                self._let_go(request)
            return
        if request is not None:
            request.unsent += 1
        out = self._outgoing
        out.append([buffers, request])
        if len(out) > 1 or (batch and self._sender is not None):
            self._wake_sender()
            return
        try:
            if self._flush() is not _SENT:
                self._wake_sender()  # the rest when the socket takes more
        except OSError as exc:
            self._fail(self._send_error(exc))

    def _wake_sender(self) -> None:
        if self._sender_idle:
            self._sender_idle = False
            trio.lowlevel.reschedule(self._sender)

    def _flush(self) -> int:
        """Hand the kernel as much of the queued PDUs as it takes now: _SENT or _BLOCKED;
        _LOCKED when the receiver thread is sending (it wakes the sender once done).  The
        send lock stays with the trio thread while a PDU of its is half sent."""
        if not self._outgoing:
            return _SENT
        if not self._trio_sending:
            self._send_wanted = True  # before trying: a thread releasing looks at it after
            if not self._send_lock.acquire(False):
                return _LOCKED
            self._send_wanted = False
            self._trio_sending = True
        try:
            got = self._flush_locked()
        except BaseException:
            self._drop_send_lock()
            raise
        if not self._partial:
            self._drop_send_lock()
        return got

    def _drop_send_lock(self) -> None:
        """The trio thread lets other threads send (nothing of its is half sent)."""
        if self._trio_sending:
            self._trio_sending = False
            self._send_lock.release()

    def _flush_locked(self) -> int:
        out = self._outgoing
        sock = self.sock
        while out:
            iov: list = []
            for entry in out:
                iov.extend(entry[0])
                if len(iov) >= MAX_IOV:
                    break
            try:
                sent = sock.sendmsg(iov, (), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return _BLOCKED
            while sent:
                buffers = out[0][0]
                first = buffers[0]
                if sent < len(first):
                    buffers[0] = memoryview(first)[sent:]
                    self._partial = True
                    break
                sent -= len(first)
                self._sent_head()
        return _SENT

    def _sent_head(self) -> None:
        """The first queued buffer is wholly with the kernel: drop it (and its PDU if done)."""
        out = self._outgoing
        entry = out[0]
        buffers = entry[0]
        del buffers[0]
        self._partial = bool(buffers)
        if not buffers:
            out.popleft()
            request = entry[1]
            if request is not None:
                request.unsent -= 1
                if not request.unsent and request.completion is not None:
                    self._finish(request, request.completion)

    async def _send_queued(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The sender: hands queued PDUs to the kernel, waiting while the socket is full."""
        self._sender = trio.lowlevel.current_task()
        task_status.started()
        try:
            while True:
                if not self._outgoing or self._failed is not None:
                    self._sender_idle = True
                    await trio.lowlevel.wait_task_rescheduled(cancellable)
                    continue
                try:
                    got = self._flush()
                    if got is _BLOCKED:
                        await trio.lowlevel.wait_writable(self.sock)
                    elif got is _LOCKED:  # woken when the other thread is done (_deliver)
                        self._sender_idle = True
                        await trio.lowlevel.wait_task_rescheduled(cancellable)
                except OSError as exc:
                    if self._failed is None:
                        self._fail(self._send_error(exc))
                except trio.ClosedResourceError:
                    pass  # failed and closed meanwhile: nothing more to send
        finally:
            self._sender = None
            self._sender_idle = False

    def _send_error(self, exc: OSError) -> TransportError:
        return TransportError(f"{self.name}: sending to "
                              f"{self.transport.traddr}:{self.transport.trsvcid} "
                              f"failed: {exc.strerror or exc}")

    # -- receiving ------------------------------------------------------------------------------

    async def receive(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read and dispatch PDUs until the connection fails or the queue stops.

        Small PDUs are read by this task, large ones by the receiver thread it waits for
        (:meth:`_receive`); it also runs the queue's sender and command watchdog.
        """
        try:
            with trio.CancelScope() as self._receiver:
                async with trio.open_nursery() as nursery:
                    await nursery.start(self._watchdog.run)
                    await nursery.start(self._send_queued)
                    nursery.start_soon(self._stop_receiver_when_cancelled)
                    task_status.started()
                    try:
                        await self._receive()
                    except pdu.PduError as exc:
                        self._fail(TransportError(f"{self.name}: {exc}"))
                    except TransportError as exc:
                        self._fail(exc)
                    except OSError as exc:
                        self._fail(TransportError(f"{self.name}: receiving from "
                                                  f"{self.transport.traddr}:"
                                                  f"{self.transport.trsvcid} failed: "
                                                  f"{exc.strerror or exc}"))
                    except trio.ClosedResourceError:
                        self._fail(TransportError(f"{self.name} is closed"))
                    finally:
                        if self._failed is None:
                            self._fail(TransportError(f"{self.name}: stopped"))
                        nursery.cancel_scope.cancel()
        finally:
            self._received.set()

    async def _stop_receiver_when_cancelled(self) -> None:
        """The receiver thread cannot see a cancellation: fail the queue, which ends it."""
        try:
            await trio.sleep_forever()
        finally:
            if self._failed is None:
                self._fail(TransportError(f"{self.name}: stopped"))

    async def _receive(self) -> None:
        """Small PDUs are read and handled on the trio thread, each whole from the receive
        buffer; from a PDU larger than :data:`BULK_BYTES` on, the receiver thread reads
        until the stream goes quiet or carries small PDUs only."""
        hdgst = self.header_digest
        while True:
            if self._rend - self._rstart < 8 and self._woke:
                # Let the callers just let go run (and submit more) before reading on.
                self._woke = False
                await trio.lowlevel.checkpoint()
            await self._fill_async(8)
            pdu_type, _, hlen, _, plen = pdu.peek_common(self._rview, self._rstart)
            size = pdu.header_bytes(pdu_type, hlen, header_digest=hdgst)
            whole = max(plen, size)
            if self._rend - self._rstart < whole:
                if whole > BULK_BYTES:
                    await self._run_receiver()
                    continue
                # Check the header before waiting for the rest: a PLEN that lies would be
                # waited for (a read ending with its C2HData has nothing behind it).
                await self._fill_async(size)
                pdu.parse_header(self._rview, self._rstart, header_digest=hdgst,
                                 data_digest=self.data_digest)
                await self._fill_async(whole)
            if pdu_type == pdu.R2T and self._asks_bulk():
                await self._run_receiver()  # it answers the R2T itself, and reads on
                continue
            self._one_pdu()  # all of it is buffered: no socket read on the trio thread
            if self._inbox:
                batch, self._inbox = self._inbox, []
                self._deliver(batch)
                del batch  # held here, it would keep the callers' memory until the next one

    async def _fill_async(self, count: int) -> None:
        """Have at least ``count`` bytes in the receive buffer (trio thread)."""
        if self._rend - self._rstart >= count:
            return
        self._compact()
        while self._rend < count:
            try:
                n = self.sock.recv_into(self._rview[self._rend:max(self._rend + RECV_BYTES,
                                                                   count)],
                                        0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                self._woke = False  # the callers let go have run meanwhile
                if self._closed:  # failed meanwhile (a shut-down socket still reads)
                    raise trio.ClosedResourceError from None
                continue
            except OSError:
                if self._closed:
                    raise trio.ClosedResourceError from None
                raise
            if n == 0:
                raise self._closed_by_peer()
            self._rend += n

    def _asks_bulk(self) -> bool:
        """Whether the R2T at the head of the buffer asks for bulk data (its R2TL; the
        header is checked when it is handled)."""
        return pdu.peek_data_length(self._rview, self._rstart) >= BULK_BYTES

    def _compact(self) -> None:
        if self._rstart:
            kept = self._rend - self._rstart
            self._rview[:kept] = self._rview[self._rstart:self._rend]
            self._rstart, self._rend = 0, kept

    async def _run_receiver(self) -> None:
        """Run the receiver thread until it hands the reading back (or the queue fails)."""
        if self._failed is not None:
            raise trio.ClosedResourceError
        if self._poll is None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 _timeval(RECEIVE_POLL))
            # it may send H2CData too: bound its waits there (the trio thread never waits)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(STALL_TIMEOUT))
            self._poll = select.poll()
            self._poll.register(self.sock.fileno(), select.POLLIN)
        self._threads += 1
        try:
            # Not abandoned on cancellation: the thread writes into the callers' memory.
            # _stop_receiver_when_cancelled ends it instead (within RECEIVE_POLL at worst).
            # What it read last was handed over before its end (_receive_loop).
            await self._mailbox.run_in_thread(self._receive_loop)
        except ReceiverStopped:
            raise trio.ClosedResourceError from None
        finally:
            self._thread_done()

    async def stop(self) -> None:
        """End the receive task (waiting callers fail); then close() is safe."""
        if self._receiver is None:
            return
        self._fail(TransportError(f"{self.name}: stopped"))  # ends the receiver thread's wait
        self._receiver.cancel()
        with trio.move_on_after(STOP_TIMEOUT):
            await self._received.wait()

    # -- the receiver thread --------------------------------------------------------------------
    # From here up to _deliver: the receiver thread's loop, and the PDU handling it shares with
    # the trio thread (which calls _one_pdu only with the whole PDU buffered, so it never
    # reads the socket there).  The thread reads blocking, each wait bounded by SO_RCVTIMEO,
    # receives C2HData payloads straight into the callers' memory, and hands what the trio
    # thread must act on over in batches through the mailbox, before each receive: pairs of
    # (request, completion) and (request, R2T); it changes no request.  No caller of a
    # failed queue is let go while the thread runs (_release_held), so it never writes into
    # memory given back.

    def _receive_loop(self) -> None:
        """Read PDUs until the stream stays quiet for QUIET_SECONDS at a PDU boundary or
        carries SMALL_STREAK small PDUs in a row; then the trio thread reads on."""
        self._in_receiver = True
        try:
            small = 0
            while small < SMALL_STREAK:
                if self._rend - self._rstart < 8 and not self._more_within(QUIET_SECONDS):
                    return
                small = 0 if self._one_pdu() > BULK_BYTES else small + 1
        finally:
            self._in_receiver = False
            if self._inbox:  # what it read last, ahead of its end (or error)
                try:
                    self._post()
                except ReceiverStopped:
                    pass  # trio's run is over: no one to tell

    def _more_within(self, seconds: float) -> bool:
        """Whether bytes arrive within ``seconds`` (what waits for trio is handed over)."""
        if self._inbox:
            self._post()
        return bool(self._poll.poll(seconds * 1000))

    def _one_pdu(self) -> int:
        """Read and handle one PDU (either thread); its length (an R2T's: the data it
        asks for)."""
        hdgst = self.header_digest
        self._fill(8)
        pdu_type, _, hlen, _, plen = pdu.peek_common(self._rview, self._rstart)
        size = pdu.header_bytes(pdu_type, hlen, header_digest=hdgst)
        self._fill(size)
        header = pdu.parse_header(self._rview, self._rstart, header_digest=hdgst,
                                  data_digest=self.data_digest)
        self._rstart += size
        if header.type == pdu.CAPSULE_RESP:
            self._response(header.completion)
        elif header.type == pdu.C2H_DATA:
            self._c2h_data(header, size)
        elif header.type == pdu.R2T:
            self._r2t(header)
            return header.length
        else:  # C2HTermReq
            raise TransportError(f"{self.name}: the controller ended the connection "
                                 f"with a C2HTermReq ({pdu.term_reason(header.length)})")
        return plen

    def _post(self) -> None:
        """Hand the answered commands and R2Ts read so far to the trio thread."""
        batch, self._inbox = self._inbox, []
        try:
            self._mailbox.post(batch)
        except trio.RunFinishedError:
            raise ReceiverStopped from None

    def _fill(self, count: int) -> None:
        """Have at least ``count`` bytes in the receive buffer."""
        if self._rend - self._rstart >= count:
            return
        self._compact()
        # Right after a payload received in place, more large ones likely follow: ask for
        # about the PDU headers between them, so that little payload is copied twice.
        ask = AFTER_PAYLOAD_BYTES if self._after_payload else RECV_BYTES
        self._after_payload = False
        while self._rend < count:
            self._rend += self._recv_into(self._rview[self._rend:max(self._rend + ask, count)])

    def _recv_into(self, dest: memoryview, flags: int = 0) -> int:
        """Receive at least one byte into ``dest``, first handing over what waits for the
        trio thread (the receive may block).  ReceiverStopped once the queue failed."""
        while True:
            if self._inbox:
                self._post()
            try:
                n = self.sock.recv_into(dest, 0, flags)
            except BlockingIOError:  # SO_RCVTIMEO passed without a byte: look again
                if self._closed:
                    raise ReceiverStopped from None
                continue
            except OSError:
                if self._closed:
                    raise ReceiverStopped from None
                raise
            if n == 0:
                if self._closed:  # shut down by _fail
                    raise ReceiverStopped
                raise self._closed_by_peer()
            return n

    def _closed_by_peer(self) -> TransportError:
        return TransportError(f"{self.name}: {self.transport.traddr}:"
                              f"{self.transport.trsvcid} closed the connection")

    def _take_buffered(self, dest: memoryview) -> int:
        """Copy the buffered bytes that begin ``dest``; how many."""
        have = min(self._rend - self._rstart, len(dest))
        if have:
            dest[:have] = self._rview[self._rstart:self._rstart + have]
            self._rstart += have
        return have

    def _read_into(self, dest: memoryview, have: int = 0) -> None:
        """Fill ``dest`` (its first ``have`` bytes are there) from the stream: a large rest
        is received in place (in one call, MSG_WAITALL), a small one through the buffer."""
        want = len(dest)
        while have < want:
            rest = want - have
            if rest < DIRECT_RECV_BYTES:
                self._fill(rest)
                dest[have:] = self._rview[self._rstart:self._rstart + rest]
                self._rstart += rest
                return
            have += self._recv_into(dest[have:], socket.MSG_WAITALL)
            self._after_payload = True

    def _skip(self, count: int) -> bytes:
        self._fill(count)
        at = self._rstart
        self._rstart += count
        return bytes(self._rview[at:at + count])

    def _lookup(self, cid: int, what: str) -> Request:
        """The request in flight under ``cid``: sent, not answered yet (as far as the
        reader knows; the trio thread releases it only once the answer is handed over)."""
        request = self._pending.get(cid)
        if request is None or self._answered.get(cid) == request.serial:
            raise TransportError(f"{self.name}: {what} for command ID {cid}, "
                                 "which is not in flight")
        return request

    def _answer(self, request: Request, completion: Completion) -> None:
        self._answered[request.cid] = request.serial
        self._progress.pop(request.cid, None)
        self._inbox.append((request, completion))

    def _response(self, completion: Completion) -> None:
        cid = completion.command_id
        request = self._pending.get(cid)
        if request is not None and self._answered.get(cid) == request.serial:
            raise TransportError(f"{self.name}: second response for command ID {cid}")
        self._answer(self._lookup(cid, "CapsuleResp"), completion)

    def _c2h_data(self, header: pdu.Header, header_size: int) -> None:
        request = self._lookup(header.cid, "C2HData")
        if request.data is None or request.to_controller:
            raise TransportError(f"{self.name}: C2HData for command {header.cid}, "
                                 "which reads no data")
        end = header.offset + header.length
        if end > request.data.length:
            raise TransportError(f"{self.name}: C2HData for command {header.cid} at "
                                 f"{header.offset}+{header.length} runs past its "
                                 f"{request.data.length}-byte buffer")
        so_far = self._progress.get(header.cid)
        expected = so_far[1] if so_far and so_far[0] is request else 0
        if header.offset != expected:  # in order, as Linux receives it: no holes, no overlaps
            raise TransportError(f"{self.name}: C2HData for command {header.cid} at offset "
                                 f"{header.offset}, expected {expected}")
        if header.pdo > header_size:
            self._skip(header.pdo - header_size)
        dest = request.buffer()[header.offset:end]
        have = self._take_buffered(dest)
        self._mid_payload = request  # its data is mid-PDU: a timeout now fails the queue
        try:
            self._read_into(dest, have)
        finally:
            self._mid_payload = None
        if header.data_digest:
            want = pdu.digest(dest)
            got = self._skip(pdu.DIGEST_BYTES)
            if got != want:
                raise TransportError(f"{self.name}: data digest mismatch on C2HData for "
                                     f"command {header.cid} (got {got.hex()}, computed "
                                     f"{want.hex()})")
        received = header.length + expected
        if header.flags & pdu.FLAG_SUCCESS:
            if received != request.data.length:
                raise TransportError(f"{self.name}: C2HData for command {header.cid} "
                                     f"claims success after {received} of "
                                     f"{request.data.length} bytes")
            self._answer(request, Completion(0, 0, self.qid, header.cid, 0, False))
        else:
            self._progress[header.cid] = (request, received)

    def _r2t(self, header: pdu.Header) -> None:
        request = self._lookup(header.cid, "R2T")
        if request.data is None or not request.to_controller:
            raise TransportError(f"{self.name}: R2T for command {header.cid}, "
                                 "which writes no data")
        end = header.offset + header.length
        if end > request.data.length:
            raise TransportError(f"{self.name}: R2T for command {header.cid} asks for "
                                 f"{header.offset}+{header.length}, past its "
                                 f"{request.data.length} bytes")
        if self._in_receiver:
            self._answer_r2t(request, header)
        else:
            self._inbox.append((request, header))

    def _answer_r2t(self, request: Request, header: pdu.Header) -> None:
        """Receiver thread: send the data an R2T asks for at once, from this thread (no
        hand-off to the trio thread and on to another thread); the target waits for it.
        The command's answer can only come after it, so its caller is never let go while
        the data is being sent; a failed queue holds its callers until this thread ends."""
        if self._inbox:
            self._post()  # the callers answered so far go on meanwhile
        pdus = self._h2c_pdus(request, header)
        splicer = self._receiver_splicer
        if splicer is None and any(type(b) is Bulk and b.splice for b in pdus[0]):
            splicer = self._receiver_splicer = open_splicer()
        try:
            self._send_in_thread(splicer, pdus)
        except Stalled:
            raise TransportError(f"{self.name}: sending H2CData for command {header.cid} to "
                                 f"{self.transport.traddr}:{self.transport.trsvcid}: the "
                                 f"socket took no data within {STALL_TIMEOUT:g} s"
                                 ) from None
        except OSError as exc:
            if self._closed:
                raise ReceiverStopped from None
            raise self._send_error(exc) from None

    def _send_in_thread(self, splicer: Splicer | None, pdus: list[list]) -> None:
        """The receiver thread: send ``pdus`` under the send lock, waiting for it
        (each wait bounded, ending once the queue is closed).  Raises Stalled, OSError."""
        lock = self._send_lock
        while not lock.acquire(timeout=RECEIVE_POLL):
            if self._closed:
                raise OSError(errno.EPIPE, "the queue is closed")
        try:
            if self._closed:
                raise OSError(errno.EPIPE, "the queue is closed")
            send_pdus(self.sock, splicer, pdus)
        finally:
            lock.release()
            if self._send_wanted:  # the trio thread's sender waits for the lock
                try:
                    self._mailbox.post([(None, None)])
                except trio.RunFinishedError:
                    pass  # no one waits any more

    # -- back on the trio thread ----------------------------------------------------------------

    def _deliver(self, batch: list) -> None:
        """The reader's pairs: let answered callers go, answer R2Ts.  (Also a callback of
        trio's: an error here would end the whole run, so it fails the queue instead.)"""
        try:
            for request, what in batch:
                if request is None:  # a thread let go of the send lock the sender wants
                    self._wake_sender()
                    continue
                if self._pending.get(request.cid) is not request:
                    continue  # the queue failed meanwhile: its callers are held, then let go
                if type(what) is Completion:
                    self._finish(request, what)
                else:
                    self._send_h2c(request, what)
        except Exception as exc:  # noqa: BLE001 - the queue's error, for its callers
            self._fail(TransportError(f"{self.name}: {exc}"))

    def _finish(self, request: Request, completion: Completion) -> None:
        """``request`` is answered: let its caller go once nothing of it is left to send."""
        request.completion = completion
        if request.unsent:
            return  # the sender finishes it when its last PDU left (it reads the caller's data)
        self._release(request)
        self._let_go(request)

    def _let_go(self, request: Request) -> None:
        request.finished = True
        request.view = None  # the caller's memory is the caller's again
        self._woke = True
        task = request.task
        if task is not None:
            request.task = None
            trio.lowlevel.reschedule(task)

    def _h2c_pdus(self, request: Request, header: pdu.Header) -> list[list]:
        return h2c_pdus(request, header, maxh2cdata=self.maxh2cdata, cpda=self.cpda,
                        header_digest=self.header_digest, data_digest=self.data_digest,
                        splice=self._splice)

    def _send_h2c(self, request: Request, header: pdu.Header) -> None:
        """Answer an R2T (read by the trio thread): the asked-for data in H2CData PDUs."""
        for buffers in self._h2c_pdus(request, header):
            if self._failed is not None:  # a piece could not be sent: the queue holds the caller
                return
            # At once when nothing else waits: the target waits for this data.
            self._submit(buffers, request, batch=False)

    # -- timeouts -------------------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        self._mailbox.drain()  # an answer handed over but not yet handled is no timeout
        for request in list(self._pending.values()):
            if request.task is None or request.deadline > now:
                continue
            if request.unsent:
                # Its PDUs still wait for the socket and read the caller's memory: the
                # connection is stuck, and only closing it lets the caller go safely.
                self._fail(TransportError(f"{self.name}: command {request.cid} could not be "
                                          f"sent within {request.timeout:g} s"))
                return
            if request is self._mid_payload:  # stuck mid-PDU
                self._fail(TransportError(f"{self.name}: command {request.cid}'s data did "
                                          f"not all arrive within {request.timeout:g} s"))
                return
            # The target may still send its data or an R2T: close the connection before
            # its caller gets its memory back (Linux: nvme_tcp_timeout, error recovery).
            request.error = timeout_error(request, self.name, " (its connection is closed)")
            self._fail(closed_for_timeout(request, self.name))
            return

    # -- failure and teardown -------------------------------------------------------------------

    def _fail(self, error: TransportError) -> None:
        if self._failed is None:
            self._failed = error.with_traceback(None)  # the reader's frames hold requests
        self._outgoing.clear()  # nothing more is sent on this connection
        self._partial = False
        self._drop_send_lock()  # (a thread waiting for it sees the queue closed)
        pending, self._pending = self._pending, {}
        for request in pending.values():
            if request.error is None:  # (a timed-out one has its own)
                request.error = self._failed
            request.unsent = 0
        self._held.extend(pending.values())
        self._free = []
        self._slot_waiters.unpark_all()
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self.sock)  # wakes a task waiting on it
            if self._threads:
                # The receiver thread still uses the fd: end its call now, close when it is done
                # (closing under it could hand its number to another file meanwhile).
                try:
                    self.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            else:
                self._close_socket()
        self._release_held()

    def _release_held(self) -> None:
        """Let the callers of a failed queue go, once no thread can touch their memory."""
        if self._threads:
            return
        held, self._held = self._held, []
        for request in held:
            if not request.finished:
                self._let_go(request)  # its error was set when the queue failed

    def _thread_done(self) -> None:
        """A thread using the socket ended: the last one of a failed queue closes it."""
        self._threads -= 1
        if self._failed is not None and not self._threads:
            self._close_socket()
            self._release_held()

    def _close_socket(self) -> None:
        self.sock.close()
        if self._receiver_splicer is not None:
            self._receiver_splicer.close()
            self._receiver_splicer = None

    def close(self) -> None:
        if self._failed is None:
            self._failed = TransportError(f"{self.name} is closed")
        if self._receiver is not None:
            self._receiver.cancel()
        self._fail(self._failed)


def probe(host: str, port: int, timeout: float = 10.0) -> ICResp:
    """Open a TCP connection, send an ICReq and return the target's ICResp."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(icreq_pdu())
            reply = b""
            while len(reply) < pdu.IC_PDU_LENGTH:
                chunk = sock.recv(pdu.IC_PDU_LENGTH - len(reply))
                if not chunk:
                    raise ConnectError(f"{host}:{port} closed the connection before its ICResp")
                reply += chunk
    except OSError as exc:
        raise ConnectError(f"NVMe/TCP probe of {host}:{port} failed: {exc}") from exc
    try:
        return parse_icresp(reply)
    except ValueError as exc:
        raise ConnectError(f"{host}:{port} answered with {exc}") from None


def main(argv: list[str] | None = None) -> int:
    """``python -m nvmeof_fuse.transport.tcp HOST PORT``: print the ICResp or the error."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m nvmeof_fuse.transport.tcp HOST PORT", file=sys.stderr)
        return 2
    try:
        resp = probe(args[0], int(args[1]))
    except (ConnectError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"ICResp from {args[0]}:{args[1]}: pfv={resp.pfv} cpda={resp.cpda} "
          f"maxh2cdata={resp.maxh2cdata}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
