"""A TLS front for the fake NVMe/TCP target (tests/tcp_target.py), as stunnel or tlshd
would be: it takes TLS 1.3 with a PSK on a port of its own (OpenSSL's server side, through
the same ctypes bindings: Python's ssl has no PSK before 3.13) and relays each connection's
application data, by OpenSSL's own record layer (SSL_read/SSL_write), to the target's plain
port.  So the host's userspace record layer is checked against OpenSSL's, not its own.

``stall``: accept connections and never answer (a stalled handshake); it may be set at any
time, and ``keys`` changed, for the connections after.  Each connection's handshake failure
is kept in ``failures``, one line each; so is a backend that refuses (the target's port away
during an outage), after which the host's connection is closed, as a TLS terminator in front
of a target that is down closes it.

:meth:`inject` is a target that breaks TLS in the middle of I/O: in place of a read's data
(the next chunk from the target of ``min_bytes`` or more: not a keep-alive's answer, nor an
Identify's 4 KiB) it sends part of a record and closes, or an alert, or a post-handshake
message (KeyUpdate, NewSessionTicket) that NVMe/TCP never carries.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import socket
import threading

from nvmeof_fuse.nvme import tls_record as rec
from nvmeof_fuse.transport.tcp import libssl
from nvmeof_fuse.transport.tcp import tls_handshake as th

RELAY_BYTES = 1 << 16
INJECTIONS = ("cut mid-record", "close_notify", "KeyUpdate", "NewSessionTicket")
"""What :meth:`TlsFront.inject` sends in place of a read's data."""
POST_HANDSHAKE = {"KeyUpdate": ("SSL_key_update", [ctypes.c_void_p, ctypes.c_int]),
                  "NewSessionTicket": ("SSL_new_session_ticket", [ctypes.c_void_p])}
"""The libssl calls that queue a post-handshake message (the product binds neither)."""
SSL_KEY_UPDATE_NOT_REQUESTED = 0


def post_handshake_call(what: str):
    """libssl's call that queues ``what`` (a KeyUpdate, a NewSessionTicket), bound; None
    where this libssl lacks it."""
    lib, _ = libssl.libs()
    name, argtypes = POST_HANDSHAKE[what]
    fn = getattr(lib, name, None)
    if fn is None or not hasattr(lib, "SSL_do_handshake"):
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.SSL_do_handshake.argtypes, lib.SSL_do_handshake.restype = [ctypes.c_void_p], ctypes.c_int
    return fn


class _Front:
    """What both fronts share: a listening socket on ``host``, a thread per connection
    (``_serve``), and an exit that ends them all."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.failures: list[str] = []
        self.handshakes = 0
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._closing = False
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def __enter__(self):
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(sock)
            self._spawn(self._serve, sock)

    def _serve(self, sock: socket.socket) -> None:
        raise NotImplementedError


class TlsFront(_Front):
    def __init__(self, backend_port: int, keys: dict[str, bytes], suite: str, *,
                 stall: bool = False, backend_host: str = "127.0.0.1") -> None:
        self.backend_port = backend_port
        self.backend_host = backend_host
        self.keys = keys
        self.suite = suite
        self.stall = stall
        super().__init__()
        self._connections: list[th.Connection] = []
        self._lock = threading.Lock()
        self._alert = False
        self._injection: str | None = None
        self._injections_left: int | None = 0
        self._inject_min = 0
        self.injected: list[str] = []
        """What :meth:`inject` sent, one entry each time."""

    def cut_all(self) -> None:
        """Cut every connection so far, as an outage does (the host reconnects)."""
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close_notify_all(self) -> None:
        """Have every live connection send a close_notify alert (an alert mid-stream), from
        its own relay thread (an SSL object is not for two threads at once)."""
        self._alert = True

    def inject(self, what: str, *, times: int | None = 1, min_bytes: int = 8192) -> None:
        """From now on, in place of the next ``times`` chunks (None: every one) of
        ``min_bytes`` or more that the target sends a host: ``what`` (:data:`INJECTIONS`).
        "cut mid-record" sends a record's header and part of its body, then closes;
        "close_notify" sends that alert and closes; "KeyUpdate" and "NewSessionTicket" send
        that message (a record of type handshake), then relay on."""
        if what not in INJECTIONS:
            raise ValueError(f"no injection {what!r}: one of {', '.join(INJECTIONS)}")
        with self._lock:
            self._injection, self._injections_left, self._inject_min = what, times, min_bytes

    def _take_injection(self, size: int) -> str | None:
        """The injection due in place of a chunk of ``size`` bytes, if any (counted)."""
        with self._lock:
            what = self._injection
            if what is None or size < self._inject_min or self._injections_left == 0:
                return None
            if self._injections_left is not None:
                self._injections_left -= 1
            self.injected.append(what)
            return what

    def _inject(self, what: str, sock, conn) -> bool:
        """Send ``what`` on a relayed connection (its relay thread); whether the relay goes
        on after it."""
        if what == "cut mid-record":
            whole = rec.MAX_CIPHERTEXT
            sock.sendall(bytes([rec.APPLICATION_DATA, 3, 3]) + whole.to_bytes(2, "big")
                         + os.urandom(whole // 3))
            return False
        if what == "close_notify":
            conn.close_notify()
            return False
        fn = post_handshake_call(what)
        lib, _ = libssl.libs()
        args = (SSL_KEY_UPDATE_NOT_REQUESTED,) if what == "KeyUpdate" else ()
        if fn is None or fn(conn._ssl, *args) != 1 or lib.SSL_do_handshake(conn._ssl) != 1:
            self.failures.append(f"libssl did not send a {what}: {libssl.last_error()}")
            return False
        return True

    def _serve(self, sock: socket.socket) -> None:
        if self.stall:
            with contextlib.suppress(OSError):
                while sock.recv(1 << 16):  # until the host or the test ends it
                    pass
            sock.close()
            return
        sock.setblocking(False)
        conn = th.server(sock.fileno(), self.keys, self.suite)
        try:
            th.handshake_blocking(conn, sock.fileno(), 10)
        except th.HandshakeError as exc:
            self.failures.append(str(exc))
            conn.close()
            sock.close()
            return
        self.handshakes += 1
        sock.setblocking(True)
        try:
            backend = socket.create_connection((self.backend_host, self.backend_port), 10)
        except OSError as exc:  # the target's port is away (an outage): as if it closed
            self.failures.append(f"backend {self.backend_host}:{self.backend_port}: {exc}")
            conn.close()
            sock.close()
            return
        backend.settimeout(None)
        self._sockets.append(backend)
        with self._lock:
            self._connections.append(conn)
        try:
            self._relay(sock, conn, backend)
        except (OSError, th.HandshakeError):
            pass
        finally:
            with self._lock:
                self._connections.remove(conn)
                conn.close()
            backend.close()
            sock.close()

    def _relay(self, sock, conn, backend) -> None:
        buf = bytearray(RELAY_BYTES)
        poll = select.poll()
        poll.register(sock, select.POLLIN)
        poll.register(backend, select.POLLIN)
        while True:
            if self._alert:
                conn.close_notify()
                return
            ready = {fd for fd, _ in poll.poll(50)} if not conn.pending() else {sock.fileno()}
            if sock.fileno() in ready:
                n = conn.read_into(buf)
                if n == 0:
                    return
                if n > 0:
                    backend.sendall(buf[:n])
            if backend.fileno() in ready:
                data = backend.recv(RELAY_BYTES)
                if not data:
                    return
                what = self._take_injection(len(data))
                if what is not None and not self._inject(what, sock, conn):
                    return
                conn.write(data)
            if self._closing:
                return


# -- a fast front: the records in the kernel, the bytes relayed in the kernel ----------------------

PIPE_BYTES = 1 << 20
"""Each relay direction's pipe (F_SETPIPE_SZ; 1 MiB is the default pipe-max-size)."""
F_SETPIPE_SZ = 1031
POLL_MS = 200
"""How often a relay thread idle on poll looks whether the front is closing."""


class KernelRelayFront(_Front):
    """A front fast enough to bench through: TLS 1.3 with a PSK as :class:`TlsFront`, but
    after the handshake the server socket's records go to the kernel (kTLS,
    ``install_kernel_tls(client=False)``) and the plain bytes move between it and the
    target's plain port by ``os.splice`` through a pipe, one thread per direction: no byte
    crosses into Python.  With ``keys=None`` it is a plain relay (no TLS, the same splice),
    the peer a TLS figure is fairly compared with.

    Before the kernel takes a socket it checks that OpenSSL holds no bytes past the
    handshake (:meth:`~th.Connection.buffered`: read-ahead is off); no NewSessionTicket is
    sent (the server's Connection sets no tickets).  A connection whose handshake or kTLS
    setup fails is closed and its reason kept in ``failures``, one line each.
    """

    def __init__(self, backend_port: int, keys: dict[str, bytes] | None = None,
                 suite: str | None = None, *, backend_host: str = "127.0.0.1",
                 host: str = "127.0.0.1", handshake_timeout: float = 60) -> None:
        if keys is not None and suite is None:
            raise ValueError("a TLS front needs the PSKs' suite")
        self.backend = (backend_host, backend_port)
        self.keys = keys
        self.suite = suite
        self.handshake_timeout = handshake_timeout
        self.mode = "plain" if keys is None else "ktls"
        self.connections = 0
        super().__init__(host)

    def _serve(self, sock: socket.socket) -> None:
        try:
            if self.keys is not None:
                self.secure(sock)
                self.handshakes += 1
            backend = socket.create_connection(self.backend, timeout=self.handshake_timeout)
        except (OSError, th.HandshakeError) as exc:
            self.failures.append(str(exc))
            sock.close()
            return
        self._sockets.append(backend)
        self.connections += 1
        for sock_ in (sock, backend):
            sock_.setblocking(False)
            sock_.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        inbound = threading.Thread(target=self._pump, args=(backend, sock), daemon=True)
        inbound.start()
        self._pump(sock, backend)
        inbound.join()
        backend.close()
        sock.close()

    def secure(self, sock: socket.socket) -> th.Secrets:
        """The server's handshake on ``sock``, then its records to the kernel; OSError or
        HandshakeError, in one line, when either fails."""
        from nvmeof_fuse.transport.tcp.tls_records import install_kernel_tls

        secrets = self.handshake(sock)
        if not install_kernel_tls(sock, secrets, client=False):
            raise OSError("this kernel has no kTLS (modprobe tls)")
        return secrets

    def handshake(self, sock: socket.socket) -> th.Secrets:
        """The server's side of the handshake on ``sock`` (OpenSSL, within the timeout);
        HandshakeError if OpenSSL read past it (bytes the kernel would not see)."""
        sock.setblocking(False)
        conn = th.server(sock.fileno(), self.keys or {}, self.suite or "")
        try:
            secrets = th.handshake_blocking(conn, sock.fileno(), self.handshake_timeout)
            if conn.buffered():
                raise th.HandshakeError("OpenSSL read past the handshake: records the "
                                        "kernel would never see")
            return secrets
        finally:
            conn.close()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """``src``'s bytes on to ``dst`` through a pipe, in the kernel, until either ends
        (then both end: NVMe/TCP has no half-closed connections)."""
        read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        with contextlib.suppress(OSError):
            fcntl.fcntl(write_end, F_SETPIPE_SZ, PIPE_BYTES)
        readable, writable = select.poll(), select.poll()
        readable.register(src, select.POLLIN)
        writable.register(dst, select.POLLOUT)
        source, sink = src.fileno(), dst.fileno()
        try:
            while not self._closing:
                if not readable.poll(POLL_MS):
                    continue
                held = 0  # take what src has (kTLS hands one record per splice), then pass it
                while held < PIPE_BYTES:
                    try:
                        n = os.splice(source, write_end, PIPE_BYTES - held)
                    except BlockingIOError:
                        break
                    if n == 0:
                        if not held:
                            return
                        break
                    held += n
                while held:
                    try:
                        held -= os.splice(read_end, sink, held)
                    except BlockingIOError:
                        writable.poll(POLL_MS)
        except OSError:
            pass  # a reset, or a record that is not application data (EIO): the end
        finally:
            os.close(read_end)
            os.close(write_end)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
