"""TLS 1.3 records after the handshake: in the kernel (kTLS) where it can be, else here.

**Kernel** (:func:`install_kernel_tls`): the traffic keys go to the socket (``TCP_ULP``
"tls", then ``SOL_TLS`` ``TLS_TX``/``TLS_RX`` with ``tls12_crypto_info_aes_gcm_128/256``,
version 0x0304), as tlshd hands them over for the kernel's own NVMe/TCP.  The socket stays
a plain fd: the queue's ``sendmsg``, ``recv_into(MSG_WAITALL)`` and splice keep working.  A
record that is not application data makes a receive fail with EIO; :func:`kernel_record`
then reads its type (``TLS_GET_RECORD_TYPE``) to name it.

**Userspace** (:class:`UserspaceRecords`, where the kernel has no kTLS): the queue gets one
end of a socket pair, and two threads move bytes between its other end and the TCP
connection, sealing and opening records with libcrypto's AES-GCM (framing by
:mod:`~nvmeof_fuse.nvme.tls_record`): the queue's code is the same over either.  A record
that is not application data, or fails its tag, ends the connection: the pair's end closes
and :attr:`UserspaceRecords.problem` names why, in the line the queue fails with.

Either way the record layer says what it is (:class:`RecordLayer`): ``tls: kernel`` or
``tls: userspace``, and its suite, for ``.nvmeof/stats``.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import threading
from dataclasses import dataclass

from ...errors import ConnectError
from ...nvme import tls_record as rec
from .libssl import Aead
from .tls_handshake import Secrets

SOL_TLS = 282
TLS_TX, TLS_RX = 1, 2
TCP_ULP = 31
TLS_GET_RECORD_TYPE = 2
TLS_CIPHER_AES_GCM_128, TLS_CIPHER_AES_GCM_256 = 51, 52
SLOTS = 16
"""Records sealed per send by the userspace layer (16 x 16 KiB)."""
PAIR_BUFFER_BYTES = 4 << 20
INBOUND_BUFFER_BYTES = 512 * 1024
MAX_IOV = 512
SEND_POLL = 1.0
"""The outbound thread's longest wait on a TCP send before it looks whether the queue closed
its end (a target that stopped reading must not hold the thread and the connection)."""


@dataclass(frozen=True)
class RecordLayer:
    """Where a connection's records are sealed and opened, for reports."""

    where: str
    """``kernel`` or ``userspace``."""
    suite: str

    def describe(self) -> str:
        return f"tls: {self.where} ({self.suite})"


def crypto_info(keys: rec.TrafficKeys) -> bytes:
    """``struct tls12_crypto_info_aes_gcm_128/256`` for TLS 1.3: the version, the cipher,
    the IV's last 8 bytes, the key, its first 4 (the salt) and the record sequence 0."""
    cipher = TLS_CIPHER_AES_GCM_128 if len(keys.key) == 16 else TLS_CIPHER_AES_GCM_256
    return (struct.pack("=HH", rec.TLS13_VERSION, cipher) + keys.iv[4:] + keys.key
            + keys.iv[:4] + bytes(8))


def install_kernel_tls(sock: socket.socket, secrets: Secrets, *, client: bool = True) -> bool:
    """Hand the records of ``sock`` to the kernel; False where it has no kTLS (nothing
    changed: the userspace layer takes over).  ConnectError when the kernel took the send
    keys but refused the receive keys (the socket is then neither)."""
    send, receive = ((secrets.client, secrets.server) if client
                     else (secrets.server, secrets.client))
    try:
        sock.setsockopt(socket.SOL_TCP, TCP_ULP, b"tls")
        sock.setsockopt(SOL_TLS, TLS_TX, crypto_info(rec.traffic_keys(send, secrets.suite)))
    except OSError:
        return False  # no tls module, or no TLS 1.3 in it: the socket is plain TCP still
    try:
        sock.setsockopt(SOL_TLS, TLS_RX, crypto_info(rec.traffic_keys(receive, secrets.suite)))
    except OSError as exc:
        raise ConnectError(f"kernel TLS took the send keys but refused the receive keys: "
                           f"{exc.strerror or exc}") from None
    return True


def kernel_record(sock: socket.socket) -> str:
    """After a kTLS receive failed with EIO: name the record that is not application data
    (read with its type, ``TLS_GET_RECORD_TYPE``), or say that it could not be read."""
    try:
        data, ancillary, _, _ = sock.recvmsg(rec.MAX_PLAINTEXT, socket.CMSG_SPACE(1),
                                             socket.MSG_DONTWAIT)
    except OSError as exc:
        return f"a TLS record the kernel would not hand over ({exc.strerror or exc})"
    for level, kind, value in ancillary:
        if level == SOL_TLS and kind == TLS_GET_RECORD_TYPE and value:
            return rec.describe(value[0], data)
    return "a TLS record that is not application data"


class UserspaceRecords:
    """The userspace record layer of one connection (see the module).

    ``local`` is the queue's socket; the TCP socket is this object's, closed by its
    threads once either side ends.
    """

    def __init__(self, tcp: socket.socket, secrets: Secrets, *, client: bool = True) -> None:
        send, receive = ((secrets.client, secrets.server) if client
                         else (secrets.server, secrets.client))
        self.layer = RecordLayer("userspace", secrets.suite)
        out_keys = rec.traffic_keys(send, secrets.suite)
        in_keys = rec.traffic_keys(receive, secrets.suite)
        self._seal, self._seal_iv = Aead(out_keys.key, True), out_keys.iv
        self._open, self._open_iv = Aead(in_keys.key, False), in_keys.iv
        self._tcp = tcp
        tcp.setblocking(True)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                       struct.pack("ll", int(SEND_POLL), int(SEND_POLL % 1 * 1e6)))
        self.local, self._inner = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for end in (self.local, self._inner):
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, PAIR_BUFFER_BYTES)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PAIR_BUFFER_BYTES)
        self.problem: str | None = None
        """Why the connection ended, when the records ended it (for the queue's error)."""
        self._lock = threading.Lock()
        self._running = 2
        self._threads = [threading.Thread(target=self._guarded, args=(fn,), daemon=True,
                                          name=f"tls-{fn.__name__.strip('_')}")
                         for fn in (self._outbound, self._inbound)]

    def start(self) -> socket.socket:
        """Start the threads; the socket the queue reads and writes."""
        for thread in self._threads:
            thread.start()
        return self.local

    def join(self, timeout: float) -> bool:
        """Wait for both threads to end (tests); whether they did."""
        for thread in self._threads:
            thread.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    # -- the threads ------------------------------------------------------------------------

    def _guarded(self, fn) -> None:
        try:
            fn()
        except rec.RecordError as exc:
            self._end(str(exc))
        except OSError as exc:
            if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN):
                self._end(f"the TLS connection failed: {exc.strerror or exc}")
        finally:
            self._end(None)
            with self._lock:
                self._running -= 1
                last = not self._running
            if last:
                for sock in (self._tcp, self._inner):
                    sock.close()
                self._seal.close()
                self._open.close()

    def _end(self, problem: str | None) -> None:
        """End both directions (the first problem named is kept)."""
        with self._lock:
            if problem and self.problem is None:
                self.problem = problem
        for sock in (self._inner, self._tcp):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _outbound(self) -> None:
        """The queue's bytes, sealed into records of at most 16 KiB, out to TCP."""
        size = rec.MAX_PLAINTEXT
        stride = rec.HEADER_BYTES + size + 1 + rec.TAG_BYTES
        buf = bytearray(stride * SLOTS)
        view = memoryview(buf)
        slots = [view[i * stride + rec.HEADER_BYTES:i * stride + rec.HEADER_BYTES + size]
                 for i in range(SLOTS)]
        seal, iv = self._seal, self._seal_iv
        sequence = 0
        while True:
            n = self._inner.recvmsg_into(slots)[0]
            if n == 0:
                return  # the queue closed its end
            records = []
            for i in range(SLOTS):
                length = min(n, size)
                if length == 0:
                    break
                n -= length
                at = i * stride
                head = rec.header(length)
                view[at:at + rec.HEADER_BYTES] = head
                body = at + rec.HEADER_BYTES
                buf[body + length] = rec.APPLICATION_DATA
                seal.seal(rec.nonce(iv, sequence), head, view[body:body + length + 1],
                          view[body:body + length + 1 + rec.TAG_BYTES])
                sequence += 1
                records.append(view[at:body + length + 1 + rec.TAG_BYTES])
            _send_all(self._tcp, records, self._queue_gone)

    def _queue_gone(self) -> bool:
        """Whether the queue closed its end of the pair (its end hung up)."""
        poll = select.poll()
        poll.register(self._inner, select.POLLIN)
        return any(events & select.POLLHUP for _, events in poll.poll(0))

    def _inbound(self) -> None:
        """Records from TCP, opened, their application data on to the queue."""
        buf = bytearray(INBOUND_BUFFER_BYTES)
        view = memoryview(buf)
        opener, iv = self._open, self._open_iv
        start = end = sequence = 0
        while True:
            n = self._tcp.recv_into(view[end:])
            if n == 0:
                if self.problem is None and end > start:
                    self._end("the target closed the connection in the middle of a TLS record")
                return
            end += n
            plain = []
            while end - start >= rec.HEADER_BYTES:
                length = rec.parse_header(view[start:start + rec.HEADER_BYTES])
                whole = rec.HEADER_BYTES + length
                if end - start < whole:
                    break
                head = bytes(view[start:start + rec.HEADER_BYTES])
                body = view[start + rec.HEADER_BYTES:start + whole]
                if not opener.open(rec.nonce(iv, sequence), head, body):
                    raise rec.RecordError("a TLS record failed its authentication "
                                          "(bad_record_mac: another key, or corrupted)")
                sequence += 1
                kind, content = rec.inner_content(body[:-rec.TAG_BYTES])
                if kind != rec.APPLICATION_DATA:
                    _send_all(self._inner, plain)  # what came before it still counts
                    raise rec.RecordError(rec.describe(kind, bytes(body[:content])))
                if content:
                    plain.append(body[:content])
                start += whole
            _send_all(self._inner, plain)
            del plain
            if start == end:
                start = end = 0
            elif len(buf) - end < rec.HEADER_BYTES + rec.MAX_CIPHERTEXT:
                kept = end - start
                view[:kept] = view[start:end]
                start, end = 0, kept


def _send_all(sock: socket.socket, buffers: list, gone=None) -> None:
    """sendmsg all of ``buffers`` into a blocking socket; with a send timeout on it, ``gone()``
    is asked at each timeout whether to give up (EPIPE)."""
    while buffers:
        try:
            sent = sock.sendmsg(buffers[:MAX_IOV])
        except BlockingIOError:
            if gone is not None and gone():
                raise OSError(errno.EPIPE, "the queue closed its end") from None
            continue
        while sent:
            if sent >= len(buffers[0]):
                sent -= len(buffers[0])
                buffers.pop(0)
            else:
                buffers[0] = buffers[0][sent:]
                sent = 0
