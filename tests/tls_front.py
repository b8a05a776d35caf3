"""A TLS front for the fake NVMe/TCP target (tests/tcp_target.py), as stunnel or tlshd
would be: it takes TLS 1.3 with a PSK on a port of its own (OpenSSL's server side, through
the same ctypes bindings: Python's ssl has no PSK before 3.13) and relays each connection's
application data, by OpenSSL's own record layer (SSL_read/SSL_write), to the target's plain
port.  So the host's userspace record layer is checked against OpenSSL's, not its own.

``stall``: accept connections and never answer (a stalled handshake).  Each connection's
handshake failure is kept in ``failures``, one line each; so is a backend that refuses (the
target's port away during an outage), after which the host's connection is closed, as a
TLS terminator in front of a target that is down closes it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading

from nvmeof_fuse.transport.tcp import tls_handshake as th

RELAY_BYTES = 1 << 16


class TlsFront:
    def __init__(self, backend_port: int, keys: dict[str, bytes], suite: str, *,
                 stall: bool = False, backend_host: str = "127.0.0.1") -> None:
        self.backend_port = backend_port
        self.backend_host = backend_host
        self.keys = keys
        self.suite = suite
        self.stall = stall
        self.failures: list[str] = []
        self.handshakes = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closing = False
        self._sockets: list[socket.socket] = []
        self._connections: list[th.Connection] = []
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._alert = False

    def __enter__(self) -> TlsFront:
        thread = threading.Thread(target=self._accept, daemon=True)
        thread.start()
        self._threads.append(thread)
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

    def cut_all(self) -> None:
        """Cut every connection so far, as an outage does (the host reconnects)."""
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close_notify_all(self) -> None:
        """Have every live connection send a close_notify alert (an alert mid-stream), from
        its own relay thread (an SSL object is not for two threads at once)."""
        self._alert = True

    def _accept(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._sockets.append(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            thread.start()
            self._threads.append(thread)

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
                conn.write(data)
            if self._closing:
                return
