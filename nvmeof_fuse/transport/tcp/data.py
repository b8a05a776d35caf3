"""NVMe/TCP data: the caller's memory as the socket sees it, and H2CData sent from it.

Memory over TCP needs no registration: a read's payload is received straight into the
caller's bytes and a write's is sent from them.  The socket reaches host memory only, so
GPU memory is refused by name (the companion API stages it through host memory, as
kvikio's compat mode does).  Bulk write data leaves by the receiver thread, copied into the
socket (or spliced, :mod:`.splice`, where the transport asks for it), in blocking calls
bounded by the socket's send timeout.
"""

from __future__ import annotations

import ctypes
import socket
import struct

from ...nvme import tcp_pdu as pdu
from ..region import DataRef
from .splice import Spliced, Splicer

BULK_BYTES = 64 * 1024
"""Data from this size on is moved by the queue's receiver thread, not the trio thread: a PDU
received larger than this (and the stream after it), and the H2CData answering an R2T that
asks for this much (and the stream after that R2T).  The copy and the TCP work of a large
payload take about as long as many small PDUs, and the GIL is released for them, so the
queues' large transfers run in parallel on the machine's CPUs.  Smaller ones stay on the
trio thread, where they cost less than the hop to a thread and back."""

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


def h2c_pdus(payload: memoryview, header: pdu.Header, *, maxh2cdata: int, cpda: int,
             header_digest: bool, data_digest: bool, splice: bool) -> list[list]:
    """The H2CData PDUs (each a list of buffers) answering ``header``, an R2T for a write of
    ``payload``: pieces of at most MAXH2CDATA, bulk ones marked for a thread to send."""
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
