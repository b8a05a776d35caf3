"""The benches' fast front (tls_front.KernelRelayFront): its plain splice relay is byte-exact
both ways, its handshake leaves every byte past it in the socket and sends no session ticket,
and its kTLS relay is byte-exact where the kernel has kTLS (the testbed VM: ``modprobe tls``;
the development hosts have none, where the front refuses the connection in one line)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest
from tls_front import KernelRelayFront

from nvmeof_fuse.transport.tcp import tls_handshake as th
from nvmeof_fuse.transport.tcp import tls_records as tr

IDENTITY = "NVMe0R01 nqn.2014-08.org.nvmexpress:uuid:host nqn.2026-12.io.test:subsys"
SUITE = "TLS_AES_128_GCM_SHA256"
BOUND = 60  # s: a hang guard (the VM runs Python about 10x slower)


class Echo:
    """A plain TCP server that sends back what it gets (the target behind the front)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with sock:
                while data := sock.recv(1 << 20):
                    sock.sendall(data)

    def close(self) -> None:
        self.listener.close()


def echoed(sock: socket.socket, data: bytes) -> bytes:
    """Send ``data`` through ``sock`` from a thread while reading as much back here."""
    sock.settimeout(BOUND)
    sender = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    sender.start()
    got = bytearray()
    while len(got) < len(data):
        chunk = sock.recv(1 << 20)
        if not chunk:
            break
        got += chunk
    sender.join(BOUND)
    return bytes(got)


def kernel_has_tls() -> bool:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_ulp") as f:
            return "tls" in f.read().split()
    except OSError:
        return False


def test_the_plain_relay_is_byte_exact_both_ways():
    echo = Echo()
    data = os.urandom(9 << 20)  # more than a pipe holds
    try:
        with KernelRelayFront(echo.port) as front, \
                socket.create_connection(("127.0.0.1", front.port)) as sock:
            assert echoed(sock, data) == data
            assert echoed(sock, b"x") == b"x"  # a lone byte is not held back
            assert front.mode == "plain" and front.connections == 1 and front.failures == []
    finally:
        echo.close()


def client_handshake(sock: socket.socket, key: bytes) -> th.Secrets:
    sock.setblocking(False)
    conn = th.client(sock.fileno(), IDENTITY, key, SUITE)
    try:
        return th.handshake_blocking(conn, sock.fileno(), BOUND)
    finally:
        conn.close()
        sock.setblocking(True)


def test_the_handshake_reads_nothing_past_itself_and_sends_no_ticket():
    """What the kernel's record layer must find in the socket: every record after the
    handshake (here raw bytes the host sends at once), and none from the front (a
    NewSessionTicket would reach a kTLS reader as EIO)."""
    key = os.urandom(32)
    after = os.urandom(4096)
    with KernelRelayFront(1, {IDENTITY: key}, SUITE) as front, handshaken(front, key) as (
            host, target, secrets, front_outcome):
        host.sendall(after)
        assert front_outcome() == secrets
        target.setblocking(True)
        target.settimeout(BOUND)
        got = bytearray()
        while len(got) < len(after):
            got += target.recv(len(after) - len(got))
        assert bytes(got) == after
        with pytest.raises(BlockingIOError):  # the front's side sent nothing after it
            host.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)


def test_a_handshake_that_left_bytes_in_openssl_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(th.Connection, "buffered", lambda self: True)
    key = os.urandom(32)
    with KernelRelayFront(1, {IDENTITY: key}, SUITE) as front, handshaken(front, key) as (
            _, _, _, front_outcome):
        assert str(front_outcome()) == ("OpenSSL read past the handshake: records the "
                                          "kernel would never see")


@contextlib.contextmanager
def handshaken(front: KernelRelayFront, key: bytes):
    """A socket pair, the front's handshake on one end (in a thread) and the host's on the
    other: ``(host, target, host's Secrets, front_outcome)``; ``front_outcome()`` waits for
    the front's thread and gives its Secrets or its HandshakeError."""
    host, target = socket.socketpair()
    done: dict = {}

    def serve():
        try:
            done["front"] = front.handshake(target)
        except th.HandshakeError as exc:
            done["front"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def front_outcome():
        thread.join(BOUND)
        return done.get("front")

    try:
        yield host, target, client_handshake(host, key), front_outcome
    finally:
        host.close()
        target.close()


def test_the_ktls_relay_is_byte_exact_or_says_the_kernel_has_no_ktls():
    key = os.urandom(32)
    echo = Echo()
    data = os.urandom(5 << 20)
    try:
        with KernelRelayFront(echo.port, {IDENTITY: key}, SUITE) as front, \
                socket.create_connection(("127.0.0.1", front.port)) as sock:
            secrets = client_handshake(sock, key)
            if not kernel_has_tls():
                sock.settimeout(BOUND)
                assert sock.recv(1) == b""  # the front closed it
                assert front.failures == ["this kernel has no kTLS (modprobe tls)"]
                pytest.skip("this kernel has no kTLS (the testbed VM's has)")
            assert tr.install_kernel_tls(sock, secrets)
            assert echoed(sock, data) == data
            assert echoed(sock, b"x") == b"x"
            assert front.handshakes == 1 and front.connections == 1 and front.failures == []
    finally:
        echo.close()
