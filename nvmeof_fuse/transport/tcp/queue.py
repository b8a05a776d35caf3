"""One NVMe queue over one TCP connection: commands out, answers in, many in flight.

Capsules go out from the trio thread: a command alone at once, others in flight with it
by a sender task, in one ``sendmsg`` per trio batch.  A write's data rides in the capsule
up to the in-capsule limit; otherwise it answers the controller's R2Ts in H2CData PDUs
(:mod:`.data`), sent by the receiver thread the moment it reads a bulk R2T.  A
per-socket send lock keeps PDUs from interleaving; the trio thread never waits for it.

What comes in is read by the queue's :class:`~.reader.PduReader`: small PDUs on the
trio thread, large ones (and the stream after them) by the queue's receiver thread, whose
answers reach trio in batches through the queue's :class:`~..mailbox.Mailbox`, the one
bridge from its threads into trio.  Only the trio thread changes a command's state.

Anything that breaks the protocol (a bad digest, a length that disagrees with its header,
an unknown PDU type, data for a command not in flight) fails every command of the queue
with :class:`TransportError` and closes the connection, which makes the controller
reconnect.  So does a command timeout, as in Linux (``nvme_tcp_timeout`` stops the queue
before the request completes): the target may still send C2HData or an R2T for the
command, so its caller gets its memory back only once the connection is closed, never
while a late PDU could land in it or read it.
"""

from __future__ import annotations

import errno
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from ...errors import CommandTimeout, TransportError
from ...nvme import Completion, set_command_id
from ...nvme import tcp_pdu as pdu
from ...nvme.command import CONNECT_DISABLE_SQFLOW
from ...nvme.sgl import in_capsule_data
from ...nvme.tcp_pdu import ICResp
from ..cids import CommandIds
from ..mailbox import Mailbox
from ..parking import Watchdog, closed_for_timeout, for_caller, timeout_error, unsent
from ..region import DataRef
from .data import BULK_BYTES, Bulk, Stalled, h2c_pdus, send_pdus, transport_data_block
from .reader import PduReader, ReceiverStopped
from .request import Request
from .splice import Splicer, open_splicer
from .tls_records import UserspaceRecords, kernel_record


class Peer(Protocol):
    """What a queue needs of its transport (:class:`~.transport.TcpTransport`)."""

    traddr: str
    trsvcid: int
    splice: bool

_SENT, _BLOCKED, _LOCKED = range(3)  # what TcpQueue._flush got to

MAX_IOV = 512  # buffers per sendmsg (the kernel's IOV_MAX is 1024)
STOP_TIMEOUT = 5.0
STALL_TIMEOUT = 30.0
"""The receiver thread's longest wait to send H2CData (SO_SNDTIMEO); a command's own deadline,
when sooner, fails its queue first (the watchdog)."""
RECEIVE_POLL = 1.0
"""The receiver thread's longest socket wait (SO_RCVTIMEO) before it looks whether its queue
was closed (a shutdown of the socket ends the wait at once)."""
TRANSPORT_SGL = struct.pack("<QI3xB", 0, 0, 0x5A)
"""Transport SGL Data Block (type 5, subtype 0xA), length 0: no data, as Linux nvme-tcp."""


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


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

    def __init__(self, transport: Peer, sock, qid: int, size: int,
                 in_capsule_bytes: int, resp: ICResp, *, records: UserspaceRecords | None = None,
                 kernel_tls: bool = False) -> None:
        self.transport = transport
        self._records = records  # the userspace TLS record layer behind ``sock``, if any
        self._kernel_tls = kernel_tls  # the kernel seals and opens this socket's records
        # A plain socket in blocking mode, for the receiver thread (a whole payload in one
        # call, received or sent); the trio thread passes MSG_DONTWAIT: a send that
        # can go on at once does not yield to trio (two scheduler passes per command saved);
        # otherwise it waits on the fd.
        self.sock = socket.socket(fileno=sock.detach())
        self.sock.setblocking(True)
        self._mailbox = Mailbox(self._deliver)  # the threads' one way into trio
        self._threads = 0  # threads using the socket: it is closed once none is
        self.closed = False
        """The queue failed or stopped: its socket is closed, or shut down while a thread
        still uses it."""
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
        self._ids = CommandIds(size - 1)  # an SQ of N entries holds N-1 commands
        self._free = self._ids.free  # its free slots (the hot path reads them)
        self._pending: dict[int, Request] = {}
        self._slot_waiters = trio.lowlevel.ParkingLot()
        self._slot_wanted = 0  # callers waiting for a slot, parked or woken and not yet run
        self._failed: TransportError | None = None
        self._receiver: trio.CancelScope | None = None
        self._received = trio.Event()
        self._outgoing: deque[list] = deque()
        """PDUs not yet (wholly) handed to the kernel: ``[buffers, request or None]``."""
        self._sender = None  # the sender task
        self._sender_idle = False  # parked, waiting for PDUs to send
        self._watchdog = Watchdog(
            lambda: (r for r in self._pending.values() if r.task is not None or r.done is not None),
            self._expire)
        self._splice = transport.splice
        self._send_lock = threading.Lock()
        """Held by whichever thread puts PDUs into the socket, so that they never
        interleave: the trio thread (never waiting for it) and the receiver thread
        answering an R2T (waiting, bounded)."""
        self._trio_sending = False  # the trio thread holds _send_lock
        self._partial = False  # the head of _outgoing is partly with the kernel (lock kept)
        self._send_wanted = False  # the trio thread found _send_lock taken: wake the sender
        self._receiver_splicer: Splicer | None = None  # the receiver thread's own pipe
        self._thread_waits_bounded = False  # the socket's SO_RCVTIMEO and SO_SNDTIMEO are set
        self._serial = 0  # of the last request made (Request.serial)
        self._woke = False  # the receive loop let a caller go since it last yielded
        self._held: list[Request] = []  # failed, let go once no thread uses the socket
        self.reader = PduReader(self.sock, self, self._pending,
                                header_digest=self.header_digest, data_digest=self.data_digest)
        """The incoming stream (the receiver thread's while it runs, else the trio thread's)."""

    @property
    def name(self) -> str:
        return "admin queue" if self.qid == 0 else f"I/O queue {self.qid}"

    @property
    def available(self) -> int:
        return len(self._free)

    # -- commands ---------------------------------------------------------------------------

    async def _allocate(self, timeout: float) -> int:
        if self._failed is None and not self._free:
            self._slot_wanted += 1  # start() leaves freed slots to us meanwhile
            try:
                with trio.move_on_after(timeout):
                    while not self._free and self._failed is None:
                        await self._slot_waiters.park()
            finally:
                self._slot_wanted -= 1
        if self._failed is not None:
            raise unsent(self._failed)
        if not self._free:
            raise CommandTimeout(f"{self.name} stayed full for {timeout:g} s")
        return self._ids.take()

    def _release(self, request: Request) -> None:
        if self._pending.get(request.cid) is request:
            del self._pending[request.cid]
            self._ids.give_back(request.cid)
            if self._slot_waiters:
                self._slot_waiters.unpark()

    def start(self, sqe: bytearray, data: DataRef | None, done: Callable[[Request], None], *,
              to_controller: bool = False, timeout: float) -> bool:
        """Send ``sqe`` without waiting for it: ``done(request)`` is called once it finished
        (``request.completion``, or ``request.error``), by the trio thread, never before
        this returns; it must not raise.  False, with nothing sent, when the queue failed or
        no slot is free for it (callers waiting for one go first)."""
        if (self._failed is not None or not self._free or self._slot_wanted
                or self._sender is None):
            return False
        request = self._send_command(self._ids.take(), sqe, data, to_controller, batch=True)
        request.done = done
        self._watchdog.watch(request, timeout)
        return True

    async def execute(self, sqe: bytearray, data: DataRef | None = None, *,
                      to_controller: bool = False, timeout: float) -> Completion:
        if self._failed is None and self._free:
            cid = self._ids.take()
        else:
            cid = await self._allocate(timeout)
        # With others in flight, other callers likely submit in this trio batch too: the
        # sender hands them to the kernel together, in one sendmsg.
        request = self._send_command(cid, sqe, data, to_controller,
                                     batch=len(self._pending) > 0)
        if not request.finished:
            await self._watchdog.park(request, timeout)
        if request.error is not None:
            raise for_caller(request.error)
        return request.completion  # type: ignore[return-value]

    def _send_command(self, cid: int, sqe: bytearray, data: DataRef | None,
                      to_controller: bool, *, batch: bool) -> Request:
        """The request for ``sqe`` on command ID ``cid``, its capsule queued for the socket
        (sent at once unless ``batch``: see :meth:`_submit`)."""
        length = data.length if data is not None else 0
        self._serial += 1
        inline = to_controller and 0 < length <= self.in_capsule_bytes
        request = Request(cid, data if length else None, to_controller, self._serial, inline)
        self._pending[cid] = request
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
        self._submit(buffers, request, batch=batch)
        return request

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

    def _sender_cancelled(self, _raise_cancel) -> trio.lowlevel.Abort:
        """The idle sender is cancelled: it is already due to run (with Cancelled), so
        nobody may wake it again; PDUs submitted meanwhile are sent by their callers."""
        self._sender = None
        self._sender_idle = False
        return trio.lowlevel.Abort.SUCCEEDED

    async def _send_queued(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The sender: hands queued PDUs to the kernel, waiting while the socket is full."""
        self._sender = trio.lowlevel.current_task()
        task_status.started()
        try:
            while True:
                if not self._outgoing or self._failed is not None:
                    self._sender_idle = True
                    await trio.lowlevel.wait_task_rescheduled(self._sender_cancelled)
                    continue
                try:
                    got = self._flush()
                    if got is _BLOCKED:
                        await trio.lowlevel.wait_writable(self.sock)
                    elif got is _LOCKED:  # woken when the other thread is done (_deliver)
                        self._sender_idle = True
                        await trio.lowlevel.wait_task_rescheduled(self._sender_cancelled)
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
                        self._fail(self._receive_error(exc))
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
        reader = self.reader
        while True:
            if reader.buffered() < 8 and self._woke:
                # Let the callers just let go run (and submit more) before reading on.
                self._woke = False
                await trio.lowlevel.checkpoint()
            await self._fill(8)
            pdu_type, size, whole = reader.peek()
            if reader.buffered() < whole:
                if whole > BULK_BYTES:
                    await self._run_receiver()
                    continue
                await self._fill(size)
                reader.check_header()  # before waiting for the length it claims
                await self._fill(whole)
            if pdu_type == pdu.R2T and reader.asks_bulk():
                await self._run_receiver()  # it answers the R2T itself, and reads on
                continue
            reader.one_pdu()  # all of it is buffered: no socket read on the trio thread
            if reader.inbox:
                batch = reader.take_inbox()
                self._deliver(batch)
                del batch  # held here, it would keep the callers' memory until the next one

    async def _fill(self, count: int) -> None:
        """Have at least ``count`` bytes in the reader's buffer (trio thread)."""
        while True:
            try:
                if self.reader.receive_nowait(count):
                    return
            except OSError:
                if self.closed:
                    raise trio.ClosedResourceError from None
                raise
            await trio.lowlevel.wait_readable(self.sock)
            self._woke = False  # the callers let go have run meanwhile
            if self.closed:  # failed meanwhile (a shut-down socket still reads)
                raise trio.ClosedResourceError

    async def _run_receiver(self) -> None:
        """Run the receiver thread until it hands the reading back (or the queue fails)."""
        if self._failed is not None:
            raise trio.ClosedResourceError
        if not self._thread_waits_bounded:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 _timeval(RECEIVE_POLL))
            # it may send H2CData too: bound its waits there (the trio thread never waits)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(STALL_TIMEOUT))
            self._thread_waits_bounded = True
        self._threads += 1
        try:
            # Not abandoned on cancellation: the thread writes into the callers' memory.
            # _stop_receiver_when_cancelled ends it instead (within RECEIVE_POLL at worst).
            # What it read last was handed over before its end (PduReader.run).
            await self._mailbox.run_in_thread(self.reader.run)
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

    # -- for the reader (ReaderOwner), on its receiver thread -------------------------------------

    def post(self, batch: list) -> None:
        """Receiver thread: hand the reader's ``batch`` to the trio thread."""
        try:
            self._mailbox.post(batch)
        except trio.RunFinishedError:
            raise ReceiverStopped from None

    def closed_by_peer(self) -> TransportError:
        where = f"{self.transport.traddr}:{self.transport.trsvcid}"
        problem = self._records.problem if self._records is not None else None
        if problem:  # the TLS records ended the connection: say which
            return TransportError(f"{self.name}: the TLS connection to {where} ended: "
                                  f"{problem}")
        return TransportError(f"{self.name}: {where} closed the connection")

    def _receive_error(self, exc: OSError) -> TransportError:
        where = f"{self.transport.traddr}:{self.transport.trsvcid}"
        if self._kernel_tls and exc.errno == errno.EIO and not self.closed:
            # kTLS hands over only application data: name the record it would not.
            return TransportError(f"{self.name}: the TLS connection to {where} ended: "
                                  f"{kernel_record(self.sock)}")
        return TransportError(f"{self.name}: receiving from {where} failed: "
                              f"{exc.strerror or exc}")

    def answer_r2t(self, request: Request, header: pdu.Header) -> None:
        """Receiver thread: send the data an R2T asks for at once, from this thread (no
        hand-off to the trio thread and on to another thread); the target waits for it.
        The command's answer can only come after it, so its caller is never let go while
        the data is being sent; a failed queue holds its callers until this thread ends."""
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
            if self.closed:
                raise ReceiverStopped from None
            raise self._send_error(exc) from None

    def _send_in_thread(self, splicer: Splicer | None, pdus: list[list]) -> None:
        """The receiver thread: send ``pdus`` under the send lock, waiting for it
        (each wait bounded, ending once the queue is closed).  Raises Stalled, OSError."""
        lock = self._send_lock
        while not lock.acquire(timeout=RECEIVE_POLL):
            if self.closed:
                raise OSError(errno.EPIPE, "the queue is closed")
        try:
            if self.closed:
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
            if completion.ok and request.to_controller and request.data is not None:
                # The target cannot have the data still queued here: its success is a lie.
                self._fail(TransportError(f"{self.name}: CapsuleResp for command "
                                          f"{request.cid} claims success for a write "
                                          "before all its data was sent"))
                return
            return  # the sender finishes it when its last PDU left (it reads the caller's data)
        self._release(request)
        self._let_go(request)

    def _let_go(self, request: Request) -> None:
        request.finished = True
        request.view = None  # the caller's memory is the caller's again
        task = request.task
        if task is not None:
            self._woke = True
            request.task = None
            trio.lowlevel.reschedule(task)
        elif request.done is not None:
            done, request.done = request.done, None
            done(request)

    def _h2c_pdus(self, request: Request, header: pdu.Header) -> list[list]:
        return h2c_pdus(request.buffer(), header, maxh2cdata=self.maxh2cdata, cpda=self.cpda,
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

    def cut_timeouts(self, deadline: float) -> None:
        self._watchdog.cut(deadline)

    def _expire(self, now: float) -> None:
        self._mailbox.drain()  # an answer handed over but not yet handled is no timeout
        for request in list(self._pending.values()):
            if (request.task is None and request.done is None) or request.deadline > now:
                continue
            if request.unsent:
                # Its PDUs still wait for the socket and read the caller's memory: the
                # connection is stuck, and only closing it lets the caller go safely.
                self._fail(TransportError(f"{self.name}: command {request.cid} could not be "
                                          f"sent within {request.timeout:g} s"))
                return
            if request is self.reader.mid_payload:  # stuck mid-PDU
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
        pending = list(self._pending.values())
        self._pending.clear()  # in place: the reader looks requests up in it
        for request in pending:
            if request.error is None:  # (a timed-out one has its own)
                request.error = self._failed
            request.unsent = 0
        self._held.extend(pending)
        self._free.clear()
        self._slot_waiters.unpark_all()
        if not self.closed:
            self.closed = True
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

