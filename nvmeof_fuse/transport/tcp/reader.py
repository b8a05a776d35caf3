"""The incoming side of an NVMe/TCP queue: its receive buffer, and the PDUs read from it.

A :class:`PduReader` reads the stream of one queue's socket, checks each PDU against the
commands in flight and turns it into what the queue acts on: ``(request, completion)``
pairs for answered commands and ``(request, R2T header)`` pairs for R2Ts, gathered in
:attr:`PduReader.inbox`.  A C2HData payload goes straight into the caller's memory
(``recv_into``); the reader changes no request.

Two threads use it, never at once.  The queue's trio task reads small PDUs, each only
once it is whole in the buffer (:meth:`PduReader.receive_nowait`, then
:meth:`PduReader.one_pdu`), so it never waits on the socket there.  From a PDU over
:data:`~.data.BULK_BYTES` on, the queue's receiver thread reads the stream, headers and
data, in blocking calls bounded by the socket's receive timeout (:meth:`PduReader.run`),
as the kernel's io_work does, and hands its inbox to the trio thread before each receive
that may block.  It answers a bulk R2T itself, through its owner.  A command's success
counts its data: a read's C2HData must have brought all of it, a write's R2Ts must have
asked for all of it (in order) unless it rode in the capsule.  Anything that breaks
the protocol raises :class:`~nvmeof_fuse.errors.TransportError` (or
:class:`~nvmeof_fuse.nvme.tcp_pdu.PduError`), which fails the queue.
"""

from __future__ import annotations

import select
import socket
from typing import Protocol

from ...errors import TransportError
from ...nvme import Completion
from ...nvme import tcp_pdu as pdu
from .data import BULK_BYTES
from .request import Request

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
QUIET_SECONDS = 0.1
"""The receiver thread hands the reading back to the trio thread once the stream stayed quiet
this long at a PDU boundary ..."""
SMALL_STREAK = 64
"""... or after this many small PDUs in a row (no bulk payload among them)."""


class ReceiverStopped(Exception):
    """The receiver thread ends: its queue failed or stopped (or trio's run is over)."""


class ReaderOwner(Protocol):
    """What a reader needs of its queue."""

    name: str
    qid: int
    closed: bool
    """The queue failed or stopped: the socket is (being) shut down."""

    def post(self, batch: list) -> None:
        """Hand ``batch`` to the trio thread; ReceiverStopped once trio's run is over."""

    def answer_r2t(self, request: Request, header: pdu.Header) -> None:
        """Receiver thread: send the data the R2T asks for; ReceiverStopped once closed."""

    def closed_by_peer(self) -> TransportError:
        """The error for a connection the target closed."""


class PduReader:
    """One queue's incoming stream (see the module docstring)."""

    def __init__(self, sock: socket.socket, owner: ReaderOwner, pending: dict[int, Request], *,
                 header_digest: bool, data_digest: bool) -> None:
        self.sock = sock
        self._owner = owner
        self._pending = pending
        """The queue's commands in flight, by command ID (the queue's own dict, kept in place)."""
        self.header_digest = header_digest
        self.data_digest = data_digest
        self.inbox: list = []
        """(request, completion) and (request, R2T header) pairs for the trio thread."""
        self.mid_payload: Request | None = None
        """The command whose data is being received (a timeout now must fail the queue)."""
        self.in_thread = False  # the receiver thread runs (and answers bulk R2Ts itself)
        self._answered: dict[int, int] = {}  # by command ID: the serial last answered
        self._progress: dict[int, tuple[Request, int]] = {}
        """By command ID: a read's C2HData bytes so far, or a write's bytes asked for by R2T."""
        self._poll: select.poll | None = None  # set as the receiver thread first runs
        self._buf = bytearray(RECV_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._after_payload = False  # the last receive went straight into a payload

    # -- the trio thread: whole PDUs from the buffer, no waiting ----------------------------

    def buffered(self) -> int:
        return self._end - self._start

    def receive_nowait(self, count: int) -> bool:
        """Have at least ``count`` bytes buffered, receiving what the socket holds now;
        False when it holds too few (wait until it is readable, then ask again)."""
        if self._end - self._start >= count:
            return True
        self._compact()
        while self._end < count:
            try:
                n = self.sock.recv_into(self._view[self._end:max(self._end + RECV_BYTES, count)],
                                        0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False
            if n == 0:
                raise self._owner.closed_by_peer()
            self._end += n
        return True

    def peek(self) -> tuple[int, int, int]:
        """The buffered PDU's type, header size and whole size (its first 8 bytes are here)."""
        pdu_type, _, hlen, _, plen = pdu.peek_common(self._view, self._start)
        size = pdu.header_bytes(pdu_type, hlen, header_digest=self.header_digest)
        return pdu_type, size, max(plen, size)

    def check_header(self) -> None:
        """Check the buffered header, before its PDU's length is waited for (a PLEN that
        lies would be waited for: a read ending with its C2HData has nothing behind it)."""
        pdu.parse_header(self._view, self._start, header_digest=self.header_digest,
                         data_digest=self.data_digest)

    def asks_bulk(self) -> bool:
        """Whether the R2T at the head of the buffer asks for bulk data (its R2TL; the
        header is checked when it is handled)."""
        return pdu.peek_data_length(self._view, self._start) >= BULK_BYTES

    def take_inbox(self) -> list:
        batch, self.inbox = self.inbox, []
        return batch

    # -- either thread ------------------------------------------------------------------------

    def one_pdu(self) -> int:
        """Read and handle one PDU; its length (an R2T's: the data it asks for).  The trio
        thread calls it only with the whole PDU buffered, so it never reads the socket there."""
        hdgst = self.header_digest
        self._fill(8)
        pdu_type, _, hlen, _, plen = pdu.peek_common(self._view, self._start)
        size = pdu.header_bytes(pdu_type, hlen, header_digest=hdgst)
        self._fill(size)
        header = pdu.parse_header(self._view, self._start, header_digest=hdgst,
                                  data_digest=self.data_digest)
        self._start += size
        if header.type == pdu.CAPSULE_RESP:
            self._response(header.completion)
        elif header.type == pdu.C2H_DATA:
            self._c2h_data(header, size)
        elif header.type == pdu.R2T:
            self._r2t(header)
            return header.length
        else:  # C2HTermReq
            raise TransportError(f"{self._owner.name}: the controller ended the connection "
                                 f"with a C2HTermReq ({pdu.term_reason(header.length)})")
        return plen

    def _lookup(self, cid: int, what: str) -> Request:
        """The request in flight under ``cid``: sent, not answered yet (as far as the
        reader knows; the trio thread releases it only once the answer is handed over).
        A command ID carries its slot's generation (:mod:`..cids`): one of an earlier use
        of the slot is not in flight."""
        request = self._pending.get(cid)
        if request is None or self._answered.get(cid) == request.serial:
            raise TransportError(f"{self._owner.name}: {what} for command ID {cid}, "
                                 "which is not in flight")
        return request

    def _answer(self, request: Request, completion: Completion) -> None:
        self._answered[request.cid] = request.serial
        self._progress.pop(request.cid, None)
        self.inbox.append((request, completion))

    def _response(self, completion: Completion) -> None:
        cid = completion.command_id
        request = self._pending.get(cid)
        if request is not None and self._answered.get(cid) == request.serial:
            raise TransportError(f"{self._owner.name}: second response for command ID {cid}")
        request = self._lookup(cid, "CapsuleResp")
        data = request.data
        if data is not None and completion.ok and not request.in_capsule:
            # A read succeeds only with all its data: else its buffer holds what it held.
            # A write succeeds only once its R2Ts asked for all of it: else the target
            # never had the rest, and a success would report unwritten data as written.
            so_far = self._progress.get(cid)
            moved = so_far[1] if so_far is not None and so_far[0] is request else 0
            if moved != data.length:
                what = ("were asked for by R2T" if request.to_controller
                        else "of C2HData")
                raise TransportError(f"{self._owner.name}: CapsuleResp for command {cid} "
                                     f"claims success after {moved} of {data.length} "
                                     f"bytes {what}")
        self._answer(request, completion)

    def _data_request(self, header: pdu.Header, what: str, to_controller: bool) -> Request:
        """The command a C2HData or R2T names: in flight, moving data that way, with
        the bytes named inside its buffer."""
        request = self._lookup(header.cid, what)
        if request.data is None or request.to_controller != to_controller:
            raise TransportError(f"{self._owner.name}: {what} for command {header.cid}, "
                                 f"which {'writes' if to_controller else 'reads'} no data")
        if header.offset + header.length > request.data.length:
            raise TransportError(f"{self._owner.name}: {what} for command {header.cid} names "
                                 f"bytes {header.offset}+{header.length}, past its "
                                 f"{request.data.length}-byte buffer")
        return request

    def _c2h_data(self, header: pdu.Header, header_size: int) -> None:
        name = self._owner.name
        request = self._data_request(header, "C2HData", False)
        end = header.offset + header.length
        so_far = self._progress.get(header.cid)
        expected = so_far[1] if so_far and so_far[0] is request else 0
        if header.offset != expected:  # in order, as Linux receives it: no holes, no overlaps
            raise TransportError(f"{name}: C2HData for command {header.cid} at offset "
                                 f"{header.offset}, expected {expected}")
        if header.pdo > header_size:
            self._skip(header.pdo - header_size)
        dest = request.buffer()[header.offset:end]
        have = self._take_buffered(dest)
        self.mid_payload = request
        try:
            self._read_into(dest, have)
        finally:
            self.mid_payload = None
        if header.data_digest:
            want = pdu.digest(dest)
            got = self._skip(pdu.DIGEST_BYTES)
            if got != want:
                raise TransportError(f"{name}: data digest mismatch on C2HData for "
                                     f"command {header.cid} (got {got.hex()}, computed "
                                     f"{want.hex()})")
        received = header.length + expected
        if header.flags & pdu.FLAG_SUCCESS:
            if received != request.data.length:
                raise TransportError(f"{name}: C2HData for command {header.cid} "
                                     f"claims success after {received} of "
                                     f"{request.data.length} bytes")
            self._answer(request, Completion(0, 0, self._owner.qid, header.cid, 0, False))
        else:
            self._progress[header.cid] = (request, received)

    def _r2t(self, header: pdu.Header) -> None:
        request = self._data_request(header, "R2T", True)
        so_far = self._progress.get(header.cid)
        asked = so_far[1] if so_far and so_far[0] is request else 0
        if header.offset != asked:  # in order, no holes, no overlaps: all is asked for once
            raise TransportError(f"{self._owner.name}: R2T for command {header.cid} at "
                                 f"offset {header.offset}, expected {asked}")
        self._progress[header.cid] = (request, asked + header.length)
        if self.in_thread:
            if self.inbox:
                self._post()  # the callers answered so far go on meanwhile
            self._owner.answer_r2t(request, header)
        else:
            self.inbox.append((request, header))

    # -- the buffer and the socket ------------------------------------------------------------

    def _compact(self) -> None:
        if self._start:
            kept = self._end - self._start
            self._view[:kept] = self._view[self._start:self._end]
            self._start, self._end = 0, kept

    def _fill(self, count: int) -> None:
        """Have at least ``count`` bytes in the receive buffer."""
        if self._end - self._start >= count:
            return
        self._compact()
        # Right after a payload received in place, more large ones likely follow: ask for
        # about the PDU headers between them, so that little payload is copied twice.
        ask = AFTER_PAYLOAD_BYTES if self._after_payload else RECV_BYTES
        self._after_payload = False
        while self._end < count:
            self._end += self._recv_into(self._view[self._end:max(self._end + ask, count)])

    def _recv_into(self, dest: memoryview, flags: int = 0) -> int:
        """Receive at least one byte into ``dest``, first handing over what waits for the
        trio thread (the receive may block).  ReceiverStopped once the queue failed."""
        while True:
            if self.inbox:
                self._post()
            try:
                n = self.sock.recv_into(dest, 0, flags)
            except BlockingIOError:  # SO_RCVTIMEO passed without a byte: look again
                if self._owner.closed:
                    raise ReceiverStopped from None
                continue
            except OSError:
                if self._owner.closed:
                    raise ReceiverStopped from None
                raise
            if n == 0:
                if self._owner.closed:  # shut down as the queue failed
                    raise ReceiverStopped
                raise self._owner.closed_by_peer()
            return n

    def _take_buffered(self, dest: memoryview) -> int:
        """Copy the buffered bytes that begin ``dest``; how many."""
        have = min(self._end - self._start, len(dest))
        if have:
            dest[:have] = self._view[self._start:self._start + have]
            self._start += have
        return have

    def _read_into(self, dest: memoryview, have: int = 0) -> None:
        """Fill ``dest`` (its first ``have`` bytes are there) from the stream: a large rest
        is received in place (in one call, MSG_WAITALL), a small one through the buffer."""
        want = len(dest)
        while have < want:
            rest = want - have
            if rest < DIRECT_RECV_BYTES:
                self._fill(rest)
                dest[have:] = self._view[self._start:self._start + rest]
                self._start += rest
                return
            have += self._recv_into(dest[have:], socket.MSG_WAITALL)
            self._after_payload = True

    def _skip(self, count: int) -> bytes:
        self._fill(count)
        at = self._start
        self._start += count
        return bytes(self._view[at:at + count])

    # -- the receiver thread ------------------------------------------------------------------

    def run(self) -> None:
        """The receiver thread: read PDUs until the stream stays quiet for QUIET_SECONDS at
        a PDU boundary or carries SMALL_STREAK small PDUs in a row; then the trio thread
        reads on.  What it read last is handed over before it ends (or raises)."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.sock.fileno(), select.POLLIN)
        self.in_thread = True
        try:
            small = 0
            while small < SMALL_STREAK:
                if self._end - self._start < 8 and not self._more_within(QUIET_SECONDS):
                    return
                small = 0 if self.one_pdu() > BULK_BYTES else small + 1
        finally:
            self.in_thread = False
            if self.inbox:
                try:
                    self._post()
                except ReceiverStopped:
                    pass  # trio's run is over: no one to tell

    def _more_within(self, seconds: float) -> bool:
        """Whether bytes arrive within ``seconds`` (what waits for trio is handed over)."""
        if self.inbox:
            self._post()
        return bool(self._poll.poll(seconds * 1000))

    def _post(self) -> None:
        """Hand the answered commands and R2Ts read so far to the trio thread."""
        self._owner.post(self.take_inbox())
